"""Tests of rill.protocols.framed_uds.adapter over a real Unix socket, with the in-process
engine client over a ``FakeRunner`` (the real engine code, no model).

(End-to-end tests against a real server with a real model are in test_e2e.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rill.errors import ConfigError
from rill.frontend.inproc import InprocClient
from rill.protocols.framed_uds import adapter
from rill.server import Deps
from rill.testing.fake_runner import StepGate
from tests.helpers import wait_until

from .conftest import FramedClient, engine_client, uds_config


def greedy(client: InprocClient, prompt: str, num_tokens: int) -> list[int]:
    """The tokens greedy decoding of ``prompt`` gives on the client's ``FakeRunner``."""
    engine = client.engine
    assert engine is not None
    ids = engine.tokenizer.encode(prompt)
    out: list[int] = []
    for _ in range(num_tokens):
        out.append(int(np.argmax(engine.runner.logits_after(ids + out))))
    return out


def fail_after(client: InprocClient, prompt: str, num_tokens: int) -> None:
    """Make the engine step fail once ``prompt`` has ``num_tokens`` tokens (a model error)."""
    engine = client.engine
    assert engine is not None
    num_prompt = len(engine.tokenizer.encode(prompt))

    def script(tokens: Any) -> None:
        if len(tokens) >= num_prompt + num_tokens:
            raise RuntimeError("the fake model failed")

    engine.runner.script = script


async def test_streamed_request(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send({"id": "r1", "prompt": "Hello there", "max_tokens": 5, "metadata": {"k": 1}})
    events = await conn.until_end()
    assert [e["event"] for e in events] == ["token"] * 5 + ["eos"]
    assert all(e["id"] == "r1" and e["metadata"] == {"k": 1} for e in events)
    assert [e["token_id"] for e in events[:-1]] == greedy(listener.client, "Hello there", 5)  # temperature 0
    assert events[-1]["reason"] == "length"
    request = listener.requests[0]
    assert request.protocol == "framed_uds" and request.sampling.temperature == 0.0
    await conn.close()


async def test_socket_file_mode_defaults_to_0600_and_can_be_widened(make_listener, sock_path: Path) -> None:
    await make_listener()
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    assert stat.S_ISSOCK(os.stat(sock_path).st_mode)


async def test_socket_mode_option(sock_path: Path, fake_client: InprocClient) -> None:
    stop = await adapter.start(Deps(config=uds_config(sock_path, **{"uds.socket_mode": "0660"}), client=fake_client))
    try:
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o660
    finally:
        await stop()
    assert not sock_path.exists()  # the stopper removes its socket file


async def test_no_socket_opens_nothing(sock_path: Path, fake_client: InprocClient) -> None:
    assert (
        await adapter.start(Deps(config=uds_config(sock_path, **{"uds.no_socket": True}), client=fake_client)) is None
    )
    assert not sock_path.exists()


async def test_stale_socket_file_is_replaced(sock_path: Path, make_listener) -> None:
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock_path))
    dead.close()  # the file stays, nobody listens: what a killed server leaves behind
    assert sock_path.exists()
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send({"id": "r1", "prompt": "hi", "max_tokens": 1})
    assert (await conn.until_end())[-1]["event"] == "eos"
    await conn.close()


async def test_live_socket_makes_startup_fail_clearly(
    make_listener, sock_path: Path, fake_client: InprocClient
) -> None:
    await make_listener()
    with pytest.raises(ConfigError, match="another server is already listening"):
        await adapter.start(Deps(config=uds_config(sock_path), client=fake_client))
    conn = await FramedClient.connect(str(sock_path))  # the live server is untouched
    await conn.send({"id": "r1", "prompt": "hi", "max_tokens": 1})
    assert (await conn.until_end())[-1]["event"] == "eos"
    await conn.close()


async def test_path_that_is_not_a_socket_is_refused(sock_path: Path, fake_client: InprocClient) -> None:
    sock_path.write_text("precious")
    with pytest.raises(ConfigError, match="not a socket"):
        await adapter.start(Deps(config=uds_config(sock_path), client=fake_client))
    assert sock_path.read_text() == "precious"


async def test_frame_one_byte_at_a_time(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    payload = b'{"id":"slow","prompt":"one byte at a time","max_tokens":2}'
    for byte in struct.pack("<I", len(payload)) + payload:
        await conn.send_raw(bytes([byte]))
    events = await conn.until_end()
    assert [e["event"] for e in events] == ["token", "token", "eos"]
    await conn.close()


async def test_oversize_header_rejected_without_the_payload(make_listener) -> None:
    listener = await make_listener(**{"uds.max_frame_bytes": 1024})
    conn = await listener.connect()
    await conn.send_raw(struct.pack("<I", 1025))  # header only: the payload is never sent
    event = await conn.recv()
    assert event is not None and event["event"] == "error" and event["code"] == "E_PROTO_FRAME_TOO_LARGE"
    assert await conn.is_closed()
    assert listener.requests == []


async def test_oversize_frame_sent_whole_gets_the_error_instead_of_a_reset(make_listener) -> None:
    # Issue 12 item 11: a client writing a whole frame over the cap (more than the socket
    # buffers hold) and then reading must get E_PROTO_FRAME_TOO_LARGE, not ECONNRESET/EPIPE.
    listener = await make_listener(**{"uds.max_frame_bytes": 1024})
    payload = b"x" * (2 * 1024 * 1024)

    def client() -> bytes:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(listener.path))
            sock.sendall(struct.pack("<I", len(payload)) + payload)
            received = b""
            while chunk := sock.recv(65536):
                received += chunk
            return received

    received = await asyncio.to_thread(client)
    (length,) = struct.unpack_from("<I", received)
    assert len(received) == 4 + length  # one frame, then a clean end of stream
    event = json.loads(received[4:])
    assert event["event"] == "error" and event["code"] == "E_PROTO_FRAME_TOO_LARGE"
    assert listener.requests == []


async def test_zero_length_frame(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send_raw(b"\x00\x00\x00\x00")
    assert (await conn.recv())["code"] == "E_PROTO_INVALID_LEN"
    assert await conn.is_closed()


async def test_invalid_json(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send_raw(struct.pack("<I", 9) + b'{"id": "x')
    event = await conn.recv()
    assert event["event"] == "error" and event["code"] == "E_PROTO_INVALID_JSON"
    assert await conn.is_closed()


async def test_missing_prompt(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send({"id": "bad1"})
    event = await conn.recv()
    assert event == {
        "event": "error",
        "code": "E_PROTO_BAD_REQUEST",
        "message": "missing required field 'prompt'",
        "id": "bad1",
    }
    assert await conn.is_closed()


async def test_request_while_busy(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send({"id": "r1", "prompt": "long", "max_tokens": 10_000})
    assert (await conn.recv())["event"] == "token"
    await conn.send({"id": "r2", "prompt": "again"})
    events = await conn.until_end()
    assert events[-1]["event"] == "error" and events[-1]["code"] == "E_PROTO_BUSY" and events[-1]["id"] == "r2"
    assert all(e["event"] == "token" and e["id"] == "r1" for e in events[:-1])
    assert await conn.is_closed()
    await _until_engine_idle(listener.client)  # the running request was stopped too


async def test_cancel(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send({"id": "c1", "prompt": "a long story", "max_tokens": 200})
    first = [await conn.recv(), await conn.recv()]
    assert [e["event"] for e in first] == ["token", "token"]
    await conn.send({"event": "cancel", "id": "c1"})
    events = first + await conn.until_end()
    eos = [e for e in events if e["event"] == "eos"]
    assert len(eos) == 1 and eos[0]["reason"] == "cancelled" and eos[0]["id"] == "c1"
    assert len([e for e in events if e["event"] == "token"]) < 200
    await conn.send({"event": "cancel", "id": "c1"})  # late cancel: ignored, connection usable
    await conn.send({"id": "c2", "prompt": "next", "max_tokens": 1})
    assert [e["event"] for e in await conn.until_end()] == ["token", "eos"]
    await conn.close()


async def test_stream_false(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send({"id": "ns", "prompt": "hi", "max_tokens": 3, "stream": False, "metadata": {"a": "b"}})
    events = await conn.until_end()
    text = listener.client.decode(greedy(listener.client, "hi", 3))
    assert len(text) == 3  # one character per token
    assert events == [{"event": "eos", "id": "ns", "reason": "length", "text": text, "metadata": {"a": "b"}}]
    await conn.close()


async def test_two_sequential_requests_on_one_connection(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    for request_id in ("s0", "s1"):
        await conn.send({"id": request_id, "prompt": "hi", "max_tokens": 2})
        events = await conn.until_end()
        assert [e["event"] for e in events] == ["token", "token", "eos"]
        assert {e["id"] for e in events} == {request_id}
    await conn.close()


async def test_one_request_option_closes_after_eos(make_listener) -> None:
    listener = await make_listener(**{"uds.uds_one_request": True})
    conn = await listener.connect()
    await conn.send({"id": "r", "prompt": "hi", "max_tokens": 1})
    assert [e["event"] for e in await conn.until_end()] == ["token", "eos"]
    assert await conn.is_closed()


async def test_metrics_frame(make_listener) -> None:
    listener = await make_listener()
    busy = await listener.connect()
    await busy.send({"id": "r", "prompt": "hi", "max_tokens": 3})
    await busy.until_end()
    conn = await listener.connect()
    await conn.send({"type": "metrics"})
    frame = await conn.recv()
    assert frame["event"] == "metrics" and set(frame) == {"event", "metrics"}
    metrics = frame["metrics"]
    assert metrics["tokens_generated_total"] == 3 and metrics["active_sessions"] == 2
    assert metrics["batch_calls_total"] >= 3
    assert await conn.is_closed()
    other = await listener.connect()
    await other.send({"event": "metrics"})
    assert (await other.recv())["event"] == "metrics"
    await busy.close()


async def test_generation_error(make_listener) -> None:
    listener = await make_listener()
    fail_after(listener.client, "FAIL", 2)
    conn = await listener.connect()
    await conn.send({"id": "f", "prompt": "FAIL", "max_tokens": 10})
    events = [e async for e in _all(conn)]
    assert [e["event"] for e in events] == ["token", "token", "error", "eos"]
    assert events[2]["code"] == "E_RUNTIME_DECODE" and events[3]["reason"] == "error"


async def test_prompt_too_large(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send({"id": "big", "prompt": "word " * 300})  # 1501 tokens: over the context
    event = await conn.recv()
    assert event["code"] == "E_LIMIT_PROMPT_TOO_LARGE" and event["id"] == "big"
    assert "prompt too large" in event["message"]
    assert await conn.is_closed()


async def test_disconnect_mid_stream_frees_the_request(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send({"id": "d", "prompt": "hi", "max_tokens": 10_000})
    assert (await conn.recv())["event"] == "token"
    assert listener.client.stats().kv_used_bytes > 0
    await conn.close()
    await _until_engine_idle(listener.client)
    assert listener.client.stats().kv_used_bytes == 0


async def test_slo_request_overtakes_queued_ones(sock_path: Path) -> None:
    async with engine_client(max_num_seqs=1) as client:
        stop = await adapter.start(Deps(config=uds_config(sock_path), client=client))
        try:
            await _slo_request_overtakes_queued_ones(client, sock_path)
        finally:
            await stop()


async def _slo_request_overtakes_queued_ones(client: InprocClient, sock_path: Path) -> None:
    engine = client.engine
    assert engine is not None
    prompts = {"busy", "slo", "q1", "q2"}
    first_token_order: list[str] = []

    def observe(tokens: Any) -> None:  # the logits after a whole prompt give its first token
        text = engine.tokenizer.decode(tokens)
        if text in prompts and text not in first_token_order:
            first_token_order.append(text)

    # The engine steps only when the test lets it: the busy request's prefill, then nothing
    # until the other three and the cancel are in the engine's inbox. So the busy request holds
    # the only slot whatever the machine's load (it once reached its context's end first), and
    # the three wait together when the slot frees.
    gate = StepGate()
    engine.runner.script, engine.runner.gate = observe, gate
    entered = _record_entries(client)
    conns = [await FramedClient.connect(str(sock_path)) for _ in range(4)]
    try:
        gate.allow(1)
        await conns[0].send({"id": "busy", "prompt": "busy", "max_tokens": 10_000})
        assert (await conns[0].recv())["event"] == "token"  # the only slot is taken
        for conn, rid, extra in (
            (conns[1], "q1", {}),
            (conns[2], "q2", {}),
            (conns[3], "slo", {"slo": {"target_ttft_ms": 100}}),
        ):
            await conn.send({"id": rid, "prompt": rid, "max_tokens": 1} | extra)
            await entered(rid)  # in this order: q1 and q2 queue before the SLO request comes
        await conns[0].send({"event": "cancel", "id": "busy"})
        await entered("abort")
        assert gate.num_passed == 1  # busy's prefill only: nobody was scheduled meanwhile
    finally:
        gate.set()
    for conn in conns:
        await conn.until_end()
    assert first_token_order == ["busy", "slo", "q1", "q2"]


def _record_entries(client: InprocClient) -> Any:
    """Wrap ``client`` so that ``await entered(name)`` returns once the request whose prompt
    is ``name`` was put in the engine's inbox (``"abort"``: once an abort was)."""
    engine = client.engine
    assert engine is not None
    events: dict[str, asyncio.Event] = {}
    start_choice, abort = client.start_choice, client.abort

    def event(name: str) -> asyncio.Event:
        return events.setdefault(name, asyncio.Event())

    async def recording_start(choice: Any) -> Any:
        stream = await start_choice(choice)
        event(engine.tokenizer.decode(choice.prompt_ids)).set()
        return stream

    def recording_abort(request_id: Any) -> None:
        abort(request_id)
        event("abort").set()

    client.start_choice, client.abort = recording_start, recording_abort  # type: ignore[method-assign]

    async def entered(name: str) -> None:
        await event(name).wait()

    return entered


async def test_stopper_ends_live_connections(sock_path: Path, fake_client: InprocClient) -> None:
    stop = await adapter.start(Deps(config=uds_config(sock_path), client=fake_client))
    conn = await FramedClient.connect(str(sock_path))
    await conn.send({"id": "r", "prompt": "hi", "max_tokens": 10_000})
    assert (await conn.recv())["event"] == "token"
    await stop()
    while (event := await conn.recv()) is not None:
        assert event["event"] == "token"
    await _until_engine_idle(fake_client)
    assert not sock_path.exists()


async def test_newline_mode(make_listener, fake_client: InprocClient) -> None:
    fake_client.policy.max_tokens_cap = 2  # lines carry no max_tokens: the server's cap (admission's) bounds them
    listener = await make_listener(**{"uds.uds_protocol": "newline"})
    reader, writer = await asyncio.open_unix_connection(str(listener.path))
    writer.write(b"first\nsecond\n")
    writer.write_eof()  # like `printf 'first\nsecond\n' | nc -U`: the answers still come
    answers = [fake_client.decode(greedy(fake_client, line, 2)) + "\n\n" for line in ("first", "second")]
    assert await reader.read() == "".join(answers).encode()
    writer.close()


async def test_with_api_keys_a_request_needs_one_and_is_its_principal(make_listener) -> None:
    listener = await make_listener(**{"http.api_key": ["k1", "k2"]})
    for bad in ({}, {"api_key": ""}, {"api_key": "k3"}):
        conn = await listener.connect()
        await conn.send({"id": "r1", "prompt": "Hello", "max_tokens": 1} | bad)
        [error] = await conn.until_end()
        assert error["event"] == "error" and error["code"] == "E_AUTH_UNAUTHORIZED" and error["id"] == "r1"
        assert "api_key" in error["message"] and await conn.is_closed()
    assert listener.requests == []
    for key in ("k1", "k2"):
        conn = await listener.connect()
        await conn.send({"id": "r1", "prompt": "Hello", "max_tokens": 1, "api_key": key})
        assert (await conn.until_end())[-1]["event"] == "eos"
        await conn.close()
    principals = [request.principal for request in listener.requests]
    assert len(set(principals)) == 2 and all(p.startswith("key:") and "k1" not in p for p in principals)
    conn = await listener.connect()
    await conn.send({"type": "metrics", "api_key": "k3"})
    [error] = await conn.until_end()
    assert error["event"] == "error" and error["code"] == "E_AUTH_UNAUTHORIZED"
    conn = await listener.connect()
    await conn.send({"type": "metrics", "api_key": "k2"})
    assert (await conn.recv())["event"] == "metrics"


async def test_without_api_keys_the_principal_is_the_peer_user(make_listener) -> None:
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send({"id": "r1", "prompt": "Hello", "max_tokens": 1, "api_key": "ignored"})
    assert (await conn.until_end())[-1]["event"] == "eos"
    await conn.close()
    assert listener.requests[0].principal == f"uds:uid={os.getuid()}"


async def test_newline_mode_refuses_every_line_when_keys_are_on(make_listener) -> None:
    listener = await make_listener(**{"uds.uds_protocol": "newline", "http.api_key": ["k1"]})
    reader, writer = await asyncio.open_unix_connection(str(listener.path))
    writer.write(b"first\n")
    answer = await reader.read()
    assert b"E_AUTH_UNAUTHORIZED" in answer and b"cannot carry" in answer
    assert listener.requests == []
    writer.close()


async def _all(conn: FramedClient):
    while (event := await conn.recv()) is not None:
        yield event


async def _until(predicate) -> None:
    # Polls state changed by the fake engine's step loop and the tokenizer pool: bounded, not
    # timed (10 s of attempts ran out once beside two CPU hogs and the rest of the suite).
    await wait_until(predicate, attempts=60_000, interval_s=0.001)


async def _until_engine_idle(client: InprocClient) -> None:
    await _until(lambda: client.stats().num_running == 0 and client.stats().num_waiting == 0)


async def test_connections_past_the_limit_are_refused(sock_path, fake_client):
    # Regression (issue 12 item 8): any number of Unix-socket clients could be open at once.
    # The first-message timeout is long, so the idle clients surely hold both places.
    from rill.connections import ConnectionGate

    gate = ConnectionGate(2, 2)
    cfg = uds_config(sock_path, **{"connections.first_message_timeout_s": 600})
    stop = await adapter.start(Deps(config=cfg, client=fake_client, gate=gate))
    try:
        idle = [await FramedClient.connect(str(sock_path)) for _ in range(2)]
        refused = await FramedClient.connect(str(sock_path))
        event = await refused.recv()
        assert event is not None and event["event"] == "error" and event["code"] == "E_LIMIT_REJECTED"
        assert "limit of 2 connections" in event["message"] and await refused.is_closed()
        await refused.close()
        for client in idle:
            await client.close()
        await wait_until(lambda: gate.total == 0, attempts=500, interval_s=0.01)
    finally:
        await stop()


async def test_idle_unix_connections_make_room_for_other_addresses(sock_path, fake_client):
    # Issue 31 finding 5: at the total limit, Unix-socket peers (together one group for fair
    # shares) that sent nothing yet are closed to let a client of another address in; one
    # that has sent its first message is never closed.
    import pytest

    from rill.connections import ConnectionGate
    from rill.errors import TooManyConnections

    gate = ConnectionGate(3, 3)
    cfg = uds_config(sock_path, **{"connections.first_message_timeout_s": 600})
    stop = await adapter.start(Deps(config=cfg, client=fake_client, gate=gate))
    try:
        busy = await FramedClient.connect(str(sock_path))
        await busy.send({"id": "r1", "prompt": "hi", "max_tokens": 2})
        assert (await busy.until_end())[-1]["event"] == "eos"
        idle = [await FramedClient.connect(str(sock_path)) for _ in range(2)]
        await wait_until(lambda: (gate.total, gate.num_idle) == (3, 2), attempts=500, interval_s=0.01)
        # Two other addresses (as the HTTP port or gRPC would take them): fair share 3 // 2,
        # then 3 // 3; the Unix peers hold more, so their idle connections go, oldest first.
        first, second = gate.open("10.0.0.9"), gate.open("10.0.0.8")
        assert gate.evicted == 2 and await idle[0].is_closed() and await idle[1].is_closed()
        with pytest.raises(TooManyConnections):  # only the busy one is left: nobody is over a share
            gate.open("10.0.0.7")
        await busy.send({"id": "r2", "prompt": "hi", "max_tokens": 2})
        assert (await busy.until_end())[-1]["event"] == "eos"
        for client in (busy, *idle):
            await client.close()
        first.release()
        second.release()
        await wait_until(lambda: gate.total == 0, attempts=500, interval_s=0.01)
    finally:
        await stop()


async def test_idle_connections_time_out_and_free_their_places(sock_path, fake_client):
    # Regression (issue 12 item 8): a Unix-socket client that never sent a frame was held forever.
    from rill.connections import ConnectionGate

    gate = ConnectionGate(2, 2)
    cfg = uds_config(sock_path, **{"connections.first_message_timeout_s": 0.5})
    stop = await adapter.start(Deps(config=cfg, client=fake_client, gate=gate))
    try:
        idle = [await FramedClient.connect(str(sock_path)) for _ in range(2)]
        for client in idle:  # no first frame within the time allowed: an error frame, then close
            event = await client.recv()
            assert (
                event is not None and event["code"] == "E_RUNTIME_TIMEOUT" and "no message within" in event["message"]
            )
            assert await client.is_closed()
            await client.close()
        await wait_until(lambda: gate.total == 0, attempts=500, interval_s=0.01)
        served = await FramedClient.connect(str(sock_path))  # the places are free again
        await served.send({"id": "r1", "prompt": "hi", "max_tokens": 2})
        events = await served.until_end()
        assert events[-1]["event"] == "eos"
        await served.close()
    finally:
        await stop()


async def test_deep_json_frame_is_invalid_json_not_a_bare_close(make_listener) -> None:
    # Issue 12 item 5: RecursionError escaped decode and the connection closed with no frame.
    listener = await make_listener()
    conn = await listener.connect()
    payload = b'{"id": "d", "prompt": "p", "metadata": {"x": ' + b"[" * 5000 + b"]" * 5000 + b"}}"
    await conn.send_raw(struct.pack("<I", len(payload)) + payload)
    event = await conn.recv()
    assert event is not None and event["event"] == "error" and event["code"] == "E_PROTO_INVALID_JSON"
    assert await conn.is_closed()


async def test_a_session_bug_answers_with_the_generic_error_frame(make_listener, monkeypatch) -> None:
    from rill.protocols.framed_uds.session import FramedSession

    def broken(self, message):
        raise KeyError("secret internals")

    monkeypatch.setattr(FramedSession, "receive", broken)
    listener = await make_listener()
    conn = await listener.connect()
    await conn.send({"id": "x", "prompt": "hi"})
    event = await conn.recv()
    assert event is not None and event["code"] == "E_RUNTIME_INTERNAL" and "secret" not in event["message"]
    assert await conn.is_closed()


class _Rejections:
    """Records what a protocol counts in ``rill_requests_rejected_total``."""

    def __init__(self) -> None:
        self.codes: list[tuple[str, str]] = []

    def observe_rejection(self, *, protocol: str, code: str) -> None:
        self.codes.append((protocol, code))


async def test_refusals_are_counted_once_under_the_wire_codes(sock_path, fake_client) -> None:
    rejections = _Rejections()
    stop = await adapter.start(Deps(config=uds_config(sock_path), client=fake_client, metrics=rejections))
    try:
        conn = await FramedClient.connect(str(sock_path))
        await conn.send({"id": "big", "prompt": "word " * 300})  # refused by the engine: over the context
        assert (await conn.recv())["code"] == "E_LIMIT_PROMPT_TOO_LARGE" and await conn.is_closed()
        conn = await FramedClient.connect(str(sock_path))
        await conn.send({"id": "bad"})  # refused by the session: no prompt
        assert (await conn.recv())["code"] == "E_PROTO_BAD_REQUEST" and await conn.is_closed()
        assert rejections.codes == [("framed_uds", "E_LIMIT_PROMPT_TOO_LARGE"), ("framed_uds", "E_PROTO_BAD_REQUEST")]
    finally:
        await stop()


async def test_a_cancel_while_the_request_is_submitted_is_answered_at_once(
    make_listener, fake_client, monkeypatch
) -> None:
    listener = await make_listener()
    submitted, entered = asyncio.Event(), asyncio.Event()
    generate = fake_client.generate

    async def held(request: Any) -> Any:
        entered.set()
        await submitted.wait()
        return await generate(request)

    monkeypatch.setattr(fake_client, "generate", held)
    conn = await listener.connect()
    await conn.send({"id": "c1", "prompt": "hi", "max_tokens": 5})
    await asyncio.wait_for(entered.wait(), 30)
    await conn.send({"event": "cancel", "id": "c1"})
    assert await asyncio.wait_for(conn.recv(), 30) == {"event": "eos", "id": "c1", "reason": "cancelled"}
    submitted.set()
    await conn.send({"id": "c2", "prompt": "next", "max_tokens": 1})
    assert [e["event"] for e in await conn.until_end()] == ["token", "eos"]
    assert [r.prompt for r in listener.requests] == ["next"]  # the cancelled one never reached the engine
    await conn.close()


async def test_a_lagging_reader_still_gets_one_token_event_per_token(fake_client) -> None:
    """The request stream folds outputs together while its reader is behind (a slow peer):
    the session still sends one ``token`` event per token."""
    from rill.protocols._shared.driver import Driver
    from rill.protocols.framed_uds.messages import Eos, Request, Token
    from rill.protocols.framed_uds.session import FramedSession

    sent: list[Any] = []
    release = asyncio.Event()

    class SlowPeer:
        async def send(self, message: Any) -> None:
            sent.append(message)
            await release.wait()  # the first write blocks: the engine runs on meanwhile

        async def close(self, code: Any, reason: str) -> None:
            pass

        async def perform(self, action: Any) -> None:
            pass

    session = FramedSession()
    folded: list[int] = []
    on_output = session.on_output

    def counting(key: Any, out: Any, now: float) -> Any:
        folded.append(len(out.token_ids))
        return on_output(key, out, now)

    session.on_output = counting  # type: ignore[method-assign]
    driver = Driver(session, SlowPeer(), fake_client, protocol="framed_uds", principal="uds:test")
    await driver.perform(session.receive(Request(id="r", prompt="hello", max_tokens=20)))
    await _until(lambda: bool(sent) and fake_client.stats().num_running == 0 and fake_client.stats().num_waiting == 0)
    release.set()
    await asyncio.wait_for(driver.wait(), 30)
    tokens = [x for x in sent if isinstance(x, Token)]
    assert len(tokens) == 20 and isinstance(sent[-1], Eos) and sent[-1].reason == "length"
    assert max(folded) > 1  # the stream did fold outputs: the case under test happened
