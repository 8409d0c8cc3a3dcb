"""``Deps``: what the composition root (``rill.server``) hands to every protocol adapter.

It lives apart from ``rill.server`` so that adapters, ``rill.observability`` and the
middleware can name it without importing the server module above them
(``tests/test_import_boundaries.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from rill.config import SamplingDefaults, ServerConfig
from rill.connections import ConnectionGate
from rill.frontend.budget import MemoryBudget
from rill.frontend.client import EngineClient
from rill.frontend.metrics import Metrics
from rill.frontend.speech import SpeechSynth

Stopper = Callable[[], Awaitable[None]]
"""Stops something a protocol started (a listener, a worker thread)."""


@dataclass
class Deps:
    """What adapters receive: settings, the engine client and shared services."""

    config: ServerConfig
    client: EngineClient
    metrics: Metrics | None = None
    """The server's registry (``/metrics``); adapters count refusals with ``observe_rejection``."""
    api_keys: set[str] = field(default_factory=set)
    gate: ConnectionGate | None = None
    """Counts client connections for every listener (``rill.connections``)."""
    memory: MemoryBudget | None = None
    """The server-wide session-memory budget (``rill.frontend.budget``); None: unbounded."""
    sampling_defaults: SamplingDefaults | None = None
    """The batch ``/ws`` ``generation_config`` defaults; None: read from the environment and
    ``.env`` (``rill.config.sampling_defaults``) when its routes are made."""
    speech_synth: SpeechSynth | None = None
    """The ``/ws/chat`` speech synthesizer; None: espeak-ng (tests and embedders give their own)."""
    stoppers: list[Stopper] = field(default_factory=list)
    """What the server awaits, in order, when it stops, for services a protocol's routes started
    (``/ws/chat``'s speech worker)."""
