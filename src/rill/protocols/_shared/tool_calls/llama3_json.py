"""The ``llama3_json`` tool-call format: the whole output is ``{"name": ..., "parameters": {...}}``
objects joined by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1/3.2/3.3 chat
templates); an output that does not start that way is ordinary text. Imports only the
standard library.
"""

from __future__ import annotations

from rill.protocols._shared.tool_calls.deltas import Delta, add_content, merge_content
from rill.protocols._shared.tool_calls.json_call import ScannedCallParser


class Llama3JsonParser(ScannedCallParser):
    """Calls as the whole output: ``{"name": ..., "parameters": {...}}`` objects joined by ``;``."""

    TAG = "<|python_tag|>"

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix)
        self._state = "start"

    def feed(self, text: str) -> list[Delta]:
        """Take the next chunk of generated text; return what can be shown now."""
        self._pending += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return merge_content(out)

    def _step(self, out: list[Delta]) -> bool:
        if self._state == "content":
            add_content(out, self._pending)
            self._pending = ""
            return False
        if self._state in ("start", "between"):
            stripped = self._pending.lstrip()
            if self._state == "start" and stripped.startswith(self.TAG):
                self._pending = stripped[len(self.TAG) :]
                return True
            if self._state == "between" and stripped.startswith(";"):
                stripped = stripped[1:].lstrip()
            if stripped.startswith("{"):
                self._pending, self._scanner, self._state = stripped, self._new_scanner(), "call"
                return True
            if not stripped or (self._state == "start" and self.TAG.startswith(stripped)) or stripped == ";":
                return False  # too early to tell
            if self._state == "start":
                self._state = "content"
            else:
                self._pending, self._state = stripped, "content"
            return True
        assert self._scanner is not None
        deltas, rest = self._scanner.feed(self._pending)
        out.extend(deltas)
        self._pending = ""
        if self._scanner.is_broken or (self._scanner.is_done and not self._close(self._scanner, out)):
            if not self._scanner.has_emitted:
                add_content(out, self._scanner.buf)
            self._pending, self._scanner, self._state = rest, None, "content"
            return bool(rest)
        if not self._scanner.is_done:
            return False
        self._scanner, self._pending, self._state = None, rest, "between"
        return True

    def finish(self) -> list[Delta]:
        """The generation ended: return everything still held back."""
        out: list[Delta] = []
        if self._state == "call":
            self._keep_cut()
        if self._state == "call" and self._scanner is not None and not self._scanner.has_emitted:
            add_content(out, self._scanner.buf)
        elif self._state == "start" or (self._state == "between" and self._pending.strip()):
            add_content(out, self._pending)
        self._pending, self._scanner = "", None
        return merge_content(out)
