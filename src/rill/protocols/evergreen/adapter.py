"""Evergreen's transports: the ``EvergreenService`` on ``--grpc-port`` and the ``/evergreen``
WebSocket (one proto3-JSON ``SessionMessage`` per message).

Each connection runs one ``runner.SessionRunner`` (the session on the shared driver): a reader
task feeds it what the client sends, and the handler drains its outbox, writing each message
until ``DONE`` (gRPC status OK / WebSocket close 1000) or the error that aborts the session
(its gRPC status / WebSocket close 4000 + status, ``codec.ws_close``).

Ending: a half-close on gRPC means "no more input" (running actions finish first). A
cancelled call, a dropped connection, a closed WebSocket or an abort ends the runner, which
closes every running ``RequestStream`` at once: the requests are aborted in the engine and
their KV memory freed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote

from google.protobuf.message import DecodeError
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from rill import auth
from rill.connections import client_key
from rill.errors import IdleTimeout, TooManyConnections
from rill.protocols.evergreen import codec, grpc_server
from rill.protocols.evergreen.errors import InvalidMessage
from rill.protocols.evergreen.runner import DONE, SessionRunner

if TYPE_CHECKING:
    from rill.deps import Deps

# A refused (unauthenticated) session: how many messages, and how long after the first, are
# read before the UNAUTHENTICATED status is sent (see EvergreenServicer._drain_unauthenticated).
DRAIN_MAX_MESSAGES = 16
DRAIN_NEXT_S = 1.0


async def start(deps: Deps) -> Callable[[], Awaitable[None]] | None:
    """Serve Evergreen over gRPC on ``--grpc-port`` (0: disabled); return the async stopper.

    Raises:
        ConfigError: the port cannot be bound.
    """
    if not deps.config.evergreen.grpc_port:
        return None
    return await grpc_server.start(deps, EvergreenServicer(deps))


# -- gRPC -----------------------------------------------------------------------------------------


class EvergreenServicer:
    """``evergreen.v2.EvergreenService``: one ``StartSession`` call is one session."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps

    async def StartSession(self, request_iterator: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:  # noqa: N802
        """Run one session over a bidirectional stream (see the module docstring)."""
        import grpc

        principal = self._principal(context)
        if principal is None:
            await self._drain_unauthenticated(request_iterator, self.deps.config.connections.first_message_timeout_s)
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or unknown API key (send metadata 'authorization: Bearer KEY')",
            )
        lease = None
        if self.deps.gate is not None:
            try:
                lease = self.deps.gate.open(grpc_peer_host(context.peer()))
            except TooManyConnections as exc:
                name, message = codec.status_of(exc)
                await context.abort(grpc.StatusCode[name], message)
        runner = SessionRunner(self.deps, cast(str, principal))  # None: context.abort raised above
        first_message_s = self.deps.config.connections.first_message_timeout_s
        reader = asyncio.create_task(self._read(request_iterator, runner, first_message_s))
        try:
            while True:
                item = await runner.outbox.get()
                if item is DONE:
                    return
                if isinstance(item, BaseException):
                    name, message = codec.status_of(item)
                    await context.abort(grpc.StatusCode[name], message)
                yield codec.to_pb(item)
        finally:
            reader.cancel()
            await runner.aclose()
            if lease is not None:
                lease.release()

    @staticmethod
    async def _drain_unauthenticated(request_iterator: AsyncIterator[Any], first_message_s: float) -> None:
        """Read (and drop) what a refused client sends until it half-closes, within bounds.

        grpc's asyncio client replaces the server's status with a local INTERNAL when it
        writes or half-closes after the call ended, so aborting at once would make a client
        that sends its message and half-closes see INTERNAL instead of UNAUTHENTICATED,
        depending on timing. Nothing read is looked at; at most ``DRAIN_MAX_MESSAGES``
        messages are read, the first within ``first_message_s``, each later one within
        ``DRAIN_NEXT_S`` (a client that keeps its stream open is answered that soon).
        """
        messages = aiter(request_iterator)
        timeout = first_message_s
        with contextlib.suppress(Exception):
            for _ in range(DRAIN_MAX_MESSAGES):
                async with asyncio.timeout(timeout):
                    await anext(messages)
                timeout = DRAIN_NEXT_S

    @staticmethod
    async def _read(request_iterator: AsyncIterator[Any], runner: SessionRunner, first_message_s: float) -> None:
        messages = aiter(request_iterator)
        try:
            try:
                async with asyncio.timeout(first_message_s):
                    first = await anext(messages)
            except StopAsyncIteration:
                await runner.input_ended()
                return
            except TimeoutError:
                await runner.fail(IdleTimeout(f"no message within {first_message_s:g} s of starting the session"))
                return
            await runner.feed(first, codec.from_pb)
            async for message in messages:
                await runner.feed(message, codec.from_pb)
        except asyncio.CancelledError:
            raise
        except DecodeError as exc:  # grpc could not parse the client's bytes: the client's fault
            await runner.fail(InvalidMessage(f"not a serialized evergreen.v2.SessionMessage: {exc}"), is_refused=True)
            return
        except Exception as exc:  # noqa: BLE001 - the transport failed (e.g. a message over the size limit)
            await runner.fail(exc)
            return
        await runner.input_ended()

    def _principal(self, context: Any) -> str | None:
        """Who calls (``rill.auth.principal``), or None when keys are on and no key matches."""
        keys = self.deps.api_keys
        if not keys:
            return auth.principal(None, grpc_peer_host(context.peer()))
        tokens = [
            auth.bearer_token(value)
            for key, value in context.invocation_metadata() or ()
            if key.lower() == "authorization" and isinstance(value, str)
        ]
        matched = [token for token in tokens if auth.key_matches(token, keys)]  # every header is checked
        return auth.principal(matched[0], None) if matched else None


def grpc_peer_host(peer: str) -> str | None:
    """The client (``rill.connections.client_key``) of a gRPC peer string (``ipv4:1.2.3.4:5``,
    ``ipv6:[::1]:5``), else None."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = unquote(rest).rsplit(":", 1)[0].strip("[]")
    return client_key(host) if host else None


# -- WebSocket ------------------------------------------------------------------------------------


def routes(deps: Deps) -> list[BaseRoute]:
    """The ``/evergreen`` WebSocket: one proto3-JSON ``SessionMessage`` per message."""

    async def endpoint(ws: WebSocket) -> None:
        await websocket_session(ws, deps)

    return [WebSocketRoute("/evergreen", endpoint)]


async def websocket_session(ws: WebSocket, deps: Deps) -> None:
    """Run one session over a WebSocket (API keys are checked by the middleware)."""
    await ws.accept()
    runner = SessionRunner(deps, auth.scope_principal(ws.scope))
    reader = asyncio.create_task(_read_ws(ws, runner))
    try:
        while True:
            item = await runner.outbox.get()
            if item is DONE:
                await ws.close(1000)
                return
            if isinstance(item, BaseException):
                code, reason = codec.ws_close(item)
                await ws.close(code, reason)
                return
            if item is _DISCONNECTED:
                return
            await ws.send_text(codec.encode_json(item))
    except (WebSocketDisconnect, RuntimeError):
        return  # the peer went away while we were sending
    finally:
        reader.cancel()
        await runner.aclose()


_DISCONNECTED = object()
"""Outbox marker: the WebSocket peer left (nothing more can be written)."""


async def _read_ws(ws: WebSocket, runner: SessionRunner) -> None:
    # Every way out of this task puts something in the outbox (a message-less exit would
    # leave the writer waiting forever): a disconnect marker, or the failure that aborts.
    try:
        while True:
            try:
                event = await ws.receive()
            except RuntimeError:
                event = {"type": "websocket.disconnect"}
            if event["type"] == "websocket.disconnect":
                # A WebSocket has no half-close: the client leaving ends the session and cancels
                # every action.
                # aclose() empties the outbox (unsent messages are dropped at once), so the
                # marker that ends the writer goes in after it.
                await runner.aclose()
                runner.outbox.put_nowait(_DISCONNECTED)
                return
            text = event.get("text")
            data = text if text is not None else event.get("bytes") or b""
            await runner.feed(data, codec.decode_json)  # decoded in the worker thread; an error aborts
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bug in this loop: abort with the table's generic status
        await runner.fail(exc, is_refused=True)
