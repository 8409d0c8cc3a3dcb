"""Actions a ``/generate`` session asks its adapter to perform (plain data, no I/O).

Pure: imports the standard library, ``rill.types`` and this package's messages only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rill.protocols.generate_ws import messages as m
from rill.types import GenerateRequest

@dataclass(frozen=True)
class Send:
    """Send one message to the client."""

    message: m.ServerMessage


@dataclass(frozen=True)
class Start:
    """Wait for the model, admit (rate limits) and submit ``request``; then call
    ``on_started`` or ``on_error``."""

    request: GenerateRequest


@dataclass(frozen=True)
class Abort:
    """Stop the current generation (or cancel its start)."""


@dataclass(frozen=True)
class Pause:
    """Pause the current generation in the engine."""


@dataclass(frozen=True)
class Resume:
    """Resume the current generation in the engine."""


@dataclass(frozen=True)
class Modify:
    """Apply a validated sampling patch to the current generation."""

    patch: dict[str, Any]


@dataclass(frozen=True)
class Regenerate:
    """Restart the current generation from its prompt."""


@dataclass(frozen=True)
class StoreFeedback:
    """Store a feedback record durably, then call ``on_feedback_stored``."""

    record: dict[str, Any]


@dataclass(frozen=True)
class Close:
    """Close the connection (after a fatal error)."""

    code: int = 1011
    reason: str = ""


Action = Send | Start | Abort | Pause | Resume | Modify | Regenerate | StoreFeedback | Close
