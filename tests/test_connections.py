"""``rill.connections``: the one connection count every listener shares."""

from __future__ import annotations

import resource

import pytest

from rill.connections import FD_RESERVE, ConnectionGate, peer_host, raise_fd_limit
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
