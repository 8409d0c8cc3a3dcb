"""``rill.middleware``: API keys on HTTP and WebSocket routes, body-size limit, CORS.

A small Starlette app stands in for rill's routes and runs under uvicorn on loopback, so
the WebSocket handshake denial and chunked uploads go through a real ASGI server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from rill import auth, middleware
from rill import config as config_mod
from rill.protocols.openai_http.adapter import http_error
from tests.helpers import serving


async def _echo(request: Request) -> JSONResponse:
    body = await request.body()
    return JSONResponse({"size": len(body), "path": request.url.path})


async def _ws(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text("hello")
    await websocket.close()


def _deps(**overrides: Any) -> Any:
    cfg = config_mod.load(overrides, env={})
    return SimpleNamespace(config=cfg, api_keys=cfg.api_keys(), gate=None)


@contextlib.asynccontextmanager
async def serve(**overrides: Any) -> AsyncIterator[str]:
    inner = Starlette(
        routes=[Route("/health", _echo), Route("/v1/echo", _echo, methods=["GET", "POST"]), WebSocketRoute("/ws", _ws)]
    )
    app = middleware.wrap(inner, _deps(**overrides), render_error=http_error)
    async with serving(app) as port:
        yield f"127.0.0.1:{port}"


async def test_no_keys_means_no_auth() -> None:
    async with serve() as host, httpx.AsyncClient(base_url=f"http://{host}") as http:
        assert (await http.get("/v1/echo")).status_code == 200
        async with websockets.connect(f"ws://{host}/ws") as ws:
            assert await ws.recv() == "hello"


async def test_http_routes_need_a_bearer_key_except_health() -> None:
    async with serve(**{"http.api_key": ["k1", "k2"]}) as host, httpx.AsyncClient(base_url=f"http://{host}") as http:
        refused = await http.post("/v1/echo", json={})
        assert refused.status_code == 401
        assert refused.headers["www-authenticate"] == "Bearer"
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.json()["error"]["type"] == "invalid_request_error"
        for header in ("Bearer nope", "Basic k1", "k1", "Bearer"):
            assert (await http.get("/v1/echo", headers={"Authorization": header})).status_code == 401, header
        for header in ("Bearer k1", "bearer k2", "Bearer  k1"):
            assert (await http.get("/v1/echo", headers={"Authorization": header})).status_code == 200, header
        assert (await http.get("/v1/echo?api_key=k1")).status_code == 401  # query keys are for WebSockets only
        assert (await http.get("/health")).status_code == 200


async def test_websocket_without_key_is_refused_with_401_before_accept() -> None:
    async with serve(**{"http.api_key": ["k1"]}) as host:
        for url, headers in (
            (f"ws://{host}/ws", None),
            (f"ws://{host}/ws?api_key=bad", None),
            (f"ws://{host}/ws", {"Authorization": "Bearer bad"}),
        ):
            with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                async with websockets.connect(url, additional_headers=headers):
                    pass
            assert refused.value.response.status_code == 401
            assert b"invalid_api_key" in refused.value.response.body
        async with websockets.connect(f"ws://{host}/ws?api_key=k1") as ws:
            assert await ws.recv() == "hello"
        async with websockets.connect(f"ws://{host}/ws", additional_headers={"Authorization": "Bearer k1"}) as ws:
            assert await ws.recv() == "hello"


async def test_websocket_key_as_subprotocol_is_accepted_and_never_echoed() -> None:
    async with serve(**{"http.api_key": ["k1"]}) as host:
        for offered in (["rill", auth.key_subprotocol("bad")], ["rill"], [auth.key_subprotocol("k1") + "x"]):
            with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                async with websockets.connect(f"ws://{host}/ws", subprotocols=offered):
                    pass
            assert refused.value.response.status_code == 401
        offered = ["rill", auth.key_subprotocol("k1")]
        async with websockets.connect(f"ws://{host}/ws", subprotocols=offered) as ws:
            assert ws.subprotocol == "rill"  # the key goes one way only
            assert await ws.recv() == "hello"


async def test_the_playground_page_needs_no_key_but_everything_else_does() -> None:
    async def page(request: Request) -> JSONResponse:
        return JSONResponse({"path": request.url.path})

    inner = Starlette(
        routes=[
            Route("/", page),
            Route("/playground/static/{name}", page),
            Route("/playground/prompt", page, methods=["POST"]),
        ]
    )
    app = middleware.wrap(inner, _deps(**{"http.api_key": ["k1"]}), render_error=http_error)
    async with serving(app) as port, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        assert (await http.get("/")).status_code == 200
        assert (await http.get("/playground/static/playground.js")).status_code == 200
        assert (await http.post("/playground/prompt", json={})).status_code == 401
        assert (
            await http.post("/playground/prompt", json={}, headers={"Authorization": "Bearer k1"})
        ).status_code == 200
        # The Host check still applies to the keyless page.
        assert (await http.get("/", headers={"Host": "evil.example"})).status_code == 403


async def test_body_size_limit() -> None:
    async with serve(**{"http.max_body_bytes": 100}) as host, httpx.AsyncClient(base_url=f"http://{host}") as http:
        ok = await http.post("/v1/echo", content=b"x" * 100)
        assert ok.status_code == 200 and ok.json()["size"] == 100
        too_big = await http.post("/v1/echo", content=b"x" * 101)
        assert too_big.status_code == 413
        error = too_big.json()["error"]
        assert error["code"] == "request_too_large" and "100 bytes" in error["message"]

        async def chunks(n: int) -> AsyncIterator[bytes]:
            for _ in range(n):
                yield b"y" * 30

        assert (await http.post("/v1/echo", content=chunks(3))).json()["size"] == 90  # chunked, under
        assert (await http.post("/v1/echo", content=chunks(5))).status_code == 413  # chunked, over


async def test_router_404_and_405_under_v1_become_openai_json() -> None:
    async with serve() as host, httpx.AsyncClient(base_url=f"http://{host}") as http:
        missing = await http.post("/v1/embeddings", json={})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found" and "/v1/embeddings" in missing.json()["error"]["message"]
        wrong = await http.delete("/v1/echo")
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
        assert "GET" in wrong.headers["allow"] and "DELETE" in wrong.json()["error"]["message"]
        outside = await http.get("/nothing")
        assert outside.status_code == 404 and outside.text == "Not Found"  # other paths are left alone


async def test_cors_when_origins_are_set() -> None:
    overrides = {"http.api_key": ["k1"], "http.cors_origins": ["https://app.example"]}
    async with serve(**overrides) as host, httpx.AsyncClient(base_url=f"http://{host}") as http:
        preflight = await http.options(
            "/v1/echo",
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert preflight.status_code == 200  # answered without a key: browsers never send one here
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        refused = await http.get("/v1/echo", headers={"Origin": "https://app.example"})
        assert refused.status_code == 401
        assert refused.headers["access-control-allow-origin"] == "https://app.example"  # the page can read why
        other = await http.get("/v1/echo", headers={"Origin": "https://evil.example", "Authorization": "Bearer k1"})
        assert "access-control-allow-origin" not in other.headers
    async with serve() as host, httpx.AsyncClient(base_url=f"http://{host}") as http:
        plain = await http.get("/v1/echo", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in plain.headers


async def test_foreign_host_and_origin_are_refused_with_403() -> None:
    # Regression (issue 12 item 9): a WebSocket with Origin http://evil.example and a foreign
    # Host was accepted, and a text/plain POST with a foreign Host answered 200.
    async with serve() as host, httpx.AsyncClient(base_url=f"http://{host}") as http:
        port = host.rsplit(":", 1)[1]
        rebinding = await http.post(
            "/v1/echo", content=b"{}", headers={"Host": f"evil.example:{port}", "Content-Type": "text/plain"}
        )
        assert rebinding.status_code == 403
        assert (
            rebinding.json()["error"]["code"] == "forbidden" and "evil.example" in rebinding.json()["error"]["message"]
        )
        cross_site = await http.post(
            "/v1/echo", content=b"{}", headers={"Origin": "http://evil.example", "Content-Type": "text/plain"}
        )
        assert cross_site.status_code == 403 and "--allowed-origins" in cross_site.json()["error"]["message"]
        assert (await http.get("/v1/echo", headers={"Origin": "null"})).status_code == 403
        # What a browser sends: a page's Origin, or (DNS rebinding) the attacker's name as Host.
        for url, headers in (
            (f"ws://{host}/ws", {"Origin": "http://evil.example"}),
            (f"ws://evil.example:{port}/ws", None),
            (f"ws://{host}/ws", {"Host": "evil.example"}),
        ):
            with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                async with websockets.connect(url, additional_headers=headers, host="127.0.0.1", port=int(port)):
                    pass
            assert refused.value.response.status_code == 403
            assert b'"forbidden"' in refused.value.response.body
        # /health stays open to probes whatever name they use
        assert (await http.get("/health", headers={"Host": "rill.internal"})).status_code == 200


async def test_own_names_same_origin_and_clients_without_origin_pass() -> None:
    async with serve() as host, httpx.AsyncClient(base_url=f"http://{host}") as http:
        port = host.rsplit(":", 1)[1]
        assert (await http.post("/v1/echo", json={})).status_code == 200  # curl, the Python clients
        for name in (
            f"127.0.0.1:{port}",
            f"localhost:{port}",
            f"[::1]:{port}",
            "localhost",
            f"app.localhost:{port}",
            f"10.1.2.3:{port}",
        ):
            assert (await http.get("/v1/echo", headers={"Host": name})).status_code == 200, name
        # A page rill serves itself: its origin is the request's own scheme://host:port.
        for name in (f"127.0.0.1:{port}", f"localhost:{port}"):
            same = await http.post("/v1/echo", json={}, headers={"Host": name, "Origin": f"http://{name}"})
            assert same.status_code == 200, name
        other_port = await http.post("/v1/echo", json={}, headers={"Origin": f"http://127.0.0.1:{int(port) + 1}"})
        assert other_port.status_code == 403
        async with websockets.connect(f"ws://{host}/ws", additional_headers={"Origin": f"http://{host}"}) as ws:
            assert await ws.recv() == "hello"


async def test_allowed_origins_and_hosts_are_accepted() -> None:
    overrides = {"http.allowed_origins": ["https://app.example"], "http.allowed_hosts": ["rill.lan", ".corp.example"]}
    async with serve(**overrides) as host, httpx.AsyncClient(base_url=f"http://{host}") as http:
        assert (await http.get("/v1/echo", headers={"Origin": "https://app.example"})).status_code == 200
        assert (await http.get("/v1/echo", headers={"Origin": "https://app.example:443"})).status_code == 200
        assert (await http.get("/v1/echo", headers={"Origin": "http://app.example"})).status_code == 403
        for name in ("rill.lan:80", "RILL.LAN", "a.corp.example"):
            assert (await http.get("/v1/echo", headers={"Host": name})).status_code == 200, name
        assert (await http.get("/v1/echo", headers={"Host": "corp.example.evil"})).status_code == 403
        async with websockets.connect(f"ws://{host}/ws", additional_headers={"Origin": "https://app.example"}) as ws:
            assert await ws.recv() == "hello"
    async with (
        serve(**{"http.allowed_origins": ["*"], "http.allowed_hosts": ["*"]}) as host,
        httpx.AsyncClient(base_url=f"http://{host}") as http,
    ):
        assert (
            await http.get("/v1/echo", headers={"Origin": "http://evil.example", "Host": "evil.example"})
        ).status_code == 200


async def test_service_names_pass_on_a_non_loopback_bind_and_are_refused_on_loopback() -> None:
    # Issue 33: a server bound to 0.0.0.0 in Docker/compose is called by its service name.
    # The listener here is always on loopback; the rule follows the configured --host.
    names = ("rill", "rill:8000", "my-service.local", "MY-SERVICE.local:8000")
    async with serve(**{"http.host": "0.0.0.0"}) as host, httpx.AsyncClient(base_url=f"http://{host}") as http:
        port = host.rsplit(":", 1)[1]
        for name in names:
            assert (await http.get("/v1/echo", headers={"Host": name})).status_code == 200, name
        async with websockets.connect(f"ws://rill:{port}/ws", host="127.0.0.1", port=int(port)) as ws:
            assert await ws.recv() == "hello"
        # Any Host passing does not open the server to other sites' pages: Origin still rules.
        cross_site = await http.get("/v1/echo", headers={"Host": "rill", "Origin": "http://evil.example"})
        assert cross_site.status_code == 403 and "--allowed-origins" in cross_site.json()["error"]["message"]
        # A page the server serves itself under its service name is same-origin.
        same = await http.get("/v1/echo", headers={"Host": "rill:8000", "Origin": "http://rill:8000"})
        assert same.status_code == 200
    async with serve() as host, httpx.AsyncClient(base_url=f"http://{host}") as http:  # the default 127.0.0.1
        for name in names:
            refused = await http.get("/v1/echo", headers={"Host": name})
            assert refused.status_code == 403, name
            assert "--allowed-hosts" in refused.json()["error"]["message"]


async def test_allowed_hosts_rule_on_a_non_loopback_bind() -> None:
    overrides = {"http.host": "0.0.0.0", "http.allowed_hosts": ["rill", ".svc.cluster.local"]}
    async with serve(**overrides) as host, httpx.AsyncClient(base_url=f"http://{host}") as http:
        port = host.rsplit(":", 1)[1]
        for name in ("rill:8000", "api.svc.cluster.local", f"172.18.0.3:{port}", f"[fd00::3]:{port}", "localhost"):
            assert (await http.get("/v1/echo", headers={"Host": name})).status_code == 200, name
        for name in ("my-service.local", "evil.example:8000", "svc.cluster.local.evil"):
            assert (await http.get("/v1/echo", headers={"Host": name})).status_code == 403, name


@pytest.mark.parametrize(
    ("bind", "service_name_passes"),
    [
        ("127.0.0.1", False),
        ("127.0.0.2", False),
        ("::1", False),
        ("[::1]", False),
        ("localhost", False),
        ("0.0.0.0", True),
        ("::", True),
        ("", True),
        ("192.168.1.10", True),
        ("fd00::3", True),
    ],
)
def test_the_host_rule_follows_the_bind(bind: str, service_name_passes: bool) -> None:
    sites = middleware.SiteCheck(bind, [], [])
    scope = {"type": "http", "headers": [(b"host", b"compose-service:8000")]}
    assert (sites.refusal(scope) is None) is service_name_passes
    # A second Host header cannot smuggle a name past a strict check.
    smuggled = {"type": "http", "headers": [(b"host", b"127.0.0.1"), (b"host", b"compose-service")]}
    assert (sites.refusal(smuggled) is None) is service_name_passes
    # With --allowed-hosts the list rules on every bind.
    listed = middleware.SiteCheck(bind, ["compose-service"], [])
    assert listed.refusal(scope) is None
    assert listed.refusal({"type": "http", "headers": [(b"host", b"other-service")]}) is not None


@contextlib.asynccontextmanager
async def serve_limited(
    max_total: int = 100, per_client: int = 100, timeout_s: float = 2.0
) -> AsyncIterator[tuple[str, Any]]:
    """The stand-in app behind the connection gate, as ``rill serve`` runs it (small limits)."""
    import uvicorn

    from rill.connections import ConnectionGate, http_protocol_factory

    overrides = {
        "connections.max_connections": max_total,
        "connections.max_connections_per_client": per_client,
        "connections.first_message_timeout_s": timeout_s,
        "connections.header_timeout_s": timeout_s,
        "connections.body_timeout_s": timeout_s,
    }
    deps = _deps(**overrides)
    deps.gate = ConnectionGate(max_total, per_client)

    async def quiet_ws(websocket: WebSocket) -> None:
        await websocket.accept()
        message = await websocket.receive()
        if message["type"] == "websocket.receive":
            await websocket.send_text("echo " + (message.get("text") or ""))
            await websocket.close()

    inner = Starlette(routes=[Route("/v1/echo", _echo, methods=["GET", "POST"]), WebSocketRoute("/quiet", quiet_ws)])
    app = middleware.wrap(inner, deps, render_error=http_error)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host="127.0.0.1",
            port=0,
            log_level="warning",
            lifespan="off",
            http=http_protocol_factory(deps.gate, timeout_s, http_error),
        )
    )  # type: ignore[arg-type]
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    try:
        yield f"127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", deps.gate
    finally:
        server.should_exit = True
        await task


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(), 30)  # until the server closes; a hang bound only
    except ConnectionError:
        return b""


async def _gauge_settles(gate: Any) -> bool:
    """Whether the gate counts no connection within a bounded number of loop turns."""
    for _ in range(500):
        if gate.total == 0:
            return True
        await asyncio.sleep(0.01)
    return False


async def test_a_slowloris_body_gets_408_and_the_connection_closes() -> None:
    async with serve_limited() as (host, gate):
        ip, port = host.split(":")
        reader, writer = await asyncio.open_connection(ip, int(port))
        writer.write(b"POST /v1/echo HTTP/1.1\r\nHost: " + host.encode() + b'\r\nContent-Length: 100\r\n\r\n{"a":')
        answer = await _read_all(reader)  # the server ends it: EOF after the 408
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408")
        assert b'"code":"idle_timeout"' in answer and b"body" in answer


async def test_headers_that_never_end_get_408_and_the_connection_closes() -> None:
    async with serve_limited() as (host, gate):
        ip, port = host.split(":")
        reader, writer = await asyncio.open_connection(ip, int(port))
        writer.write(b"GET /v1/echo HTTP/1.1\r\nHost: x")
        answer = await _read_all(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"headers" in answer
        # A connection that never sends a byte, and a keep-alive connection idle after a
        # response, are closed without a word (an unasked 408 could pass for another answer).
        reader, writer = await asyncio.open_connection(ip, int(port))
        assert await _read_all(reader) == b""
        writer.close()
        reader, writer = await asyncio.open_connection(ip, int(port))
        writer.write(b"GET /v1/echo HTTP/1.1\r\nHost: " + host.encode() + b"\r\n\r\n")
        answer = await _read_all(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 200") and answer.count(b"HTTP/1.1") == 1
        assert gate.total == 0 or await _gauge_settles(gate)


async def test_a_websocket_without_a_first_message_is_closed_with_1008() -> None:
    async with serve_limited() as (host, gate):
        async with websockets.connect(f"ws://{host}/quiet") as ws:
            with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 30)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
        assert "no message within" in closed.value.rcvd.reason
    async with serve_limited(timeout_s=600) as (host, gate):  # long, so load cannot make it fire first
        async with websockets.connect(f"ws://{host}/quiet") as ws:  # a client that speaks is served
            await ws.send("hi")
            assert await ws.recv() == "echo hi"


async def test_connections_past_the_limits_get_503_and_leases_are_returned() -> None:
    async with serve_limited(max_total=6, per_client=3, timeout_s=60) as (host, gate):
        ip, port = host.split(":")

        async def idle_from(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection(ip, int(port), local_addr=(source, 0))

        a = [await idle_from("127.0.0.2") for _ in range(3)]
        reader, writer = await idle_from("127.0.0.2")  # a 4th from the same address
        answer = await _read_all(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer and b"127.0.0.2" in answer
        b = [await idle_from("127.0.0.3") for _ in range(3)]  # the total (6) is now used up
        # A third address's fair share is 6 // 3 = 2: its first two connections each close an
        # idle one of the address most over its share; its third is refused.
        c = [await idle_from("127.0.0.4") for _ in range(2)]
        reader, writer = await idle_from("127.0.0.4")
        answer = await _read_all(reader)
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503") and b"limit of 6 connections" in answer
        assert gate.total == 6 and gate.refused == 2 and gate.evicted == 2
        assert gate.per_client == {"127.0.0.2": 2, "127.0.0.3": 2, "127.0.0.4": 2}
        for _, w in a + b + c:
            w.close()
        async with httpx.AsyncClient(base_url=f"http://{host}") as http:  # places come back as clients leave
            for _ in range(200):
                if gate.total <= 1:
                    break
                await asyncio.sleep(0.02)
            assert (await http.get("/v1/echo")).status_code == 200
        # a WebSocket's place comes back when it closes, whatever protocol the socket ended with
        for _ in range(5):
            async with websockets.connect(f"ws://{host}/quiet") as ws:
                await ws.send("x")
                assert await ws.recv() == "echo x"
        for _ in range(200):
            if gate.total == 0:
                break
            await asyncio.sleep(0.02)
        assert gate.total == 0 and gate.per_client == {}
