"""Speech helpers for tests and benchmarks: word error rate, and a sentence spoken at the
chat wire's input format.

``word_error_rate(reference, hypothesis)`` is the word-level edit distance (substitutions,
deletions, insertions) over the reference's word count, after lower-casing and dropping
punctuation, so "Paris." and "paris" are the same word. ``spoken(text)`` speaks ``text`` with
Piper, the same way every time, and returns 16 kHz float32 mono: what a client sends as an
``audio`` part. ``ScriptedRecognizer`` is a speech recognizer double.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from rill.frontend.asr import Transcript

_WORD = re.compile(r"[\w']+")


def words(text: str) -> list[str]:
    """The lower-cased words of ``text``, punctuation dropped (apostrophes kept: "it's")."""
    return _WORD.findall(text.lower())


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Edits (substitutions, deletions, insertions) turning ``hypothesis``'s words into
    ``reference``'s, over the reference's word count (0.0 for an exact match; an empty
    reference gives 0.0 for an empty hypothesis and 1.0 otherwise)."""
    ref, hyp = words(reference), words(hypothesis)
    if not ref:
        return 0.0 if not hyp else 1.0
    # One row of the Levenshtein table at a time.
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, start=1):
        previous, row[0] = row[0], i
        for j, h in enumerate(hyp, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (r != h))
    return row[-1] / len(ref)


def spoken(text: str) -> np.ndarray:
    """``text`` spoken by Piper without its sampling noise (the same samples every time, so a
    test's input never changes from run to run), as 16 kHz float32 mono."""
    import soxr

    from rill.frontend.speech import SAMPLE_RATE_HZ, PiperSynth

    audio = PiperSynth(varied=False).synthesize(text, None, threading.Event())
    return np.asarray(soxr.resample(audio, SAMPLE_RATE_HZ, 16000), dtype=np.float32)


class ScriptedRecognizer:
    """A ``SpeechRecognizer`` double: hears ``text`` in any audio (nothing in all-zero audio),
    after waiting for ``gate`` when one is given (giving up, with what it heard so far, once
    cancelled). ``calls``, ``num_running`` and ``num_cancelled`` say what it was asked to do;
    ``started`` is set when a transcription begins."""

    name = "scripted"

    def __init__(self, text: str = "hello there", gate: threading.Event | None = None) -> None:
        self.text = text
        self.gate = gate
        self.started = threading.Event()
        self.calls: list[tuple[int, str | None]] = []
        self.num_running = 0
        self.num_cancelled = 0

    def transcribe(
        self, samples: np.ndarray, language: str | None, cancel: threading.Event, task: str = "transcribe"
    ) -> Transcript:
        """See ``rill.frontend.asr.SpeechRecognizer.transcribe`` (``task`` is ignored)."""
        from rill.frontend.asr import Transcript

        self.calls.append((len(samples), language))
        self.num_running += 1
        self.started.set()
        try:
            while self.gate is not None and not self.gate.wait(0.01):
                if cancel.is_set():
                    self.num_cancelled += 1
                    break
        finally:
            self.num_running -= 1
        duration_s = len(samples) / 16000
        text = self.text if np.any(samples) else ""
        return Transcript(text, language or "en", duration_s, duration_s if text else 0.0)
