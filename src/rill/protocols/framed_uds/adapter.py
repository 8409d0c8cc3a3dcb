"""The Unix-socket listener: sockets and the engine client meet the pure session here.

``start(deps)`` binds ``--socket`` (unless ``--no-socket``) with mode ``--socket-mode``,
replacing a stale socket file left by a dead server and refusing to start when a live server
holds the path. Each connection runs a reader loop (bytes → ``FrameDecoder`` / ``LineDecoder``
→ codec → session) and, while a request runs, a pump task (``RequestStream`` → session →
frames). The session decides; this module only performs its actions.

Cancellation: a ``cancel`` frame aborts the request in the engine and its final output still
flows (one ``eos`` "cancelled"); a disconnect or any close closes the ``RequestStream`` at
once, which aborts the request and frees its KV memory.

This is the only module of the protocol that does I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import struct
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from rill import auth
from rill.connections import Lease, stream_handler
from rill.errors import ConfigError, IdleTimeout, RillError, Unauthorized
from rill.frontend.stream import RequestStream
from rill.protocols.framed_uds import codec
from rill.protocols.framed_uds.framing import FrameDecoder, FrameTooLarge, FramingError, LineDecoder
from rill.protocols.framed_uds.messages import Metrics, MetricsQuery, Request
from rill.protocols.framed_uds.session import (
    Abort,
    Action,
    Close,
    FramedSession,
    NewlineSession,
    Rejected,
    Send,
    SendMetrics,
    SessionLimits,
    Start,
)
from rill.types import RequestOutput

if TYPE_CHECKING:
    from rill.deps import Deps

log = logging.getLogger("rill.protocols.framed_uds")

READ_BYTES = 64 * 1024
"""Bytes asked of the socket per read (frames larger than this arrive in several reads)."""

LISTEN_BACKLOG = 128

CLOSE_FLUSH_S = 5.0

DISCARD_MAX_BYTES = 64 * 1024 * 1024
"""Most payload bytes of a refused oversized frame read and dropped before the close."""
"""Longest wait for a peer to take the last frames before the connection is dropped."""


async def start(deps: Deps) -> Callable[[], Awaitable[None]] | None:
    """Open the Unix-socket listener unless ``--no-socket``; return its async stopper.

    Raises:
        ConfigError: the path is held by a live server, is not a socket, or cannot be bound.
    """
    if deps.config.uds.no_socket:
        return None
    listener = UdsListener(deps)
    await listener.open()
    return listener.close


def bind_unix_socket(path: str, mode: int) -> socket.socket:
    """A listening Unix stream socket at ``path`` whose file has permissions ``mode``.

    A socket file nobody listens on (a dead server's) is replaced; a live one, or a path
    that is not a socket, makes this raise ``ConfigError`` with a message saying what to do.
    The mode is set between ``bind`` and ``listen``: connecting is refused until ``listen``,
    so no client ever connects through a wider mode.
    """
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on Unix socket {path}: {exc.strerror or exc}") from exc
    sock.setblocking(False)
    return sock


def _remove_stale_socket(path: str) -> None:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise ConfigError(f"--socket {path} exists and is not a socket; remove it or choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        # Nobody listens: a server died without removing its socket file.
        log.info("replacing stale Unix socket %s", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ConfigError(f"cannot check Unix socket {path}: {exc.strerror or exc}") from exc
    finally:
        probe.close()
    raise ConfigError(f"another server is already listening on Unix socket {path}; stop it, "
                      "or use --socket PATH (or --no-socket) for this one")


class UdsListener:
    """The listening socket and its live connections."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.config = deps.config.uds
        self.limits = SessionLimits(one_request=self.config.uds_one_request,
                                    request_timeout_s=deps.config.http.request_timeout_s)
        self.connections: set[Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._inode: int | None = None

    async def open(self) -> None:
        """Bind and start accepting (see ``bind_unix_socket``)."""
        path = self.config.socket
        sock = bind_unix_socket(path, int(self.config.socket_mode, 8))
        self._inode = os.stat(path).st_ino
        gate = self.deps.gate
        handler = self._on_connection if gate is None else stream_handler(gate, self._on_connection, self._refuse)
        self._server = await asyncio.start_unix_server(handler, sock=sock, limit=READ_BYTES)
        log.info("framed-uds (%s) listening on %s (mode %s)", self.config.uds_protocol, path, self.config.socket_mode)

    async def close(self) -> None:
        """Stop accepting, stop every connection's request, remove the socket file."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            await connection.close()
        if self._server is not None:
            await self._server.wait_closed()
        with contextlib.suppress(OSError):
            if os.stat(self.config.socket).st_ino == self._inode:  # never remove a successor's socket
                os.unlink(self.config.socket)

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, exc: RillError) -> None:
        """Past the connection limit: one error frame (``E_LIMIT_REJECTED``), then close."""
        connection = Connection(self, reader, writer)
        await connection.perform(connection.session.on_protocol_error(exc))
        await connection.close()

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             lease: Lease | None = None) -> None:
        connection = Connection(self, reader, writer, lease)
        self.connections.add(connection)
        try:
            await connection.run()
        except Exception:  # a bug here must not take the listener down
            log.exception("framed-uds connection failed")
        finally:
            self.connections.discard(connection)
            await connection.close()


def peer_principal(writer: asyncio.StreamWriter) -> str:
    """The principal of a Unix-socket peer when the server has no API keys: ``uds:uid=N``, the
    user id of the process at the other end (``SO_PEERCRED``, which the peer cannot forge), or
    ``uds:unknown`` where the OS does not say. (With keys, a request's ``api_key`` names it.)"""
    sock = writer.get_extra_info("socket")
    option = getattr(socket, "SO_PEERCRED", None)  # Linux; other systems have other calls
    if sock is None or option is None:
        return auth.principal(None, "uds:unknown")
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    except OSError:
        return auth.principal(None, "uds:unknown")
    _pid, uid, _gid = struct.unpack("3i", raw)
    return auth.principal(None, f"uds:uid={uid}")


class Connection:
    """One client connection: performs its session's actions."""

    def __init__(self, listener: UdsListener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 lease: Lease | None = None) -> None:
        self.listener = listener
        self.lease = lease
        self.client = listener.deps.client
        self.reader = reader
        self.writer = writer
        self.principal = peer_principal(writer)
        self.is_newline = listener.config.uds_protocol == "newline"
        self.session: Any = (NewlineSession if self.is_newline else FramedSession)(listener.limits)
        self.is_closed = False
        self._closed = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._stream: RequestStream | None = None
        self._pump: asyncio.Task[None] | None = None

    async def run(self) -> None:
        """Read until the peer or the session ends the connection."""
        max_bytes = self.listener.config.max_frame_bytes
        decoder: Any = LineDecoder(max_bytes) if self.is_newline else FrameDecoder(max_bytes)
        first_message_s = self.listener.deps.config.connections.first_message_timeout_s
        # Until a first whole message arrives, the connection lives on a deadline: an idle
        # client must not hold a connection (and a file descriptor) forever.
        deadline: float | None = asyncio.get_running_loop().time() + first_message_s
        if self.lease is not None:
            # Meanwhile it is idle: the connection gate may close it to let another client in.
            self.lease.evict = self.writer.close
            self.lease.set_idle(True)
        while not self.is_closed:
            try:
                async with asyncio.timeout_at(deadline):
                    data = await self.reader.read(READ_BYTES)
            except ConnectionError:
                data = b""
            except TimeoutError:
                await self.perform(self.session.on_protocol_error(
                    IdleTimeout(f"no message within {first_message_s:g} s of connecting")))
                break
            if not data:
                await self._on_eof(decoder)
                break
            try:
                items = decoder.feed(data)
            except FramingError as exc:
                await self._refuse_frame(exc)
                break
            if items:
                deadline = None
                if self.lease is not None:
                    self.lease.set_idle(False)
            for item in items:
                await self.perform(self._receive(item))
                if self.is_closed:
                    break
        await self._closed.wait()

    def _receive(self, item: bytes) -> list[Action]:
        try:
            keys = self.listener.deps.api_keys
            if self.is_newline:
                if keys:  # a line is a bare prompt: it has no room for a key
                    return self.session.on_protocol_error(Unauthorized(
                        "this server requires an API key, which the newline protocol cannot carry; "
                        "use the framed protocol and send 'api_key'"))
                return self.session.receive_line(item)
            try:
                message = codec.decode(item)
            except RillError as exc:  # InvalidJson, InvalidRequest
                return self.session.on_protocol_error(exc, codec.wire_id(item))
            if isinstance(message, (Request, MetricsQuery)) and keys:
                wire_id = message.id if isinstance(message, Request) else None
                if not auth.key_matches(message.api_key, keys):
                    return self.session.on_protocol_error(Unauthorized(
                        "missing or unknown API key: send one of the server's keys as 'api_key'"), wire_id)
                self.principal = auth.principal(message.api_key, None)
            return self.session.receive(message)
        except Exception as exc:  # a bug must still answer with an error frame, not a bare close
            log.exception("framed-uds: a client frame could not be handled")
            return self.session.on_protocol_error(exc)

    async def _refuse_frame(self, exc: FramingError) -> None:
        actions = self.session.on_protocol_error(exc)
        closes: list[Action] = [action for action in actions if isinstance(action, Close)]
        await self.perform([action for action in actions if not isinstance(action, Close)])
        if isinstance(exc, FrameTooLarge) and not self.is_closed:
            # Answer and half-close first (a reading client sees the error, then the end),
            # then take the rest of the frame: closing with unread bytes resets the
            # connection, and a client still writing the frame would never see the error.
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                self.writer.write_eof()
                await self._discard(min(exc.num_unread_bytes, DISCARD_MAX_BYTES))
        await self.perform(closes)

    async def _discard(self, num_bytes: int) -> None:
        # Ends at the frame's end, the peer's close, or CLOSE_FLUSH_S without a byte (a peer
        # that sent only the header and keeps the socket open).
        while num_bytes > 0:
            try:
                data = await asyncio.wait_for(self.reader.read(min(READ_BYTES, num_bytes)), CLOSE_FLUSH_S)
            except (TimeoutError, ConnectionError):
                return
            if not data:
                return
            num_bytes -= len(data)

    async def _on_eof(self, decoder: Any) -> None:
        if self.is_newline:
            # EOF may be a half-close (``printf 'hi\n' | nc -U``): answer what was asked first.
            actions: list[Action] = []
            for line in decoder.finish():
                actions += self.session.receive_line(line)
            await self.perform(actions + self.session.on_end_of_input())
        else:
            await self.perform(self.session.on_disconnect())
            await self.close()

    async def perform(self, actions: list[Action]) -> None:
        """Carry out the session's actions in order; a broken peer ends the connection."""
        try:
            for action in actions:
                await self._perform_one(action)
        except (ConnectionError, OSError):
            # The peer is gone (EPIPE / ECONNRESET while writing): same as a disconnect.
            for action in self.session.on_disconnect():
                if isinstance(action, Abort):
                    self._abort()
            await self.close()

    async def _perform_one(self, action: Action) -> None:
        if isinstance(action, Send):
            message = action.message
            await self._send(message if isinstance(message, bytes) else codec.encode(message))
        elif isinstance(action, Start):
            await self._start(action)
        elif isinstance(action, Abort):
            self._abort()
        elif isinstance(action, SendMetrics):
            snapshot = codec.metrics_snapshot(self.client.stats(), len(self.listener.connections))
            await self._send(codec.encode(Metrics(metrics=snapshot)))
        elif isinstance(action, Rejected):
            metrics = self.listener.deps.metrics
            if metrics is not None and hasattr(metrics, "observe_rejection"):
                metrics.observe_rejection(protocol=codec.PROTOCOL_NAME, code=action.code)
        elif isinstance(action, Close):
            await self.close()

    async def _send(self, data: bytes) -> None:
        async with self._send_lock:
            if self.is_closed:
                return
            self.writer.write(data)
            await self.writer.drain()

    async def _start(self, action: Start) -> None:
        try:
            stream = await self.client.generate(msgspec.structs.replace(action.request, principal=self.principal))
        except Exception as exc:  # refused: bad input, queue full, not ready, ...
            if not isinstance(exc, RillError):
                log.exception("framed-uds: generate failed")
            await self.perform(self.session.on_start_failed(exc))
            return
        if self.is_closed:  # the peer left while the request was being submitted
            await stream.aclose()
            return
        self._stream = stream
        self._pump = asyncio.create_task(self._pump_outputs(stream))

    async def _pump_outputs(self, stream: RequestStream) -> None:
        try:
            async with stream:  # leaving early (close, cancel) aborts the request
                async for output in stream:
                    await self.perform(self.session.on_output(output))
                    if output.finished or self.is_closed:
                        break
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("framed-uds: stream of %s failed", stream.request_id)
            failed = RequestOutput(request_id=stream.request_id, finished=True, finish_reason="error", error=exc)
            await self.perform(self.session.on_output(failed))
        finally:
            if self._stream is stream:
                self._stream, self._pump = None, None

    def _abort(self) -> None:
        if self._stream is not None and not self._stream.is_finished:
            self._stream.abort()

    async def close(self) -> None:
        """Flush, stop the running request (freeing its KV memory) and close the socket."""
        if self.is_closed:
            return
        self.is_closed = True
        stream, pump = self._stream, self._pump
        if stream is not None:
            await stream.aclose()
        if pump is not None and pump is not asyncio.current_task():
            pump.cancel()
        # close() sends what is still buffered before closing (the error frame of a failure);
        # a peer that stopped reading must not pin the connection forever, hence the bound.
        self.writer.close()
        try:
            await asyncio.wait_for(self.writer.wait_closed(), CLOSE_FLUSH_S)
        except (TimeoutError, ConnectionError, OSError):
            self.writer.transport.abort()
        finally:
            self._closed.set()
