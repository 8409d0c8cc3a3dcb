"""Connection accounting and connection-level timeouts, shared by every listener.

One ``ConnectionGate`` per server counts open client connections, in total and per client
IP address, and refuses (``TooManyConnections``) past ``--max-connections-per-client`` or,
when it cannot make room, past ``--max-connections``.

Fair share: when every place is taken, a newcomer from an address holding less than its
fair share (``--max-connections`` over the number of addresses connected, the newcomer's
included) is let in by closing one idle connection of the address holding the most
connections over its share (``ConnectionGate.victim``), so a few addresses holding idle
sockets cannot lock everyone else out. Idle means nothing of the client is being served:
an HTTP connection between requests (or before its first), a WebSocket or Unix-socket
connection that has not sent its first message. A connection with a request or a generation in flight is never closed.
The listener marks its leases idle or busy (``Lease.set_idle``) and gives each the means
to close it (``Lease.evict``).

Every listener takes a ``Lease`` from the gate:

* the HTTP/WebSocket port through ``http_protocol_factory``: uvicorn's protocol runs inside
  ``GuardedProtocol``, which takes the lease when the TCP connection is accepted (before a
  byte is read, so idle sockets count too), refuses with a 503 past the limits, and closes
  a connection whose request headers do not arrive within ``--header-timeout-s`` (408);
  the ASGI middleware (``rill.middleware``) tells it when a request's headers are complete
  and when its response has ended, and applies the body and first-message timeouts; the
  refusals it writes itself (503, 408) come from the error renderer the server passes
  (``ErrorRenderer``: the OpenAI API's error JSON), so this module knows no protocol;
* the Unix socket through ``stream_handler`` (total only: a Unix peer has no address; for
  fair shares its peers together count as one address, ``UNADDRESSED``);
* gRPC per call (``ConnectionGate.open`` in the servicer), besides gRPC's own handshake and
  idle-connection timeouts.

``raise_fd_limit`` lifts the process's soft file-descriptor limit so the connection limit,
not the kernel, is what refuses: at the fd limit every listener would stop accepting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast

from websockets.frames import Close, Frame, Opcode

# client_key is the identity auth's principals are built on; listeners that count peers
# (evergreen's servicer) still find it here, beside peer_host.
from rill.auth import client_key as client_key
from rill.errors import IdleTimeout, TooManyConnections

log = logging.getLogger("rill.connections")

ErrorRenderer = Callable[[BaseException], tuple[int, dict[str, str], bytes]]
"""Turns an error into (HTTP status, extra headers, JSON body). The server passes the OpenAI
API's error format (``openai_http.adapter.http_error``) to this module and to
``rill.middleware``, so neither knows a protocol."""

FD_RESERVE = 256
"""File descriptors kept free beyond ``--max-connections``: model files, the feedback
store, recordings, gRPC's own connections, log files."""

REFUSAL_LOG_INTERVAL_S = 60.0
"""At most one warning per this many seconds when connections are refused."""


UNADDRESSED = "(no address)"
"""The fair-share group of connections without an address (Unix-socket peers): together they
count as one more address when the total limit is shared out."""


class Lease:
    """One counted connection; ``release()`` (idempotent) gives its place back.

    A lease starts busy. A listener that can tell when its connection is idle (nothing of
    the client being served) marks it with ``set_idle(True)``, having set ``evict``: a
    function that closes the connection at once (called synchronously by the gate, which
    releases the lease right after). Only idle leases with an ``evict`` can be closed to
    make room for another address.
    """

    __slots__ = ("_gate", "client", "_released", "evict")

    def __init__(self, gate: ConnectionGate, client: str | None) -> None:
        self._gate = gate
        self.client = client
        self._released = False
        self.evict: Callable[[], None] | None = None

    @property
    def group(self) -> str:
        """Whom this connection counts for in fair shares: its address, or ``UNADDRESSED``."""
        return UNADDRESSED if self.client is None else self.client

    @property
    def idle(self) -> bool:
        """Whether the gate may close this connection to make room."""
        return self in self._gate._idle.get(self.group, ())

    def set_idle(self, idle: bool) -> None:
        """Mark the connection idle (closable to make room, when ``evict`` is set) or busy."""
        if self._released:
            return
        held = self._gate._idle.setdefault(self.group, {})
        if idle and self.evict is not None:
            held.pop(self, None)  # re-marked: it now counts as idle since this moment
            held[self] = None
        else:
            held.pop(self, None)
        if not held:
            del self._gate._idle[self.group]

    def release(self) -> None:
        """Stop counting this connection (later calls do nothing)."""
        if not self._released:
            self.set_idle(False)
            self._released = True
            self._gate._release(self.client)


class ConnectionGate:
    """Counts open connections in total and per client address.

    Args:
        max_total: most connections open at once.
        max_per_client: most connections open at once from one client address.
    """

    def __init__(self, max_total: int, max_per_client: int) -> None:
        self.max_total = max_total
        self.max_per_client = max_per_client
        self.total = 0
        self.per_client: dict[str, int] = {}
        self.refused = 0
        self.evicted = 0
        self._last_warning = -REFUSAL_LOG_INTERVAL_S
        self.http_connections: dict[tuple[str, int], GuardedProtocol] = {}
        # Idle leases per address, the longest idle first (dicts keep insertion order).
        self._idle: dict[str, dict[Lease, None]] = {}

    def open(self, client: str | None) -> Lease:
        """Count a new connection from ``client`` (None: no address, total only).

        At the total limit, an idle connection of the address most over its fair share is
        closed to make room for a ``client`` under its share (``victim``).

        Raises:
            TooManyConnections: this client's share is used up, or the total is and no
                connection could be closed for it.
        """
        over_own_limit = client is not None and self.per_client.get(client, 0) >= self.max_per_client
        victim = None
        if self.total >= self.max_total:
            victim = None if over_own_limit else self.victim(client)
            if victim is None:
                self._refuse()
                raise TooManyConnections(f"the server holds its limit of {self.max_total} connections; retry later")
        if over_own_limit:
            self._refuse()
            raise TooManyConnections(f"too many connections from {client} (at most {self.max_per_client}); "
                                     "close some or retry later")
        if victim is not None:
            self._evict(victim)
        self.total += 1
        if client is not None:
            self.per_client[client] = self.per_client.get(client, 0) + 1
        return Lease(self, client)

    @property
    def num_idle(self) -> int:
        """Connections marked idle (closable to make room for another address)."""
        return sum(len(leases) for leases in self._idle.values())

    def fair_share(self, newcomer: str | None = None) -> int:
        """How many connections each address may hold when all places are taken: the total
        shared evenly among the addresses connected (and ``newcomer``, if it is not; the
        peers without an address count as one)."""
        groups = self._groups()
        return max(1, self.max_total // max(1, len(groups) + (newcomer is not None and newcomer not in groups)))

    def victim(self, newcomer: str | None) -> Lease | None:
        """The connection to close so ``newcomer`` can connect at the total limit, or None.

        Only a newcomer with an address holding fewer than its fair share may displace
        anyone, and only an idle connection of another address (or of the peers without
        one, together) holding more than its fair share: of those, the one holding the
        most, and its connection idle the longest. Pure: nothing is closed here.
        """
        if newcomer is None:
            return None  # no address, no share of its own to claim (Unix-socket peers)
        groups = self._groups()
        share = self.fair_share(newcomer)
        if groups.get(newcomer, 0) >= share:
            return None
        candidates = [(count, group) for group, count in groups.items()
                      if count > share and group != newcomer and self._idle.get(group)]
        if not candidates:
            return None
        _, group = max(candidates)
        return next(iter(self._idle[group]))

    def _groups(self) -> dict[str, int]:
        """Connections held by each address, and by the peers without one (``UNADDRESSED``)."""
        groups = dict(self.per_client)
        unaddressed = self.total - sum(groups.values())
        if unaddressed > 0:
            groups[UNADDRESSED] = unaddressed
        return groups

    def _evict(self, lease: Lease) -> None:
        assert lease.evict is not None
        self.evicted += 1
        now = time.monotonic()
        if now - self._last_warning >= REFUSAL_LOG_INTERVAL_S:
            self._last_warning = now
            log.warning("at the limit of %d connections: closing an idle connection of %s (holding %d, over its "
                        "fair share) to let another address in; %d closed so far", self.max_total, lease.client,
                        self.per_client.get(lease.client or "", 0), self.evicted)
        evict = lease.evict
        lease.release()  # its place is free now, whenever the socket actually goes
        try:
            evict()
        except Exception:  # a peer already gone must not refuse the newcomer
            log.debug("closing an idle connection failed", exc_info=True)

    def _release(self, client: str | None) -> None:
        self.total -= 1
        if client is not None:
            left = self.per_client[client] - 1
            if left:
                self.per_client[client] = left
            else:
                del self.per_client[client]

    def _refuse(self) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._last_warning >= REFUSAL_LOG_INTERVAL_S:
            self._last_warning = now
            log.warning("refusing connections: %d open (limit %d, %d per client); %d refused so far",
                        self.total, self.max_total, self.max_per_client, self.refused)

    def http_connection(self, scope: MutableMapping[str, Any]) -> GuardedProtocol | None:
        """The HTTP-port connection an ASGI ``scope`` arrived on (None if unknown)."""
        client = scope.get("client")
        return self.http_connections.get((client[0], client[1])) if client else None


def peer_host(peername: Any) -> str | None:
    """The client a socket's peer name counts as (``rill.auth.client_key``); None for Unix
    sockets and unknowns."""
    if isinstance(peername, (tuple, list)) and peername and isinstance(peername[0], str):
        return client_key(peername[0])
    return None


def raise_fd_limit(max_connections: int) -> int:
    """Raise the soft open-file limit toward what ``max_connections`` needs; return the limit.

    The soft limit is raised up to the hard limit (never above it, never lowered). When even
    the hard limit is too small, a warning says so: past it, every listener stops accepting.
    """
    try:
        import resource
    except ImportError:  # not a POSIX system
        return 0
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit to %d: %s", target, exc)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning("the open-file limit (%d) is below --max-connections %d + %d reserved: connections are "
                    "capped at %d; raise the limit (ulimit -n) for more", soft, max_connections, FD_RESERVE,
                    max(1, soft - FD_RESERVE))
    return soft


# -- HTTP / WebSocket port ------------------------------------------------------------------------


_REASONS = {408: "Request Timeout", 503: "Service Unavailable"}


def _raw_response(render: ErrorRenderer, exc: TooManyConnections | IdleTimeout) -> bytes:
    """A whole HTTP/1.1 error response for ``exc``, as the HTTP routes answer it (``render``)."""
    status, wire_headers, body = render(exc)
    headers = {**wire_headers, "content-type": "application/json", "content-length": str(len(body)),
               "connection": "close"}
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

    def __init__(self, inner: asyncio.Protocol, gate: ConnectionGate, header_timeout_s: float,
                 render_error: ErrorRenderer) -> None:
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
        self.inner.connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        """Pass bytes on to the current protocol; adopt a WebSocket it switched to."""
        if not self._connected:
            return
        if self._timer is not None:
            self._partial = True
        self.inner.data_received(data)
        self._adopt_switched_protocol()

    def eof_received(self) -> bool | None:
        """Pass the end of input on."""
        if not self._connected:
            return None
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        """Give the lease back and tell the current protocol."""
        self._disarm()
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
        if self._connected:
            self._arm()

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


def http_protocol_factory(gate: ConnectionGate, header_timeout_s: float, render_error: ErrorRenderer,
                          inner_class: Any = None) -> Callable[..., asyncio.Protocol]:
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


# -- asyncio stream servers (Unix socket) ---------------------------------------------------------


StreamHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LeasedHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Lease | None"], Awaitable[None]]
Refuser = Callable[[asyncio.StreamReader, asyncio.StreamWriter, TooManyConnections], Awaitable[None]]


def stream_handler(gate: ConnectionGate, handler: LeasedHandler, refuse: Refuser) -> StreamHandler:
    """``handler`` for ``asyncio.start_server``/``start_unix_server`` under a lease of ``gate``.

    ``handler`` gets the connection's lease, to mark it idle while the peer has sent
    nothing (``Lease.set_idle``, with ``Lease.evict`` set). Past the limits ``refuse`` runs
    instead (it should answer in the protocol's own error format); the writer is closed
    after it either way.
    """

    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            lease = gate.open(peer_host(writer.get_extra_info("peername")))
        except TooManyConnections as exc:
            try:
                await refuse(reader, writer, exc)
            finally:
                writer.close()
            return
        try:
            await handler(reader, writer, lease)
        finally:
            lease.release()

    return guarded
