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

Calls written as plain JSON (``accept_text_calls``): some tool models, Qwen2.5-Coder among
them, answer a question that needs a tool with a reply that is only the call object, fenced
(```` ```json ````, or ```` ``` ```` alone) or bare, instead of their template's tags. Wrapped
around any format's parser, ``TextCallParser`` makes such a reply one call when its whole text
(surrounding whitespace aside) is ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``)
and an injected check says the name is a declared tool and the arguments are valid for it.
Anything else is the inner parser's output, unchanged: text exactly as written, tagged calls
as the format reads them. While the text could still become such a call, it is held back.

Imports only the standard library.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

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


def accept_text_calls(inner: ToolCallParser, is_valid: Callable[[str, dict[str, Any]], bool],
                      call_id_prefix: str) -> ToolCallParser:
    """``inner``, also reading a reply that is only a JSON call object as a call (``TextCallParser``).

    ``is_valid(name, arguments)`` says whether ``name`` is a declared tool and ``arguments``
    (the parsed object) are valid for it; ``call_id_prefix`` is the one ``inner`` was made with.
    """
    return TextCallParser(inner, is_valid, call_id_prefix)


def call_id(prefix: str, index: int) -> str:
    """A stable, OpenAI-looking id (``call_`` + 24 hex digits) for call ``index`` of a choice."""
    return "call_" + hashlib.sha256(f"{prefix}/{index}".encode()).hexdigest()[:24]


# ----------------------------------------------------------------------------- one call object

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class _Nesting:
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
        self.nesting = _Nesting()
        self.is_done = False
        self.is_broken = False  # the text is not a JSON object
        self.name: str | None = None
        self.name_end: int | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.num_args_sent = 0
        self._scanned = 0
        self._value_scanned = 0
        self._value = _Nesting()  # the arguments value on its own

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
            deltas.append(ToolCallDelta(self.index, arguments[len(sent):]))
        return ToolCall(id=self.id, name=obj["name"], arguments=arguments), deltas


def _unescape(raw: str) -> str:
    try:
        return cast(str, json.loads(f'"{raw}"'))  # a JSON string literal
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
        self._is_after_call = False  # only whitespace since the last call (or its closing tag)

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
            if self._is_after_call and self.calls:
                # Whitespace between or after calls is layout, not an answer; only that
                # whitespace: a later chunk of text that starts with a space keeps it.
                pending = self._pending = pending.lstrip()
                self._is_after_call = not pending
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
                self._scanner, self._pending, self._state = None, rest, "content"
                return bool(rest)
            if not self._scanner.is_done:
                return False
            if not self._close(self._scanner, out):
                _add_content(out, self.OPEN + self._scanner.buf)
            self._scanner, self._pending, self._state = None, rest, "after"
            self._is_after_call = True
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

    def __init__(self, inner: ToolCallParser, is_valid: Callable[[str, dict[str, Any]], bool],
                 call_id_prefix: str) -> None:
        self.inner = inner
        self.calls = inner.calls
        self._shape = _TextCallShape(is_valid)
        self._prefix = call_id_prefix
        self._held: list[Delta] | None = []  # None once the reply cannot be a text call

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
        return _merge_content(held)


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
        self.nesting = _Nesting()
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
        if ch == "{" and (state in ("lead", "gap") or (state == "ticks" and self.ticks == 3)
                          or (state == "info" and self.info.lower() == "json")):
            self.state = "object"
            return self._object_step(ch)
        if ch.isalpha() and (state == "info" or (state == "ticks" and self.ticks == 3)):
            self.state, self.info = "info", self.info + ch
            return "json".startswith(self.info.lower())
        return False

    def _object_step(self, ch: str) -> bool:
        self.obj.append(ch)
        nesting = self.nesting
        if (self.key_start is None and not nesting.in_string and nesting.depth == 1 and not ch.isspace()
                and ch not in '"}'):
            return False  # the first thing in the object is not a key
        event = nesting.step(ch)
        if event == "string-end" and self.key_start is not None and self.key_start >= 0:
            # A call object starts with one of its keys: anything else (a JSON answer) is
            # released now instead of being held until its end.
            key = "".join(self.obj[self.key_start:])
            self.key_start = -1
            return _unescape(key[1:-1]) in _CALL_KEYS
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
