"""Incremental detokenization and stop-string matching (pure; no I/O, no threads).

``IncrementalDetokenizer`` turns generated token ids into text one token at a time.
``StopStringMatcher`` cuts that text at the first stop string. Chained per request::

    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    stops = StopStringMatcher(params.stop)
    for token_id in generated:
        text, matched = stops.feed(detok.push(token_id))
        emit(text)
        if matched is not None:
            break                      # finish_reason "stop", stop_reason = matched
    else:
        emit(stops.feed(detok.flush())[0] + stops.flush())

Imports only the standard library; the tokenizer is duck-typed (``rill.models.tokenizer.
Tokenizer`` or anything with ``decode(ids, skip_special_tokens)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from rill.models.tokenizer import Tokenizer  # noqa: F401 - the usual implementation

REPLACEMENT_CHAR = "\ufffd"

# Prompt tokens decoded ahead of the first generated token, so that its leading space
# (SentencePiece "▁", byte-level "Ġ") is kept as it is in the full text (vLLM uses 5 too).
PROMPT_CONTEXT_TOKENS = 5

# Tokens the decode window may hold before it is forced to slide. A UTF-8 character spans
# at most 4 byte tokens, so only invalid byte runs or long runs of tokens that decode to
# nothing get here; the cap keeps the cost per token bounded even then.
MAX_WINDOW_TOKENS = 32


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Decode a growing token sequence into text deltas, never splitting a character.

    Keeps a small window of token ids: the context (the tokens that produced the previous
    delta, which preserve the next token's leading space and keep byte runs whole) followed
    by the tokens not yet fully turned into text. ``_num_emitted`` says how many characters
    of ``decode(window)`` were already returned. Each ``push`` decodes only the window
    (O(1) amortized per token) and returns the characters past that count, except a
    trailing run of U+FFFD: byte-level and byte-fallback tokens may end in the middle of a
    UTF-8 character, which decodes as U+FFFD until later tokens complete it. This is the
    prefix/read offset scheme of TGI and vLLM, plus early release of the complete part.

    Whitespace follows the tokenizer's decoder. The first generated token is decoded after
    up to ``PROMPT_CONTEXT_TOKENS`` prompt tokens, so the concatenation of all deltas is the
    text the generated tokens add to the prompt: with a byte-level tokenizer, or with no
    prompt, that equals ``tokenizer.decode(output_ids)``; with a SentencePiece-style decoder
    that drops the first token's leading space, a leading space of the first generated
    token is kept (as vLLM and TGI do), so ``prompt_text + completion`` reads right.
    """

    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        """Start after ``prompt_ids`` (only the last few are kept as context)."""
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        self._num_context = 0
        self._num_emitted = 0
        self._num_chars = 0  # len(decode(window)) after the last push
        self.reset(prompt_ids)

    def reset(self, prompt_ids: Sequence[int] = ()) -> None:
        """Forget generated tokens and start again after ``prompt_ids`` (regenerate)."""
        self._window = list(prompt_ids[max(0, len(prompt_ids) - PROMPT_CONTEXT_TOKENS) :])
        self._num_context = len(self._window)
        # The prompt's text is context, never output: count all of it as emitted.
        self._num_emitted = self._num_chars = len(self._decode(self._window)) if self._window else 0

    @property
    def has_held_text(self) -> bool:
        """True when ``flush`` would return text (an incomplete character is held back)."""
        return self._num_emitted < self._num_chars

    def push(self, token_id: int) -> str:
        """Add one generated token; return the new text (possibly "")."""
        self._window.append(token_id)
        text = self._decode(self._window)
        end = len(text.rstrip(REPLACEMENT_CHAR))
        if end < len(text) and len(self._window) > MAX_WINDOW_TOKENS:
            end = len(text)  # only invalid bytes stay incomplete this long: give them out as U+FFFD
        if end == len(text) == self._num_chars == self._num_emitted > 0:
            # The token added nothing to text that already had some (a skipped special
            # token): drop it, so that the context keeps text for the next token's spacing.
            self._window.pop()
            return ""
        self._num_chars = len(text)
        delta = text[self._num_emitted : end] if end > self._num_emitted else ""
        self._num_emitted = max(self._num_emitted, end)
        if end == len(text) and (delta or len(self._window) > MAX_WINDOW_TOKENS):
            self._slide()  # not on an empty delta: a context without text would lose spacing
        return delta

    def push_many(self, token_ids: Iterable[int]) -> str:
        """``push`` each id and return the concatenated text."""
        return "".join(self.push(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """Return the text still held back (a trailing incomplete character, as U+FFFD)."""
        text = self._decode(self._window)
        delta = text[self._num_emitted :]
        self._num_emitted = self._num_chars = len(text)
        return delta

    def _slide(self) -> None:
        # Everything is emitted: the tokens after the old context become the new context.
        # They start where the text was complete, so byte runs inside them stay whole.
        window = self._window[self._num_context :]
        if len(window) > MAX_WINDOW_TOKENS:
            window = window[-1:]
        self._window = window
        self._num_context = len(window)
        self._num_emitted = self._num_chars = len(self._decode(window))

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class StopStringMatcher:
    """Find stop strings in streamed text, across any chunking.

    ``feed`` returns the text that is safe to emit and the stop string that matched, if any.
    Text that could still be the start of a stop string is held back (only the longest such
    suffix). On a match, everything before the stop string is returned and the stop string
    and anything after it are dropped; the matcher then stays finished. Among stop strings
    found in the same chunk, the one that would complete first wins (the earliest end; on a
    tie, the longest), so the result never depends on how text was split into chunks.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        """``stops``: the stop strings; empty strings and duplicates are ignored."""
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self._max_held = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.matched: str | None = None

    @property
    def held(self) -> str:
        """Text held back because it may begin a stop string."""
        return self._held

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add ``text``; return (text to emit now, matched stop string or None).

        After a match, further calls return ("", None).
        """
        if self.matched is not None:
            return "", None
        if not self.stops:
            return text, None
        buffer = self._held + text
        found = self._first_match(buffer)
        if found is not None:
            start, stop = found
            self.matched, self._held = stop, ""
            return buffer[:start], stop
        num_held = self._partial_suffix_len(buffer)
        self._held = buffer[len(buffer) - num_held :] if num_held else ""
        return buffer[: len(buffer) - num_held], None

    def flush(self) -> str:
        """Generation ended for another reason: return the held text."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            start = buffer.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop string."""
        for size in range(min(len(buffer), self._max_held), 0, -1):
            suffix = buffer[len(buffer) - size :]
            if any(stop.startswith(suffix) for stop in self.stops):
                return size
        return 0
