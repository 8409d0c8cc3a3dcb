"""Bounded JSON decoding shared by every protocol's codec (pure).

msgspec parses any nesting depth until the interpreter's recursion limit, then raises
``RecursionError``; it raises ``UnicodeDecodeError`` for bytes that are not UTF-8 inside a
string and ``UnicodeEncodeError`` for a ``str`` holding a lone surrogate. None of these are a
``msgspec.DecodeError``, so each codec would have to remember them. ``decode`` turns all of
them into ``UnsafeJson`` (a ``msgspec.DecodeError``), and refuses nesting deeper than
``MAX_DEPTH`` before parsing, so a decoded value can always be walked, re-encoded or handed
to a template without hitting the recursion limit later.

After ``decode`` the only exceptions are ``msgspec.DecodeError`` and its subclasses
(``msgspec.ValidationError`` for a schema mismatch, ``UnsafeJson``), whatever the input.

Imports msgspec, numpy and the standard library only: no I/O.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec
import numpy as np

T = TypeVar("T")

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects accepted (a chat request with tool schemas needs < 20)."""

_QUOTE = ord('"')
_STEPS = np.zeros(256, dtype=np.int8)
_STEPS[list(b"[{")] = 1
_STEPS[list(b"]}")] = -1
_CHUNK_BYTES = 1 << 20  # bounds the scan's working memory (a few int32 arrays of this length)


class UnsafeJson(msgspec.DecodeError):
    """The text nests deeper than the limit, or is not valid UTF-8 / holds a lone surrogate."""


def nesting_depth(data: str | bytes, stop_above: int | None = None) -> int:
    """The deepest nesting of arrays and objects in JSON text ``data`` (brackets in strings do not count).

    A vectorised running sum over 1 MiB chunks: strings are told apart by the parity of the
    quotes before each bracket, once escaped backslashes and escaped quotes are removed.
    Invalid JSON (an unterminated string) gives some depth; the parser refuses it anyway.

    Args:
        data: the text.
        stop_above: stop scanning (and return the depth so far) once it passes this value.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    depth = deepest = num_quotes = 0
    for start in range(0, len(raw), _CHUNK_BYTES):
        chunk = np.frombuffer(raw, dtype=np.uint8, count=min(_CHUNK_BYTES, len(raw) - start), offset=start)
        quotes = np.cumsum(chunk == _QUOTE, dtype=np.int32) + num_quotes
        steps = np.where(quotes & 1, 0, _STEPS[chunk])  # a bracket after an odd number of quotes is text
        running = np.cumsum(steps, dtype=np.int32) + depth
        deepest = max(deepest, int(running.max()))
        depth, num_quotes = int(running[-1]), int(quotes[-1])
        if stop_above is not None and deepest > stop_above:
            break
    return deepest


def is_too_deep(data: str | bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether JSON text ``data`` nests arrays and objects deeper than ``limit``.

    Cheap for ordinary input: text with at most ``limit`` opening brackets in all cannot
    nest deeper, and only two ``count`` calls run; otherwise ``nesting_depth`` scans it.
    """
    if isinstance(data, str):
        num_openers = data.count("[") + data.count("{")
    else:
        num_openers = data.count(b"[") + data.count(b"{")
    return num_openers > limit and nesting_depth(data, stop_above=limit) > limit


def check_depth(data: str | bytes, limit: int = MAX_DEPTH) -> None:
    """Raise ``UnsafeJson`` when ``data`` nests arrays/objects deeper than ``limit``."""
    if is_too_deep(data, limit):
        raise UnsafeJson(f"JSON nests arrays and objects deeper than {limit} levels")


def decode(decoder: msgspec.json.Decoder[T], data: str | bytes, limit: int = MAX_DEPTH) -> T:
    """``decoder.decode(data)`` that raises only ``msgspec.DecodeError`` (or a subclass).

    Raises:
        UnsafeJson: nesting deeper than ``limit``, bytes that are not UTF-8, a lone surrogate.
        msgspec.ValidationError: valid JSON that does not match the decoder's type.
        msgspec.DecodeError: any other malformed JSON.
    """
    check_depth(data, limit)
    try:
        return decoder.decode(data)
    except UnicodeError as exc:
        where = f" at byte {exc.start}" if isinstance(exc, UnicodeDecodeError) else ""
        raise UnsafeJson(f"JSON text is not valid UTF-8{where}") from exc
    except RecursionError as exc:  # a deep stack at the call site; the scan above bounds the input
        raise UnsafeJson("JSON nests too deeply") from exc
