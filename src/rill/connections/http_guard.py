"""The HTTP/WebSocket port under the gate: uvicorn's protocol wrapped in ``GuardedProtocol``.

The wrapper takes a lease when the TCP connection is accepted (before a byte is read),
refuses with a 503 past the limits, closes a connection whose request headers do not arrive
in time (408), and lets the gate close it while idle. Its refusals are written by the
``ErrorRenderer`` the server passes, so this module knows no protocol.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from websockets.frames import Close, Frame, Opcode

from rill.connections.gate import ConnectionGate, Lease, peer_host
from rill.errors import IdleTimeout, TooManyConnections

ErrorRenderer = Callable[[BaseException], tuple[int, dict[str, str], bytes]]
"""Turns an error into (HTTP status, extra headers, JSON body). The server passes the OpenAI
API's error format (``openai_http.adapter.http_error``) to this module and to
``rill.middleware``, so neither knows a protocol."""

_REASONS = {408: "Request Timeout", 503: "Service Unavailable"}

LINGER_S = 2.0
"""Longest a connection closed while its client was still sending stays open to read and drop
that input (``GuardedProtocol`` docstring)."""

LINGER_BYTES = 64 * 2**20
"""Most input read and dropped while lingering; past it the connection closes at once."""


def _raw_response(render: ErrorRenderer, exc: TooManyConnections | IdleTimeout) -> bytes:
    """A whole HTTP/1.1 error response for ``exc``, as the HTTP routes answer it (``render``)."""
    status, wire_headers, body = render(exc)
    headers = {
        **wire_headers,
        "content-type": "application/json",
        "content-length": str(len(body)),
        "connection": "close",
    }
    head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
    head += "".join(f"{name.lower()}: {value}\r\n" for name, value in headers.items())
    return head.encode("latin-1") + b"\r\n" + body


def _close_frame(code: int, reason: str) -> bytes:
    """A server's WebSocket close frame (unmasked): ``code`` and a short ``reason``."""
    return Frame(Opcode.CLOSE, Close(code, reason).serialize()).serialize(mask=False)


class GuardedProtocol(asyncio.Protocol):
    """uvicorn's HTTP protocol (and, after an upgrade, its WebSocket protocol) under a lease.

    Everything the transport reports is passed on to the current inner protocol. When the
    inner protocol switches the transport to a WebSocket protocol, this one takes the
    transport back and passes on to the new protocol instead, so the lease is released
    when the socket closes whatever protocol it ended with.

    Header timeout: armed on accept and again whenever a response has ended
    (``request_done``); disarmed when the app receives a request (``request_started``).
    On expiry the connection is closed, after a 408 if part of a request had arrived.

    Lingering close: uvicorn's protocol closes the socket at once when what it reads fails (a
    WebSocket message over ``ws_max_size``: close 1009). The client may still be sending then,
    and a socket closed with unread input answers with a reset, which can reach the client
    before the close frame does: it would see a dropped connection, not the refusal. So a close
    made while input is being handled writes what is pending, then the end of output, and
    reads and drops the client's further bytes until it ends its side, for at most
    ``LINGER_S`` and ``LINGER_BYTES``, as HTTP servers do after an error answer.

    Idle (closable by the gate to make room for another address, ``Lease.evict``): while
    the header timer runs, and while a WebSocket has not sent its first message
    (``set_idle``, from the middleware). Closed that way, a client that had sent part of
    a request gets a 503, a WebSocket a close frame 1013 (try again later).

    Args:
        inner: uvicorn's protocol for this connection.
        gate: the server's connection gate.
        header_timeout_s: time allowed for a request's headers.
        render_error: writes the 503 and 408 answers (status, headers, JSON body).
    """

    def __init__(
        self, inner: asyncio.Protocol, gate: ConnectionGate, header_timeout_s: float, render_error: ErrorRenderer
    ) -> None:
        self.inner = inner
        self.gate = gate
        self.header_timeout_s = header_timeout_s
        self.render_error = render_error
        self.transport: asyncio.Transport | None = None
        self.lease: Lease | None = None
        self.key: tuple[str, int] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._partial = False
        self._connected = False
        self._websocket = False
        self.evicted = False
        self._receiving = False  # inside the inner protocol's data_received
        self.lingering = False  # closed while the client was sending: reading and dropping its input
        self._lingered_bytes = 0
        self._linger_timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol --------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """Take a lease (or answer 503 and close) and start the header timer."""
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peername = transport.get_extra_info("peername")
        try:
            self.lease = self.gate.open(peer_host(peername))
        except TooManyConnections as exc:
            # Refused before reading: nothing of this client is parsed or handed to the app.
            transport.write(_raw_response(self.render_error, exc))
            transport.close()
            return
        self.lease.evict = self._evict
        if isinstance(peername, (tuple, list)) and len(peername) >= 2:
            self.key = (peername[0], peername[1])
            self.gate.http_connections[self.key] = self
        self._connected = True
        self.inner.connection_made(cast(asyncio.Transport, _InnerTransport(transport, self)))
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Pass bytes on to the current protocol; adopt a WebSocket it switched to."""
        if self.lingering:
            self._lingered_bytes += len(data)
            if self._lingered_bytes > LINGER_BYTES and self.transport is not None:
                self.transport.close()
            return
        if not self._connected:
            return
        if self._timer is not None:
            self._partial = True
        self._receiving = True
        try:
            self.inner.data_received(data)
        finally:
            self._receiving = False
        self._adopt_switched_protocol()

    def eof_received(self) -> bool | None:
        """Pass the end of input on (while lingering: the client is done, close)."""
        if self.lingering:
            return False
        if not self._connected:
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        """Give the lease back and tell the current protocol."""
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self.key is not None and self.gate.http_connections.get(self.key) is self:
            del self.gate.http_connections[self.key]
        if self.lease is not None:
            self.lease.release()
        if self._connected:
            self._connected = False
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        """Pass flow control on."""
        if self._connected:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        """Pass flow control on."""
        if self._connected:
            self.inner.resume_writing()

    # called by the ASGI middleware -------------------------------------------------------------
    def request_started(self) -> bool:
        """The app has a request (its headers are complete): stop the header timer.

        Returns False when the gate has already closed this connection to make room (the
        request must not run: its client is gone).
        """
        self._disarm()
        self.set_idle(False)
        return not self.evicted

    def set_idle(self, idle: bool) -> None:
        """Whether the gate may close this connection to make room (nothing in flight)."""
        if self.lease is not None:
            self.lease.set_idle(idle)

    def request_done(self) -> None:
        """A response has ended: the next request's headers are due within the timeout."""
        if self._connected and not self.lingering:
            self._arm()

    def close_for_inner(self) -> None:
        """The inner protocol closes the connection: at once, or lingering when it does so while
        handling input (see the class docstring)."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.lingering:
            return
        if not self._receiving or not transport.can_write_eof():
            transport.close()
            return
        self.lingering = True
        self._disarm()
        transport.write_eof()  # after what is pending (the close frame, the error answer)
        self._linger_timer = asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def is_closing_for_inner(self) -> bool:
        """What the inner protocol sees of ``is_closing``: lingering counts as closing."""
        return self.lingering or self.transport is None or self.transport.is_closing()

    # ------------------------------------------------------------------------------------------
    def _adopt_switched_protocol(self) -> None:
        transport = self.transport
        if transport is None:
            return
        current = transport.get_protocol()
        if current is not self and not transport.is_closing():
            # uvicorn upgraded to a WebSocket: keep receiving the events, hand them on.
            self.inner = cast(asyncio.Protocol, current)  # uvicorn's WebSocket protocols are Protocols
            self._websocket = True
            transport.set_protocol(self)

    def _arm(self) -> None:
        self._disarm()
        self._partial = False
        self._timer = asyncio.get_running_loop().call_later(self.header_timeout_s, self._on_header_timeout)
        self.set_idle(True)

    def _evict(self) -> None:
        # Called by the gate (synchronously, while accepting another connection).
        self.evicted = True
        self._disarm()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.lingering:  # its answer is written already, and its output ended
            transport.close()
            return
        reason = "the server is at its connection limit; this idle connection was closed for another client"
        if self._websocket:
            transport.write(_close_frame(1013, "server busy; retry later"))
        elif self._partial:
            transport.write(_raw_response(self.render_error, TooManyConnections(reason)))
        transport.close()

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_header_timeout(self) -> None:
        self._timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self._partial:
            exc = IdleTimeout(f"no complete request headers within {self.header_timeout_s:g} s")
            transport.write(_raw_response(self.render_error, exc))
        # With no byte of a request, close without a word: a keep-alive client could take an
        # unasked 408 for the answer to a request it is sending right now.
        transport.close()


class _InnerTransport:
    """The transport as uvicorn's protocol sees it: the connection's own, except that closing
    goes through ``GuardedProtocol.close_for_inner`` (a lingering close)."""

    def __init__(self, transport: asyncio.Transport, guard: GuardedProtocol) -> None:
        self._transport = transport
        self._guard = guard

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        """Write, unless lingering: its output has ended, and a write then would raise where a
        closed transport drops it."""
        if not self._guard.lingering:
            self._transport.write(data)

    def close(self) -> None:
        """Close, lingering if input is being handled."""
        self._guard.close_for_inner()

    def is_closing(self) -> bool:
        """True once closed or lingering."""
        return self._guard.is_closing_for_inner()


def http_protocol_factory(
    gate: ConnectionGate, header_timeout_s: float, render_error: ErrorRenderer, inner_class: Any = None
) -> Callable[..., asyncio.Protocol]:
    """A uvicorn ``http=`` protocol class stand-in: its protocol wrapped in ``GuardedProtocol``.

    Args:
        gate: the server's connection gate.
        header_timeout_s: time allowed for a request's headers.
        render_error: writes the refusals made before the app sees a request (503, 408).
        inner_class: uvicorn's HTTP protocol class (default: its ``auto`` choice).
    """
    if inner_class is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        inner_class = AutoHTTPProtocol

    def create(**kwargs: Any) -> asyncio.Protocol:
        return GuardedProtocol(inner_class(**kwargs), gate, header_timeout_s, render_error)

    return create
