"""Issue 31: Evergreen sessions charge the server-wide session-memory budget
(``--max-session-memory``) and a principal's share of it; past either a session aborts with
RESOURCE_EXHAUSTED although it is under its own ``--evergreen-max-bytes``, and everything a
session held is free again once it ends. Through a real server, over gRPC and the
``/evergreen`` WebSocket."""

from __future__ import annotations

import re

import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed

from rill.clients.evergreen import EvergreenClient, EvergreenError
from rill.protocols.evergreen import codec
from tests.conftest import free_port, start_server
from tests.helpers import wait_until

from .helpers import leaf, msg

KIB = 1024
BIG = 400 * KIB
"""One session's leaf: under --evergreen-max-bytes (600 KiB), over half the budget (1 MiB)."""


def used_bytes(live) -> int:
    """``rill_session_memory_used_bytes`` as /metrics shows it."""
    text = httpx.get(f"{live.url}/metrics", headers=live.headers).text
    return int(float(re.search(r"^rill_session_memory_used_bytes\{[^}]*\} (\S+)$", text, re.M).group(1)))


async def until_used(live, predicate) -> None:
    await wait_until(lambda: predicate(used_bytes(live)), attempts=500, interval_s=0.02)


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    """A server whose session memory (1 MiB) is smaller than three sessions' limits (600 KiB each)."""
    server = start_server(
        tiny_model_dir,
        **{
            "evergreen.grpc_port": free_port(),
            "evergreen.evergreen_max_bytes": 600 * KIB,
            "connections.max_session_memory": "1MiB",
            "connections.max_session_memory_per_principal": "1MiB",
        },
    )
    server.headers = {}
    yield server
    server.stop()


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    """A server with two API keys, each key's share (500 KiB) a quarter of the budget."""
    server = start_server(
        tiny_model_dir,
        **{
            "evergreen.grpc_port": free_port(),
            "evergreen.evergreen_max_bytes": 600 * KIB,
            "http.api_key": ["key-one", "key-two"],
            "connections.max_session_memory": "2000KiB",
        },
    )
    server.headers = {"Authorization": "Bearer key-one"}
    yield server
    server.stop()


def grpc_address(live) -> str:
    return f"127.0.0.1:{live.config.evergreen.grpc_port}"


async def test_sessions_stop_at_the_server_wide_budget_and_free_it_when_they_end(live):
    async with EvergreenClient(grpc_address(live)) as client:
        first = client.open_session()
        await first.send(msg(leaf("a", "x" * BIG)))  # held: no action, input not ended
        await until_used(live, lambda used: used > BIG)
        held = used_bytes(live)
        async with ws_connect(f"{live.ws_url}/evergreen", max_size=None) as ws:
            await ws.send(codec.encode_json(msg(leaf("b", "y" * BIG))))
            await until_used(live, lambda used: used > 2 * BIG)
            # A third session is under its own 600 KiB, but the server's 1 MiB is taken.
            third = client.open_session()
            await third.send(msg(leaf("c", "z" * BIG)))
            with pytest.raises(EvergreenError) as info:
                await third.receive()
            assert info.value.status == "RESOURCE_EXHAUSTED"
            assert "--max-session-memory" in str(info.value)
            assert used_bytes(live) > 2 * BIG  # the refused session took nothing, the others keep theirs
        await until_used(live, lambda used: used == held)  # the WebSocket session's bytes are back
        await first.end_input()
        assert await first.receive() is None  # ends OK (nothing to run)
    await until_used(live, lambda used: used == 0)
    # The budget is whole again: a new session may hold as much as the first two did.
    async with EvergreenClient(grpc_address(live)) as client:
        again = client.open_session()
        await again.send(msg(leaf("d", "w" * BIG)))
        await again.send(msg(leaf("e", "v" * (BIG // 4))))
        await until_used(live, lambda used: used > BIG + BIG // 4)
        again.cancel()
    await until_used(live, lambda used: used == 0)


async def test_a_websocket_session_past_the_budget_closes_with_resource_exhausted(live):
    async with EvergreenClient(grpc_address(live)) as client:
        first, second = client.open_session(), client.open_session()
        await first.send(msg(leaf("a", "x" * BIG)))
        await second.send(msg(leaf("b", "x" * BIG)))
        await until_used(live, lambda used: used > 2 * BIG)
        async with ws_connect(f"{live.ws_url}/evergreen", max_size=None) as ws:
            await ws.send(codec.encode_json(msg(leaf("c", "y" * BIG))))
            with pytest.raises(ConnectionClosed) as info:
                await ws.recv()
        assert info.value.rcvd.code == codec.WS_CLOSE_BASE + codec.STATUS_NUMBERS["RESOURCE_EXHAUSTED"]
        first.cancel()
        second.cancel()
    await until_used(live, lambda used: used == 0)


async def test_a_principal_past_its_share_is_refused_while_another_still_gets_in(keyed):
    async with (
        EvergreenClient(grpc_address(keyed), api_key="key-one") as one,
        EvergreenClient(grpc_address(keyed), api_key="key-two") as two,
    ):
        first = one.open_session()
        await first.send(msg(leaf("a", "x" * BIG)))
        await until_used(keyed, lambda used: used > BIG)
        second = one.open_session()  # same key: its share (500 KiB) is nearly used up
        await second.send(msg(leaf("b", "y" * BIG)))
        with pytest.raises(EvergreenError) as info:
            await second.receive()
        assert info.value.status == "RESOURCE_EXHAUSTED"
        assert "--max-session-memory-per-principal" in str(info.value)
        other = two.open_session()  # another key: its own share
        await other.send(msg(leaf("c", "z" * BIG)))
        await until_used(keyed, lambda used: used > 2 * BIG)
        first.cancel()
        other.cancel()
    await until_used(keyed, lambda used: used == 0)
