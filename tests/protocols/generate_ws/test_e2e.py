"""/generate against a real `rill serve` (tiny random-init model) on loopback.

The spec's three example flows, the control guarantees (pause, modify → greedy, regenerate
with a seed, stop, disconnect frees KV) and the errors a real server produces. Random
weights make gibberish: the tests assert order, counts and equality between runs.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from rill.types import GenerateRequest, SamplingParams
from tests.conftest import start_server

from .test_adapter import is_status, is_type, recv, send, until

PROMPT = "Once upon a time"
BURST = 400  # the limited server's token-bucket burst (tokens per key)
LONG = 400  # tokens: the tiny model makes ~2000 tokens/s, so a control sent after the first
# token arrives long before such a generation could end on its own


def ws_url(server: Any, query: str = "") -> str:
    return f"{server.ws_url}/generate{query}"


def tokens_of(msgs: list[dict]) -> list[dict]:
    return [m for m in msgs if m["type"] == "token"]


async def greedy_ids(server: Any, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt_ids`` straight from the engine (on the server's loop)."""

    async def run() -> list[int]:
        stream = await server.client.generate(
            GenerateRequest(
                prompt_token_ids=prompt_ids,
                sampling=SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True),
                protocol="test",
            )
        )
        ids: list[int] = []
        async with stream:
            async for out in stream:
                ids += out.token_ids
        return ids

    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), server.loop))


@pytest.fixture(scope="module")
def limited_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A second server with a per-request time limit and a rate limit."""
    live = start_server(
        tiny_model_dir,
        **{
            "http.request_timeout_s": 1.5,
            "http.rate_limit_tokens_per_s": 1.0,
            "http.rate_limit_burst": BURST,
            "http.api_key": ["k", "k2"],
            "http.data_dir": str(tmp_path_factory.mktemp("data")),
        },
    )
    yield live
    live.stop()


async def test_flow_basic_generation(server: Any) -> None:
    async with connect(ws_url(server)) as ws:
        await send(
            ws,
            type="config",
            prompt="Write a short story about a robot learning to paint.",
            parameters={"max_tokens": 12, "temperature": 0.7, "ignore_eos": True},
            options={"stream": True},
        )
        init = await recv(ws)
        assert init["type"] == "init" and init["request_id"] and init["model"] == "tiny-llama"
        assert (
            init["model_info"]["max_tokens"] == server.client.model_info.max_context_tokens
            and init["model_info"]["dtype"] == "float32"
        )
        msgs = await until(ws, is_type("completion"))
        toks, completion = tokens_of(msgs), msgs[-1]
        assert len(toks) == 12 == completion["usage"]["completion_tokens"]
        assert completion["finish_reason"] == "length" and toks[-1]["finished"] is True
        assert completion["generated_text"] == "".join(t["token"] for t in toks) == toks[-1]["generated_text"]
        usage = completion["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    server.wait_idle()


async def test_flow_error_and_recovery(limited_server: Any) -> None:
    async with connect(ws_url(limited_server, "?api_key=k")) as ws:
        # The first request leaves room in key k's token bucket for the second, however many
        # tokens it makes before the pause lands (on a loaded machine: nearly all of them).
        first = BURST - 4
        await send(ws, type="config", prompt=PROMPT, parameters={"max_tokens": first, "ignore_eos": True})
        init = await recv(ws)
        msgs = await until(ws, is_type("token"))
        await send(ws, type="control", action="pause")  # held mid-stream until the 1.5 s limit hits
        msgs += await until(ws, is_type("error"))
        err = msgs[-1]
        assert err["error"] == "timeout" and err["recoverable"] is True and err["recovery_action"] == "retry"
        assert err["request_id"] == init["request_id"]
        assert tokens_of(msgs) and err["generated_text"] == tokens_of(msgs)[-1]["generated_text"]
        await send(ws, type="config", prompt=PROMPT, parameters={"max_tokens": 4, "ignore_eos": True})
        msgs = await until(ws, is_type("completion"))
        assert msgs[0]["type"] == "init" and msgs[0]["request_id"] != init["request_id"]
        assert msgs[-1]["usage"]["completion_tokens"] == 4
    limited_server.wait_idle()


async def test_flow_midstream_control(server: Any) -> None:
    async with connect(ws_url(server)) as ws:
        await send(
            ws, type="config", prompt=PROMPT, parameters={"max_tokens": LONG, "temperature": 0.7, "ignore_eos": True}
        )
        await until(ws, is_type("token"))
        await send(ws, type="control", action="modify", parameters={"temperature": 0.9})
        msgs = await until(ws, is_status("modified"))
        assert msgs[-1]["parameters"]["temperature"] == 0.9 and msgs[-1]["parameters"]["max_tokens"] == LONG
        await until(ws, is_type("token"))  # generation continues
        await send(ws, type="control", action="stop")
        msgs = await until(ws, is_type("completion"))
        assert msgs[-1]["finish_reason"] == "cancelled"
        assert 0 < msgs[-1]["usage"]["completion_tokens"] < LONG
    server.wait_idle()


async def test_no_token_between_pause_and_resume(server: Any) -> None:
    async with connect(ws_url(server)) as ws:
        await send(
            ws,
            type="config",
            prompt=PROMPT,
            parameters={"max_tokens": LONG, "temperature": 0, "ignore_eos": True},
            options={"include_token_ids": True},
        )
        first = await until(ws, is_type("token"))
        await send(ws, type="control", action="pause")
        before = await until(ws, is_status("paused"))
        stats = server.stats()
        assert (stats.num_paused, stats.num_running) == (1, 0)  # out of the batch: no work for it
        await send(ws, type="control", action="resume")
        between = await until(ws, is_status("resumed"))
        assert [m["type"] for m in between] == ["status"]
        rest = await until(ws, is_type("completion"))
    ids = [t["token_id"] for t in tokens_of(first + before + rest)]
    assert len(ids) == LONG == rest[-1]["usage"]["completion_tokens"]  # continued where it stopped
    prompt_ids = server.client.engine.tokenizer.encode(PROMPT)
    assert ids == await greedy_ids(server, prompt_ids, LONG)  # ... and exactly as if never paused
    server.wait_idle()


async def test_modify_to_temperature_zero_continues_greedily(server: Any) -> None:
    async with connect(ws_url(server)) as ws:
        await send(
            ws,
            type="config",
            prompt=PROMPT,
            parameters={"max_tokens": LONG, "temperature": 1.5, "seed": 11, "ignore_eos": True},
            options={"include_token_ids": True},
        )
        head = await until(ws, lambda m: m["type"] == "token" and len(m["generated_text"]) > 0)
        await send(ws, type="control", action="modify", parameters={"temperature": 0})
        head += await until(ws, is_status("modified"))
        tail = await until(ws, is_type("completion"))
    head_ids = [t["token_id"] for t in tokens_of(head)]
    tail_ids = [t["token_id"] for t in tokens_of(tail)]
    assert len(head_ids) + len(tail_ids) == LONG and tail_ids
    prompt_ids = server.client.engine.tokenizer.encode(PROMPT)
    assert tail_ids == await greedy_ids(server, prompt_ids + head_ids, len(tail_ids))
    server.wait_idle()


async def test_regenerate_with_seed_reproduces_the_first_run(server: Any) -> None:
    params = {"max_tokens": LONG, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    async with connect(ws_url(server)) as ws:
        await send(ws, type="config", prompt=PROMPT, parameters=params, options={"include_token_ids": True})
        init = await recv(ws)
        first = tokens_of(await until(ws, lambda m: m["type"] == "token" and len(m["generated_text"]) >= 0))
        first += tokens_of(await until(ws, is_type("token")))
        hits_before = server.stats().prefix_cache_hits_tokens
        await send(ws, type="control", action="regenerate")
        first += tokens_of(await until(ws, is_status("regenerating")))
        num_prompt = len(server.client.engine.tokenizer.encode(PROMPT))
        # The restart reuses the prompt's KV (all but the last prompt token, which is recomputed).
        assert server.stats().prefix_cache_hits_tokens - hits_before >= num_prompt - 1
        fresh = await recv(ws)
        assert fresh["type"] == "init" and fresh["request_id"] == init["request_id"]
        second = await until(ws, is_type("completion"))
        assert second[-1]["usage"]["completion_tokens"] == LONG
        second_ids = [t["token_id"] for t in tokens_of(second)]
        assert second_ids[: len(first)] == [t["token_id"] for t in first]
        await send(ws, type="config", prompt=PROMPT, parameters=params, options={"include_token_ids": True})
        third = await until(ws, is_type("completion"))
        assert [t["token_id"] for t in tokens_of(third)] == second_ids  # a full run with the same seed
    server.wait_idle()


async def test_allowed_token_ids_hold_from_config_and_after_modify(server: Any) -> None:
    allowed = list(range(10, 40))
    async with connect(ws_url(server)) as ws:
        await send(ws, type="config", prompt=PROMPT, parameters={"max_tokens": 5, "allowed_token_ids": [10**6]})
        err = await recv(ws)
        assert (err["type"], err["field"], err["recoverable"]) == ("error", "parameters.allowed_token_ids", True)
        await send(
            ws,
            type="config",
            prompt=PROMPT,
            options={"include_token_ids": True},
            parameters={
                "max_tokens": LONG,
                "temperature": 1.0,
                "seed": 3,
                "ignore_eos": True,
                "allowed_token_ids": allowed,
            },
        )
        head = await until(ws, is_type("token"))
        await send(ws, type="control", action="modify", parameters={"allowed_token_ids": [7]})
        head += await until(ws, is_status("modified"))
        tail = await until(ws, is_type("completion"))
    ids = [t["token_id"] for t in tokens_of(head + tail)]
    # Allowed tokens until the modify took effect (at most when "modified" was sent), then only 7.
    switch = next(i for i, token in enumerate(ids) if token not in allowed)
    assert switch > 0 and set(ids[switch:]) == {7} and len(ids) - switch >= len(tokens_of(tail)) > 0
    server.wait_idle()


async def test_stop_yields_cancelled_completion(server: Any) -> None:
    async with connect(ws_url(server)) as ws:
        await send(ws, type="config", prompt=PROMPT, parameters={"max_tokens": LONG, "ignore_eos": True})
        await until(ws, is_type("token"))
        await send(ws, type="control", action="stop")
        msgs = await until(ws, is_type("completion"))
        assert msgs[-1]["finish_reason"] == "cancelled"
        assert msgs[-1]["generated_text"] == (
            tokens_of(msgs)[-1]["generated_text"] if tokens_of(msgs) else msgs[-1]["generated_text"]
        )
    server.wait_idle()


async def test_disconnect_mid_stream_frees_kv(server: Any) -> None:
    async with connect(ws_url(server)) as ws:
        await send(ws, type="config", prompt=PROMPT * 20, parameters={"max_tokens": LONG, "ignore_eos": True})
        await until(ws, is_type("token"))
        held = server.stats()
        assert held.num_running == 1 and held.kv_used_bytes > 0
    stats = server.wait_idle()  # polls engine state; fails if the KV is never freed
    assert stats.kv_used_bytes == 0 and stats.requests_finished_total.get("cancelled", 0) >= 1


async def test_real_errors_reach_the_client(server: Any) -> None:
    async with connect(ws_url(server)) as ws:
        await send(ws, type="config", prompt=PROMPT, parameters={"temperature": -1})
        err = await recv(ws)
        assert (err["error"], err["field"], err["recoverable"]) == ("invalid_request", "parameters.temperature", True)
        await send(ws, type="config", prompt="word " * 2000)
        err = await recv(ws)
        max_context = server.client.model_info.max_context_tokens
        assert err["error"] == "context_length_exceeded" and err["max_context_tokens"] == max_context
        assert err["prompt_tokens"] > max_context
        await send(ws, type="control", action="pause")
        err = await recv(ws)
        assert err["error"] == "invalid_request" and "none is running" in err["message"]
        await send(ws, type="config", prompt=PROMPT, parameters={"max_tokens": 2})
        assert (await until(ws, is_type("completion")))[-1]["usage"]["completion_tokens"] <= 2


async def test_rate_limited_on_real_server(limited_server: Any) -> None:
    async with connect(ws_url(limited_server, "?api_key=k2")) as ws:
        await send(ws, type="config", prompt=PROMPT, parameters={"max_tokens": 300, "ignore_eos": True})
        await recv(ws)
        headers = {"Authorization": "Bearer k2"}
        async with connect(ws_url(limited_server), additional_headers=headers) as other:  # same key
            await send(other, type="config", prompt=PROMPT, parameters={"max_tokens": 300})
            err = await recv(other)
            assert err["error"] == "rate_limited" and err["retry_after_seconds"] > 0
        # Ends by itself (or by the 1.5 s limit on a loaded machine): no control needed.
        await until(ws, lambda m: m["type"] in ("completion", "error"))
    limited_server.wait_idle()


async def test_rest_json_and_sse_on_real_server(server: Any) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        res = await http.post("/v1/generate", json=body)
        assert res.status_code == 200
        data = res.json()
        assert (
            data["id"].startswith("gen_") and data["model"] == "tiny-llama" and data["usage"]["completion_tokens"] == 6
        )
        async with http.stream("POST", "/v1/generate", json=body | {"stream": True}) as stream_res:
            events = [json.loads(line[6:]) async for line in stream_res.aiter_lines() if line.startswith("data: ")]
        assert [e["type"] for e in events] == ["init"] + ["token"] * 6 + ["completion"]
        assert events[-1]["generated_text"] == data["generated_text"]  # greedy: same text both ways
    server.wait_idle()


async def test_waiting_requests_learn_their_queue_position(server: Any) -> None:
    config = {"prompt": PROMPT, "parameters": {"max_tokens": 3, "ignore_eos": True}}
    async with connect(ws_url(server)) as first, connect(ws_url(server)) as second:
        with server.hold_engine():  # nothing is scheduled: both wait, in arrival order
            await send(first, type="config", **config)
            assert (await recv(first))["type"] == "init"  # alone in the queue: not reported
            await send(second, type="config", **config)
            [*_, queued_second] = await until(second, is_status("queued"))
            [*_, queued_first] = await until(first, is_status("queued"))
        assert (queued_first["position"], queued_second["position"]) == (1, 2)
        assert queued_first["queue_length"] == queued_second["queue_length"] == 2
        for ws in (first, second):
            msgs = await until(ws, is_type("completion"))
            assert len(tokens_of(msgs)) == 3
            assert not any(is_status("queued")(m) for m in msgs[msgs.index(tokens_of(msgs)[0]) :])
    server.wait_idle()
