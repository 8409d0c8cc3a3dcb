"""Actions a ``/generate`` session asks its adapter to perform (plain data, no I/O).

``Send``, ``Start``, ``Abort`` and ``Close`` are every protocol's (``protocols/_shared/actions``);
the controls only this wire has are defined here.

Pure: imports the standard library, ``rill.types``, ``protocols/_shared`` and this package's messages only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rill.protocols._shared.actions import Abort, Close, Send, Start
from rill.protocols.generate_ws import messages as m

__all__ = [
    "Abort",
    "Action",
    "Attach",
    "Close",
    "Modify",
    "Pause",
    "Record",
    "Regenerate",
    "Resume",
    "Send",
    "Start",
    "StopRecording",
    "StoreFeedback",
]


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
class Record:
    """Open the resumable transcript of generation ``request_id``, then call
    ``on_record_opened`` (or ``on_start_failed`` when the server keeps too many): every message
    sent from then on, until ``StopRecording``, goes into it, and the connection follows it."""

    request_id: str


@dataclass(frozen=True)
class StopRecording:
    """The recorded generation has sent its last message: close its transcript (it stays
    readable for the grace period) and send the next messages straight to the client."""


@dataclass(frozen=True)
class Attach:
    """Re-attach this connection to the resumable generation ``request_id``: send what it
    sent after ``last_index``, then follow it; a generation still running is steered from this
    connection from now on. A failure is answered with ``on_resume_failed``."""

    request_id: str
    last_index: int


Action = (
    Send[m.ServerMessage]
    | Start
    | Abort
    | Pause
    | Resume
    | Modify
    | Regenerate
    | StoreFeedback
    | Close
    | Record
    | StopRecording
    | Attach
)
"""``Start``: wait for the model, then submit (``on_started`` or ``on_start_failed`` follows);
``Abort`` stops the current generation or cancels its start; ``Close`` follows a fatal error."""
