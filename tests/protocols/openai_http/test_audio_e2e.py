"""OpenAI's audio routes on a real ``rill serve`` (the tiny chat model, Whisper base and Piper):
the ``openai`` client's ``audio.transcriptions.create`` in every response format and streamed,
``audio.translations.create`` and ``audio.speech.create`` (wav, pcm, mp3, streamed, SSE) work
unchanged; speech spoken by rill comes back through rill's Whisper with a word error rate of
at most 10 %; bad files and bad fields get OpenAI's error JSON with their status.
"""

from __future__ import annotations

import base64
import io
import json
import threading
import time
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from rill.frontend import speech as speech_module
from rill.frontend.audio_files import decode_audio
from rill.models import speech as speech_models
from rill.testing.speech import word_error_rate
from tests.conftest import LiveServer, start_server

SENTENCE = "Please tell me the weather forecast for tomorrow morning in the city of London."
"""15 words Whisper hears well in Piper's voice (see tests/frontend/test_asr.py)."""

MAX_AUDIO_S = 30.0


def _wav(samples: np.ndarray, rate_hz: int, width: int = 2) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(width)
        out.setframerate(rate_hz)
        if width == 1:
            out.writeframes((np.clip(samples, -1, 1) * 127 + 128).astype(np.uint8).tobytes())
        else:
            out.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


@pytest.fixture(scope="module")
def live(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Whisper joined into a temporary folder; Piper without sampling noise, so the round trip
    hears the same samples every run."""
    whisper_dir = tmp_path_factory.mktemp("cache") / "whisper-base"
    patch = pytest.MonkeyPatch()
    patch.setattr(speech_models, "whisper_model_dir", lambda: whisper_dir)
    patch.setattr(speech_module, "make_synth", lambda choice: speech_module.PiperSynth(varied=False))
    server = start_server(tiny_model_dir, **{"speech.asr": "whisper", "speech.asr_max_audio_s": MAX_AUDIO_S})
    yield server
    server.stop()
    patch.undo()


@pytest.fixture(scope="module")
def spoken_wav() -> bytes:
    """The sentence as Piper says it, a 24 kHz 16-bit WAV."""
    audio = speech_module.PiperSynth(varied=False).synthesize(SENTENCE, None, threading.Event())
    return _wav(audio, speech_module.SAMPLE_RATE_HZ)


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_are_listed_by_their_own_ids(live: LiveServer) -> None:
    ids = [m.id for m in _client(live).models.list()]
    assert "whisper-base" in ids and "piper-en_US-joe-medium" in ids
    assert _client(live).models.retrieve("whisper-base").id == "whisper-base"


def test_speech_round_trip_through_transcription(live: LiveServer) -> None:
    client = _client(live)
    speech = client.audio.speech.create(model="tts-1", voice="alloy", input=SENTENCE, response_format="wav")
    heard = client.audio.transcriptions.create(model="whisper-1", file=("speech.wav", speech.content, "audio/wav"))
    assert word_error_rate(SENTENCE, heard.text) <= 0.10, heard.text
    # The same speech as mp3 (through FFmpeg both ways) is heard as well.
    mp3 = client.audio.speech.create(model="piper-en_US-joe-medium", voice="echo", input=SENTENCE)
    assert mp3.content[:3] == b"ID3" or mp3.content[0] == 0xFF
    heard = client.audio.transcriptions.create(model="whisper-base", file=("speech.mp3", mp3.content, "audio/mpeg"))
    assert word_error_rate(SENTENCE, heard.text) <= 0.10, heard.text


def test_transcription_formats(live: LiveServer, spoken_wav: bytes) -> None:
    client = _client(live)
    file = ("q.wav", spoken_wav, "audio/wav")
    text = client.audio.transcriptions.create(model="whisper-1", file=file, response_format="text")
    assert isinstance(text, str) and word_error_rate(SENTENCE, text) <= 0.10, text
    verbose = client.audio.transcriptions.create(
        model="whisper-1", file=file, response_format="verbose_json", timestamp_granularities=["segment"]
    )
    assert verbose.language == "en" and verbose.duration == pytest.approx(len(spoken_wav) / 48000, abs=0.05)
    assert verbose.segments and verbose.segments[0].start >= 0 and verbose.segments[-1].end <= verbose.duration
    assert "".join(s.text for s in verbose.segments).strip() == verbose.text.strip() == text.strip()
    srt = client.audio.transcriptions.create(model="whisper-1", file=file, response_format="srt")
    assert srt.startswith("1\n00:00:0") and " --> " in srt and "," in srt.splitlines()[1]
    vtt = client.audio.transcriptions.create(model="whisper-1", file=file, response_format="vtt", language="en")
    assert vtt.startswith("WEBVTT\n\n00:00:0") and "." in vtt.splitlines()[2]


def test_streamed_transcription(live: LiveServer, spoken_wav: bytes) -> None:
    events = list(
        _client(live).audio.transcriptions.create(
            model="whisper-1", file=("q.wav", spoken_wav, "audio/wav"), stream=True
        )
    )
    assert [e.type for e in events[:-1]] == ["transcript.text.delta"] * (len(events) - 1) and len(events) >= 2
    assert events[-1].type == "transcript.text.done"
    assert "".join(e.delta for e in events[:-1]) == events[-1].text
    assert word_error_rate(SENTENCE, events[-1].text) <= 0.10


def test_translation(live: LiveServer, spoken_wav: bytes) -> None:
    answer = _client(live).audio.translations.create(model="whisper-1", file=("q.wav", spoken_wav, "audio/wav"))
    assert word_error_rate(SENTENCE, answer.text) <= 0.10, answer.text  # English stays English


def test_speech_formats_and_streaming(live: LiveServer) -> None:
    client = _client(live)
    two = "The first sentence is short. The second one follows it."
    pcm = client.audio.speech.create(model="tts-1", voice="nova", input=two, response_format="pcm").content
    wav = client.audio.speech.create(model="tts-1", voice="nova", input=two, response_format="wav").content
    assert wav[:4] == b"RIFF" and wav[44:] == pcm and len(pcm) % 2 == 0
    assert 2.0 < len(pcm) / 2 / 24000 < 8.0
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="nova", input=two, response_format="pcm"
    ) as response:
        assert response.headers["content-type"] == "audio/pcm"
        chunks = list(response.iter_bytes())
    assert b"".join(chunks) == pcm
    fast = client.audio.speech.create(model="tts-1", voice="nova", input=two, response_format="pcm", speed=2.0)
    assert len(fast.content) / len(pcm) == pytest.approx(0.5, abs=0.01)
    flac = client.audio.speech.create(model="tts-1", voice="nova", input=two, response_format="flac").content
    samples, rate = decode_audio(flac, 60)
    assert flac[:4] == b"fLaC" and len(samples) / rate == pytest.approx(len(pcm) / 2 / 24000, abs=0.05)

    with httpx.stream(
        "POST",
        f"{live.url}/v1/audio/speech",
        json={"input": two, "voice": "alloy", "response_format": "pcm", "stream_format": "sse"},
        timeout=60,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 2 + ["speech.audio.done"]  # one per sentence
    assert b"".join(base64.b64decode(e["audio"]) for e in events[:-1]) == pcm


SHORT = object()
"""Stands for the first third of a second of the spoken sentence."""


@pytest.mark.parametrize(
    ("fields", "file", "status", "param", "text"),
    [
        ({}, ("notes.txt", b"this is not audio at all\n" * 40, "text/plain"), 400, "file", "not a sound file"),
        ({}, ("empty.wav", b"", "audio/wav"), 400, "file", "empty"),
        ({"model": "whisper-1"}, None, 400, "file", "'file' is required"),
        ({"response_format": "docx"}, SHORT, 400, "response_format", "must be one of"),
        ({"temperature": "7"}, SHORT, 400, "temperature", "0..1"),
        ({"timestamp_granularities[]": "word"}, SHORT, 400, "timestamp_granularities", "segments only"),
        ({"model": "gpt-9"}, SHORT, 404, "model", "does not exist"),
        ({"language": "klingon"}, SHORT, 400, "language", "klingon"),
    ],
)
def test_bad_transcription_requests(
    live: LiveServer, spoken_wav: bytes, fields: dict[str, str], file: Any, status: int, param: str, text: str
) -> None:
    if file is SHORT:
        file = ("q.wav", spoken_wav[: 44 + 16000], "audio/wav")
    files = {"file": file} if file is not None else None
    response = httpx.post(f"{live.url}/v1/audio/transcriptions", data=fields, files=files, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"] and error["type"] == "invalid_request_error"


def test_long_audio_is_refused(live: LiveServer) -> None:
    # Ten minutes at 16 kHz (19 MB) is past the body limit: 413 before anything is read.
    ten_minutes = _wav(np.full(16000 * 600, 0.01, np.float32), 16000)
    response = httpx.post(f"{live.url}/v1/audio/transcriptions", files={"file": ("long.wav", ten_minutes)}, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
    # Three minutes at 8 kHz, 8 bits (1.4 MB) fits the body but not the 30 s cap: 400, and no work.
    deps = live.state["deps"]
    before = deps.asr.counters.num_transcribed_total
    three_minutes = _wav(np.full(8000 * 180, 0.01, np.float32), 8000, width=1)
    response = httpx.post(
        f"{live.url}/v1/audio/transcriptions", files={"file": ("long.wav", three_minutes)}, timeout=60
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "file" and "longer than" in response.json()["error"]["message"]
    assert deps.asr.counters.num_transcribed_total == before and deps.asr.num_pending == 0


@pytest.mark.parametrize(
    ("body", "param", "text"),
    [
        ({"input": "Hi.", "response_format": "ogg"}, "response_format", "must be one of"),
        ({"input": "Hi.", "speed": 4.5}, "speed", "0.25..4.0"),
        ({"input": "Hi.", "speed": 0.1}, "speed", "0.25..4.0"),
        ({"input": "Hi.", "voice": "darth"}, "voice", "one voice"),
        ({"input": ""}, "input", "required"),
        ({"input": "a" * 5000}, "input", "at most 4096"),
    ],
)
def test_bad_speech_requests(live: LiveServer, body: dict[str, Any], param: str, text: str) -> None:
    response = httpx.post(f"{live.url}/v1/audio/speech", json={"model": "tts-1", "voice": "alloy", **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"]
    with pytest.raises(openai.BadRequestError):
        _client(live).audio.speech.create(model="tts-1", voice="alloy", input="Hi.", speed=9)


def _audio_api(live: LiveServer) -> Any:
    """The server's ``AudioApi`` (its stopper is a bound method of it)."""
    from rill.protocols.openai_http.audio_api import AudioApi

    return next(s.__self__ for s in live.state["deps"].stoppers if isinstance(getattr(s, "__self__", None), AudioApi))


def test_a_client_that_leaves_stops_the_speech(live: LiveServer) -> None:
    speech = _audio_api(live).speech
    cancelled_before = speech.num_cancelled_total
    text = " ".join(f"This is sentence number {i} of a long reading." for i in range(40))
    with httpx.stream(
        "POST", f"{live.url}/v1/audio/speech", json={"input": text, "response_format": "pcm"}, timeout=60
    ) as response:
        first = next(response.iter_raw())
        assert response.status_code == 200 and len(first) > 0
    # The server sees the disconnect, closes the reply's speech stream and drops its sentences.
    deadline = time.monotonic() + 30
    while speech.num_open_streams or speech.num_running_jobs:
        assert time.monotonic() < deadline, "the speech stream outlived its client"
        time.sleep(0.02)
    assert speech.num_cancelled_total == cancelled_before + 1


def test_rate_limits_count_audio_requests_and_seconds_and_no_recognition_is_404(tiny_model_dir: Any) -> None:
    server = start_server(
        tiny_model_dir,
        **{
            "speech.asr": "off",
            "policy.rate_limit_requests": 3,
            "policy.rate_limit_audio_s": 2.0,
            "policy.rate_limit_window": 3600.0,
        },
    )
    url = f"{server.url}/v1/audio/speech"
    try:
        refused = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": ("a.wav", b"RIFF")}, timeout=60)
        assert refused.status_code == 404 and "--asr whisper" in refused.json()["error"]["message"]
        assert "whisper-base" not in [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
        short = httpx.post(url, json={"input": "Hi.", "response_format": "pcm"}, timeout=60)
        assert short.status_code == 200 and len(short.content) / 48000 < 2.0
        # Admitted under the 2 s limit, it speaks past it: the seconds are charged when it ends.
        long = httpx.post(url, json={"input": SENTENCE, "response_format": "pcm"}, timeout=60)
        assert long.status_code == 200 and len(long.content) / 48000 > 2.0
        limited = httpx.post(url, json={"input": "Hi.", "response_format": "pcm"}, timeout=60)
        assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limited"
        assert "of audio" in limited.json()["error"]["message"] and "retry-after" in limited.headers
    finally:
        server.stop()


def test_a_full_recognition_pool_refuses_before_decoding(live: LiveServer, spoken_wav: bytes) -> None:
    asr = live.state["deps"].asr
    before = asr.counters.num_transcribed_total
    asr.pool.max_pending = 0  # as if --asr-max-queue transcriptions were waiting
    try:
        response = httpx.post(f"{live.url}/v1/audio/transcriptions", files={"file": ("q.wav", spoken_wav)}, timeout=60)
    finally:
        asr.pool.max_pending = 16
    assert response.status_code == 503 and response.json()["error"]["code"] == "resource_exhausted"
    assert asr.counters.num_transcribed_total == before
