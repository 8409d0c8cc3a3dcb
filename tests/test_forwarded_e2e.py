"""Forwarded client addresses on a real ``rill serve`` (issue 31, finding 7).

Without API keys a client's per-client limits (rate limit, feedback quota) are keyed by its
address. uvicorn believed ``X-Forwarded-For`` from 127.0.0.1 by default, so a local client
got a fresh rate-limit budget for every address it named in the header. Now the header is
believed only from ``--forwarded-allow-ips`` (default none), and the connection gate counts
the socket's peer either way.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer, start_server
from tests.test_isolation_e2e import wait_waiting


def _limited(model_dir: Path, **overrides: object) -> LiveServer:
    return start_server(model_dir, **{"http.rate_limit_requests": 1, "http.rate_limit_window": 3600.0, **overrides})


@pytest.fixture(scope="module")
def default_server(tiny_model_dir: Path) -> LiveServer:
    live = _limited(tiny_model_dir)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def proxied_server(tiny_model_dir: Path) -> LiveServer:
    live = _limited(tiny_model_dir, **{"http.forwarded_allow_ips": ["127.0.0.1"]})
    yield live
    live.stop()


async def _complete(live: LiveServer, forwarded_for: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
        return await http.post(
            "/v1/completions", json={"prompt": "Hello", "max_tokens": 1}, headers={"X-Forwarded-For": forwarded_for}
        )


async def test_a_spoofed_forwarded_address_does_not_buy_a_fresh_budget(default_server: LiveServer) -> None:
    first = await _complete(default_server, "10.1.1.1")
    second = await _complete(default_server, "10.2.2.2")  # another "client", same socket peer
    assert first.status_code == 200, first.text
    assert second.status_code == 429 and second.json()["error"]["code"] == "rate_limited", second.text


async def test_a_trusted_proxy_s_forwarded_address_is_the_client(proxied_server: LiveServer) -> None:
    first = await _complete(proxied_server, "10.1.1.1")
    second = await _complete(proxied_server, "10.2.2.2")
    again = await _complete(proxied_server, "10.1.1.1")
    assert (first.status_code, second.status_code, again.status_code) == (200, 200, 429), again.text


async def test_behind_a_trusted_proxy_the_gate_still_counts_and_finds_the_socket(proxied_server: LiveServer) -> None:
    import asyncio

    gate = proxied_server.gate
    with proxied_server.hold_engine():
        reply = asyncio.create_task(_complete(proxied_server, "10.3.3.3"))
        await wait_waiting(proxied_server, 1)
        # The in-flight request's connection is the proxy's socket, found by its peer: counted
        # as 127.0.0.1 and marked busy (its header timer stopped), not left idle.
        counted = proxied_server.call(
            lambda: (
                dict(gate.per_client),
                [key[0] for key, connection in gate.http_connections.items() if not connection.lease.idle],
            )
        )
    assert (await reply).status_code == 200
    assert counted[0].get("127.0.0.1", 0) >= 1 and "10.3.3.3" not in counted[0]
    assert counted[1] == ["127.0.0.1"], counted  # the one busy connection: this request's
