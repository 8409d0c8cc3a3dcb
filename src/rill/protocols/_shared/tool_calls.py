"""Incremental parsing of a model's tool-call text into calls (pure, sans-I/O).

A model asked to call a function writes the call as text in a model-specific format. A
parser is fed that text chunk by chunk, as it is generated, and returns what can be shown
so far: ``ContentDelta`` (text meant for the user) and ``ToolCallDelta`` (a call's name once,
then its JSON arguments in fragments). Concatenating every fragment of a call gives its
arguments exactly as the model wrote them (a JSON text); chunk boundaries never change the
result. ``finish`` flushes what was held back when the generation ends.

Formats (``FORMATS``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, possibly
  several, between ordinary text (Hermes, Qwen2.5, Qwen3 templates).
- ``llama3_json``: the whole output is one or more ``{"name": ..., "parameters": {...}}``
  objects separated by ``;``, optionally after ``<|python_tag|>`` (Llama 3.1/3.2/3.3 templates);
  an output that does not start that way is ordinary text.

``rill.models.chat_template.tool_call_format`` picks one from a chat template's source. ``call_grammar`` builds the Lark
grammar that forces an output to be valid calls of the offered functions, in the same format
(used for ``tool_choice: required`` and named functions).

Imports only the standard library.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

FORMATS = ("hermes", "llama3_json")
"""The tool-call formats a parser exists for."""


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

    def feed(self, text: str) -> list[Delta]:
        """Take the next chunk of generated text; return what can be shown now."""
        ...

    def finish(self) -> list[Delta]:
        """The generation ended: return everything still held back."""
        ...


def make_parser(fmt: str, call_id_prefix: str) -> ToolCallParser:
    """A fresh parser for ``fmt``; call ids are derived from ``call_id_prefix`` (unique per choice)."""
    if fmt == "hermes":
        return HermesParser(call_id_prefix)
    if fmt == "llama3_json":
        return Llama3JsonParser(call_id_prefix)
    raise ValueError(f"unknown tool-call format {fmt!r}; use one of {', '.join(FORMATS)}")


def call_id(prefix: str, index: int) -> str:
    """A stable, OpenAI-looking id (``call_`` + 24 hex digits) for call ``index`` of a choice."""
    return "call_" + hashlib.sha256(f"{prefix}/{index}".encode()).hexdigest()[:24]


# ----------------------------------------------------------------------------- one call object

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class _CallScanner:
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
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.is_done = False
        self.is_broken = False  # the text is not a JSON object
        self.name: str | None = None
        self.name_end: int | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.num_args_sent = 0
        self._scanned = 0
        self._value_scanned = 0
        self._value_depth = 0
        self._value_in_string = False
        self._value_escaped = False

    @property
    def has_emitted(self) -> bool:
        """True once the name (and so the call) has been shown."""
        return self.name is not None

    def feed(self, text: str) -> tuple[list[Delta], str]:
        """Take text; return the deltas and the text after the object's end (if it ended)."""
        self.buf += text
        leftover = self._scan()
        deltas: list[Delta] = []
        if self.name is None and not self.is_broken:
            m = _NAME.match(self.buf)
            if m is not None:
                self.name = _unescape(m.group(1))
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
        while i < len(buf):
            ch = buf[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.is_done = True
                    self.buf, rest = buf[: i + 1], buf[i + 1 :]
                    self._scanned = i + 1
                    return rest
            elif self.depth == 0 and not ch.isspace():
                self.is_broken = True  # not an object: nothing here is a call
            i += 1
            if self.depth == 0 and i > 0 and self.is_broken:
                break
        self._scanned = i
        return ""

    def _scan_value(self) -> None:
        # The arguments value on its own: it ends at a ',' or a closing bracket outside it.
        assert self.args_start is not None
        buf = self.buf
        i = max(self._value_scanned, self.args_start)
        while i < len(buf) and self.args_end is None:
            ch = buf[i]
            if self._value_in_string:
                if self._value_escaped:
                    self._value_escaped = False
                elif ch == "\\":
                    self._value_escaped = True
                elif ch == '"':
                    self._value_in_string = False
            elif ch == '"':
                self._value_in_string = True
            elif ch in "{[":
                self._value_depth += 1
            elif ch in "}]" and self._value_depth > 0:
                self._value_depth -= 1
            elif ch in ",}]" and self._value_depth == 0:
                self.args_end = i
            i += 1
        self._value_scanned = i

    def _args_fragment(self) -> str:
        assert self.args_start is not None
        self._scan_value()
        if self.args_end is not None:
            upto = len(self.buf[: self.args_end].rstrip())
        elif self._value_depth > 0 or self._value_in_string:
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
        except ValueError:
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
            deltas.append(ToolCallDelta(self.index, arguments[len(sent):]))
        return ToolCall(id=self.id, name=obj["name"], arguments=arguments), deltas


def _unescape(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


# ----------------------------------------------------------------------------- formats


@dataclass
class _Base:
    prefix: str
    calls: list[ToolCall] = field(default_factory=list)
    _pending: str = ""
    _scanner: _CallScanner | None = None
    _num_started: int = 0

    def _new_scanner(self) -> _CallScanner:
        scanner = _CallScanner(self._num_started, call_id(self.prefix, self._num_started))
        self._num_started += 1
        return scanner

    def _close(self, scanner: _CallScanner, out: list[Delta]) -> bool:
        call, deltas = scanner.complete()
        out.extend(deltas)
        if call is not None:
            self.calls.append(call)
            return True
        if not scanner.has_emitted:
            self._num_started -= 1  # its index was never shown: reuse it
        return False


class HermesParser(_Base):
    """``<tool_call>{json}</tool_call>`` blocks among ordinary text."""

    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, prefix: str) -> None:
        super().__init__(prefix)
        self._state = "content"

    def feed(self, text: str) -> list[Delta]:
        """Take the next chunk of generated text; return what can be shown now."""
        self._pending += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return _merge_content(out)

    def _step(self, out: list[Delta]) -> bool:
        pending = self._pending
        if self._state == "content":
            if self.calls:  # whitespace between or after calls is layout, not an answer
                pending = self._pending = pending.lstrip()
            at = pending.find(self.OPEN)
            if at >= 0:
                if pending[:at].strip() or not self.calls:
                    _add_content(out, pending[:at])
                self._pending = pending[at + len(self.OPEN):]
                self._scanner = self._new_scanner()
                self._state = "call"
                return True
            keep = _held_prefix(pending, self.OPEN)
            _add_content(out, pending[: len(pending) - keep])
            self._pending = pending[len(pending) - keep:]
            return False
        if self._state == "call":
            assert self._scanner is not None
            deltas, rest = self._scanner.feed(pending)
            out.extend(deltas)
            self._pending = ""
            if self._scanner.is_broken:
                _add_content(out, self.OPEN + self._scanner.buf)
                self._scanner, self._state = None, "content"
                return bool(rest)
            if not self._scanner.is_done:
                return False
            if not self._close(self._scanner, out):
                _add_content(out, self.OPEN + self._scanner.buf)
            self._scanner, self._pending, self._state = None, rest, "after"
            return True
        # after a call: expect the closing tag (whitespace around it is layout)
        stripped = pending.lstrip()
        if stripped.startswith(self.CLOSE):
            self._pending, self._state = stripped[len(self.CLOSE):], "content"
            return True
        if self.CLOSE.startswith(stripped):
            return False  # not enough text yet
        self._state = "content"  # no closing tag: carry on with what came
        return True

    def finish(self) -> list[Delta]:
        """The generation ended: return everything still held back."""
        out: list[Delta] = []
        if self._state == "call" and self._scanner is not None and not self._scanner.has_emitted:
            _add_content(out, self.OPEN + self._scanner.buf)
        elif self._state == "content" and self._pending.strip():
            _add_content(out, self._pending)
        self._pending, self._scanner = "", None
        return _merge_content(out)


class Llama3JsonParser(_Base):
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
        return _merge_content(out)

    def _step(self, out: list[Delta]) -> bool:
        if self._state == "content":
            _add_content(out, self._pending)
            self._pending = ""
            return False
        if self._state in ("start", "between"):
            stripped = self._pending.lstrip()
            if self._state == "start" and stripped.startswith(self.TAG):
                self._pending = stripped[len(self.TAG):]
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
                _add_content(out, self._scanner.buf)
            self._pending, self._scanner, self._state = rest, None, "content"
            return bool(rest)
        if not self._scanner.is_done:
            return False
        self._scanner, self._pending, self._state = None, rest, "between"
        return True

    def finish(self) -> list[Delta]:
        """The generation ended: return everything still held back."""
        out: list[Delta] = []
        if self._state == "call" and self._scanner is not None and not self._scanner.has_emitted:
            _add_content(out, self._scanner.buf)
        elif self._state == "start" or (self._state == "between" and self._pending.strip()):
            _add_content(out, self._pending)
        self._pending, self._scanner = "", None
        return _merge_content(out)


def _add_content(out: list[Delta], text: str) -> None:
    if text:
        out.append(ContentDelta(text))


def _merge_content(deltas: list[Delta]) -> list[Delta]:
    merged: list[Delta] = []
    for d in deltas:
        if isinstance(d, ContentDelta) and merged and isinstance(merged[-1], ContentDelta):
            merged[-1] = ContentDelta(merged[-1].text + d.text)
        else:
            merged.append(d)
    return merged


# ----------------------------------------------------------------------------- forcing a call


def call_grammar(fmt: str, tools: list[dict[str, Any]], name: str | None = None) -> str:
    """A Lark grammar (llguidance dialect) whose sentences are valid calls in format ``fmt``.

    ``name`` restricts it to one function (a named ``tool_choice``), else any of ``tools``
    (``tool_choice: required``). The output is one call whose arguments follow the function's
    ``parameters`` schema (any object when it has none), written as compact JSON: free
    whitespace would let a model pad the call without end.
    """
    functions = [t["function"] for t in tools if t.get("type", "function") == "function" and "function" in t]
    if name is not None:
        functions = [f for f in functions if f.get("name") == name]
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    options = []
    for fn in functions:
        params = fn.get("parameters") or {"type": "object"}
        options.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    schema["x-guidance"] = {"whitespace_flexible": False}
    body = "%json " + json.dumps(schema)
    if fmt == "llama3_json":
        return f"start: {body}\n"
    return f'start: "<tool_call>\\n" obj "\\n</tool_call>"\nobj: {body}\n'
