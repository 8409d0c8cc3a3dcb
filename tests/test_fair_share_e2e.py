"""Fair shares of the connection limit on a real ``rill serve`` (issue 31, finding 5).

Before: with every place taken by two addresses holding idle sockets (each within its
per-address limit), every other client was refused (503) until the idle ones timed out,
over and over. Now a client from a third address is served: an idle connection of the
address most over its fair share is closed to make room (an HTTP connection with no
request under way silently, a WebSocket that sent nothing with close code 1013), and never
one with a request in flight.

Assertions are on events and on the server's own connection gate, never on elapsed time;
the bounded waits only turn a hang into a failure.
"""

from __future__ import annotations

import asyncio
import base64
import os
import struct

import httpx
import pytest

from tests.conftest import LiveServer, start_server
from tests.test_isolation_e2e import wait_waiting

MAX_CONNECTIONS = 8
PER_CLIENT = 5
HELD = 4  # idle connections each of two addresses holds in the first test
HANG_S = 60  # a hang bound, never a pass condition
HTTP_SOURCE, WS_SOURCE = "127.0.0.2", "127.0.0.3"  # the served client comes from 127.0.0.1


@pytest.fixture(scope="module")
def small_server(tiny_model_dir) -> LiveServer:
    live = start_server(
        tiny_model_dir,
        **{
            "connections.max_connections": MAX_CONNECTIONS,
            "connections.max_connections_per_client": PER_CLIENT,
            # Long: no idle connection may end by its own timeout while the test runs.
            "connections.first_message_timeout_s": 600.0,
            "connections.header_timeout_s": 600.0,
        },
    )
    yield live
    live.stop()


async def _until_no_connection(live: LiveServer) -> None:
    """Wait until the server has seen every earlier connection close (a hang bound only)."""
    for _ in range(HANG_S * 50):
        if live.call(lambda: live.gate.total) == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the server still counts {live.call(lambda: live.gate.total)} connections")


async def _read_head(reader: asyncio.StreamReader) -> bytes:
    return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HANG_S)


async def _idle_http(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that sends nothing (uvicorn's own keep-alive timeout would end one kept
    alive after a request; before its first request only the header timeout applies)."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(HTTP_SOURCE, 0))


async def _idle_websocket(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A WebSocket that was accepted and never sends its first message."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(WS_SOURCE, 0))
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        (
            f"GET /ws/chat HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    head = await _read_head(reader)
    assert head.startswith(b"HTTP/1.1 101"), head
    return reader, writer


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    received = bytearray()
    try:
        while chunk := await reader.read(65536):
            received += chunk
    except ConnectionError:
        pass
    return bytes(received)


def _close_codes(frames: bytes) -> list[int]:
    """The codes of the server's close frames (unmasked, short) among ``frames``."""
    codes, at = [], 0
    while at + 2 <= len(frames):
        opcode, length = frames[at] & 0x0F, frames[at + 1] & 0x7F
        header = 2 + (2 if length == 126 else 8 if length == 127 else 0)
        if length >= 126:
            length = int.from_bytes(frames[at + 2 : at + header], "big")
        if opcode == 8 and length >= 2:
            codes.append(struct.unpack("!H", frames[at + header : at + header + 2])[0])
        at += header + length
    return codes


async def test_two_addresses_holding_idle_sockets_cannot_lock_a_third_out(small_server: LiveServer) -> None:
    port, gate = small_server.port, small_server.gate
    await _until_no_connection(small_server)
    held_http = [await _idle_http(port) for _ in range(HELD)]
    held_ws = [await _idle_websocket(port) for _ in range(HELD)]
    # Every place is taken, by connections the server itself counts as idle.
    for _ in range(HANG_S * 50):
        if small_server.call(lambda: (gate.total, gate.num_idle)) == (MAX_CONNECTIONS, MAX_CONNECTIONS):
            break
        await asyncio.sleep(0.02)
    assert small_server.call(lambda: (gate.total, gate.num_idle, dict(gate.per_client))) == (
        MAX_CONNECTIONS,
        MAX_CONNECTIONS,
        {HTTP_SOURCE: HELD, WS_SOURCE: HELD},
    )
    watchers = {
        asyncio.create_task(_until_closed(reader)): source
        for source, held in ((HTTP_SOURCE, held_http), (WS_SOURCE, held_ws))
        for reader, _ in held
    }

    # A third address, on two connections at once: both are served. Its fair share is
    # 8 // 3 = 2; each connection closes an idle one of the address holding the most (4),
    # so one of each address goes. The engine is held so the first request is still in
    # flight (its connection counted, and busy) when the second connects.
    async def complete() -> httpx.Response:
        async with httpx.AsyncClient(base_url=small_server.url, timeout=HANG_S) as http:
            return await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})

    with small_server.hold_engine():
        first = asyncio.create_task(complete())
        await wait_waiting(small_server, 1)
        second = asyncio.create_task(complete())
        await wait_waiting(small_server, 2)
    for reply in await asyncio.wait_for(asyncio.gather(first, second), HANG_S):
        assert reply.status_code == 200, reply.text

    while sum(w.done() for w in watchers) < 2:
        done, _ = await asyncio.wait(
            [w for w in watchers if not w.done()], timeout=HANG_S, return_when=asyncio.FIRST_COMPLETED
        )
        assert done, f"the server closed {sum(w.done() for w in watchers)} idle connections to make room, not 2"
    closed: dict[str, bytes] = {}
    for watcher, source in watchers.items():
        if watcher.done():
            assert source not in closed, f"two connections of {source} were closed"
            closed[source] = watcher.result()
    assert closed[HTTP_SOURCE] == b""  # nothing asked: closed without a word
    assert _close_codes(closed[WS_SOURCE]) == [1013]  # no first message yet: try again later
    counts = small_server.call(lambda: (dict(gate.per_client), gate.evicted, gate.refused))
    assert {k: v for k, v in counts[0].items() if k != "127.0.0.1"} == {HTTP_SOURCE: HELD - 1, WS_SOURCE: HELD - 1}
    assert counts[1:] == (2, 0)

    for watcher in watchers:
        watcher.cancel()
    for _reader, writer in (*held_http, *held_ws):
        writer.close()


async def test_a_connection_with_a_request_in_flight_is_never_closed_to_make_room(small_server: LiveServer) -> None:
    port, gate = small_server.port, small_server.gate
    await _until_no_connection(small_server)
    evicted_before = small_server.call(lambda: gate.evicted)

    async def complete(source: str) -> httpx.Response:
        transport = httpx.AsyncHTTPTransport(local_address=source)
        async with httpx.AsyncClient(base_url=small_server.url, timeout=HANG_S, transport=transport) as http:
            return await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})

    with small_server.hold_engine():
        # 127.0.0.2 holds the most (5), all with a request in flight; 127.0.0.3 holds 3 idle.
        busy = [asyncio.create_task(complete(HTTP_SOURCE)) for _ in range(PER_CLIENT)]
        await wait_waiting(small_server, PER_CLIENT)
        idle = [
            await asyncio.open_connection("127.0.0.1", port, local_addr=(WS_SOURCE, 0))
            for _ in range(MAX_CONNECTIONS - PER_CLIENT)
        ]
        for _ in range(HANG_S * 50):
            if small_server.call(lambda: (gate.total, gate.num_idle)) == (MAX_CONNECTIONS, 3):
                break
            await asyncio.sleep(0.02)
        assert small_server.call(lambda: (gate.total, gate.num_idle)) == (MAX_CONNECTIONS, 3)
        # A third address: the room comes from 127.0.0.3's idle connections, not from the
        # busier 127.0.0.2, whose every connection has a request in flight.
        newcomer = asyncio.create_task(complete("127.0.0.1"))
        await wait_waiting(small_server, PER_CLIENT + 1)
        counts = small_server.call(lambda: (dict(gate.per_client), gate.evicted))
    replies = await asyncio.wait_for(asyncio.gather(*busy, newcomer), HANG_S)
    assert [reply.status_code for reply in replies] == [200] * (PER_CLIENT + 1)
    assert counts == ({HTTP_SOURCE: PER_CLIENT, WS_SOURCE: 2, "127.0.0.1": 1}, evicted_before + 1)
    assert await asyncio.wait_for(_until_closed(idle[0][0]), HANG_S) == b""  # the one idle the longest
    for _, writer in idle:
        writer.close()
