"""Evergreen's I/O: the ``grpc.aio`` server on ``--grpc-port`` and the ``/evergreen`` WebSocket.

Both transports run the same ``SessionRunner`` around the pure ``EvergreenSession``:

* a reader feeds each inbound message to the session and performs its commands; the
  message is converted and ``receive`` runs (storing fragments, expanding the inputs of the
  actions it starts) in a worker thread, so a 4 MiB message never stalls the event loop;
  every other call into the session holds the same lock, so the session sees one caller at
  a time;
* each started action runs as a task: read its file refs and build the request (both in a
  worker thread: a large prompt is joined and decoded off the event loop), ``client.generate``,
  and turn every ``RequestOutput`` into output fragments;
* an outbox queue carries messages to the writer, then either ``DONE`` (gRPC: status OK
  after the client half-closed and every action finished) or the exception that aborts the
  session (gRPC status / WebSocket close code 4000 + status, see ``codec.ws_close``).

Ending: a half-close on gRPC means "no more input" (running actions finish first). A
cancelled call, a dropped connection, a closed WebSocket or an abort closes every running
``RequestStream`` at once, which aborts the requests in the engine and frees their KV memory.

This is the only module of the protocol that does I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote

import msgspec
from google.protobuf.message import DecodeError
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from rill import auth
from rill.connections import client_key
from rill.errors import ConfigError, GenerationError, IdleTimeout, RillError, TooManyConnections
from rill.frontend.stream import RequestStream
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.errors import InvalidMessage, RefDenied, RefNotFound, SessionLimit, UnsupportedInput
from rill.protocols.evergreen.messages import SessionMessage
from rill.protocols.evergreen.session import (
    Close,
    Command,
    EvergreenSession,
    FileRef,
    Generate,
    ModelFacts,
    Send,
    SessionLimits,
    is_under,
)

if TYPE_CHECKING:
    from rill.deps import Deps

log = logging.getLogger("rill.protocols.evergreen")

DONE = object()
"""Outbox marker: the session ended normally."""

GRPC_GRACE_S = 1.0
"""Seconds running calls get to finish when the server stops."""

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


def read_refs(refs: list[FileRef], roots: tuple[str, ...], max_bytes: int) -> tuple[dict[str, bytes], int]:
    """Read the file refs of a started action (blocking: run it in a thread).

    Each file is read once however many refs name it (by its real path). Symlinks are
    resolved and the real path is checked against the roots again, so a link inside a root
    cannot reach a file outside it. Only regular files are read: a FIFO, device or socket is
    refused after a ``stat``, without opening it, and the file is opened non-blocking, so a
    ref can never hold a worker thread. At most ``max_bytes + 1`` bytes are read in total.

    Returns:
        The content of each ref by its ``path``, and the number of bytes read (each file once).

    Raises:
        RefDenied: the real path leaves every root.
        RefNotFound: the file is missing, a folder or unreadable.
        UnsupportedInput: not a regular file, or a path the OS cannot take.
        SessionLimit: the files hold more than ``max_bytes``.
    """
    contents: dict[str, bytes] = {}
    by_real_path: dict[str, bytes] = {}
    num_read_bytes = 0
    for ref in refs:
        if ref.path in contents:
            continue
        try:
            real = os.path.realpath(ref.path)
        except (ValueError, UnicodeError) as exc:  # NUL or an unencodable name: never a file
            raise UnsupportedInput(f"ref '{ref.uri}' is not a valid path") from exc
        if not any(is_under(real, root) for root in roots):
            raise RefDenied(f"ref '{ref.uri}' resolves outside the allowed file roots")
        data = by_real_path.get(real)
        if data is None:
            data = by_real_path[real] = _read_regular_file(ref.uri, real, max_bytes - num_read_bytes)
            num_read_bytes += len(data)
        contents[ref.path] = data
    return contents, num_read_bytes


READ_BLOCK_BYTES = 1024 * 1024


def _read_regular_file(uri: str, path: str, max_bytes: int) -> bytes:
    """The content of the regular file at real ``path``, read non-blocking, at most ``max_bytes``."""
    try:
        info = os.stat(path)
        _check_regular(uri, info)
        if info.st_size > max_bytes:
            raise _too_big(uri, max_bytes)
        # O_NOFOLLOW: the path was resolved; a symlink swapped in since then is refused.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
        try:
            _check_regular(uri, os.fstat(fd))  # the file may have been replaced after the stat
            blocks: list[bytes] = []
            num_bytes = 0
            while num_bytes <= max_bytes:
                block = os.read(fd, min(READ_BLOCK_BYTES, max_bytes + 1 - num_bytes))
                if not block:
                    break
                blocks.append(block)
                num_bytes += len(block)
        finally:
            os.close(fd)
    except FileNotFoundError as exc:
        raise RefNotFound(f"ref '{uri}': no such file") from exc
    except OSError as exc:
        raise RefNotFound(f"ref '{uri}' cannot be read: {exc.strerror}") from exc
    except (ValueError, UnicodeError) as exc:
        raise UnsupportedInput(f"ref '{uri}' is not a valid path") from exc
    if num_bytes > max_bytes:
        raise _too_big(uri, max_bytes)  # it grew after the stat
    return b"".join(blocks)


def _check_regular(uri: str, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        raise RefNotFound(f"ref '{uri}' is a folder, not a file")
    if not stat.S_ISREG(info.st_mode):
        raise UnsupportedInput(f"ref '{uri}' is not a regular file (a FIFO, device or socket); "
                               "rill reads regular files only")


def _too_big(uri: str, max_bytes: int) -> SessionLimit:
    return SessionLimit(f"ref '{uri}' holds more than the {max_bytes} bytes left to this session and prompt "
                        "(--evergreen-max-bytes, --evergreen-max-prompt-bytes)")


# -- gRPC -----------------------------------------------------------------------------------------


async def start(deps: Deps) -> Callable[[], Awaitable[None]] | None:
    """Start the gRPC server on ``--grpc-port`` (0: disabled); return its async stopper.

    Raises:
        ConfigError: the port cannot be bound.
    """
    port = deps.config.evergreen.grpc_port
    if not port:
        return None
    import grpc

    from rill.protocols.evergreen._pb import evergreen_service_pb2_grpc as service_grpc

    max_bytes = max(deps.config.http.max_body_bytes, 4 * 1024 * 1024)
    limits = deps.config.connections
    first_message_ms = int(limits.first_message_timeout_s * 1000)
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes),
                 # grpc sets SO_REUSEPORT by default, which would let a second server share the port
                 # silently (splitting sessions between two processes): refuse it, as for the HTTP port.
                 ("grpc.so_reuseport", 0),
                 # Connections that never finish the HTTP/2 handshake, or that hold no call, are
                 # closed like idle WebSockets; calls themselves are counted by the gate.
                 ("grpc.server_handshake_timeout_ms", first_message_ms),
                 ("grpc.max_connection_idle_ms", first_message_ms)],
        maximum_concurrent_rpcs=limits.max_connections)
    service_grpc.add_EvergreenServiceServicer_to_server(EvergreenServicer(deps), server)
    health = _add_standard_services(server)
    await _set_health(health, serving=False)  # before the port opens: no probe sees SERVING early
    address = f"{deps.config.http.host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"cannot listen for gRPC on {address} (--grpc-port): {exc}") from exc
    if not bound:
        raise ConfigError(f"cannot listen for gRPC on {address} (--grpc-port)")
    await server.start()
    log.info("evergreen gRPC listening on %s", address)
    watch = asyncio.create_task(_serving_when_ready(deps, health))

    async def stop() -> None:
        watch.cancel()
        await health.enter_graceful_shutdown()  # probes see NOT_SERVING while calls drain
        await server.stop(GRPC_GRACE_S)

    return stop


def _add_standard_services(server: Any) -> Any:
    """Add ``grpc.health.v1.Health`` (NOT_SERVING until the model is ready) and server
    reflection (``grpcurl list``, ``grpcurl describe``) to ``server``; return the health servicer.

    Both answer without an API key, as ``/health`` does: they tell nothing of any session.
    """
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from rill.protocols.evergreen._pb import evergreen_service_pb2 as service_pb2

    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    names = (service_pb2.DESCRIPTOR.services_by_name["EvergreenService"].full_name,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    return servicer


HEALTH_SERVICES = ("", "evergreen.v2.EvergreenService")
"""Health-check service names: the whole server ("") and the Evergreen service."""


async def _set_health(health: Any, *, serving: bool) -> None:
    from grpc_health.v1 import health_pb2

    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in HEALTH_SERVICES:
        await health.set(name, status)


async def _serving_when_ready(deps: Deps, health: Any) -> None:
    """Turn health to SERVING once the model is ready; a failed load keeps NOT_SERVING
    (and ends ``rill serve``)."""
    try:
        await deps.client.wait_ready()
    except Exception:  # noqa: BLE001 - an engine that never gets ready leaves health unset
        return
    await _set_health(health, serving=True)


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
