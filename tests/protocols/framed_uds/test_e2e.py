"""End-to-end tests of the framed Unix-socket protocol against a real server (tiny random model).

One server for the module, with its socket in a temporary folder and ``--max-num-seqs 1`` so
that the SLO test can saturate the engine. Random-init models write gibberish: the tests check
event order, counts, equality between runs and errors, never wording.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

import httpx
import pytest

from rill.protocols.framed_uds import adapter
from rill.server import Deps
from rill.types import GenerateRequest, SamplingParams
from tests.conftest import LiveServer, start_server
from tests.helpers import wait_until

from .conftest import FramedClient, uds_config

CANDIDATE_PROMPTS = [
    "Once upon a time",
    "The river stone",
    "Ada found the golden lantern near the bridge",
    "Milo counted the silver candles",
    "Hello there",
]


@pytest.fixture(scope="module")
def uds_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    path = tmp_path_factory.mktemp("uds") / "rill.sock"
    live = start_server(
        tiny_model_dir,
        **{"uds.no_socket": False, "uds.socket": str(path), "uds.max_frame_bytes": 4096, "engine.max_num_seqs": 1},
    )
    yield live
    live.stop()


@pytest.fixture(scope="module")
def long_prompt(uds_server: LiveServer) -> str:
    """A prompt whose greedy continuation runs 16 tokens without an end-of-sequence token.

    Chosen by behaviour at run time (a random model may stop early on some prompts).
    """

    async def probe() -> str:
        for prompt in CANDIDATE_PROMPTS:
            conn = await connect(uds_server)
            await conn.send({"id": "probe", "prompt": prompt, "max_tokens": 16})
            events = await conn.until_end()
            await conn.close()
            if events[-1].get("reason") == "length":
                return prompt
        pytest.skip("every candidate prompt stops early on this model")

    return asyncio.run(probe())


def socket_path(server: LiveServer) -> str:
    return server.config.uds.socket


async def connect(server: LiveServer) -> FramedClient:
    return await FramedClient.connect(socket_path(server))


def tokens(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "token"]


def assert_idle(server: LiveServer) -> None:
    stats = server.wait_idle()
    assert stats.kv_used_bytes == 0 and stats.num_running == 0


def test_socket_is_created_with_mode_0600(uds_server: LiveServer) -> None:
    mode = os.stat(socket_path(uds_server)).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


async def test_streamed_request(uds_server: LiveServer) -> None:
    conn = await connect(uds_server)
    await conn.send({"id": "s1", "prompt": "Once upon a time", "max_tokens": 6})
    events = await conn.until_end()
    assert events[-1]["event"] == "eos" and events[-1]["id"] == "s1" and events[-1]["reason"] in ("stop", "length")
    toks = tokens(events)
    assert 1 <= len(toks) <= 6 and len(toks) == len(events) - 1
    assert all(e["id"] == "s1" and isinstance(e["text"], str) and isinstance(e["token_id"], int) for e in toks)
    await conn.close()


async def test_frame_delivered_one_byte_at_a_time(uds_server: LiveServer) -> None:
    request = {"id": "b1", "prompt": "Once upon a time", "max_tokens": 4}
    whole = await connect(uds_server)
    await whole.send(request)
    expected = await whole.until_end()
    conn = await connect(uds_server)
    payload = b'{"id": "b1", "prompt": "Once upon a time", "max_tokens": 4}'
    for byte in struct.pack("<I", len(payload)) + payload:
        await conn.send_raw(bytes([byte]))
    assert await conn.until_end() == expected  # greedy: the same events as the frame sent whole
    await whole.close()
    await conn.close()


async def test_frame_over_the_limit_rejected_without_reading_its_payload(uds_server: LiveServer) -> None:
    conn = await connect(uds_server)
    await conn.send_raw(struct.pack("<I", 4097))  # the limit is 4096; no payload byte is ever sent
    event = await conn.recv()
    assert event is not None and event["event"] == "error" and event["code"] == "E_PROTO_FRAME_TOO_LARGE"
    assert await conn.is_closed()


async def test_invalid_json(uds_server: LiveServer) -> None:
    conn = await connect(uds_server)
    await conn.send_raw(struct.pack("<I", 14) + b'{"id": "j1", "')
    event = await conn.recv()
    assert event["event"] == "error" and event["code"] == "E_PROTO_INVALID_JSON"
    assert await conn.is_closed()


async def test_missing_prompt(uds_server: LiveServer) -> None:
    conn = await connect(uds_server)
    await conn.send({"id": "bad1"})
    event = await conn.recv()
    assert event["event"] == "error" and event["code"] == "E_PROTO_BAD_REQUEST" and event["id"] == "bad1"
    assert "prompt" in event["message"]
    assert await conn.is_closed()
    text = httpx.get(f"{uds_server.url}/metrics").text  # counted like other protocols' refusals
    from prometheus_client.parser import text_string_to_metric_families

    rejected = [
        s.labels
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "rill_requests_rejected_total" and s.labels["protocol"] == "framed_uds"
    ]
    assert any(labels["code"] == "E_PROTO_BAD_REQUEST" and labels["model_name"] for labels in rejected)


async def test_prompt_too_large(uds_server: LiveServer) -> None:
    prompt = "".join("qzxj7#@!%^&*()"[(i * 7) % 14] for i in range(3000))  # ~1 token per character
    conn = await connect(uds_server)
    await conn.send({"id": "big", "prompt": prompt, "max_tokens": 4})
    event = await conn.recv()
    assert event["event"] == "error" and event["code"] == "E_LIMIT_PROMPT_TOO_LARGE" and event["id"] == "big"
    assert event["message"].startswith("prompt too large")
    assert await conn.is_closed()


async def test_request_while_busy(uds_server: LiveServer) -> None:
    conn = await connect(uds_server)
    # Both frames in one write: the second arrives while the first is certainly running.
    frames = b""
    for request in ({"id": "r1", "prompt": "Hello", "max_tokens": 50}, {"id": "r2", "prompt": "Again"}):
        body = json.dumps(request).encode()
        frames += struct.pack("<I", len(body)) + body
    await conn.send_raw(frames)
    events = await conn.until_end()
    assert events[-1]["event"] == "error" and events[-1]["code"] == "E_PROTO_BUSY" and events[-1]["id"] == "r2"
    assert all(e["id"] == "r1" and e["event"] == "token" for e in events[:-1])
    assert await conn.is_closed()
    assert_idle(uds_server)  # the running request was stopped and freed


async def test_cancel(uds_server: LiveServer, long_prompt: str) -> None:
    conn = await connect(uds_server)
    await conn.send({"id": "c1", "prompt": long_prompt, "max_tokens": 200})
    events = [await conn.recv(), await conn.recv()]
    assert [e["event"] for e in events] == ["token", "token"]
    await conn.send({"event": "cancel", "id": "c1"})
    events += await conn.until_end()
    eos = [e for e in events if e["event"] == "eos"]
    assert len(eos) == 1 and eos[0] == {"event": "eos", "id": "c1", "reason": "cancelled"}
    assert len(tokens(events)) < 200
    assert_idle(uds_server)
    await conn.send({"id": "c2", "prompt": long_prompt, "max_tokens": 1})  # the connection is still usable
    assert [e["event"] for e in await conn.until_end()] == ["token", "eos"]
    await conn.close()


async def test_stream_false_sends_the_whole_text_in_one_eos(uds_server: LiveServer) -> None:
    request = {"id": "n1", "prompt": "Once upon a time", "max_tokens": 6}
    streamed = await connect(uds_server)
    await streamed.send(request)
    events = await streamed.until_end()
    single = await connect(uds_server)
    await single.send(request | {"stream": False})
    answer = await single.until_end()
    assert len(answer) == 1 and answer[0]["event"] == "eos" and answer[0]["reason"] == events[-1]["reason"]
    assert answer[0]["text"] == "".join(e["text"] for e in tokens(events))
    await streamed.close()
    await single.close()


async def test_metadata_is_echoed_in_every_event(uds_server: LiveServer) -> None:
    meta = {"trace": "t-42", "nested": {"a": [1, 2]}}
    conn = await connect(uds_server)
    await conn.send({"id": "m1", "prompt": "Once upon a time", "max_tokens": 3, "metadata": meta})
    events = await conn.until_end()
    assert events[-1]["event"] == "eos" and all(e["metadata"] == meta for e in events)
    await conn.send({"id": "m2", "prompt": "Hi", "top_p": 7, "metadata": meta})
    error = await conn.recv()
    assert error["event"] == "error" and error["code"] == "E_PROTO_BAD_REQUEST" and error["metadata"] == meta
    assert "top_p" in error["message"]


async def test_metrics_frame(uds_server: LiveServer) -> None:
    before = uds_server.stats().generation_tokens_total
    conn = await connect(uds_server)
    await conn.send({"id": "x", "prompt": "Once upon a time", "max_tokens": 3})
    num_tokens = len(tokens(await conn.until_end()))
    admin = await connect(uds_server)
    await admin.send({"type": "metrics"})
    frame = await admin.recv()
    assert frame["event"] == "metrics" and await admin.is_closed()
    metrics = frame["metrics"]
    for key in (
        "tokens_generated_total",
        "batch_calls_total",
        "last_batch_size",
        "decode_ms_last",
        "decode_ms_ewma",
        "prefill_tokens_total",
        "active_sessions",
    ):
        assert key in metrics
    assert metrics["tokens_generated_total"] == before + num_tokens == uds_server.stats().generation_tokens_total
    assert metrics["active_sessions"] == 2 and metrics["kv_used_bytes"] == 0
    await conn.close()


async def test_two_sequential_requests_on_one_connection(uds_server: LiveServer) -> None:
    conn = await connect(uds_server)
    answers = []
    for request_id in ("q0", "q1"):
        await conn.send({"id": request_id, "prompt": "Once upon a time", "max_tokens": 3})
        events = await conn.until_end()
        assert events[-1]["event"] == "eos" and {e["id"] for e in events} == {request_id}
        answers.append([(e["text"], e["token_id"]) for e in tokens(events)])
    assert answers[0] == answers[1]  # greedy: the same answer twice
    await conn.close()


async def test_disconnect_mid_stream_frees_kv(uds_server: LiveServer) -> None:
    conn = await connect(uds_server)
    await conn.send({"id": "d1", "prompt": "Once upon a time", "max_tokens": 500})
    assert (await conn.recv())["event"] == "token"
    assert uds_server.stats().kv_used_bytes > 0
    await conn.close()
    assert_idle(uds_server)


async def test_newline_mode(uds_server: LiveServer, tmp_path: Path) -> None:
    # A second listener in newline mode on the same engine (as `--uds-protocol newline` would run).
    path = tmp_path / "nl.sock"
    deps = Deps(config=uds_config(path, **{"uds.uds_protocol": "newline"}), client=uds_server.client)
    uds_server.call(
        setattr, uds_server.client.policy, "max_tokens_cap", 3
    )  # lines carry no max_tokens: the cap bounds them
    stop = asyncio.run_coroutine_threadsafe(adapter.start(deps), uds_server.loop).result(10)
    try:
        framed = await connect(uds_server)
        expected = []
        for prompt in ("Once upon a time", "The river stone"):
            await framed.send({"id": "e", "prompt": prompt, "max_tokens": 3})
            expected.append("".join(e["text"] for e in tokens(await framed.until_end())))
        await framed.close()
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(b"Once upon a time\nThe river stone\n")
        writer.write_eof()
        output = (await reader.read()).decode()
        writer.close()
        assert output == "".join(text + "\n\n" for text in expected)
    finally:
        asyncio.run_coroutine_threadsafe(stop(), uds_server.loop).result(10)
        uds_server.call(setattr, uds_server.client.policy, "max_tokens_cap", None)


async def test_slo_request_overtakes_queued_requests(uds_server: LiveServer) -> None:
    # Saturate the engine (one sequence at a time) with a request that cannot stop early.
    blocker_request = GenerateRequest(
        prompt="Once upon a time",
        protocol="test",
        sampling=SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True),
    )
    blocker = asyncio.run_coroutine_threadsafe(uds_server.client.generate(blocker_request), uds_server.loop).result(10)
    await until(lambda: uds_server.stats().num_running == 1)
    order: list[str] = []

    async def first_token(conn: FramedClient, request_id: str) -> None:
        first = await conn.recv()
        assert first is not None and first["event"] == "token", first
        order.append(request_id)
        assert (await conn.until_end())[-1]["event"] == "eos"

    def num_in_engine() -> int:
        stats = uds_server.stats()  # one snapshot
        return stats.num_waiting + stats.num_running

    conns = {request_id: await connect(uds_server) for request_id in ("plain1", "plain2", "slo")}
    waiters = []
    for num_queued, request_id in enumerate(("plain1", "plain2", "slo"), start=2):
        request = {"id": request_id, "prompt": "The river stone", "max_tokens": 2}
        if request_id == "slo":
            request["slo"] = {"target_ttft_ms": 200}
        await conns[request_id].send(request)
        waiters.append(asyncio.create_task(first_token(conns[request_id], request_id)))
        # Wait until the engine has it before sending the next one. The slo request may even
        # preempt the blocker and finish at once: its first token also proves it was admitted.
        await until(lambda n=num_queued, rid=request_id: num_in_engine() == n or rid in order)
    assert order in ([], ["slo"])  # nothing queued without an SLO got a token while the blocker ran
    uds_server.call(uds_server.client.abort, blocker.request_id)
    await asyncio.gather(*waiters)
    assert order == ["slo", "plain1", "plain2"]
    for conn in conns.values():
        await conn.close()
    assert_idle(uds_server)


async def until(predicate) -> None:
    """Poll engine state until ``predicate`` holds (fails the test if it never does)."""
    await wait_until(predicate, attempts=2000, interval_s=0.005)
