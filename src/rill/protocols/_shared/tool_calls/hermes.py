"""The ``hermes`` tool-call format: ``<tool_call>{json}</tool_call>`` blocks among ordinary text
(Hermes, Qwen2.5 and Qwen3 chat templates). Imports only the standard library.
"""

from __future__ import annotations

from rill.protocols._shared.tool_calls.deltas import Delta, add_content, merge_content
from rill.protocols._shared.tool_calls.json_call import ScannedCallParser


class HermesParser(ScannedCallParser):
    """``<tool_call>{json}</tool_call>`` blocks among ordinary text."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix)
        self._state = "content"
        self._is_after_call = False  # only whitespace since the last call (or its closing tag)

    def feed(self, text: str) -> list[Delta]:
        """Take the next chunk of generated text; return what can be shown now."""
        self._pending += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return merge_content(out)

    def _step(self, out: list[Delta]) -> bool:
        pending = self._pending
        if self._state == "content":
            if self._is_after_call and self.calls:
                # Whitespace between or after calls is layout, not an answer; only that
                # whitespace: a later chunk of text that starts with a space keeps it.
                pending = self._pending = pending.lstrip()
                self._is_after_call = not pending
            at = pending.find(self.OPEN)
            if at >= 0:
                if pending[:at].strip() or not self.calls:
                    add_content(out, pending[:at])
                self._pending = pending[at + len(self.OPEN) :]
                self._scanner = self._new_scanner()
                self._state = "call"
                return True
            keep = _held_prefix(pending, self.OPEN)
            add_content(out, pending[: len(pending) - keep])
            self._pending = pending[len(pending) - keep :]
            return False
        if self._state == "call":
            assert self._scanner is not None
            deltas, rest = self._scanner.feed(pending)
            out.extend(deltas)
            self._pending = ""
            if self._scanner.is_broken:
                add_content(out, self.OPEN + self._scanner.buf)
                self._scanner, self._pending, self._state = None, rest, "content"
                return bool(rest)
            if not self._scanner.is_done:
                return False
            if not self._close(self._scanner, out):
                # Not a call after all: the block and what follows are the answer, as written.
                add_content(out, self.OPEN + self._scanner.buf)
                self._scanner, self._pending, self._state = None, rest, "content"
                return bool(rest)
            self._scanner, self._pending, self._state = None, rest, "after"
            self._is_after_call = True
            return True
        # after a call: expect the closing tag (whitespace around it is layout)
        stripped = pending.lstrip()
        if stripped.startswith(self.CLOSE):
            self._pending, self._state = stripped[len(self.CLOSE) :], "content"
            return True
        if self.CLOSE.startswith(stripped):
            return False  # not enough text yet
        self._state = "content"  # no closing tag: carry on with what came
        return True

    def finish(self) -> list[Delta]:
        """The generation ended: return everything still held back."""
        out: list[Delta] = []
        if self._state == "call":
            self._keep_cut()
        if self._state == "call" and self._scanner is not None and not self._scanner.has_emitted:
            add_content(out, self.OPEN + self._scanner.buf)
        elif self._state == "content" and self._pending.strip():
            add_content(out, self._pending)
        self._pending, self._scanner = "", None
        return merge_content(out)


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
