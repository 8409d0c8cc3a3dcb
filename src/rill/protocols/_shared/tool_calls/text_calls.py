"""Calls written as plain JSON: a reply that is only a (fenced) JSON call object becomes a call.

Some tool models, Qwen2.5-Coder among them, answer a question that needs a tool with a reply
that is only the call object instead of their template's tags. ``TextCallParser``, wrapped
around any format's parser, makes such a reply one call when an injected check accepts its
name and arguments; anything else is the inner parser's output, unchanged. Imports only the
standard library.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rill.protocols._shared.tool_calls.deltas import (
    Delta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    call_id,
    merge_content,
)
from rill.protocols._shared.tool_calls.json_call import Nesting, unescape


class TextCallParser:
    """A reply whose whole text is one JSON call object becomes that call; else ``inner``'s output.

    The text is given to ``inner`` as it comes. While what came so far could still be such a
    reply (whitespace, an opening fence or a prefix of one, an unfinished object, a finished
    valid call followed only by whitespace or the closing fence), ``inner``'s deltas are held;
    the moment it cannot, they are all released and the rest passes straight through. A call
    is made only at ``finish``: until the generation ends, more text may follow the object.
    A call ``inner`` finds itself (its format's tags) ends the holding too: ``inner`` owns the
    reply then. ``calls`` is ``inner``'s list, to which the text call is added.
    """

    def __init__(
        self, inner: ToolCallParser, is_valid: Callable[[str, dict[str, Any]], bool], call_id_prefix: str
    ) -> None:
        self.inner = inner
        self.calls = inner.calls
        self._shape = _TextCallShape(is_valid)
        self._prefix = call_id_prefix
        self._held: list[Delta] | None = []  # None once the reply cannot be a text call

    @property
    def cut(self) -> ToolCall | None:
        """``inner``'s call cut by the end of the generation (a text call is whole or none)."""
        return self.inner.cut

    def feed(self, text: str) -> list[Delta]:
        """Take the next chunk of generated text; return what can be shown now."""
        out = self.inner.feed(text)
        if self._held is None:
            return out
        self._held += out
        self._shape.feed(text)
        if self._shape.is_broken or _has_call(out):
            return self._release()
        return []

    def finish(self) -> list[Delta]:
        """The generation ended: the text call, or everything still held back."""
        out = self.inner.finish()
        if self._held is None:
            return out
        call = self._shape.call()
        if call is None or _has_call(out) or self.calls:
            self._held += out
            return self._release()
        self._held = None  # what inner made of the text (content) is the call's text: dropped
        name, arguments = call
        index = len(self.calls)
        id_ = call_id(self._prefix, index)
        self.calls.append(ToolCall(id=id_, name=name, arguments=arguments))
        return [ToolCallDelta(index, arguments, id=id_, name=name)]

    def _release(self) -> list[Delta]:
        held, self._held = self._held or [], None
        return merge_content(held)


def _has_call(deltas: list[Delta]) -> bool:
    return any(isinstance(d, ToolCallDelta) for d in deltas)


_CALL_KEYS = ("name", "arguments", "parameters")


class _TextCallShape:
    """Follows a reply character by character: could it still be one (fenced) JSON call object?

    ``is_broken`` turns true as soon as it cannot (and stays so); ``call`` at the end gives the
    name and the arguments text of a reply that is one. States, in order: ``lead`` (whitespace),
    ``ticks`` (the opening fence's backticks), ``info`` (its language: none or ``json``),
    ``gap`` (whitespace before the object), ``object``, then ``after`` (bare: whitespace) or
    ``tail`` / ``closing`` / ``done`` (fenced: whitespace, the closing backticks, whitespace).
    """

    def __init__(self, is_valid: Callable[[str, dict[str, Any]], bool]) -> None:
        self.is_valid = is_valid
        self.is_broken = False
        self.state = "lead"
        self.is_fenced = False
        self.ticks = 0
        self.info = ""
        self.obj: list[str] = []
        self.nesting = Nesting()
        self.key_start: int | None = None  # where the object's first key starts (-1 once checked)
        self.found: tuple[str, str] | None = None

    def feed(self, text: str) -> None:
        """Take the next chunk of the reply."""
        for ch in text:
            if self.is_broken:
                return
            self.is_broken = not self._step(ch)

    def call(self) -> tuple[str, str] | None:
        """At the end of the reply: ``(name, arguments text)`` if it is one call, else None."""
        if self.is_broken:
            return None
        if self.state == "after" or self.state == "done" or (self.state == "closing" and self.ticks == 3):
            return self.found
        return None

    def _step(self, ch: str) -> bool:
        state = self.state
        if state == "object":
            return self._object_step(ch)
        if ch.isspace():
            if state == "ticks":
                if self.ticks != 3:
                    return False
                self.state = "gap"
            elif state == "info":
                if self.info.lower() != "json":
                    return False
                self.state = "gap"
            elif state == "closing":
                if self.ticks != 3:
                    return False
                self.state = "done"
            return True
        if ch == "`":
            if state == "lead":
                self.state, self.is_fenced, self.ticks = "ticks", True, 1
                return True
            if state == "tail":
                self.state, self.ticks = "closing", 1
                return True
            if state in ("ticks", "closing"):
                self.ticks += 1
                return self.ticks <= 3
            return False
        if ch == "{" and (
            state in ("lead", "gap")
            or (state == "ticks" and self.ticks == 3)
            or (state == "info" and self.info.lower() == "json")
        ):
            self.state = "object"
            return self._object_step(ch)
        if ch.isalpha() and (state == "info" or (state == "ticks" and self.ticks == 3)):
            self.state, self.info = "info", self.info + ch
            return "json".startswith(self.info.lower())
        return False

    def _object_step(self, ch: str) -> bool:
        self.obj.append(ch)
        nesting = self.nesting
        if (
            self.key_start is None
            and not nesting.in_string
            and nesting.depth == 1
            and not ch.isspace()
            and ch not in '"}'
        ):
            return False  # the first thing in the object is not a key
        event = nesting.step(ch)
        if event == "string-end" and self.key_start is not None and self.key_start >= 0:
            # A call object starts with one of its keys: anything else (a JSON answer) is
            # released now instead of being held until its end.
            key = "".join(self.obj[self.key_start :])
            self.key_start = -1
            return unescape(key[1:-1]) in _CALL_KEYS
        if event == "string-start" and self.key_start is None:
            self.key_start = len(self.obj) - 1
        elif event == "close" and nesting.depth == 0:
            self.found = _call_parts("".join(self.obj), self.is_valid)
            self.state = "tail" if self.is_fenced else "after"
            return self.found is not None
        return True


def _call_parts(text: str, is_valid: Callable[[str, dict[str, Any]], bool]) -> tuple[str, str] | None:
    """``(name, arguments text as written)`` of a JSON call object accepted by ``is_valid``, else None."""
    try:
        obj = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json's stack allows
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    spans = _member_spans(text)
    if len(spans) != 2 or set(spans) not in ({"name", "arguments"}, {"name", "parameters"}):
        return None  # duplicate or extra keys: not the shape a call is written in
    key = "arguments" if "arguments" in spans else "parameters"
    arguments = obj[key]
    if not isinstance(arguments, dict) or not is_valid(obj["name"], arguments):
        return None
    start, end = spans[key]
    return obj["name"], text[start:end]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity; clients would not


def _member_spans(text: str) -> dict[str, tuple[int, int]]:
    """Where each member's value starts and ends in a valid JSON object's text; empty when a
    key repeats (the object then holds fewer members than were written)."""
    decoder = json.JSONDecoder()
    spans: dict[str, tuple[int, int]] = {}
    num_members = 0
    i = _skip_space(text, 1)
    while text[i] != "}":
        key, i = decoder.raw_decode(text, i)
        i = _skip_space(text, _skip_space(text, i) + 1)  # past the ':'
        _, end = decoder.raw_decode(text, i)
        spans[key] = (i, end)
        num_members += 1
        i = _skip_space(text, end)
        if text[i] == ",":
            i = _skip_space(text, i + 1)
    return spans if num_members == len(spans) else {}


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\n\r":  # JSON's whitespace, not Unicode's
        i += 1
    return i
