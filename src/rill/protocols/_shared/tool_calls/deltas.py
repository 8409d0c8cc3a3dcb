"""What a tool-call parser returns (``ContentDelta``, ``ToolCallDelta``), the complete calls it
collects (``ToolCall``), what every parser does (``ToolCallParser``) and how calls are named
(``call_id``). Imports only the standard library.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ContentDelta:
    """Ordinary text of the answer."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call ``index``: the first one carries ``id`` and ``name``, later ones only
    ``arguments`` fragments (the first one's ``arguments`` may be empty)."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


Delta = ContentDelta | ToolCallDelta


@dataclass
class ToolCall:
    """One complete call: ``arguments`` is a JSON text."""

    id: str
    name: str
    arguments: str


class ToolCallParser(Protocol):
    """What every format's parser does."""

    calls: list[ToolCall]

    @property
    def cut(self) -> ToolCall | None:
        """After ``finish``: the call the generation ended inside (its name shown, its arguments
        as far as they were shown), None when it ended outside a call. Never in ``calls``."""
        ...

    def feed(self, text: str) -> list[Delta]:
        """Take the next chunk of generated text; return what can be shown now."""
        ...

    def finish(self) -> list[Delta]:
        """The generation ended: return everything still held back."""
        ...


def call_id(prefix: str, index: int) -> str:
    """A stable, OpenAI-looking id (``call_`` + 24 hex digits) for call ``index`` of a choice."""
    return "call_" + hashlib.sha256(f"{prefix}/{index}".encode()).hexdigest()[:24]


def add_content(out: list[Delta], text: str) -> None:
    """Append ``text`` to ``out`` as content, unless it is empty."""
    if text:
        out.append(ContentDelta(text))


def merge_content(deltas: list[Delta]) -> list[Delta]:
    """``deltas`` with each run of consecutive content deltas joined into one."""
    merged: list[Delta] = []
    for d in deltas:
        if isinstance(d, ContentDelta) and merged and isinstance(merged[-1], ContentDelta):
            merged[-1] = ContentDelta(merged[-1].text + d.text)
        else:
            merged.append(d)
    return merged
