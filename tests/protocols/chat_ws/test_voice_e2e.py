"""/ws/chat with a real voice, end to end: the default model (SmolLM2-135M-Instruct, from its
wheel's GGUF file), Whisper hearing what Piper said, Piper speaking the reply.

A question spoken by Piper (espeak-ng's speech is too poorly recognised to stand for a user)
is sent as an ``audio`` part, and as a video's audio track; the greedy reply must name Paris,
and what was heard must reach the client before the first token. Bad audio gets the
protocol's error and closes the chat, before any transcription.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile
import soxr
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from rill.cli import main as rill_main
from rill.frontend.speech import SAMPLE_RATE_HZ, PiperSynth
from rill.models import speech as speech_models
from rill.models.default import default_gguf_path
from rill.testing.speech import spoken, word_error_rate
from tests.conftest import LiveServer, start_server

from .media_samples import pcm_b64, video_bytes

TIMEOUT_S = 120
QUESTION = "What is the capital of France?"
MAX_AUDIO_S = 10.0


@pytest.fixture(scope="module")
def question() -> np.ndarray:
    """The question as Piper says it (the same rendition every run), at the wire's 16 kHz."""
    return spoken(QUESTION)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    """The default model's GGUF (dequantized: its int4 form answers this question badly), Piper
    and Whisper (its file joined into a temporary folder, not the user's cache), and a short
    audio cap. A small step budget keeps the start-up warm-up short (the prompts here are
    under 100 tokens)."""
    whisper_dir = tmp_path_factory.mktemp("cache") / "whisper-base"
    patch = pytest.MonkeyPatch()
    patch.setattr(speech_models, "whisper_model_dir", lambda: whisper_dir)
    server = start_server(
        default_gguf_path(),
        **{
            "engine.weights": "dense",
            "engine.max_num_batched_tokens": 256,
            "speech.tts": "piper",
            "speech.asr": "whisper",
            "speech.asr_max_audio_s": MAX_AUDIO_S,
        },
    )
    yield server
    server.stop()
    patch.undo()


def conversation(live: LiveServer, body: dict[str, Any] | str) -> tuple[list[dict[str, Any]], int | None]:
    """Every message of one chat, and the code the server closed it with."""
    messages: list[dict[str, Any]] = []
    with connect(f"{live.ws_url}/ws/chat", max_size=None, open_timeout=TIMEOUT_S) as ws:
        ws.send(body if isinstance(body, str) else json.dumps(body))
        try:
            while True:
                messages.append(json.loads(ws.recv(timeout=TIMEOUT_S)))
        except ConnectionClosed as exc:
            return messages, exc.rcvd.code if exc.rcvd is not None else None


def ask(part: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": [part]}],
        "generation": {"do_sample": False, "max_new_tokens": 24},
        "tts": {"enabled": False},
        **extra,
    }


def test_a_spoken_question_is_heard_answered_and_spoken_back(live: LiveServer, question: np.ndarray) -> None:
    # A reference voice, which Piper cannot imitate: the reply says so instead of pretending.
    tts = {"enabled": True, "ref_audio_data": pcm_b64(question[:1600])}
    messages, code = conversation(live, ask({"type": "audio", "data": pcm_b64(question)}, tts=tts))
    kinds = [m["type"] for m in messages]
    assert code == 1000 and kinds[:3] == ["transcript", "queue_done", "prefill_done"] and kinds[-1] == "done", kinds
    heard, done = messages[0], messages[-1]
    first_token = next(i for i, m in enumerate(messages) if m.get("text_delta"))
    assert 0 == kinds.index("transcript") < first_token
    assert (heard["message_index"], heard["content_index"], heard["kind"], heard["language"]) == (0, 0, "audio", "en")
    assert word_error_rate(QUESTION, heard["text"]) <= 0.10, heard["text"]
    assert heard["duration_s"] == pytest.approx(len(question) / 16000, abs=0.01) and 0 < heard["speech_s"]
    assert "Paris" in done["text"], done["text"]
    assert done["tts"] == {"synthesizer": "piper", "voice": "en_US-joe-medium", "note": PiperSynth.REF_AUDIO_NOTE}

    # The reply's speech is Piper's, at 24 kHz, and says what the text says.
    speech = np.concatenate(
        [np.frombuffer(base64.b64decode(m["audio_data"]), "<f4") for m in messages if m.get("audio_data")]
    )
    assert len(speech) / SAMPLE_RATE_HZ > 1.0 and np.abs(speech).max() <= 1.0
    asr = live.state["deps"].asr
    reply_heard = asyncio.run_coroutine_threadsafe(
        asr.transcribe(speech, sample_rate_hz=SAMPLE_RATE_HZ), live.loop
    ).result(TIMEOUT_S)
    assert "paris" in reply_heard.text.lower(), reply_heard.text
    assert speech_models.is_whisper_complete(speech_models.whisper_model_dir())  # the patched folder


def test_a_videos_audio_track_is_heard(live: LiveServer, question: np.ndarray, tmp_path: Path) -> None:
    seconds = len(question) / 16000
    video = video_bytes(tmp_path / "question.mp4", seconds=seconds, sound=question)
    messages, code = conversation(live, ask({"type": "video", "data": base64.b64encode(video).decode()}))
    heard, done = messages[0], messages[-1]
    assert code == 1000 and heard["type"] == "transcript" and done["type"] == "done"
    assert heard["kind"] == "video" and "cannot see the video's frames" in heard["note"]
    assert word_error_rate(QUESTION, heard["text"]) <= 0.10, heard["text"]
    assert "Paris" in done["text"], done["text"]


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        ({"data": pcm_b64([0.1, float("nan")])}, "NaN or infinite"),
        ({"data": ""}, "audio data is empty"),
        ({"data": pcm_b64(np.zeros(1600)), "sample_rate": 50}, "sample_rate 50 is outside 8000..192000"),
        (
            {"data": pcm_b64(np.zeros(int(11 * 16000)))},
            f"11.0 s of audio is more than speech recognition takes ({MAX_AUDIO_S:g} s, --asr-max-audio-s)",
        ),
        ({"data": pcm_b64(np.zeros(2 * 16000))}, "no speech was heard in it (2.0 s of audio)"),
        ({"data": "QUESTION", "language": "klingon"}, "language 'klingon' is not one whisper-base knows"),
    ],
)
def test_bad_audio_gets_the_protocols_error(
    live: LiveServer, question: np.ndarray, part: dict[str, Any], expected: str
) -> None:
    part = {"type": "audio", **part}
    if part["data"] == "QUESTION":
        part["data"] = pcm_b64(question)
    messages, code = conversation(live, ask(part))
    assert code == 1000 and [m["type"] for m in messages] == ["error"], messages
    assert expected in messages[0]["error"] and "messages[0].content[0]" in messages[0]["error"]


def test_rill_client_chat_asks_with_a_wav_file(
    live: LiveServer, question: np.ndarray, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wav = tmp_path / "question.wav"
    at_44k = soxr.resample(question, 16000, 44100)
    soundfile.write(wav, np.stack([at_44k, at_44k], axis=1), 44100)  # stereo, another rate: the client converts
    argv = ["client", "chat", "--wav", str(wav), "--temperature", "0", "--max-new-tokens", "24"]
    assert rill_main([*argv, "--url", f"{live.ws_url}/ws/chat"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out
    assert re.search(r"^\[heard \(en, 1\.\d s\): What is the capital of France\?\]$", err, re.M), err


def test_ten_minutes_of_audio_is_over_the_message_size_limit(live: LiveServer) -> None:
    # 600 s of float32 at 16 kHz is 38.4 MB, 51 MB in base64: more than --max-body-bytes (4 MiB)
    # lets into one WebSocket message, so the server closes with "message too big" unread.
    data = base64.b64encode(np.zeros(600 * 16000, "<f4").tobytes()).decode()
    messages, code = conversation(live, ask({"type": "audio", "data": data}))
    assert messages == [] and code == 1009
