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

__all__ = ["Abort", "Action", "Close", "Modify", "Pause", "Regenerate", "Resume", "Send", "Start", "StoreFeedback"]


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


Action = Send[m.ServerMessage] | Start | Abort | Pause | Resume | Modify | Regenerate | StoreFeedback | Close
"""``Start``: wait for the model, then submit (``on_started`` or ``on_start_failed`` follows);
``Abort`` stops the current generation or cancels its start; ``Close`` follows a fatal error."""
