"""One JSON call object (``{"name": ..., "arguments": {...}}``) followed as its text arrives.

``CallScanner`` tracks JSON nesting (``Nesting``) to find where the object ends without a
parser, and streams the call's name and arguments as soon as they can be shown;
``ScannedCallParser`` is the base of the formats' parsers (``hermes.py``,
``llama3_json.py``), which find where objects start. Imports only the standard library.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import cast

from rill.protocols._shared.tool_calls.deltas import Delta, ToolCall, ToolCallDelta, call_id

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class Nesting:
    """Where a JSON text stands after each character: inside a string (and just after a
    backslash in it), and how many objects and arrays deep."""

    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def step(self, ch: str) -> str:
        """Take one character; return ``"string-start"``, ``"string-end"``, ``"open"``,
        ``"close"`` or ``""`` (anything else, inside a string or not)."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                return "string-end"
            return ""
        if ch == '"':
            self.in_string = True
            return "string-start"
        if ch in "{[":
            self.depth += 1
            return "open"
        if ch in "}]":
            self.depth -= 1
            return "close"
        return ""


class CallScanner:
    """Follows the text of one JSON call object as it arrives.

    Tracks JSON nesting (strings and escapes included) so that it knows where the object
    ends without a parser, streams the name once ``{"name": "..."`` is complete and the
    arguments value as it grows (held back only: trailing whitespace at the top level). An
    object that puts the arguments before the name is still parsed, at its end.
    """

    def __init__(self, index: int, id_: str) -> None:
        self.index = index
        self.id = id_
        self.buf = ""
        self.nesting = Nesting()
        self.is_done = False
        self.is_broken = False  # the text is not a JSON object
        self.name: str | None = None
        self.name_end: int | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.num_args_sent = 0
        self._scanned = 0
        self._value_scanned = 0
        self._value = Nesting()  # the arguments value on its own

    @property
    def has_emitted(self) -> bool:
        """True once the name (and so the call) has been shown."""
        return self.name is not None

    def feed(self, text: str) -> tuple[list[Delta], str]:
        """Take text; return the deltas and the text after the object's end (if it ended) or
        after the character that showed it is not an object (``is_broken``)."""
        self.buf += text
        leftover = self._scan()
        deltas: list[Delta] = []
        if self.name is None and not self.is_broken:
            m = _NAME.match(self.buf)
            if m is not None:
                self.name = unescape(m.group(1))
                self.name_end = m.end()
                deltas.append(ToolCallDelta(self.index, "", id=self.id, name=self.name))
        if self.name_end is not None and self.args_start is None:
            m = _ARGS_KEY.match(self.buf, self.name_end)
            if m is not None and m.end() < len(self.buf):
                self.args_start = m.end()
        if self.args_start is not None:
            fragment = self._args_fragment()
            if fragment:
                deltas.append(ToolCallDelta(self.index, fragment))
        return deltas, leftover

    def _scan(self) -> str:
        buf = self.buf
        i = self._scanned
        nesting = self.nesting
        while i < len(buf):
            ch = buf[i]
            event = nesting.step(ch)
            if event == "close" and nesting.depth == 0:
                self.is_done = True
                self.buf, rest = buf[: i + 1], buf[i + 1 :]
                self._scanned = i + 1
                return rest
            if not event and not nesting.in_string and nesting.depth == 0 and not ch.isspace():
                self.is_broken = True  # not an object: nothing here is a call
            i += 1
            if nesting.depth == 0 and i > 0 and self.is_broken:
                # What follows is the caller's to read again (it may hold a call), as it
                # would be had it come in a later chunk.
                self.buf, rest = buf[:i], buf[i:]
                self._scanned = i
                return rest
        self._scanned = i
        return ""

    def _scan_value(self) -> None:
        # The arguments value on its own: it ends at a ',' or a closing bracket outside it.
        assert self.args_start is not None
        buf = self.buf
        i = max(self._value_scanned, self.args_start)
        value = self._value
        while i < len(buf) and self.args_end is None:
            ch = buf[i]
            if not value.in_string and value.depth == 0 and ch in ",}]":
                self.args_end = i
            else:
                value.step(ch)
            i += 1
        self._value_scanned = i

    def _args_fragment(self) -> str:
        assert self.args_start is not None
        self._scan_value()
        if self.args_end is not None:
            upto = len(self.buf[: self.args_end].rstrip())
        elif self._value.depth > 0 or self._value.in_string:
            upto = len(self.buf)
        else:
            upto = len(self.buf.rstrip())
        upto = max(upto, self.args_start)
        start = self.args_start + self.num_args_sent
        fragment = self.buf[start:upto]
        self.num_args_sent += len(fragment)
        return fragment

    def complete(self) -> tuple[ToolCall | None, list[Delta]]:
        """At the object's end: the call (None if it is not a valid call) and any last deltas."""
        try:
            obj = json.loads(self.buf)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json's stack allows
            return None, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, []
        deltas: list[Delta] = []
        if self.args_start is not None and self.args_end is not None:
            arguments = self.buf[self.args_start : self.args_end].rstrip()
        else:  # arguments before the name, or none: show the call whole, now
            value = obj.get("arguments", obj.get("parameters", {}))
            arguments = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            if self.name is None:
                deltas.append(ToolCallDelta(self.index, "", id=self.id, name=obj["name"]))
            sent = arguments[: self.num_args_sent]
            deltas.append(ToolCallDelta(self.index, arguments[len(sent) :]))
        return ToolCall(id=self.id, name=obj["name"], arguments=arguments), deltas


def unescape(raw: str) -> str:
    """The text of a JSON string's contents as written (``raw``, without its quotes); ``raw``
    itself when it is not valid JSON string text."""
    try:
        return cast(str, json.loads(f'"{raw}"'))  # a JSON string literal
    except ValueError:
        return raw


@dataclass
class ScannedCallParser:
    """What the formats' parsers share: the calls found so far and the scanner of the call
    being read; call ids are derived from ``prefix`` (``call_id``)."""

    prefix: str
    calls: list[ToolCall] = field(default_factory=list)
    cut: ToolCall | None = None
    _pending: str = ""
    _scanner: CallScanner | None = None
    _num_started: int = 0

    def _new_scanner(self) -> CallScanner:
        scanner = CallScanner(self._num_started, call_id(self.prefix, self._num_started))
        self._num_started += 1
        return scanner

    def _keep_cut(self) -> None:
        """At ``finish``: keep the call being read, if its name was shown, as ``cut``.

        A generation cut by ``max_tokens`` inside a forced call has streamed the name and
        part of the arguments; a response built at the end shows the same call, as OpenAI
        does with ``finish_reason`` ``length``."""
        scanner = self._scanner
        if scanner is None or scanner.name is None:
            return
        arguments = ""
        if scanner.args_start is not None:
            arguments = scanner.buf[scanner.args_start : scanner.args_start + scanner.num_args_sent]
        self.cut = ToolCall(id=scanner.id, name=scanner.name, arguments=arguments)

    def _close(self, scanner: CallScanner, out: list[Delta]) -> bool:
        call, deltas = scanner.complete()
        out.extend(deltas)
        if call is not None:
            self.calls.append(call)
            return True
        if not scanner.has_emitted:
            self._num_started -= 1  # its index was never shown: reuse it
        return False
