"""``rill.middleware``: API keys on HTTP and WebSocket routes, body-size limit, CORS.

A small Starlette app stands in for rill's routes and runs under uvicorn on loopback, so
the WebSocket handshake denial and chunked uploads go through a real ASGI server.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, AsyncIterator

import httpx
import pytest
import websockets
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket

from rill import config as config_mod
from rill import middleware
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
    return SimpleNamespace(config=cfg, api_keys=cfg.api_keys())


@contextlib.asynccontextmanager
async def serve(**overrides: Any) -> AsyncIterator[str]:
    inner = Starlette(routes=[Route("/health", _echo), Route("/v1/echo", _echo, methods=["GET", "POST"]),
                              WebSocketRoute("/ws", _ws)])
    app = middleware.wrap(inner, _deps(**overrides))
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
        for url, headers in ((f"ws://{host}/ws", None), (f"ws://{host}/ws?api_key=bad", None),
                             (f"ws://{host}/ws", {"Authorization": "Bearer bad"})):
            with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
                async with websockets.connect(url, additional_headers=headers):
                    pass
            assert refused.value.response.status_code == 401
            assert b"invalid_api_key" in refused.value.response.body
        async with websockets.connect(f"ws://{host}/ws?api_key=k1") as ws:
            assert await ws.recv() == "hello"
        async with websockets.connect(f"ws://{host}/ws", additional_headers={"Authorization": "Bearer k1"}) as ws:
            assert await ws.recv() == "hello"


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
        preflight = await http.options("/v1/echo", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
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
