"""Text → speakable segments (pure): sentence by sentence, never the reasoning.

The one splitter of every protocol that speaks text: ``/ws/chat`` cuts its streamed replies,
``/v1/audio/speech`` its whole input (``split``), so the first segment is spoken while the
rest waits. ``Segmenter.feed(delta)`` takes each new piece of reply text as it streams and
returns the segments that became complete; ``flush()`` returns the rest at the end. Text
between thinking tags (``<think>…</think>`` and the like) is dropped, including tags split
across deltas. A segment ends at sentence punctuation followed by a space or a newline
(so ``3.14`` or ``e.g.x`` do not cut), right after CJK sentence punctuation, at a comma once
the segment is long enough, or at a word boundary when it grows past ``max_chars`` (so text
without punctuation still starts speaking early). Segments with no letter or digit are not
returned: there is nothing to say. Pure: stdlib only.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_TAGS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<thinking>", "</thinking>"),
    ("<reasoning>", "</reasoning>"),
)
"""Open/close tag pairs whose content is reasoning, never spoken."""

_SENTENCE_END = ".!?;:"
_CJK_END = "。！？；…"
_CLAUSE_END = ",，、"


@dataclass(frozen=True)
class SegmenterLimits:
    """Where segments are cut.

    Attributes:
        max_chars: a segment longer than this is cut at its last space (or hard, if none).
        min_clause_chars: a comma cuts a segment only once it is at least this long.
        first_max_chars, first_min_clause_chars: the same for the first segment, shorter so
            that the first audio comes sooner (time to first audio is what a listener waits).
    """

    max_chars: int = 160
    min_clause_chars: int = 60
    first_max_chars: int = 60
    first_min_clause_chars: int = 20


class Segmenter:
    """Cuts one reply's streamed text into speakable segments (one instance per reply)."""

    def __init__(
        self,
        limits: SegmenterLimits | None = None,
        *,
        starts_in_thinking: bool = False,
        think_tags: tuple[tuple[str, str], ...] = THINK_TAGS,
    ) -> None:
        """``starts_in_thinking``: the prompt already opened a thinking block (some chat
        templates end the generation prompt with ``<think>``), so text is reasoning until
        a close tag."""
        self.limits = limits or SegmenterLimits()
        self._tags = think_tags
        self._close_tag: str | None = think_tags[0][1] if starts_in_thinking else None
        self._raw = ""  # text not classified yet: it may end in the start of a tag
        self._speech = ""  # speakable text not cut into segments yet
        self._num_segments = 0

    def feed(self, delta: str) -> list[str]:
        """Add new reply text; return the segments it completed, in order."""
        self._raw += delta
        self._classify(final=False)
        return self._cut(final=False)

    def flush(self) -> list[str]:
        """End of the reply: return every remaining segment (reasoning left open is dropped)."""
        self._classify(final=True)
        return self._cut(final=True)

    # -- thinking tags -----------------------------------------------------------------
    def _classify(self, final: bool) -> None:
        while self._raw:
            if self._close_tag is not None:
                end = self._raw.find(self._close_tag)
                if end < 0:
                    # Keep only what could be the start of the close tag; the rest is reasoning.
                    keep = 0 if final else _partial_suffix(self._raw, (self._close_tag,))
                    self._raw = self._raw[len(self._raw) - keep :] if keep else ""
                    return
                self._raw = self._raw[end + len(self._close_tag) :]
                self._close_tag = None
                continue
            start, tag = self._first_tag()
            if tag is None:
                keep = 0 if final else _partial_suffix(self._raw, self._all_tags())
                self._speech += self._raw[: len(self._raw) - keep]
                self._raw = self._raw[len(self._raw) - keep :]
                return
            self._speech += self._raw[:start]
            opener = next((o for o, c in self._tags if o == tag), None)
            self._raw = self._raw[start + len(tag) :]
            if opener is not None:
                self._close_tag = next(c for o, c in self._tags if o == tag)
            # A stray close tag (no opener seen) is simply removed.

    def _all_tags(self) -> tuple[str, ...]:
        return tuple(t for pair in self._tags for t in pair)

    def _first_tag(self) -> tuple[int, str | None]:
        best, best_tag = len(self._raw), None
        for tag in self._all_tags():
            index = self._raw.find(tag)
            if 0 <= index < best:
                best, best_tag = index, tag
        return best, best_tag

    # -- sentences ---------------------------------------------------------------------
    def _cut(self, final: bool) -> list[str]:
        segments: list[str] = []
        while True:
            cut = self._boundary()
            if cut is None:
                break
            segment = self._speech[:cut]
            self._speech = self._speech[cut:]
            if _is_speakable(segment):
                segments.append(segment.strip())
                self._num_segments += 1
        if final and _is_speakable(self._speech):
            segments.append(self._speech.strip())
            self._num_segments += 1
        if final:
            self._speech = ""
        return segments

    def _boundary(self) -> int | None:
        text = self._speech
        first = self._num_segments == 0
        max_chars = self.limits.first_max_chars if first else self.limits.max_chars
        min_clause_chars = self.limits.first_min_clause_chars if first else self.limits.min_clause_chars
        for i, ch in enumerate(text):
            if ch == "\n" or ch in _CJK_END:
                return i + 1
            followed_by_space = i + 1 < len(text) and text[i + 1].isspace()
            if ch in _SENTENCE_END and followed_by_space:
                return i + 1
            if ch in _CLAUSE_END and followed_by_space and i + 1 >= min_clause_chars:
                return i + 1
            if i + 1 >= max_chars:
                space = text.rfind(" ", 0, i + 1)
                return space + 1 if space > 0 else i + 1
        return None


def _is_speakable(text: str) -> bool:
    return any(ch.isalnum() for ch in text)


def _partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of one of ``tags``."""
    best = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:size]):
                best = size
                break
    return best


def split(text: str, limits: SegmenterLimits | None = None) -> list[str]:
    """The speakable segments of a whole text (no reasoning to drop: every tag is read as
    written), each at most ``limits.max_chars`` long."""
    segmenter = Segmenter(limits, think_tags=())
    return [*segmenter.feed(text), *segmenter.flush()]
