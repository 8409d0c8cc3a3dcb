"""/ws/chat end to end: a real server (tiny random text-only model), real espeak-ng speech
(``--tts espeak``), no speech recognition (``--asr off``).

Random weights give gibberish, so tests assert message order, counts, framing, errors and
engine counters, never wording. Speech runs through ``GatedSynth``: espeak-ng itself, with a
gate a test can close to hold a chat in its speaking phase (to fill the queue, or to be
sure speech is in progress when the client leaves) without any sleep.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile
from websockets.sync.client import connect

import rill.frontend.speech as speech_module
from rill.cli import main as rill_main
from rill.frontend.speech import SAMPLE_RATE_HZ, EspeakSynth
from rill.protocols._shared.segmenter import Segmenter
from tests.conftest import start_server

from . import spec_example
from .media_samples import pcm_b64, png_b64, tone, video_bytes

TIMEOUT_S = 120


class GatedSynth(EspeakSynth):
    """espeak-ng whose jobs wait while ``gate`` is clear (and give up when cancelled)."""

    gate = threading.Event()
    num_started = 0
    num_cancelled = 0
    num_active = 0

    def synthesize(self, text: str, language: str | None, cancel: threading.Event) -> np.ndarray:
        cls = type(self)
        cls.num_started += 1
        cls.num_active += 1
        try:
            while not cls.gate.wait(0.01):
                if cancel.is_set():
                    cls.num_cancelled += 1
                    return np.zeros(0, np.float32)
            return super().synthesize(text, language, cancel)
        finally:
            cls.num_active -= 1


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """This module's server: one chat at a time, two places in line, recording on, espeak-ng
    speech, no speech recognition and no OCR (audio and images refused as the model cannot
    take them; the voice round trip is ``test_voice_e2e.py``'s, text in images ``test_ocr_e2e.py``'s)."""
    data = tmp_path_factory.mktemp("chat-data")
    ref = data / "ref.wav"
    voice = EspeakSynth().synthesize("This is the reference voice.", "en", threading.Event())
    soundfile.write(ref, voice, SAMPLE_RATE_HZ)
    GatedSynth.gate.set()
    patch = pytest.MonkeyPatch()
    patch.setattr(speech_module, "EspeakSynth", GatedSynth)  # the server's synth is made on first use
    server = start_server(
        tiny_model_dir,
        **{
            "engine.num_threads": 1,
            "chat.chat_max_active": 1,
            "chat.chat_max_queue": 2,
            "chat.record": True,
            "chat.ref_audio": str(ref),
            "http.data_dir": str(data),
            "speech.tts": "espeak",
            "speech.asr": "off",
            "speech.ocr": "off",
        },
    )
    yield server
    GatedSynth.gate.set()
    server.stop()
    patch.undo()


def ws_url(live) -> str:
    return f"{live.ws_url}/ws/chat"


def payload(content: Any = "Hello!", **extra: Any) -> dict:
    body = {
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": content},
        ],
        "generation": {"max_new_tokens": 48, "temperature": 0.7, "seed": 1},
    }
    body.update(extra)
    return body


def open_chat(live, body: dict):
    ws = connect(ws_url(live), max_size=None, open_timeout=TIMEOUT_S)
    ws.send(json.dumps(body))
    return ws


def recv(ws) -> dict:
    return json.loads(ws.recv(timeout=TIMEOUT_S))


def until_closed(ws) -> list[dict]:
    messages: list[dict] = []
    try:
        while True:
            messages.append(recv(ws))
    except Exception as exc:  # ConnectionClosed ends the conversation
        if "ConnectionClosed" not in type(exc).__name__:
            raise
    return messages


def chat(live, body: dict) -> list[dict]:
    with open_chat(live, body) as ws:
        return until_closed(ws)


def pcm(msg: dict) -> np.ndarray:
    raw = base64.b64decode(msg["audio_data"])
    assert len(raw) % 4 == 0
    return np.frombuffer(raw, dtype="<f4")


# -- the spec's example ------------------------------------------------------------------
def test_spec_python_example_prints_reply_and_audio(live, capsys: pytest.CaptureFixture) -> None:
    asyncio.run(spec_example.chat_streaming(server_url=ws_url(live), ref_audio_path=None))
    out = capsys.readouterr().out
    assert re.search(r"^Prefill done, \d+ input tokens$", out, re.M)
    assert "\nFinal: " in out and re.search(r"^Tokens: \d+ in, \d+ out$", out, re.M)
    seconds = float(re.search(r"^Received ([0-9.]+)s of audio$", out, re.M).group(1))
    assert seconds > 0
    live.wait_idle()


# -- streaming, framing, speech timing ---------------------------------------------------
def test_stream_order_framing_and_first_audio_before_text_completes(live) -> None:
    messages = chat(live, payload(generation={"max_new_tokens": 160, "seed": 7}))
    kinds = [m["type"] for m in messages]
    assert kinds[:2] == ["queue_done", "prefill_done"] and kinds[-1] == "done"
    assert set(kinds[2:-1]) == {"chunk"}
    chunks = messages[2:-1]
    for m in chunks:
        assert set(m) - {"type"} and set(m) <= {
            "type",
            "text_delta",
            "audio_data",
        }  # never empty, empty fields left out
        assert m.get("text_delta", "x") and m.get("audio_data", "x")
    text_at = [i for i, m in enumerate(chunks) if "text_delta" in m]
    audio_at = [i for i, m in enumerate(chunks) if "audio_data" in m]
    assert audio_at and audio_at[0] < text_at[-1], "the first sentence must be spoken while the text still streams"

    done = messages[-1]
    text = "".join(m["text_delta"] for m in chunks if "text_delta" in m)
    assert done["text"] == text and 0 < done["generated_tokens"] <= 160
    assert done["input_tokens"] == messages[1]["input_tokens"] > 0 and done["audio_data"] is None
    audio = np.concatenate([pcm(m) for m in chunks if "audio_data" in m])
    assert np.isfinite(audio).all() and np.abs(audio).max() <= 1.0 and np.sqrt(np.mean(audio**2)) > 0.01
    # 24 kHz framing: the received samples match the same sentences spoken locally at 24 kHz
    # (at espeak-ng's own 22.05 kHz they would be 8% fewer).
    segmenter = Segmenter()
    segments = [s for m in chunks if "text_delta" in m for s in segmenter.feed(m["text_delta"])] + segmenter.flush()
    local = EspeakSynth()
    expected = sum(len(local.synthesize(s, None, threading.Event())) for s in segments)
    assert abs(len(audio) - expected) < 0.01 * expected
    live.wait_idle()


def test_non_streaming_sends_whole_text_and_audio_in_done(live) -> None:
    messages = chat(live, payload(streaming=False, generation={"max_new_tokens": 40, "seed": 3}))
    assert [m["type"] for m in messages] == ["queue_done", "prefill_done", "done"]
    done = messages[-1]
    assert done["generated_tokens"] == 40 and done["text"]
    assert len(pcm(done)) > SAMPLE_RATE_HZ // 10


def test_same_seed_same_text_and_tts_off_means_no_audio(live) -> None:
    body = payload(tts={"enabled": False}, generation={"max_new_tokens": 24, "seed": 11})
    first, second = chat(live, body), chat(live, body)
    assert first[-1]["text"] == second[-1]["text"]
    assert not any("audio_data" in m for m in first if m["type"] == "chunk")
    assert first[-1]["audio_data"] is None


def test_language_picks_the_voice(live) -> None:
    messages = chat(live, payload(tts={"enabled": True, "language": "fr"}, generation={"max_new_tokens": 24}))
    assert messages[-1]["type"] == "done"


# -- queue ---------------------------------------------------------------------------------
def test_queue_messages_leaving_and_full_queue(live) -> None:
    GatedSynth.gate.clear()  # the first chat keeps its slot while its speech is held
    try:
        a = open_chat(live, payload(generation={"max_new_tokens": 16}))
        assert [recv(a)["type"], recv(a)["type"]] == ["queue_done", "prefill_done"]
        b = open_chat(live, payload())
        queued_b = recv(b)
        assert (queued_b["type"], queued_b["position"], queued_b["queue_length"]) == ("queued", 1, 1)
        c = open_chat(live, payload())
        queued_c = recv(c)
        assert (queued_c["type"], queued_c["position"], queued_c["queue_length"]) == ("queued", 2, 2)
        assert queued_c["estimated_wait_s"] > 0
        with open_chat(live, payload()) as d:
            assert until_closed(d) == [{"type": "error", "error": "Queue full"}]
            assert d.close_code == 1013
        b.close()  # leaves while queued: c moves up
        moved = recv(c)
        assert (moved["type"], moved["position"], moved["queue_length"]) == ("queue_update", 1, 1)
        e = open_chat(live, payload(tts={"enabled": False}))
        assert (recv(e)["type"],) == ("queued",)
    finally:
        GatedSynth.gate.set()
    assert until_closed(a)[-1]["type"] == "done"
    rest_c = until_closed(c)
    assert [m["type"] for m in rest_c[:2]] == ["queue_done", "prefill_done"] and rest_c[-1]["type"] == "done"
    rest_e = until_closed(e)
    assert rest_e[0]["type"] == "queue_update" and rest_e[0]["position"] == 1
    assert rest_e[1]["type"] == "queue_done" and rest_e[-1]["type"] == "done"
    for ws in (a, c, e):
        ws.close()
    live.wait_idle()


def test_first_queued_message_shape(live) -> None:
    GatedSynth.gate.clear()
    try:
        a = open_chat(live, payload(generation={"max_new_tokens": 8}))
        assert recv(a)["type"] == "queue_done"
        b = open_chat(live, payload())
        queued = recv(b)
        assert set(queued) == {"type", "position", "estimated_wait_s", "queue_length"}
        assert (queued["type"], queued["position"], queued["queue_length"]) == ("queued", 1, 1)
        b.close()
    finally:
        GatedSynth.gate.set()
    assert until_closed(a)[-1]["type"] == "done"
    a.close()
    live.wait_idle()


# -- leaving mid-reply ---------------------------------------------------------------------
def test_disconnect_mid_reply_stops_generation_and_speech_and_frees_kv(live) -> None:
    before = live.stats()
    started, cancelled = GatedSynth.num_started, GatedSynth.num_cancelled
    GatedSynth.gate.clear()
    try:
        ws = open_chat(live, payload(generation={"max_new_tokens": 900, "seed": 5}))
        while recv(ws)["type"] != "chunk":
            pass
        while GatedSynth.num_started == started:  # a sentence is being spoken (held by the gate)
            recv(ws)
        ws.close()
        after = live.wait_idle()
        # The engine counts an ended request just after freeing it (another thread): wait,
        # bounded, until this one is counted, then check how it ended.
        for _ in range(1000):
            if sum(after.requests_finished_total.values()) > sum(before.requests_finished_total.values()):
                break
            threading.Event().wait(0.01)
            after = live.stats()
        while GatedSynth.num_active:  # the speech job notices the cancel within one gate poll
            threading.Event().wait(0.01)
    finally:
        GatedSynth.gate.set()
    assert after.kv_used_bytes == 0 and after.num_running == 0
    finished = after.requests_finished_total
    assert finished.get("cancelled", 0) == before.requests_finished_total.get("cancelled", 0) + 1
    assert after.generation_tokens_total - before.generation_tokens_total < 900
    assert GatedSynth.num_cancelled == cancelled + 1


# -- errors ----------------------------------------------------------------------------------
def error_of(live, body: dict | str) -> str:
    with connect(ws_url(live), max_size=None) as ws:
        ws.send(body if isinstance(body, str) else json.dumps(body))
        messages = until_closed(ws)
    assert len(messages) == 1 and messages[0]["type"] == "error", messages
    return messages[0]["error"]


@pytest.fixture(scope="module")
def video_b64(tmp_path_factory: pytest.TempPathFactory) -> str:
    return base64.b64encode(video_bytes(tmp_path_factory.mktemp("v") / "v.mp4", seconds=2.0)).decode()


@pytest.mark.parametrize(
    ("part", "expected"),
    [
        ({"type": "image", "data": "IMAGE"}, "cannot take image input"),
        ({"type": "audio", "data": "AUDIO"}, "cannot take audio input"),
        ({"type": "video", "data": "VIDEO"}, "cannot take video input"),
        ({"type": "audio", "data": base64.b64encode(b"\0" * 7).decode()}, "not a multiple of 4"),
        ({"type": "audio", "data": pcm_b64([0.1, float("nan")])}, "NaN or infinite"),
        ({"type": "audio", "data": "AUDIO", "sample_rate": 50}, "sample_rate 50"),
        ({"type": "image", "data": base64.b64encode(b"GIF? no").decode()}, "not a readable image"),
        ({"type": "video", "data": base64.b64encode(b"\0" * 100).decode()}, "not a readable video"),
        ({"type": "video", "data": "VIDEO", "stack_frames": 99}, "stack_frames 99"),
        ({"type": "sticker", "data": "x"}, "invalid request"),
    ],
)
def test_media_errors_name_the_part_model_and_modality(live, video_b64: str, part: dict, expected: str) -> None:
    data = {"IMAGE": png_b64(), "AUDIO": pcm_b64(tone(0.2)), "VIDEO": video_b64}
    part = {k: data.get(v, v) if isinstance(v, str) else v for k, v in part.items()}
    error = error_of(live, payload(content=[{"type": "text", "text": "What is this?"}, part]))
    assert expected in error
    if "cannot take" in expected:
        assert f"the model '{live.client.model_info.name}'" in error and "messages[1].content[1]" in error


def test_spec_example_with_reference_voice_is_refused_clearly(live) -> None:
    system = [
        {"type": "text", "text": "Mimic the voice from the audio sample."},
        {"type": "audio", "data": pcm_b64(tone(0.5))},
        {"type": "text", "text": "Reply naturally."},
    ]
    error = error_of(
        live,
        {
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            "tts": {"enabled": True, "mode": "audio_assistant"},
        },
    )
    assert "cannot take audio input" in error and "messages[0].content[1]" in error


@pytest.mark.parametrize(
    ("tts", "expected"),
    [
        ({"mode": "voice_cloning"}, "supported modes: default, audio_assistant"),
        ({"ref_audio_data": "AAAAAA=="}, "cannot speak in a reference voice"),
        ({"ref_audio_path": "/tmp/ref.wav"}, "cannot speak in a reference voice"),
        ({"language": "klingon"}, "tts.language 'klingon' has no voice"),
    ],
)
def test_speech_settings_that_cannot_be_honoured(live, tts: dict, expected: str) -> None:
    assert expected in error_of(live, payload(tts={"enabled": True, **tts}))


def test_request_errors(live) -> None:
    assert "not valid JSON" in error_of(live, "{nope")
    assert "temprature" in error_of(live, payload(generation={"temprature": 1}))
    assert "generation: 'top_p' must be in (0, 1]" in error_of(live, payload(generation={"top_p": 0}))
    assert "Service not ready" not in error_of(live, payload(generation={"max_new_tokens": 0}))
    live.wait_idle()


# -- recordings, reference audio, client -------------------------------------------------------
def test_recording_is_stored_and_served(live) -> None:
    # 32 seeded tokens at least: words to speak, whatever the random model would sample first.
    messages = chat(live, payload(generation={"max_new_tokens": 32, "min_new_tokens": 32, "seed": 1}))
    done = messages[-1]
    rid = done["recording_session_id"]
    assert re.fullmatch(r"chat_[0-9a-f]{16}", rid)
    record = httpx.get(f"{live.url}/api/recordings/{rid}").json()
    assert record["text"] == done["text"] and record["generated_tokens"] == done["generated_tokens"]
    assert record["request"]["messages"][1]["content"] == "Hello!"
    wav = httpx.get(f"{live.url}{record['audio']['url']}")
    assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav"
    audio, rate = soundfile.read(__import__("io").BytesIO(wav.content), dtype="float32")
    streamed = np.concatenate([pcm(m) for m in messages if m["type"] == "chunk" and "audio_data" in m])
    assert rate == SAMPLE_RATE_HZ and np.array_equal(audio, streamed)
    assert httpx.get(f"{live.url}/api/recordings/chat_0000000000000000").status_code == 404
    assert httpx.get(f"{live.url}/api/recordings/..%2Fetc").status_code == 404


def test_default_ref_audio_in_the_source_shape(live) -> None:
    info = httpx.get(f"{live.url}/api/default_ref_audio").json()
    assert set(info) == {"name", "duration", "sample_rate", "samples", "base64"}
    assert info["name"] == "ref.wav" and info["sample_rate"] == 16000
    samples = np.frombuffer(base64.b64decode(info["base64"]), dtype="<f4")
    assert len(samples) == info["samples"] and info["duration"] == round(len(samples) / 16000, 1) > 0.5


def test_rill_client_chat_prints_and_writes_wav(live, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "reply.wav"
    code = rill_main(
        [
            "client",
            "chat",
            "--url",
            ws_url(live),
            "--prompt",
            "Hello!",
            "--say",
            "--out",
            str(out),
            "--max-new-tokens",
            "32",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0 and captured.out.strip()
    info = soundfile.info(str(out))
    assert info.samplerate == SAMPLE_RATE_HZ and info.channels == 1 and info.frames > 0
    assert "s of speech written to" in captured.err
    live.wait_idle()
