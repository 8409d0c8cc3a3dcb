"""What the router and the engine client of one process tell each other: the replicas the
router can reach now (for ``/health``), and the generations running on each (for balancing).

Ray Serve builds the router from a pickled copy of its class, module globals included, so both
sides meet here, in a module the router imports by name, rather than in its globals.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_live: dict[str, frozenset[str]] = {}
_in_flight: dict[str, dict[str, int]] = {}


def publish(deployment: str, replicas: frozenset[str]) -> None:
    """Record the ids of ``deployment``'s replicas the router can route to now."""
    with _lock:
        _live[deployment] = replicas
        counts = _in_flight.get(deployment, {})
        for gone in set(counts) - replicas:
            del counts[gone]


def live_replicas(deployment: str) -> frozenset[str]:
    """The ids of ``deployment``'s replicas the router of this process can route to now."""
    with _lock:
        return _live.get(deployment, frozenset())


def count(deployment: str, replica: str, delta: int) -> None:
    """Add ``delta`` to the generations running on ``replica`` (the engine client counts each
    from its start to its end; the router balances on it)."""
    with _lock:
        counts = _in_flight.setdefault(deployment, {})
        value = counts.get(replica, 0) + delta
        if value > 0:
            counts[replica] = value
        else:
            counts.pop(replica, None)


def in_flight(deployment: str) -> dict[str, int]:
    """The generations running on each of ``deployment``'s replicas, as the engine client of this
    process counts them."""
    with _lock:
        return dict(_in_flight.get(deployment, {}))
