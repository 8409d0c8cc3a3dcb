"""``rill.connections``: the one connection count every listener shares."""

from __future__ import annotations

import asyncio
import resource
from typing import Any

import pytest

from rill.connections import FD_RESERVE, ConnectionGate, GuardedProtocol, peer_host, raise_fd_limit
from rill.errors import TooManyConnections


def test_the_gate_bounds_each_client_and_the_total() -> None:
    gate = ConnectionGate(max_total=4, max_per_client=2)
    a1, a2 = gate.open("10.0.0.1"), gate.open("10.0.0.1")
    with pytest.raises(TooManyConnections, match="from 10.0.0.1"):
        gate.open("10.0.0.1")
    b1 = gate.open("10.0.0.2")
    unix = gate.open(None)  # no address: counted in the total only
    with pytest.raises(TooManyConnections, match="limit of 4 connections"):
        gate.open("10.0.0.3")
    assert (gate.total, gate.refused, gate.per_client) == (4, 2, {"10.0.0.1": 2, "10.0.0.2": 1})
    a1.release()
    a1.release()  # idempotent: a double release must not free a place twice
    assert gate.total == 3 and gate.per_client["10.0.0.1"] == 1
    for lease in (a2, b1, unix):
        lease.release()
    assert gate.total == 0 and gate.per_client == {}


def test_peer_host() -> None:
    assert peer_host(("127.0.0.1", 5000)) == "127.0.0.1"
    assert peer_host(("::1", 5000, 0, 0)) == "::/64"
    # One IPv6 host holds a /64: its addresses share one per-client count.
    assert peer_host(("2001:db8:1:2::a", 1)) == peer_host(("2001:db8:1:2:ffff::b", 1)) == "2001:db8:1:2::/64"
    assert peer_host(("2001:db8:1:3::a", 1)) == "2001:db8:1:3::/64"
    assert peer_host(("::ffff:10.0.0.1", 1, 0, 0)) == "10.0.0.1"  # dual-stack listener
    assert peer_host("") is None and peer_host(None) is None  # Unix sockets


class _Transport(asyncio.Transport):
    """A socket stand-in that records what is written to it."""

    def __init__(self, peername: tuple[str, int]) -> None:
        super().__init__()
        self.peername = peername
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.peername if name == "peername" else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_a_refused_http_connection_is_answered_in_the_format_the_server_passes() -> None:
    # rill.connections knows no protocol: the 503 is whatever render_error makes of the refusal.
    gate = ConnectionGate(max_total=1, max_per_client=1)
    gate.open("10.0.0.1")
    refusals: list[BaseException] = []

    def render(exc: BaseException) -> tuple[int, dict[str, str], bytes]:
        refusals.append(exc)
        return 503, {"Retry-After": "1"}, b'{"error":"full"}'

    transport = _Transport(("10.0.0.1", 5000))
    GuardedProtocol(asyncio.Protocol(), gate, 1.0, render).connection_made(transport)
    assert len(refusals) == 1 and isinstance(refusals[0], TooManyConnections)
    assert transport.written == (
        b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-type: application/json\r\n"
        b'content-length: 16\r\nconnection: close\r\n\r\n{"error":"full"}'
    )
    assert transport.closed and gate.total == 1


def test_raise_fd_limit_lifts_the_soft_limit_up_to_the_hard_one() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        low = min(soft, 512)
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        wanted = 1000
        raised = raise_fd_limit(wanted)
        expected = wanted + FD_RESERVE if hard == resource.RLIM_INFINITY else min(wanted + FD_RESERVE, hard)
        assert raised == expected == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _idle_lease(gate: ConnectionGate, client: str, closed: list) -> object:
    """A lease marked idle whose ``evict`` records that it was closed."""
    lease = gate.open(client)
    lease.evict = lambda: closed.append(lease)
    lease.set_idle(True)
    return lease


def test_the_default_share_of_one_address_is_an_eighth_of_the_total() -> None:
    from rill.config import ConnectionConfig

    assert ConnectionConfig().per_client_limit() == 256 == ConnectionConfig().max_connections // 8
    assert ConnectionConfig(max_connections=4).per_client_limit() == 1
    assert ConnectionConfig(max_connections_per_client=7).per_client_limit() == 7


def test_at_the_limit_a_newcomer_displaces_an_idle_connection_of_the_address_most_over_its_share() -> None:
    gate = ConnectionGate(max_total=8, max_per_client=5)
    closed: list = []
    a = [_idle_lease(gate, "10.0.0.1", closed) for _ in range(5)]
    b = [_idle_lease(gate, "10.0.0.2", closed) for _ in range(3)]
    assert gate.total == 8
    # A third address: fair share 8 // 3 = 2; 10.0.0.1 holds 5, the most over it: its
    # connection idle the longest is closed, and released before the newcomer is counted.
    assert gate.victim("10.0.0.3") is a[0]
    c1 = gate.open("10.0.0.3")
    assert closed == [a[0]] and gate.evicted == 1 and gate.refused == 0
    assert gate.total == 8 and gate.per_client == {"10.0.0.1": 4, "10.0.0.2": 3, "10.0.0.3": 1}
    c2 = gate.open("10.0.0.3")
    assert closed == [a[0], a[1]] and gate.per_client["10.0.0.1"] == 3
    # Now 10.0.0.1 and 10.0.0.2 hold 3 each (over the share of 2): the tie goes to either,
    # never to the newcomer itself, which now holds its share and displaces nobody.
    assert gate.victim("10.0.0.3") is None
    with pytest.raises(TooManyConnections, match="limit of 8"):
        gate.open("10.0.0.3")
    assert gate.refused == 1 and len(closed) == 2
    # Released leases are no longer candidates; a double release after eviction is harmless.
    a[0].release()
    assert gate.total == 8
    for lease in (*a[2:], *b, c1, c2):
        lease.release()
    assert gate.total == 0 and gate.per_client == {} and gate._idle == {}


def test_a_busy_connection_is_never_closed_to_make_room() -> None:
    gate = ConnectionGate(max_total=4, max_per_client=4)
    closed: list = []
    busy = [gate.open("10.0.0.1") for _ in range(3)]  # requests in flight: not idle
    for lease in busy:
        lease.evict = lambda: closed.append("busy")
    idle = _idle_lease(gate, "10.0.0.1", closed)
    idle.set_idle(False)  # its request started: busy again
    with pytest.raises(TooManyConnections):
        gate.open("10.0.0.2")
    assert closed == [] and gate.victim("10.0.0.2") is None
    idle.set_idle(True)  # the response ended: idle between requests
    newcomer = gate.open("10.0.0.2")
    assert closed == [idle] and gate.per_client == {"10.0.0.1": 3, "10.0.0.2": 1}
    # Without a way to close it (no evict), a lease marked idle is not a candidate either.
    busy[0].evict = None
    busy[0].set_idle(True)
    assert not busy[0].idle and gate.victim("10.0.0.3") is None
    for lease in (*busy, newcomer):
        lease.release()


def test_an_address_within_its_share_is_never_displaced_and_unix_peers_displace_nobody() -> None:
    gate = ConnectionGate(max_total=4, max_per_client=4)
    closed: list = []
    leases = [_idle_lease(gate, client, closed) for client in ("10.0.0.1", "10.0.0.1", "10.0.0.2", "10.0.0.2")]
    # Two addresses at 2 each; a third's share is 4 // 3 = 1: both hold 2 > 1, so one goes.
    assert gate.victim("10.0.0.3") in leases
    assert gate.victim(None) is None  # a Unix-socket peer has no share to claim
    with pytest.raises(TooManyConnections):
        gate.open(None)
    # An address already connected claims against the current addresses: 4 // 2 = 2 each,
    # nobody is over it.
    assert gate.victim("10.0.0.1") is None and closed == []
    for lease in leases:
        lease.release()


def test_peers_without_an_address_share_as_one_group() -> None:
    from rill.connections import UNADDRESSED

    gate = ConnectionGate(max_total=8, max_per_client=8)
    closed: list = []
    unix = []
    for _ in range(6):
        lease = gate.open(None)
        lease.evict = lambda lease=lease: closed.append(lease)
        lease.set_idle(True)
        unix.append(lease)
    a = [_idle_lease(gate, "10.0.0.1", closed) for _ in range(2)]
    # Groups: 10.0.0.1 holds 2, the Unix peers 6; a newcomer makes three: share 8 // 3 = 2.
    assert gate.fair_share("10.0.0.2") == 2 and gate.victim("10.0.0.2") is unix[0]
    gate.open("10.0.0.2")
    assert closed == [unix[0]] and gate.per_client == {"10.0.0.1": 2, "10.0.0.2": 1}
    assert gate._groups()[UNADDRESSED] == 5
    assert all(lease not in closed for lease in a)
