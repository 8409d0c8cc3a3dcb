"""The Unix-socket protocol's transport: one ``Connection`` per accepted socket.

``start(deps)`` opens the listener (``listener.py``: binding, accepting, stopping). Each
connection reads bytes (``FrameDecoder`` / ``LineDecoder`` → codec → session) under a
first-message deadline, answers an oversized frame before closing, writes frames, and runs
its session on one session driver (``protocols/_shared/driver``), which submits the requests
under the peer's principal and pumps their outputs. The session decides; this module only
carries bytes.

Cancellation: a ``cancel`` frame aborts the request in the engine and its final output still
flows (one ``eos`` "cancelled"); a disconnect or any close ends the connection's request at
once, which frees its KV memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from rill import auth
from rill.connections import Lease
from rill.errors import IdleTimeout, RillError, Unauthorized
from rill.protocols._shared.actions import Close
from rill.protocols._shared.driver import Driver, Gone, Transport
from rill.protocols.framed_uds import codec
from rill.protocols.framed_uds.framing import FrameDecoder, FrameTooLarge, FramingError, LineDecoder
from rill.protocols.framed_uds.listener import READ_BYTES, UdsListener, peer_principal
from rill.protocols.framed_uds.messages import Metrics, MetricsQuery, Request, ServerMessage
from rill.protocols.framed_uds.session import Action, FramedSession, NewlineSession, SessionLimits

if TYPE_CHECKING:
    from rill.deps import Deps

log = logging.getLogger("rill.protocols.framed_uds")

CLOSE_FLUSH_S = 5.0
"""Longest wait for a peer to take the last frames before the connection is dropped."""

DISCARD_MAX_BYTES = 64 * 1024 * 1024
"""Most payload bytes of a refused oversized frame read and dropped before the close."""


async def start(deps: Deps) -> Callable[[], Awaitable[None]] | None:
    """Open the Unix-socket listener unless ``--no-socket``; return its async stopper.

    Raises:
        ConfigError: the path is held by a live server, is not a socket, or cannot be bound.
    """
    if deps.config.uds.no_socket:
        return None
    limits = SessionLimits(
        one_request=deps.config.uds.uds_one_request, request_timeout_s=deps.config.policy.request_timeout_s
    )
    listener = UdsListener(deps.config.uds, deps.gate, functools.partial(Connection, deps, limits))
    await listener.open()
    return listener.close


class Connection(Transport):
    """One client connection: reads and writes its socket; its driver runs the rest."""

    def __init__(
        self,
        deps: Deps,
        limits: SessionLimits,
        listener: UdsListener,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        lease: Lease | None = None,
    ) -> None:
        self.deps, self.listener, self.lease = deps, listener, lease
        self.reader, self.writer = reader, writer
        self.is_newline = listener.config.uds_protocol == "newline"
        self.session: Any = (NewlineSession if self.is_newline else FramedSession)(limits)
        # No one_event_per_token: the framed session sends one token event per token of an
        # output itself; the newline session writes raw text.
        self.driver = Driver(
            self.session,
            self,
            deps.client,
            protocol=codec.PROTOCOL_NAME,
            principal=peer_principal(writer),
            metrics=deps.metrics,
        )
        self.is_closed = False
        self._closed = asyncio.Event()
        self._send_lock = asyncio.Lock()

    async def run(self) -> None:
        """Read until the peer or the session ends the connection."""
        with contextlib.suppress(Gone):  # the peer left while we wrote: send() closed the connection
            await self._read()
        await self._closed.wait()

    async def _read(self) -> None:
        max_bytes = self.listener.config.max_frame_bytes
        decoder: Any = LineDecoder(max_bytes) if self.is_newline else FrameDecoder(max_bytes)
        first_message_s = self.deps.config.connections.first_message_timeout_s
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
                await self.driver.perform(
                    self.session.on_protocol_error(
                        IdleTimeout(f"no message within {first_message_s:g} s of connecting")
                    )
                )
                return
            if not data:
                await self._on_eof(decoder)
                return
            try:
                items = decoder.feed(data)
            except FramingError as exc:
                await self._refuse_frame(exc)
                return
            if items and deadline is not None:
                deadline = None
                if self.lease is not None:
                    self.lease.set_idle(False)
            for item in items:
                await self.driver.perform(self._receive(item))
                if self.is_closed:
                    return

    def _receive(self, item: bytes) -> list[Action]:
        try:
            keys = self.deps.api_keys
            if self.is_newline:
                if keys:  # a line is a bare prompt: it has no room for a key
                    return self.session.on_protocol_error(
                        Unauthorized(
                            "this server requires an API key, which the newline protocol cannot carry; "
                            "use the framed protocol and send 'api_key'"
                        )
                    )
                return self.session.receive_line(item)
            try:
                message = codec.decode(item)
            except RillError as exc:  # InvalidJson, InvalidRequest
                return self.session.on_protocol_error(exc, codec.wire_id(item))
            if isinstance(message, (Request, MetricsQuery)) and keys:
                wire_id = message.id if isinstance(message, Request) else None
                if not auth.key_matches(message.api_key, keys):
                    return self.session.on_protocol_error(
                        Unauthorized("missing or unknown API key: send one of the server's keys as 'api_key'"), wire_id
                    )
                self.driver.principal = auth.principal(message.api_key, None)
            return self.session.receive(message)
        except Exception as exc:  # a bug must still answer with an error frame, not a bare close
            log.exception("framed-uds: a client frame could not be handled")
            return self.session.on_protocol_error(exc)

    async def _refuse_frame(self, exc: FramingError) -> None:
        # The session answers with the error and a Close; the close waits for what follows.
        await self.driver.perform([a for a in self.session.on_protocol_error(exc) if not isinstance(a, Close)])
        if isinstance(exc, FrameTooLarge) and not self.is_closed:
            # Answer and half-close first (a reading client sees the error, then the end),
            # then take the rest of the frame: closing with unread bytes resets the
            # connection, and a client still writing the frame would never see the error.
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                self.writer.write_eof()
                await self._discard(min(exc.num_unread_bytes, DISCARD_MAX_BYTES))
        await self.close()

    async def _discard(self, num_bytes: int) -> None:
        # Ends at the frame's end, the peer's close, or CLOSE_FLUSH_S without a byte (a peer
        # that sent only the header and keeps the socket open).
        while num_bytes > 0:
            try:
                async with asyncio.timeout(CLOSE_FLUSH_S):
                    data = await self.reader.read(min(READ_BYTES, num_bytes))
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
            await self.driver.perform(actions + self.session.on_end_of_input())
        else:
            await self.driver.perform(self.session.on_disconnect())
            await self.close()

    async def send(self, message: ServerMessage | bytes) -> None:
        """Write one frame (framed mode) or raw bytes (newline mode); a broken peer ends the connection."""
        data = message if isinstance(message, bytes) else codec.encode(message)
        try:
            async with self._send_lock:
                if self.is_closed:
                    raise Gone
                self.writer.write(data)
                await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            # The peer is gone (EPIPE / ECONNRESET while writing): as a disconnect.
            self.session.on_disconnect()
            await self.close()
            raise Gone from exc

    async def perform(self, action: Any) -> None:
        """The metrics frame (``SendMetrics``, this wire's one action of its own)."""
        snapshot = codec.metrics_snapshot(self.deps.client.stats(), len(self.listener.connections))
        await self.send(Metrics(metrics=snapshot))

    async def refuse(self, exc: RillError) -> None:
        """Past the connection limit: one error frame (``E_LIMIT_REJECTED``), then close."""
        with contextlib.suppress(Gone):
            await self.driver.perform(self.session.on_protocol_error(exc))
        await self.close()

    async def close(self, code: int | None = None, reason: str = "") -> None:
        """Flush, stop the running request (freeing its KV memory) and close the socket."""
        if self.is_closed:
            return
        self.is_closed = True
        try:
            await self.driver.aclose()
            # close() sends what is still buffered before closing (the error frame of a failure);
            # a peer that stopped reading must not pin the connection forever, hence the bound.
            self.writer.close()
            async with asyncio.timeout(CLOSE_FLUSH_S):
                await self.writer.wait_closed()
        except (TimeoutError, ConnectionError, OSError):
            self.writer.transport.abort()
        finally:
            self._closed.set()
