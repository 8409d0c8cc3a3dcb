"""Starlette routes of the protocol: WebSocket ``/generate`` and ``POST /v1/generate`` (JSON,
or Server-Sent Events with ``"stream": true``).

The transport only: authentication, the read loop, encoding, closing, and the controls only
this wire has (pause, resume, modify, regenerate, feedback). Each connection (or REST call)
runs its session on one session driver (``protocols/_shared/driver``), which waits for the
model, submits, reports the queue, applies the server's time limit and pumps the outputs.
What the protocol keeps beyond one connection is ``service.py``.

API keys (when configured): ``Authorization: Bearer KEY`` or, for browsers, the key
subprotocol or ``?api_key=KEY`` (``rill.auth.websocket_key``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from rill.deps import Deps
from rill.errors import InvalidRequest, RillError
from rill.frontend.stream import RequestStream
from rill.protocols._shared import sse
from rill.protocols._shared.driver import Driver, Gone, Transport
from rill.protocols.generate_ws import codec
from rill.protocols.generate_ws import messages as m
from rill.protocols.generate_ws import session as s
from rill.protocols.generate_ws.service import GenerateService

log = logging.getLogger("rill.protocols.generate_ws")

Write = Callable[[m.ServerMessage], Awaitable[None]]
"""Writes one message to a conversation's peer (raises ``Gone`` once the peer has left)."""

_STREAM_CONTROLS: dict[type, Callable[[RequestStream], None]] = {
    s.Pause: RequestStream.pause,
    s.Resume: RequestStream.resume,
    s.Regenerate: RequestStream.regenerate,
}
"""The controls that act on the running request at once."""


class _Wire(Transport):
    """One conversation's wire (a socket, one REST reply, one SSE stream): its session, the
    session's driver and the actions only ``/generate`` has. ``write`` raises ``Gone`` once
    the peer has left; ``close`` (a socket's) takes a WebSocket close code."""

    def __init__(
        self,
        service: GenerateService,
        write: Write,
        api_key: str | None,
        principal: str,
        close: Callable[[int, str], Awaitable[None]] | None = None,
    ) -> None:
        self.service, self.api_key, self.principal = service, api_key, principal
        self._write, self._close = write, close
        self.session = service.new_session()
        self.history = service.history(principal, self.session)
        # Outputs reach the session whole (no one_event_per_token): it sends one token per
        # token itself, and needs a folded output's events beside its tokens to order them
        # (a resume before the tokens after it, a restart's stale tokens before the new init)
        # and to spread the output's time over its tokens.
        self.driver = Driver(
            self.session,
            self,
            service.client,
            protocol=s.PROTOCOL,
            principal=principal,
            metrics=service.deps.metrics,
            waits_for_model=True,
            reports_queue=True,
            time_limit_s=service.deps.config.policy.request_timeout_s,
        )
        self._handlers: dict[type, Callable[[Any], Awaitable[None]]] = {
            s.Pause: self._control,
            s.Resume: self._control,
            s.Regenerate: self._control,
            s.Modify: self._modify,
            s.StoreFeedback: self._store_feedback,
        }

    async def receive_text(self, text: str | bytes) -> None:
        """One frame from the client (JSON text, or the same as UTF-8 bytes)."""
        try:
            msg = codec.decode(text)
        except InvalidRequest as exc:
            await self.driver.perform(self.session.on_invalid(exc))
            return
        except Exception as exc:  # a decoder bug: the generic error frame, never a dead handler
            log.exception("a /generate frame could not be decoded")
            await self.driver.perform(self.session.on_error(exc))
            return
        await self.receive(msg)

    async def receive(self, msg: m.ClientMessage) -> None:
        """One decoded client message."""
        try:
            actions = self.session.receive(msg, time.monotonic())
        except Exception as exc:  # a session bug: the generic error frame (and close), logged
            log.exception("a /generate message could not be handled")
            actions = self.session.on_error(exc)
        await self.driver.perform(actions)

    async def send(self, message: m.ServerMessage) -> None:
        """Charge what the session remembers (it changes as generations end), then write."""
        self.history.charge()
        await self._write(message)

    async def close(self, code: int | None, reason: str) -> None:
        """Close the socket (a REST reply ends with its generation instead)."""
        if self._close is not None:
            await self._close(1011 if code is None else code, reason)

    async def perform(self, action: Any) -> None:
        """A control of the running generation, or a feedback write."""
        await self._handlers[type(action)](action)

    async def shutdown(self) -> None:
        """The conversation ends: stop whatever runs and give the memory back."""
        self.session.on_disconnect()
        await self.driver.aclose()
        self.history.close()

    async def _control(self, action: s.Pause | s.Resume | s.Regenerate) -> None:
        if (stream := self.driver.stream()) is not None:
            try:
                _STREAM_CONTROLS[type(action)](stream)
            except RillError as exc:  # e.g. the request finished meanwhile
                await self.driver.perform(self.session.on_invalid(exc))

    async def _modify(self, action: s.Modify) -> None:
        if (stream := self.driver.stream()) is None:
            return
        try:
            # Awaited here: the connection's next messages wait for a compile, so they apply in
            # the order they were sent.
            self.session.on_modify_applied(await stream.modify(action.patch))
        except RillError as exc:  # e.g. the request just ended, or the engine refused a value
            await self.driver.perform(self.session.on_modify_refused(exc))

    async def _store_feedback(self, action: s.StoreFeedback) -> None:
        try:
            feedback_id = await self.service.store_feedback(action.record, self.api_key, self.principal)
        except RillError as exc:
            await self.driver.perform(self.session.on_invalid(exc))
            return
        await self.driver.perform(self.session.on_feedback_stored(action.record["request_id"], feedback_id))


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

    wire = _Wire(service, write, key, service.principal(key, ws.scope), close)
    try:
        if not ok:
            await wire.driver.perform(
                wire.session.on_error(
                    codec.Unauthorized(
                        "a valid API key is required: send 'Authorization: Bearer KEY' or '?api_key=KEY'"
                    )
                )
            )
        while not closed.is_set():
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            # Binary frames are accepted too: some clients send their JSON as bytes.
            data = message.get("text")
            await wire.receive_text(data if data is not None else message.get("bytes") or b"")
    except (WebSocketDisconnect, Gone, RuntimeError):  # RuntimeError: a receive after the socket closed
        pass
    finally:
        closed.set()
        await wire.shutdown()


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

    wire = _Wire(service, collect, key, principal)
    try:
        await wire.receive(config.to_config())
        if not await _ended_before_disconnect(wire.driver, request):
            return Response(status_code=499)  # nobody is listening; the shutdown aborts the generation
    finally:
        await wire.shutdown()
    status, reply, headers = codec.rest_reply(sent, wire.session.limits.model_name)
    return Response(codec.encode(reply), status_code=status, media_type="application/json", headers=headers)


async def _sse(service: GenerateService, config: m.Config, key: str | None, principal: str) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[m.ServerMessage | None] = asyncio.Queue()  # unbounded but short: one generation's messages
    wire = _Wire(service, queue.put, key, principal)
    ended: asyncio.Task[None] | None = None
    keepalive_s = service.http.sse_keepalive_s or None
    try:
        await wire.receive(config)
        ended = asyncio.create_task(wire.driver.wait())
        ended.add_done_callback(lambda _: queue.put_nowait(None))
        while True:
            try:
                msg = await asyncio.wait_for(queue.get(), keepalive_s)
            except TimeoutError:
                yield sse.KEEP_ALIVE  # nothing to say for a while (queued, loading): keep proxies from closing
                continue
            if msg is None:
                break
            yield codec.encode_sse(msg)
    finally:
        # A client that went away closes this generator: stop the generation at once.
        await wire.shutdown()
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
