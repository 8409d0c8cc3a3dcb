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

What a kept token counts against the stream's memory bound is worked out from the lengths of
its strings (``token_size``), not by encoding it: a token is the one message sent per step,
and encoding each only to count it would cost as much again as sending it.

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
        return Entry(compact, run, len(text)), token_size(compact) + num_new_chars


# The most JSON each part of a token message takes beyond its strings' characters: the keys,
# quotes and punctuation, an integer of 20 characters, a float of 24 (msgspec's longest).
_TOKEN_FIXED = 114  # type, token, generated_text, finished, finish_reason, index
_TOKEN_ID = 32
_TIMING = 81
_REQUEST_ID = 16
_LOGPROBS = 14
_LOGPROB_ENTRY = 78


def token_size(msg: m.Token) -> int:
    """About the bytes of ``msg``'s JSON, from its strings' lengths in characters.

    Bound: at least the JSON's length when the strings are ASCII with nothing to escape, and
    at least a sixth of it whatever they hold (a character takes 1 to 6 bytes: UTF-8 up to 4,
    an escaped control character 6); each string's character count is exact.
    """
    size = _TOKEN_FIXED + len(msg.token) + len(msg.generated_text) + len(msg.finish_reason or "")
    if msg.token_id is not msgspec.UNSET:
        size += _TOKEN_ID
    if msg.timing is not msgspec.UNSET:
        size += _TIMING
    if msg.request_id is not msgspec.UNSET:
        size += _REQUEST_ID + len(msg.request_id)
    if msg.logprobs is not msgspec.UNSET:
        size += _LOGPROBS + sum(_LOGPROB_ENTRY + len(entry.token) for entry in msg.logprobs)
    return size


def message(entry: Entry) -> m.ServerMessage:
    """The message ``entry`` keeps, as it was sent."""
    if entry.run is None:
        return entry.message
    return msgspec.structs.replace(entry.message, generated_text=entry.run.value[: entry.end])
