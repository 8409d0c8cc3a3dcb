"""The replicas each deployment's router can reach now, for the engine client of the same process.

Ray Serve builds the router from a pickled copy of its class, module globals included, so the
router publishes here, in a module it imports by name, rather than in its own globals.
"""

from __future__ import annotations

import threading

_lock = threading.Lock()
_live: dict[str, frozenset[str]] = {}


def publish(deployment: str, replicas: frozenset[str]) -> None:
    """Record the ids of ``deployment``'s replicas the router can route to now."""
    with _lock:
        _live[deployment] = replicas


def live_replicas(deployment: str) -> frozenset[str]:
    """The ids of ``deployment``'s replicas the router of this process can route to now."""
    with _lock:
        return _live.get(deployment, frozenset())
