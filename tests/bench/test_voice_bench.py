"""``benchmarks/voice.py``'s in-process parts run and print their tables (the figures
themselves are not checked: nothing is timed in tests), and its helpers compute what the
tables say."""

from __future__ import annotations

import re
from types import ModuleType

import pytest

from tests.bench.helpers import load_benchmark


@pytest.fixture(scope="module")
def voice() -> ModuleType:
    """The benchmark script as a module (it imports ``compare`` from its own folder)."""
    return load_benchmark("voice.py", "voice_bench")


def test_goals_and_quantiles(voice: ModuleType) -> None:
    assert voice.goal(0.3, 0.3) == "met" and voice.goal(0.31, 0.3) == "NOT met"
    assert voice.pct([5.0, 1.0, 3.0], 0.5) == 3.0 and voice.pct([1.0, 2.0, 3.0, 4.0, 5.0], 0.9) == 5.0
    assert voice.pct([7.0], 0.9) == 7.0


def test_a_clip_is_whole_sentences_past_its_length(voice: ModuleType) -> None:
    audio, text = voice.make_clip(2.0)
    assert len(audio) >= 2 * 16000 and text == voice.SENTENCES[0]


def test_the_asr_and_tts_tables(voice: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    voice.part_asr([voice.make_clip(2.0)], threads=1)
    voice.part_tts([["The capital of France is Paris.", "It is famous."]])
    out = capsys.readouterr().out
    asr_row = re.search(r"^\s+(\d+\.\d) +\d+\.\d+ +\d+\.\d+ +(\d\.\d+)  (met|NOT met)$", out, re.M)
    assert asr_row is not None, out
    # Whisper hears most of Piper's sentence (it hears "France is" as "Francis": WER 2/6).
    assert float(asr_row[2]) < 0.5, out
    assert re.search(r"^ +piper .* (met|NOT met)$", out, re.M), out
    assert re.search(r"^ *espeak-ng .* \(peer\)$", out, re.M), out
