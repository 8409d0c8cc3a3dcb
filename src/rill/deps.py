"""``Deps``: what the composition root (``rill.server``) hands to every protocol adapter.

It lives apart from ``rill.server`` so that adapters, ``rill.observability`` and the
middleware can name it without importing the server module above them
(``tests/test_import_boundaries.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rill.config import ServerConfig
from rill.connections import ConnectionGate
from rill.frontend.budget import MemoryBudget
from rill.frontend.client import EngineClient
from rill.frontend.metrics import Metrics


@dataclass
class Deps:
    """What adapters receive: settings, the engine client and shared services."""

    config: ServerConfig
    client: EngineClient
    metrics: Metrics | None = None
    api_keys: set[str] = field(default_factory=set)
    extras: dict[str, Any] = field(default_factory=dict)
    gate: ConnectionGate | None = None
    """Counts client connections for every listener (``rill.connections``)."""
    memory: MemoryBudget | None = None
    """The server-wide session-memory budget (``rill.frontend.budget``); None: unbounded."""
