"""Starlette WebSocket routes ``/ws`` and ``/api/ws`` for the batch protocol: its transport.

Per connection: one receive loop (frame → ``BatchSession.on_frame`` → actions) and one
session driver (``protocols/_shared/driver.py``) that performs them. The driver submits one
message's prompts together (their refusals make one ERROR array), reads every prompt's
outputs and hands each wake-up's drain to ``BatchSession.on_outputs`` at once, so one
PROGRESS array carries every prompt that produced a token in that engine step; a reader
that lagged gets one PROGRESS per token all the same, as the source project sends. The
driver keeps one merged output per prompt, so what a slow client has not read yet is
bounded. On disconnect every open prompt is aborted at once, which frees its KV memory in
the engine. The continuation store is the server's (``service.BatchService``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from rill import auth
from rill.deps import Deps
from rill.protocols._shared.driver import Driver, Gone
from rill.protocols.batch_ws import codec
from rill.protocols.batch_ws.service import BatchService
from rill.protocols.batch_ws.session import PROTOCOL, SendError

log = logging.getLogger("rill.protocols.batch_ws")

PATHS = ("/ws", "/api/ws")


def routes(deps: Deps) -> list[BaseRoute]:
    """The batch WebSocket routes, sharing one continuation store."""
    service = BatchService(deps)

    async def endpoint(ws: WebSocket) -> None:
        await _Connection(service, ws).run()

    return [WebSocketRoute(path, endpoint, name=f"batch_ws{path.replace('/', '_')}") for path in PATHS]


class _Connection:
    """One accepted ``/ws`` socket: the driver's transport."""

    def __init__(self, service: BatchService, ws: WebSocket) -> None:
        self.ws = ws
        # NOTE: continuations are scoped by the credentials presented, so one API key can
        # never continue (and read) another key's generation by guessing its request_id.
        principal = auth.scope_principal(ws.scope)
        self.session = service.session(f"bws-{uuid.uuid4().hex[:12]}", _credential(ws), principal)
        self.driver = Driver(
            self.session,
            self,
            service.client,
            protocol=PROTOCOL,
            principal=principal,
            metrics=service.metrics,
            groups_steps=True,
            one_event_per_token=True,
            submits_together=True,
        )
        self._send_lock = asyncio.Lock()  # the receive loop and the driver's step task both send

    async def run(self) -> None:
        """Serve the socket until the client goes away; then abort whatever still runs."""
        await self.ws.accept()
        try:
            while (message := await self.ws.receive())["type"] != "websocket.disconnect":
                try:
                    actions = self.session.on_frame(message.get("text"), time.monotonic())
                except Exception:  # a bug: the generic error frame; the other prompts go on
                    log.exception("batch /ws message could not be handled")
                    actions = [SendError(codec.GENERIC_ERROR)]
                await self.driver.perform(actions)
        except (WebSocketDisconnect, OSError, Gone):
            pass
        finally:
            await self.driver.perform(self.session.on_disconnect())
            await self.driver.aclose()
            # Expired generations would otherwise stay charged to the budget until the next
            # prompt anyone sends.
            self.session.store.expire(time.monotonic())

    async def send(self, message: Any) -> None:
        """Write one event array."""
        await self._send_text(codec.encode_events(message))

    async def perform(self, action: SendError) -> None:
        """Write a socket-level error frame (the socket stays usable)."""
        await self._send_text(codec.encode_socket_error(action.text))

    async def close(self, code: int | None, reason: str) -> None:
        """Close the socket (after a bug)."""
        if self.ws.application_state is WebSocketState.CONNECTED:
            await self.ws.close(code=code or 1000, reason=reason)

    async def _send_text(self, text: str) -> None:
        async with self._send_lock:
            if self.ws.application_state is not WebSocketState.CONNECTED:
                raise Gone
            try:
                await self.ws.send_text(text)
            except (WebSocketDisconnect, OSError, RuntimeError) as exc:
                raise Gone from exc


def _credential(ws: WebSocket) -> str:
    """Whose continuations this socket may use: the principal of the key the middleware
    accepted (however it was sent: header, key subprotocol or query), else without keys what
    the client presented (``Authorization: Bearer`` or ``?api_key=``), or ''."""
    checked = ws.scope.get(auth.PRINCIPAL_SCOPE_KEY)
    if isinstance(checked, str):
        return checked
    header = ws.headers.get("authorization", "")
    return auth.bearer_token(header) or ws.query_params.get("api_key", "") or header
