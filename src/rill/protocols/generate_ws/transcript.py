"""A resumable generation's messages as its transcript keeps them (pure).

Every message a resumable generation sends (``init``, statuses, tokens, the completion or
error, and the replies to the client's messages meanwhile) is kept, in order, so a client that
lost its connection reads on from the last one it saw. Each carries its ``index``: its
position in the transcript.

A ``token`` message carries the whole ``generated_text`` so far, so keeping each as sent
would cost the square of the text's length. A kept token holds its own piece and where the
text ended instead; the text itself is held once per run (from one ``init`` to the next: a
``regenerate`` starts a new run), the newest text of the run, of which every earlier token's
text is a prefix. ``message`` rebuilds the token as it was sent.

Pure: msgspec and this package's messages and codec.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from rill.protocols.generate_ws import codec
from rill.protocols.generate_ws import messages as m


class _RunText:
    """The newest ``generated_text`` of one run (``init`` to ``init``)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = ""


@dataclass(frozen=True, slots=True)
class Entry:
    """One kept message: as sent, but a token's ``generated_text`` is ``run.value[:end]``."""

    message: m.ServerMessage
    run: _RunText | None = None
    end: int = 0


class Transcript:
    """Makes the entries of one generation's transcript, in order (one per generation)."""

    def __init__(self) -> None:
        self._run = _RunText()

    def entry(self, msg: m.ServerMessage, index: int) -> tuple[Entry, int]:
        """``msg`` as the entry at position ``index``, and the bytes it counts against the
        stream's bound (its JSON; a token's piece of the text instead of the whole)."""
        if isinstance(msg, m.Init):
            self._run = _RunText()
        if not isinstance(msg, m.Token):
            stamped = msgspec.structs.replace(msg, index=index)
            return Entry(stamped), len(codec.encode(stamped))
        run, text = self._run, msg.generated_text
        if len(text) < len(run.value):  # never within a run; a new run if it ever happens
            run = self._run = _RunText()
        num_new_chars = len(text) - len(run.value)
        run.value = text
        compact = msgspec.structs.replace(msg, generated_text="", index=index)
        return Entry(compact, run, len(text)), len(codec.encode(compact)) + num_new_chars


def message(entry: Entry) -> m.ServerMessage:
    """The message ``entry`` keeps, as it was sent."""
    if entry.run is None:
        return entry.message
    return msgspec.structs.replace(entry.message, generated_text=entry.run.value[: entry.end])
