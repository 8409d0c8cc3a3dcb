"""Connection limits and connection timeouts on a real ``rill serve`` (issue 12 item 8).

Before: 3,000 ``/ws/chat`` sockets that never sent a message and 3,000 HTTP requests with
unfinished bodies were all held (file descriptors 17 → 3,017), so an idle client could take
every descriptor the process had. Now each idle connection is either refused at once (503,
past ``--max-connections-per-client``) or closed after its timeout (WebSocket: close 1008;
HTTP headers or body: 408), and other clients are served meanwhile.

Assertions are on events (what each socket received before the server closed it, what the
server's own gauges said while answering a normal client), never on elapsed time; the
bounded waits only turn a hang into a failure.
"""

from __future__ import annotations

import asyncio
import base64
import os
import resource
import struct
from dataclasses import dataclass, field

import httpx
import pytest

from tests.conftest import LiveServer, start_server

IDLE_CONNECTIONS = 3000
PER_CLIENT = 200
TIMEOUT_S = 8.0
IDLE_SOURCE = "127.0.0.2"  # the idle flood's address; the normal client comes from 127.0.0.1
CLOSE_WAIT_S = 120  # a hang bound, never a pass condition


@pytest.fixture(scope="module")
def limited_server(tiny_model_dir) -> LiveServer:
    live = start_server(
        tiny_model_dir,
        **{
            "connections.max_connections": 400,
            "connections.max_connections_per_client": PER_CLIENT,
            "connections.first_message_timeout_s": TIMEOUT_S,
            "connections.header_timeout_s": TIMEOUT_S,
            "connections.body_timeout_s": TIMEOUT_S,
        },
    )
    yield live
    live.stop()


def _allow_many_files(needed: int) -> None:
    """Raise this process's soft fd limit (client and server ends of every socket live here)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.fail(f"the hard open-file limit ({hard}) is below the {needed} this test needs")
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


@dataclass
class Idle:
    """One idle client socket and what the server did with it."""

    kind: str
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    received: bytearray = field(default_factory=bytearray)
    outcome: str = ""


def _opening_bytes(kind: str, port: int) -> bytes:
    host = f"127.0.0.1:{port}"
    if kind == "bare":
        return b""  # connects and never sends a byte
    if kind == "headers":
        return f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: app".encode()
    if kind == "body":
        return (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f'Content-Length: 200\r\n\r\n{{"messages": ['
        ).encode()
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET /ws/chat HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


async def _open(kind: str, port: int) -> Idle:
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(IDLE_SOURCE, 0))
    data = _opening_bytes(kind, port)
    if data:
        writer.write(data)
        try:
            await writer.drain()
        except ConnectionError:
            pass  # refused at once: the outcome is read below
    return Idle(kind, reader, writer)


def _close_code(frames: bytes) -> int | None:
    """The code of a server close frame (opcode 8, unmasked) at the start of ``frames``."""
    if len(frames) >= 4 and frames[0] == 0x88:
        return struct.unpack("!H", frames[2:4])[0]
    return None


async def _until_closed(idle: Idle) -> None:
    """Read until the server ends the connection; name what it sent (its outcome)."""
    try:
        while True:
            chunk = await idle.reader.read(65536)
            if not chunk:
                break
            idle.received += chunk
            head, sep, rest = bytes(idle.received).partition(b"\r\n\r\n")
            if head.startswith(b"HTTP/1.1 101") and sep and _close_code(rest) is not None:
                break  # a WebSocket close frame: the server has closed its side
    except ConnectionError:
        pass
    finally:
        idle.writer.close()
    status = bytes(idle.received[:12])
    if status == b"HTTP/1.1 503":
        idle.outcome = "refused"
    elif status == b"HTTP/1.1 408":
        idle.outcome = "timed out"
    elif status == b"HTTP/1.1 101":
        code = _close_code(bytes(idle.received).partition(b"\r\n\r\n")[2])
        idle.outcome = f"closed {code}"
    elif not idle.received:
        # A socket that sent nothing is closed silently when its time is up; one that sent
        # bytes and got nothing was refused at accept (the 503 lost to a reset).
        idle.outcome = "closed silently" if idle.kind == "bare" else "refused"
    else:
        idle.outcome = f"unexpected {bytes(idle.received[:40])!r}"


def _gauge(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith((name + "{", name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


async def test_idle_connections_are_refused_past_the_limit_and_closed_after_the_timeout(
    limited_server: LiveServer,
) -> None:
    _allow_many_files(IDLE_CONNECTIONS + 2000)
    port = limited_server.port
    kinds = ("bare", "headers", "body", "ws")
    # The first PER_CLIENT fill this address's share; the rest arrive while a normal client,
    # from another address, is served: its /metrics answer counts the idle ones held at the
    # moment it was produced.
    held = await asyncio.gather(*[_open(kinds[i % len(kinds)], port) for i in range(PER_CLIENT)])
    flood = asyncio.gather(*[_open(kinds[i % len(kinds)], port) for i in range(PER_CLIENT, IDLE_CONNECTIONS)])
    async with httpx.AsyncClient(base_url=limited_server.url, timeout=60) as http:
        metrics = (await http.get("/metrics")).text
        reply = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
    idle = [*held, *await flood]
    readers = [asyncio.create_task(_until_closed(one)) for one in idle]
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    held_meanwhile = _gauge(metrics, "rill_connections_open") - 1  # minus the /metrics request itself
    assert 1 <= held_meanwhile <= PER_CLIENT

    done, pending = await asyncio.wait(readers, timeout=CLOSE_WAIT_S)
    assert not pending, f"{len(pending)} idle connections were never closed by the server"
    outcomes: dict[str, dict[str, int]] = {}
    for one in idle:
        outcomes.setdefault(one.kind, {}).setdefault(one.outcome, 0)
        outcomes[one.kind][one.outcome] += 1
    # Every idle connection ended with its protocol's answer: 503 at once past the limit,
    # else 408 (headers or body not complete in time; a silent close if nothing was sent) or
    # WebSocket close 1008 (no first message).
    expected = {
        "bare": {"refused", "closed silently"},
        "headers": {"refused", "timed out"},
        "body": {"refused", "timed out"},
        "ws": {"refused", "closed 1008"},
    }
    for kind, seen in outcomes.items():
        assert set(seen) <= expected[kind], (kind, seen)
    timed_out = sum(n for seen in outcomes.values() for outcome, n in seen.items() if outcome != "refused")
    refused = sum(seen.get("refused", 0) for seen in outcomes.values())
    assert timed_out >= PER_CLIENT and refused >= 1 and timed_out + refused == IDLE_CONNECTIONS, outcomes
    for kind in kinds:  # each kind was held (some of each got past accept) and timed out
        assert sum(n for outcome, n in outcomes[kind].items() if outcome != "refused") >= 1, (kind, outcomes)

    # Nothing is left behind: once the server has seen every close, the gate counts none of them.
    async with httpx.AsyncClient(base_url=limited_server.url) as http:

        async def only_this_client() -> bool:
            return _gauge((await http.get("/metrics")).text, "rill_connections_open") == 1

        for _ in range(200):
            if await only_this_client():
                break
            await asyncio.sleep(0.05)
        assert await only_this_client()


def test_a_message_over_the_limit_is_refused_with_1009_while_the_client_is_still_sending(
    server: LiveServer,
) -> None:
    """The server reads a message's header, refuses it (close 1009) and would close its socket at
    once; a client still writing its 12 MiB must get that close, not a reset (lingering close)."""
    import json
    import random

    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    noise = random.Random(7).randbytes(24 * 2**20).hex()  # 48 MiB, nothing to compress
    assert len(noise) > server.config.http.max_body_bytes
    for _ in range(3):
        with connect(server.ws_url + "/generate", compression=None, max_size=None) as ws:
            try:
                ws.send(json.dumps({"type": "config", "prompt": noise}))
                ws.recv(timeout=30)
            except ConnectionClosed as exc:
                assert exc.rcvd is not None and exc.rcvd.code == 1009, exc
            else:
                raise AssertionError("the server answered a message over its limit")
