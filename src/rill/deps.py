"""``Deps``: what the composition root (``rill.server``) hands to every protocol adapter.

It lives apart from ``rill.server`` so that adapters, ``rill.observability`` and the
middleware can name it without importing the server module above them
(``tests/test_import_boundaries.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rill.config import SamplingDefaults, ServerConfig, parse_size
from rill.connections import ConnectionGate
from rill.frontend.asr import AsrService
from rill.frontend.budget import MemoryBudget
from rill.frontend.client import EngineClient
from rill.frontend.embeddings import EmbeddingService
from rill.frontend.metrics import Metrics
from rill.frontend.ocr import OcrService
from rill.frontend.resumable import StreamRegistry
from rill.frontend.speech import SpeechService, SpeechSynth

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
    embeddings: EmbeddingService | None = None
    """The embedding model beside the chat model (``--embedding-model``); None: not served."""
    speech_synth: SpeechSynth | None = None
    """The ``/ws/chat`` speech synthesizer; None: espeak-ng (the server gives the one ``--tts``
    names; tests and embedders give their own)."""
    asr: AsrService | None = None
    """The server's speech recognition, shared by every protocol; None: audio input is refused
    (the server makes it from ``--asr``; tests give their own)."""
    ocr: OcrService | None = None
    """The server's OCR of image input, shared by every protocol; None: images go to the model
    as images, refused when it cannot see (the server makes it from ``--ocr``)."""
    speech: SpeechService | None = None
    """The process's one speech worker, shared by ``/ws/chat`` and ``/v1/audio/speech``:
    espeak-ng and Piper's phonemizer keep global state, so every synthesis runs on its one
    thread (``speech_service()`` makes it from ``speech_synth`` on first use)."""
    stoppers: list[Stopper] = field(default_factory=list)
    """What the server awaits, in order, when it stops, for services a protocol's routes started
    (``/ws/chat``'s speech worker)."""
    streams: StreamRegistry[Any] | None = None
    """The resumable streams of every protocol (``rill.frontend.resumable``); made from
    ``config.resume`` when None."""

    def __post_init__(self) -> None:
        if self.streams is None:
            r = self.config.resume
            self.streams = StreamRegistry(
                grace_s=r.resume_grace_s,
                max_streams=r.resume_max_streams,
                max_stream_bytes=parse_size(r.resume_max_stream_bytes, "resume_max_stream_bytes"),
                max_streams_per_client=r.resume_max_streams_per_principal,
            )

    def speech_service(self) -> SpeechService:
        """``speech``, made on first use (its worker thread is the stopping protocol's to end)."""
        if self.speech is None:
            self.speech = SpeechService(self.speech_synth)
        return self.speech

    @property
    def resumable(self) -> StreamRegistry[Any]:
        """``streams``, typed as set (``__post_init__`` fills it)."""
        assert self.streams is not None
        return self.streams
