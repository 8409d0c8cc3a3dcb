"""Evergreen's I/O: the ``grpc.aio`` server on ``--grpc-port`` and the ``/evergreen`` WebSocket.

Both transports run the same ``SessionRunner`` around the pure ``EvergreenSession``:

* a reader feeds each inbound message to the session and performs its commands; the
  message is converted and ``receive`` runs (storing fragments, expanding the inputs of the
  actions it starts) in a worker thread, so a 4 MiB message never stalls the event loop;
  every other call into the session holds the same lock, so the session sees one caller at
  a time;
* each started action runs as a task: read its file refs (``file_refs.read_refs``) and build
  the request (both in a worker thread: a large prompt is joined and decoded off the event
  loop), ``client.generate``,
  and turn every ``RequestOutput`` into output fragments;
* an outbox queue carries messages to the writer, then either ``DONE`` (gRPC: status OK
  after the client half-closed and every action finished) or the exception that aborts the
  session (gRPC status / WebSocket close code 4000 + status, see ``codec.ws_close``).

Ending: a half-close on gRPC means "no more input" (running actions finish first). A
cancelled call, a dropped connection, a closed WebSocket or an abort closes every running
``RequestStream`` at once, which aborts the requests in the engine and frees their KV memory.

The gRPC server itself (binding, health, reflection) is ``grpc_server``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote

import msgspec
from google.protobuf.message import DecodeError
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from rill import auth
from rill.connections import client_key
from rill.errors import GenerationError, IdleTimeout, RillError, TooManyConnections
from rill.frontend.stream import RequestStream
from rill.protocols.evergreen import codec, grpc_server
from rill.protocols.evergreen.errors import InvalidMessage
from rill.protocols.evergreen.file_refs import read_refs
from rill.protocols.evergreen.messages import SessionMessage
from rill.protocols.evergreen.session import (
    Close,
    Command,
    EvergreenSession,
    Generate,
    ModelFacts,
    Send,
    SessionLimits,
)

if TYPE_CHECKING:
    from rill.deps import Deps

log = logging.getLogger("rill.protocols.evergreen")

DONE = object()
"""Outbox marker: the session ended normally."""

# A refused (unauthenticated) session: how many messages, and how long after the first, are
# read before the UNAUTHENTICATED status is sent (see EvergreenServicer._drain_unauthenticated).
DRAIN_MAX_MESSAGES = 16
DRAIN_NEXT_S = 1.0


def session_limits(deps: Deps) -> SessionLimits:
    """The per-session limits and file roots from the server config."""
    e = deps.config.evergreen
    roots = tuple(os.path.realpath(r) for r in e.evergreen_file_root)
    return SessionLimits(max_depth=e.evergreen_max_depth, max_nodes=e.evergreen_max_nodes,
                         max_bytes=e.evergreen_max_bytes, max_actions=e.evergreen_max_actions,
                         max_fragments=e.evergreen_max_fragments, max_id_bytes=e.evergreen_max_id_bytes,
                         max_prompt_bytes=e.evergreen_max_prompt_bytes,
                         request_timeout_s=deps.config.http.request_timeout_s, file_roots=roots)


def model_facts(deps: Deps) -> ModelFacts:
    """What the session knows of the model (the model must be loaded)."""
    info = deps.client.model_info
    if info is None:
        return ModelFacts(name=deps.config.engine.served_model_name or "")
    return ModelFacts(name=info.name, has_chat_template=info.has_chat_template, modalities=tuple(info.modalities))


class SessionRunner:
    """Runs one session: feeds the pure session, runs its generations, fills the outbox."""

    def __init__(self, deps: Deps, principal: str) -> None:
        self.deps = deps
        self.principal = principal
        self.outbox: asyncio.Queue[Any] = asyncio.Queue()
        self._session: EvergreenSession | None = None
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._streams: dict[int, RequestStream] = {}
        self._is_over = False
        self._lock = asyncio.Lock()  # held by every call into the session (one may run in a thread)
        # What the session holds is charged to the server-wide budget under the principal,
        # and all of it given back when the session ends (close()).
        self._lease = deps.memory.lease(principal) if deps.memory is not None else None

    async def _ensure_session(self) -> EvergreenSession:
        if self._session is None:
            # The session needs the model's name and template: wait for loading to finish.
            await self.deps.client.wait_ready()
            self._session = EvergreenSession(session_limits(self.deps), model_facts(self.deps),
                                             charge=self._lease.grow if self._lease is not None else None)
        return self._session

    async def feed(self, message: Any, decode: Callable[[Any], SessionMessage] | None = None) -> None:
        """Hand one inbound message to the session; a broken rule aborts the session.

        With ``decode``, ``message`` is the transport's form (a protobuf, JSON text) and is
        decoded in the worker thread too; a decoding error aborts the session.
        """
        if self._is_over:
            return
        try:
            session = await self._ensure_session()
            async with self._lock:
                commands = await asyncio.to_thread(_decode_and_receive, session, message, decode)
            if not self._is_over:
                self._perform(commands)
        except Exception as exc:  # noqa: BLE001 - every failure aborts the session (spec "Error handling")
            self.fail(exc, is_rejection=True)

    async def input_ended(self) -> None:
        """The client half-closed: no more input will come."""
        if self._is_over:
            return
        try:
            session = await self._ensure_session()
            async with self._lock:
                commands = session.on_input_end()
            self._perform(commands)
        except Exception as exc:  # noqa: BLE001 - every failure aborts the session
            self.fail(exc, is_rejection=True)

    def fail(self, exc: BaseException, is_rejection: bool = False) -> None:
        """Abort the session with ``exc``'s status and cancel every action.

        ``is_rejection``: the failure came before the engine saw the request (a broken rule,
        a bad input, admission refused); it is counted in ``rill_requests_rejected_total``.
        """
        if self._is_over:
            return
        if not isinstance(exc, RillError):
            log.error("evergreen session failed", exc_info=exc)
        metrics = self.deps.metrics
        if is_rejection and metrics is not None and hasattr(metrics, "observe_rejection"):
            code = exc.code if isinstance(exc, RillError) else RillError.code
            metrics.observe_rejection(protocol=codec.PROTOCOL_NAME, code=code)
        self._is_over = True
        self.outbox.put_nowait(exc)
        self._cancel_all()

    def _perform(self, commands: list[Command]) -> None:
        for command in commands:
            if isinstance(command, Send):
                self.outbox.put_nowait(command.message)
            elif isinstance(command, Generate):
                self._tasks[command.action_id] = asyncio.create_task(self._run(command))
            elif isinstance(command, Close):
                self._is_over = True
                self.outbox.put_nowait(DONE)

    async def _run(self, command: Generate) -> None:
        session = self._session
        assert session is not None
        stream: RequestStream | None = None
        try:
            refs: dict[str, bytes] = {}
            if command.refs:  # reading files blocks: off the event loop
                async with self._lock:
                    budget = session.ref_budget(command)
                refs, num_read_bytes = await asyncio.to_thread(read_refs, command.refs, session.limits.file_roots, budget)
                async with self._lock:
                    session.count_refs(command, refs, num_read_bytes)
            # Joining and decoding a large prompt takes time: off the event loop too.
            request = await asyncio.to_thread(session.request_for, command, refs)
            if self._is_over:
                return
            stream = await self.deps.client.generate(msgspec.structs.replace(request, principal=self.principal))
            self._streams[command.action_id] = stream
            async with stream:
                async for output in stream:
                    if output.finish_reason == "error":
                        raise output.error if isinstance(output.error, RillError) else GenerationError(
                            f"action {command.action_id} failed while generating")
                    if self._is_over:
                        return
                    async with self._lock:
                        commands = session.on_output(command.action_id, output.text, output.finished)
                    self._perform(commands)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure aborts the session
            self.fail(exc, is_rejection=stream is None)
        finally:
            self._streams.pop(command.action_id, None)
            self._tasks.pop(command.action_id, None)

    def _cancel_all(self) -> None:
        # Close the streams first: aclose() sends the engine abort at once, even before the
        # cancelled tasks get to run their own cleanup.
        for stream in list(self._streams.values()):
            task = asyncio.ensure_future(stream.aclose())
            task.add_done_callback(_ignore_result)
        for task in list(self._tasks.values()):
            task.cancel()

    async def close(self) -> None:
        """End the session (normally, cancelled, disconnected): abort everything, drop what
        the session and the outbox hold and give its memory back to the budget."""
        self._is_over = True
        streams = list(self._streams.values())
        tasks = list(self._tasks.values())
        for stream in streams:
            await stream.aclose()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        # The runner may outlive the call (a reference held by a finished task or a traceback):
        # drop the session's store and the unsent messages now, not whenever it is collected.
        self._session = None
        while not self.outbox.empty():
            self.outbox.get_nowait()
        if self._lease is not None:
            self._lease.close()


def _decode_and_receive(session: EvergreenSession, message: Any,
                        decode: Callable[[Any], SessionMessage] | None) -> list[Command]:
    # Runs in a worker thread, under the runner's lock.
    return session.receive(decode(message) if decode is not None else message)


def _ignore_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


# -- gRPC -----------------------------------------------------------------------------------------


async def start(deps: Deps) -> Callable[[], Awaitable[None]] | None:
    """Serve Evergreen over gRPC on ``--grpc-port`` (0: disabled); return the async stopper.

    Raises:
        ConfigError: the port cannot be bound.
    """
    if not deps.config.evergreen.grpc_port:
        return None
    return await grpc_server.start(deps, EvergreenServicer(deps))


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
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or unknown API key (send metadata 'authorization: Bearer KEY')")
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
            await runner.close()
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
                runner.fail(IdleTimeout(f"no message within {first_message_s:g} s of starting the session"))
                return
            await runner.feed(first, codec.from_pb)
            async for message in messages:
                await runner.feed(message, codec.from_pb)
        except asyncio.CancelledError:
            raise
        except DecodeError as exc:  # grpc could not parse the client's bytes: the client's fault
            runner.fail(InvalidMessage(f"not a serialized evergreen.v2.SessionMessage: {exc}"), is_rejection=True)
            return
        except Exception as exc:  # noqa: BLE001 - the transport failed (e.g. a message over the size limit)
            runner.fail(exc)
            return
        await runner.input_ended()

    def _principal(self, context: Any) -> str | None:
        """Who calls (``rill.auth.principal``), or None when keys are on and no key matches."""
        keys = self.deps.api_keys
        if not keys:
            return auth.principal(None, grpc_peer_host(context.peer()))
        tokens = [auth.bearer_token(value) for key, value in context.invocation_metadata() or ()
                  if key.lower() == "authorization" and isinstance(value, str)]
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
        await runner.close()


_DISCONNECTED = object()


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
                # close() empties the outbox (unsent messages are dropped at once), so the
                # marker that ends the writer goes in after it.
                await runner.close()
                runner.outbox.put_nowait(_DISCONNECTED)
                return
            text = event.get("text")
            data = text if text is not None else event.get("bytes") or b""
            await runner.feed(data, codec.decode_json)  # decoded in the worker thread; an error aborts
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a bug in this loop: abort with the table's generic status
        runner.fail(exc, is_rejection=True)
