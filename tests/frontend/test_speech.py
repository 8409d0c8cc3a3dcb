"""espeak-ng speech: real, non-silent 24 kHz float32 audio; voices; refusals; cancel."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from rill.errors import InvalidRequest
from rill.frontend.speech import SAMPLE_RATE_HZ, EspeakSynth, SpeechService


@pytest.fixture(scope="module")
def synth() -> EspeakSynth:
    return EspeakSynth()


def test_speech_is_real_and_of_plausible_length(synth: EspeakSynth) -> None:
    short = synth.synthesize("Hello.", None, threading.Event())
    long = synth.synthesize("Hello there, this is a longer sentence spoken by the server.", None, threading.Event())
    assert short.dtype == np.float32 and long.dtype == np.float32
    # Speech at ~2-4 words per second: a 11-word sentence lasts a few seconds, longer than one word.
    assert 2.0 < len(long) / SAMPLE_RATE_HZ < 8.0
    assert len(long) > 3 * len(short)
    rms = float(np.sqrt(np.mean(long**2)))
    assert rms > 0.02 and float(np.abs(long).max()) <= 1.0
    # Speech has pauses: a good share of 20 ms frames is much quieter than the loudest.
    frames = long[: len(long) // 480 * 480].reshape(-1, 480)
    energy = np.sqrt((frames**2).mean(axis=1))
    assert (energy < 0.1 * energy.max()).mean() > 0.05


def test_same_text_same_speech(synth: EspeakSynth) -> None:
    # espeak-ng shifts its output by a few samples from call to call: same length and loudness.
    a = synth.synthesize("Repeatable.", "en", threading.Event())
    b = synth.synthesize("Repeatable.", "en", threading.Event())
    assert abs(len(a) - len(b)) < 0.01 * len(a)
    rms_a, rms_b = (float(np.sqrt(np.mean(x**2))) for x in (a, b))
    assert abs(rms_a - rms_b) < 0.02 * rms_a


@pytest.mark.parametrize("language", ["en", "EN_us", "fr", "de", "zh", "cmn", "ja", "es-419"])
def test_languages_have_voices(synth: EspeakSynth, language: str) -> None:
    synth.check(language=language, mode="default", has_ref_audio=False)


def test_voice_changes_the_audio(synth: EspeakSynth) -> None:
    en = synth.synthesize("Bonjour.", "en", threading.Event())
    fr = synth.synthesize("Bonjour.", "fr", threading.Event())
    assert len(fr) > 0 and not (len(en) == len(fr) and np.array_equal(en, fr))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"language": "klingon", "mode": "default", "has_ref_audio": False}, "tts.language 'klingon' has no voice"),
        (
            {"language": None, "mode": "voice_cloning", "has_ref_audio": False},
            "supported modes: default, audio_assistant",
        ),
        (
            {"language": None, "mode": "audio_roleplay", "has_ref_audio": False},
            "tts.mode 'audio_roleplay' is not supported",
        ),
        ({"language": None, "mode": "default", "has_ref_audio": True}, "cannot speak in a reference voice"),
    ],
)
def test_refusals_name_what_is_supported(synth: EspeakSynth, kwargs: dict, error: str) -> None:
    with pytest.raises(InvalidRequest, match=error):
        synth.check(**kwargs)


def test_cancel_stops_synthesis_early(synth: EspeakSynth) -> None:
    cancel = threading.Event()
    cancel.set()
    text = "This sentence would take several seconds to say in full. " * 4
    cut = synth.synthesize(text, None, cancel)
    full = synth.synthesize(text, None, threading.Event())
    assert len(cut) < len(full) / 4


async def test_stream_keeps_order_and_close_cancels() -> None:
    service = SpeechService()
    stream = service.open("en")
    for text in ("One.", "Two, three.", "Four five six."):
        stream.say(text)
    stream.end()
    lengths = [len(pcm) async for pcm in stream]
    assert len(lengths) == 3 and lengths[0] < lengths[2]
    await stream.aclose()
    assert service.num_open_streams == 0

    stream = service.open(None, max_pending=2)
    stream.say("A long sentence that is still being spoken when the reply is closed. " * 5)
    await stream.aclose()  # nothing read: the work is cancelled, not left running
    await asyncio.sleep(0)
    assert service.num_open_streams == 0
    service.shutdown()


class _Tone:
    """A synthesizer of one second of a 440 Hz tone per segment."""

    def synthesize(self, text: str, language: str | None, cancel: threading.Event) -> np.ndarray:
        return np.sin(np.arange(SAMPLE_RATE_HZ) * 2 * np.pi * 440 / SAMPLE_RATE_HZ).astype(np.float32)


async def test_speed_is_resampled_on_the_speech_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's ``speed`` resamples each segment where it was synthesized, never on the
    event loop: twice as fast is half the samples."""
    import soxr

    threads: list[str] = []
    resample = soxr.resample

    def noting(*args: object, **kwargs: object) -> np.ndarray:
        threads.append(threading.current_thread().name)
        return resample(*args, **kwargs)

    monkeypatch.setattr(soxr, "resample", noting)
    service = SpeechService(_Tone())  # type: ignore[arg-type]
    try:
        async with service.open(None, speed=2.0) as stream:
            stream.say("One.")
            stream.say("Two.")
            stream.end()
            lengths = [len(pcm) async for pcm in stream]
        assert lengths == [SAMPLE_RATE_HZ // 2] * 2
        assert len(threads) == 2 and all(name.startswith("rill-speech") for name in threads)
    finally:
        service.shutdown()
