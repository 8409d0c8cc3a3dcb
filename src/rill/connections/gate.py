"""The one count of open client connections: in total, per client address, and fair shares.

``ConnectionGate.open`` gives a ``Lease`` or refuses (``TooManyConnections``); at the total
limit it may close an idle connection of an address over its fair share to let another
address in (``ConnectionGate.victim``, see ``rill.connections``). Pure bookkeeping: the
listeners' guards (``http_guard``, ``stream_guard``) take and release the leases.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from rill.auth import client_key
from rill.errors import TooManyConnections

if TYPE_CHECKING:
    from rill.connections.http_guard import GuardedProtocol

log = logging.getLogger("rill.connections")

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
            raise TooManyConnections(
                f"too many connections from {client} (at most {self.max_per_client}); close some or retry later"
            )
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
        candidates = [
            (count, group)
            for group, count in groups.items()
            if count > share and group != newcomer and self._idle.get(group)
        ]
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
            log.warning(
                "at the limit of %d connections: closing an idle connection of %s (holding %d, over its "
                "fair share) to let another address in; %d closed so far",
                self.max_total,
                lease.client,
                self.per_client.get(lease.client or "", 0),
                self.evicted,
            )
        evict = lease.evict
        lease.release()  # its place is free now, whenever the socket actually goes
        try:
            evict()
        except Exception:
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
            log.warning(
                "refusing connections: %d open (limit %d, %d per client); %d refused so far",
                self.total,
                self.max_total,
                self.max_per_client,
                self.refused,
            )

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
