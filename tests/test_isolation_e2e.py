"""One bad request never ends another client's stream (issue 12, item 1), on a real server.

Eight streams run on six protocols while bad requests arrive: the audit's ``length_penalty``
±1000 beam request on ``/generate``, ``/ws`` and ``/ws/chat`` (now refused up front by the
one validation every protocol shares), and requests whose sampling raises inside the engine
(a fault injected with ``rill.testing.faults.fail_sampling`` into the very batch the eight
streams are in). The eight finish normally with the tokens they would have had alone; each
bad request gets its own protocol's error. The engine is held while everything is submitted,
so all of them share the first steps whatever the machine's load (no timing).

The validation regressions of item 11 (``top_k: -5``, ``role: "wizard"``, reserved
``chat_template_kwargs``, a 200k-prompt list) are checked on the same server.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from rill.protocols.evergreen import codec as evergreen_codec
from rill.protocols.evergreen.messages import GenerateConfig
from rill.testing.faults import fail_sampling
from rill.types import GenerateRequest, SamplingParams
from tests.conftest import LiveServer, start_server
from tests.helpers import recv_json
from tests.protocols.evergreen.helpers import customized_generate
from tests.protocols.framed_uds.conftest import FramedClient

N = 40  # tokens per stream: long enough that every stream outlives the faulty step
BAD_SEED = 777_777  # the requests whose sampling the injected fault breaks
STREAM_LIMIT_S = 120  # a hang fails the test; never a pass condition


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    """A server with every protocol on: the Unix socket in a temporary folder, chats 4 at a time."""
    sock = tmp_path_factory.mktemp("uds") / "rill.sock"
    server = start_server(
        tiny_model_dir, **{"uds.no_socket": False, "uds.socket": str(sock), "chat.chat_max_active": 4}
    )
    yield server
    server.stop()


# -- one client per protocol: each returns what its stream produced ------------------------------------


async def openai_stream(live: LiveServer, route: str, body: dict) -> dict:
    """An SSE stream of /v1/completions or /v1/chat/completions: text, finish reason, chunks."""
    text, finish, chunks = "", None, 0
    async with httpx.AsyncClient(timeout=STREAM_LIMIT_S) as http:
        async with http.stream("POST", f"{live.url}{route}", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                choice = event["choices"][0]
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                chunks += 1
                finish = choice.get("finish_reason") or finish
    return {"text": text, "finish": finish, "chunks": chunks}


async def generate_ws_stream(live: LiveServer, parameters: dict) -> dict:
    """A /generate generation with token ids: its completion message and streamed ids."""
    async with connect(f"{live.ws_url}/generate") as ws:
        await ws.send(
            json.dumps(
                {
                    "type": "config",
                    "prompt": "Once upon a time",
                    "parameters": parameters,
                    "options": {"include_token_ids": True},
                }
            )
        )
        ids: list[int] = []
        while True:
            msg = await recv_json(ws)
            assert msg["type"] != "error", msg
            if msg["type"] == "token":
                ids.append(msg["token_id"])
            if msg["type"] == "completion":
                return {"ids": ids, "finish": msg["finish_reason"], "count": msg["usage"]["completion_tokens"]}


async def batch_ws_stream(live: LiveServer) -> dict:
    """One /ws batch prompt (greedy): its COMPLETE event."""
    async with connect(f"{live.ws_url}/ws") as ws:
        await ws.send(
            json.dumps(
                {
                    "prompts": [{"request_id": "iso-batch", "prompt": "The river stone"}],
                    "generation_config": {"do_sample": False, "num_beams": 1, "max_new_tokens": N},
                }
            )
        )
        while True:
            for event in await recv_json(ws):
                assert event.get("type") != "ERROR" and "error" not in event, event
                if event.get("type") == "COMPLETE":
                    return event


async def chat_ws_stream(live: LiveServer) -> dict:
    """A /ws/chat reply without speech (``min_new_tokens`` keeps eos away): its ``done``."""
    async with connect(f"{live.ws_url}/ws/chat") as ws:
        await ws.send(
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "Tell me a story."}],
                    "generation": {"max_new_tokens": N, "min_new_tokens": N, "temperature": 0.7, "seed": 3},
                    "tts": {"enabled": False},
                }
            )
        )
        while True:
            msg = await recv_json(ws)
            assert msg["type"] != "error", msg
            if msg["type"] == "done":
                return msg


async def uds_stream(live: LiveServer) -> dict:
    """A framed Unix-socket request (greedy): its events up to ``eos``."""
    client = await FramedClient.connect(live.config.uds.socket)
    try:
        await client.send({"id": "iso-uds", "prompt": "Ada found the golden lantern", "max_tokens": N})
        events = await client.until_end()
    finally:
        client.writer.close()
    assert events and events[-1]["event"] == "eos", events
    return {"tokens": sum(1 for e in events if e["event"] == "token"), "reason": events[-1].get("reason")}


async def evergreen_stream(live: LiveServer) -> dict:
    """The README's generate action over /evergreen: the output node's text, once final."""
    config = GenerateConfig(temperature=0.0, max_tokens=N, ignore_eos=True)
    text = b""
    async with connect(f"{live.ws_url}/evergreen") as ws:
        for message in customized_generate(config):
            await ws.send(evergreen_codec.encode_json(message))
        while True:
            reply = evergreen_codec.decode_json(await asyncio.wait_for(ws.recv(), STREAM_LIMIT_S))
            for fragment in reply.node_fragments:
                if fragment.id == "response_1":
                    text += fragment.chunk_fragment.data or b""
                    if not fragment.continued:
                        return {"text": text.decode()}


# -- the bad requests: each returns its protocol's error ----------------------------------------------------


async def generate_ws_error(live: LiveServer, parameters: dict) -> dict:
    """A /generate config expected to fail: the error message."""
    async with connect(f"{live.ws_url}/generate") as ws:
        await ws.send(json.dumps({"type": "config", "prompt": "Hello there", "parameters": parameters}))
        while True:
            msg = await recv_json(ws)
            assert msg["type"] not in ("token", "completion"), msg
            if msg["type"] == "error":
                return msg


async def batch_ws_error(live: LiveServer, generation_config: dict) -> list:
    """A /ws batch expected to be refused: the frame that refuses it."""
    async with connect(f"{live.ws_url}/ws") as ws:
        await ws.send(
            json.dumps(
                {"prompts": [{"request_id": "iso-bad", "prompt": "Hello"}], "generation_config": generation_config}
            )
        )
        return await recv_json(ws)


async def chat_ws_error(live: LiveServer, generation: dict, **extra: Any) -> dict:
    """A /ws/chat request expected to fail: the error message (the socket closes after it)."""
    async with connect(f"{live.ws_url}/ws/chat") as ws:
        await ws.send(
            json.dumps(
                {
                    "messages": [{"role": "user", "content": "Hi"}],
                    "generation": generation,
                    "tts": {"enabled": False},
                    **extra,
                }
            )
        )
        while True:
            msg = await recv_json(ws)
            if msg["type"] == "error":
                return msg
            assert msg["type"] in ("queued", "queue_update", "queue_done", "prefill_done"), msg


async def openai_error(live: LiveServer, route: str, body: dict) -> httpx.Response:
    """A non-streaming OpenAI request (expected to fail)."""
    async with httpx.AsyncClient(timeout=STREAM_LIMIT_S) as http:
        return await http.post(f"{live.url}{route}", json=body)


async def solo(live: LiveServer, prompt: str, sampling: SamplingParams) -> list[int]:
    """Token ids of ``prompt`` generated alone, straight from the engine (the reference)."""

    async def run() -> list[int]:
        [ids] = await live.client.tokenize([prompt])
        stream = await live.client.generate(GenerateRequest(prompt_token_ids=ids, sampling=sampling, protocol="test"))
        out: list[int] = []
        async with stream:
            async for delta in stream:
                out += delta.token_ids
        return out

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), live.loop))


async def wait_waiting(live: LiveServer, count: int) -> None:
    """Poll until ``count`` requests sit in the (held) engine's queue; fail if they never do."""
    for _ in range(6000):
        if live.stats().num_waiting >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"only {live.stats().num_waiting} of {count} requests reached the engine")


# -- the tests ----------------------------------------------------------------------------------------------


async def test_eight_streams_on_six_protocols_survive_bad_requests(live: LiveServer) -> None:
    greedy_generate = {"max_tokens": N, "temperature": 0.0, "ignore_eos": True}
    seeded_generate = {"max_tokens": N, "temperature": 0.9, "seed": 11, "ignore_eos": True}
    faulty = {"max_tokens": N, "temperature": 0.9, "seed": BAD_SEED, "ignore_eos": True}
    before = live.stats().requests_finished_total
    with fail_sampling(live.client.engine.core.sampler, lambda p: p.seed == BAD_SEED):
        with live.hold_engine():  # everything below queues up and shares the first steps
            streams = [
                asyncio.create_task(
                    openai_stream(
                        live,
                        "/v1/completions",
                        {
                            "prompt": "The sun rose over the quiet village and",
                            "max_tokens": N,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    )
                ),
                asyncio.create_task(
                    openai_stream(
                        live,
                        "/v1/chat/completions",
                        {
                            "messages": [{"role": "user", "content": "Say something."}],
                            "max_tokens": N,
                            "temperature": 0.8,
                            "seed": 5,
                            "ignore_eos": True,
                        },
                    )
                ),
                asyncio.create_task(generate_ws_stream(live, greedy_generate)),
                asyncio.create_task(generate_ws_stream(live, seeded_generate)),
                asyncio.create_task(batch_ws_stream(live)),
                asyncio.create_task(chat_ws_stream(live)),
                asyncio.create_task(uds_stream(live)),
                asyncio.create_task(evergreen_stream(live)),
            ]
            # Requests whose sampling raises inside the engine, in the same batch as the eight.
            faults = [
                asyncio.create_task(generate_ws_error(live, faulty)),
                asyncio.create_task(
                    openai_error(
                        live,
                        "/v1/completions",
                        {
                            "prompt": "A big dog ran",
                            "max_tokens": N,
                            "temperature": 0.9,
                            "seed": BAD_SEED,
                            "ignore_eos": True,
                        },
                    )
                ),
            ]
            # The audit's item-1 request, on the three protocols that take beam parameters.
            refused = await asyncio.wait_for(
                asyncio.gather(
                    generate_ws_error(live, {"num_beams": 4, "length_penalty": 1000, "max_tokens": 16}),
                    batch_ws_error(
                        live, {"num_beams": 4, "length_penalty": -1000, "max_new_tokens": 16, "do_sample": False}
                    ),
                    chat_ws_error(live, {"num_beams": 4, "length_penalty": 1000, "max_new_tokens": 16}),
                ),
                STREAM_LIMIT_S,
            )
            await wait_waiting(live, len(streams) + len(faults))
        # The engine steps from here on, with the fault armed.
        results = await asyncio.wait_for(asyncio.gather(*streams), STREAM_LIMIT_S)
        failed = await asyncio.wait_for(asyncio.gather(*faults), STREAM_LIMIT_S)
    completion, chat, greedy, seeded, batch, chat_ws, uds, evergreen = results

    # The eight finished normally, with what they would have produced alone.
    assert completion["finish"] == "length" and completion["text"], completion
    assert chat["finish"] == "length" and chat["text"], chat
    assert greedy["finish"] == seeded["finish"] == "length"
    assert greedy["ids"] == await solo(live, "Once upon a time", SamplingParams(**greedy_generate))
    assert seeded["ids"] == await solo(live, "Once upon a time", SamplingParams(**seeded_generate))
    assert len(greedy["ids"]) == len(seeded["ids"]) == N
    assert 1 <= batch["new_tokens_count"] <= N and batch["is_eos"] == (batch["new_tokens_count"] < N), batch
    assert chat_ws["generated_tokens"] == N, chat_ws
    assert uds["reason"] in ("length", "stop") and 1 <= uds["tokens"] <= N, uds
    assert evergreen["text"], evergreen

    # Each faulty request got its own protocol's error, with no internals in it.
    gen_error, http_error = failed
    assert gen_error["error"] == "internal_error" and "injected" not in gen_error["message"], gen_error
    assert http_error.status_code == 500, http_error.text
    assert http_error.json()["error"]["code"] == "generation_error", http_error.text
    assert "injected" not in http_error.text

    # The item-1 request is refused before it reaches the engine, naming the field.
    gen_refusal, batch_refusal, chat_refusal = refused
    assert gen_refusal["error"] == "invalid_request" and gen_refusal["field"] == "parameters.length_penalty", (
        gen_refusal
    )
    assert len(batch_refusal) == 1 and "length_penalty" in batch_refusal[0]["error"], batch_refusal
    assert "length_penalty" in chat_refusal["error"], chat_refusal

    # Exactly the two faulty requests ended in error; nothing is left running or holding KV.
    after = live.wait_idle().requests_finished_total
    assert after.get("error", 0) - before.get("error", 0) == 2, (before, after)
    assert after.get("length", 0) - before.get("length", 0) >= 6, (before, after)


def counters(live: LiveServer) -> tuple[int, dict[str, int]]:
    """Prompt tokens ever scheduled and requests ever finished: both move if anything was submitted."""
    stats = live.stats()
    return stats.prompt_tokens_total, dict(stats.requests_finished_total)


async def test_top_k_follows_one_rule_on_every_protocol(live: LiveServer) -> None:
    # -5 was clamped to 0 on the OpenAI routes and refused on /generate; -1 means "off" on all.
    for route, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        bad = await openai_error(live, route, {**body, "top_k": -5, "max_tokens": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k", bad.text
        ok = await openai_error(live, route, {**body, "top_k": -1, "max_tokens": 2})
        assert ok.status_code == 200, ok.text
    refused = await generate_ws_error(live, {"top_k": -5, "max_tokens": 2})
    assert refused["error"] == "invalid_request" and refused["field"] == "parameters.top_k", refused
    chat_refused = await chat_ws_error(live, {"top_k": -5, "max_new_tokens": 2})
    assert "top_k" in chat_refused["error"], chat_refused
    live.wait_idle()


async def test_unknown_roles_and_reserved_template_kwargs_are_400(live: LiveServer) -> None:
    before = counters(live)
    route = "/v1/chat/completions"
    wizard = await openai_error(live, route, {"messages": [{"role": "wizard", "content": "Hi"}], "max_tokens": 2})
    assert wizard.status_code == 400 and wizard.json()["error"]["param"] == "messages", wizard.text
    assert "wizard" in wizard.json()["error"]["message"]
    for kwargs in ({"messages": 1}, {"add_generation_prompt": False}, {"tools": 3}):
        reserved = await openai_error(
            live,
            route,
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "chat_template_kwargs": kwargs},
        )
        assert reserved.status_code == 400, (kwargs, reserved.status_code, reserved.text)
        assert reserved.json()["error"]["param"] == "chat_template_kwargs", reserved.text
    assert counters(live) == before  # refused before anything reached the engine
    chat_refused = await chat_ws_error(live, {"max_new_tokens": 2}, messages=[{"role": "wizard", "content": "Hi"}])
    assert chat_refused["type"] == "error", chat_refused
    # tools reach the template through its own argument (they were refused as a reserved kwarg).
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    ok = await openai_error(
        live,
        route,
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "tools": tools,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    assert ok.status_code == 200, ok.text
    live.wait_idle()


async def test_a_huge_prompt_list_is_refused_before_anything_is_submitted(live: LiveServer) -> None:
    # 200k strings gave 429 after 1,024 requests had been submitted and aborted.
    cap = live.config.http.max_choices_per_request
    before = counters(live)
    huge = await openai_error(live, "/v1/completions", {"prompt": ["Hi"] * 200_000, "max_tokens": 1})
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "prompt", huge.text
    over = await openai_error(live, "/v1/completions", {"prompt": ["Hi"] * (cap // 2 + 1), "n": 2, "max_tokens": 1})
    assert over.status_code == 400, over.text
    chat_n = await openai_error(
        live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 128, "max_tokens": 1}
    )
    assert chat_n.status_code == 200, chat_n.text  # within both bounds (n <= 128, choices <= cap)
    after_chat = counters(live)
    # Only the chat's 128 choices ran: neither prompt list submitted anything.
    assert sum(after_chat[1].values()) - sum(before[1].values()) == 128
    # The batch /ws sibling: a list over the socket's bound is refused whole, before any prompt runs.
    limit = live.config.batch_ws.batch_max_inflight_prompts
    async with connect(f"{live.ws_url}/ws") as ws:
        await ws.send(
            json.dumps(
                {
                    "prompts": [{"request_id": f"p{i}", "prompt": "Hi"} for i in range(limit + 1)],
                    "generation_config": {"max_new_tokens": 1},
                }
            )
        )
        frame = await recv_json(ws)
    assert len(frame) == 1 and "too many prompts" in frame[0]["error"], frame
    assert counters(live) == after_chat
    live.wait_idle()
