"""Starlette routes of the protocol: WebSocket ``/generate`` and ``POST /v1/generate`` (JSON,
or Server-Sent Events with ``"stream": true``).

The transport only: authentication, the read loop, encoding and closing. Each connection (or
REST call) is a client end (``conversation.ClientEnd``) speaking to a conversation
(``conversation.Conversation``: its session on one session driver, which waits for the model,
submits, reports the queue, applies the server's time limit and pumps the outputs). A socket
whose client sends ``resume`` moves to the conversation of the generation it names. What the
protocol keeps beyond one connection is ``service.py``.

API keys (when configured): ``Authorization: Bearer KEY`` or, for browsers, the key
subprotocol or ``?api_key=KEY`` (``rill.auth.websocket_key``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from rill.deps import Deps
from rill.errors import InvalidRequest
from rill.protocols._shared import sse
from rill.protocols._shared.driver import Driver, Gone
from rill.protocols.generate_ws import codec
from rill.protocols.generate_ws import messages as m
from rill.protocols.generate_ws.conversation import ClientEnd, Conversation
from rill.protocols.generate_ws.service import GenerateService

log = logging.getLogger("rill.protocols.generate_ws")


async def websocket(service: GenerateService, ws: WebSocket) -> None:
    """``/generate``: one connection, many generations in turn."""
    await ws.accept()
    ok, key = service.authorize(ws.headers, ws.query_params, ws.scope.get("subprotocols") or ())
    send_lock, closed = asyncio.Lock(), asyncio.Event()

    async def write(msg: m.ServerMessage) -> None:
        if closed.is_set():
            raise Gone
        async with send_lock:
            try:
                await ws.send_text(codec.encode(msg))
            except Exception as exc:  # any send failure means the peer is gone
                closed.set()
                raise Gone from exc

    async def close(code: int, reason: str) -> None:
        if not closed.is_set():
            closed.set()
            with contextlib.suppress(Exception):
                await ws.close(code, reason)

    end = ClientEnd(write, close)
    Conversation(service, end, key, service.principal(key, ws.scope))
    try:
        if not ok:
            await end.conversation.driver.perform(
                end.conversation.session.on_error(
                    codec.Unauthorized(
                        "a valid API key is required: send 'Authorization: Bearer KEY' or '?api_key=KEY'"
                    )
                )
            )
        while not closed.is_set():
            message = await ws.receive()
            if message["type"] == "websocket.disconnect" or closed.is_set():  # closed: another socket resumed
                break
            # Binary frames are accepted too: some clients send their JSON as bytes.
            data = message.get("text")
            await end.conversation.receive_text(data if data is not None else message.get("bytes") or b"")
    except (WebSocketDisconnect, Gone, RuntimeError):  # RuntimeError: a receive after the socket closed
        pass
    finally:
        closed.set()
        await end.conversation.detach(end)


async def rest(service: GenerateService, request: Request) -> Response:
    """``POST /v1/generate``: the spec's REST shape; SSE of the socket's messages with ``"stream": true``."""
    ok, key = service.authorize(request.headers, request.query_params)
    if not ok:
        return _json_error(codec.Unauthorized("a valid API key is required: send 'Authorization: Bearer KEY'"))
    body = await request.body()
    if len(body) > service.http.max_body_bytes:
        return _json_error(InvalidRequest(f"request body over {service.http.max_body_bytes} bytes"), 413)
    try:
        config = codec.decode_rest(body)
    except Exception as exc:  # InvalidRequest; anything else is a bug, answered generically
        if not isinstance(exc, InvalidRequest):
            log.exception("a /v1/generate body could not be decoded")
        return _json_error(exc)
    principal = service.principal(key, request.scope)
    if config.stream:
        return StreamingResponse(
            _sse(service, config.to_config(), key, principal), media_type=sse.MEDIA_TYPE, headers=dict(sse.HEADERS)
        )
    sent: list[m.ServerMessage] = []

    async def collect(msg: m.ServerMessage) -> None:
        sent.append(msg)

    conversation = Conversation(service, ClientEnd(collect), key, principal)
    try:
        await conversation.receive(config.to_config())
        if not await _ended_before_disconnect(conversation.driver, request):
            return Response(status_code=499)  # nobody is listening; the shutdown aborts the generation
    finally:
        await conversation.shutdown()
    status, reply, headers = codec.rest_reply(sent, conversation.session.limits.model_name)
    return Response(codec.encode(reply), status_code=status, media_type="application/json", headers=headers)


async def _sse(service: GenerateService, config: m.Config, key: str | None, principal: str) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[m.ServerMessage | None] = asyncio.Queue()  # unbounded but short: one generation's messages
    conversation = Conversation(service, ClientEnd(queue.put), key, principal)
    ended: asyncio.Task[None] | None = None
    keepalive_s = service.http.sse_keepalive_s or None
    try:
        await conversation.receive(config)
        ended = asyncio.create_task(conversation.driver.wait())
        ended.add_done_callback(lambda _: queue.put_nowait(None))
        while True:
            try:
                async with asyncio.timeout(keepalive_s):
                    msg = await queue.get()
            except TimeoutError:
                yield sse.KEEP_ALIVE  # nothing to say for a while (queued, loading): keep proxies from closing
                continue
            if msg is None:
                break
            yield codec.encode_sse(msg)
    finally:
        # A client that went away closes this generator: stop the generation at once.
        await conversation.shutdown()
        if ended is not None:
            ended.cancel()


async def _ended_before_disconnect(driver: Driver, request: Request) -> bool:
    """Wait until ``driver``'s requests have ended; False if the HTTP client went away first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    ended, watcher = asyncio.create_task(driver.wait()), asyncio.create_task(disconnected())
    try:
        await asyncio.wait({ended, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return ended.done()
    finally:
        watcher.cancel()
        ended.cancel()


def _json_error(exc: BaseException, status: int | None = None) -> Response:
    return Response(
        codec.encode(codec.error_message(exc)),
        status_code=status or codec.wire_error(exc).status or 500,
        media_type="application/json",
    )


def routes(deps: Deps) -> list[BaseRoute]:
    """``/generate`` (WebSocket) and ``POST /v1/generate``."""
    service = GenerateService(deps)
    return [
        WebSocketRoute("/generate", functools.partial(websocket, service)),
        Route("/v1/generate", functools.partial(rest, service), methods=["POST"]),
    ]
