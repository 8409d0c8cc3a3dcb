"""The /ws/chat adapter over a real loopback socket, against the in-process engine client over
a ``FakeRunner`` (the real engine code, no model) and a recording synthesizer (no espeak):
engine failures, loading, binary requests, reasoning never spoken, HTTP helpers when nothing
is configured. Where a test needs a given reply, the fake model is scripted to write it."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile
from starlette.applications import Starlette
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from rill import config as rill_config
from rill.config import EngineConfig
from rill.frontend.asr import AsrService
from rill.frontend.inproc import InprocClient
from rill.frontend.ocr import OcrService, TesseractReader
from rill.protocols.chat_ws import adapter
from rill.server import Deps
from rill.testing.fake_client import fake_client, record_requests
from rill.testing.fake_runner import StepGate, fake_tokenizer, reply_script
from rill.testing.speech import ScriptedRecognizer
from rill.types import GenerateRequest
from tests.frontend.test_ocr import GatedReader, char_error_rate, needs_tesseract
from tests.helpers import serving, wait_until

from .media_samples import image_b64, pcm_b64, text_image, tone

THINKING_TEMPLATE = fake_tokenizer().chat_templates["default"] + "{% if enable_thinking %}<think>\n{% endif %}"
"""The fake model's chat template, opening the reasoning block in the generation prompt."""


class RecordingSynth:
    """Test double: records what it is asked to say; 10 samples of a constant per character."""

    name = "recording"
    voice = "constant"

    def __init__(self) -> None:
        self.spoken: list[str] = []

    def check(self, *, language: str | None, mode: str, has_ref_audio: bool) -> None:
        pass

    def synthesize(self, text: str, language: str | None, cancel: threading.Event) -> np.ndarray:
        self.spoken.append(text)
        return np.full(10 * len(text), 0.25, np.float32)


@dataclass
class Chat:
    """A served ``/ws/chat``: its URL, the engine client behind it, what the protocol submitted
    and what the synthesizer was asked to say."""

    url: str
    client: InprocClient
    requests: list[GenerateRequest]
    synth: RecordingSynth

    def reply_with(self, text: str, body: dict[str, Any] | None = None) -> list[int]:
        """Make the fake model answer ``body``'s messages with ``text`` then end of sequence;
        the prompt's token ids as the engine sees them."""
        request = body or BODY
        tokenizer = self.client.engine.tokenizer
        prompt = tokenizer.encode_chat(
            request["messages"], chat_template_kwargs={"enable_thinking": request.get("enable_thinking", False)}
        )
        self.client.engine.runner.script = reply_script(prompt, tokenizer.encode(text, add_special_tokens=False))
        return prompt

    def num_cancelled(self) -> int:
        """Requests the engine ended as cancelled (aborted)."""
        return self.client.stats().requests_finished_total.get("cancelled", 0)


@contextlib.asynccontextmanager
async def serve_chat(
    client_args: dict[str, Any] | None = None,
    asr: AsrService | None = None,
    ocr: OcrService | None = None,
    **settings: Any,
) -> AsyncIterator[Chat]:
    """``/ws/chat`` and its HTTP routes on a loopback port over ``fake_client(**client_args)``
    (``settings``: ``area.field`` config overrides; ``asr``: speech recognition, ``ocr``: text
    in images, None: off)."""
    async with fake_client(**(client_args or {})) as client:
        cfg = rill_config.load({"chat.chat_max_active": 1, **settings}, env={})
        synth = RecordingSynth()
        requests = record_requests(client)
        deps = Deps(config=cfg, client=client, speech_synth=synth, asr=asr, ocr=ocr)
        async with serving(Starlette(routes=adapter.routes(deps))) as port:
            yield Chat(f"127.0.0.1:{port}", client, requests, synth)


async def converse(chat: Chat, body: dict | bytes) -> tuple[list[dict], int | None]:
    """Send one request; every message until the server closes, and the close code."""
    messages: list[dict] = []
    async with connect(f"ws://{chat.url}/ws/chat", max_size=None) as ws:
        await ws.send(body if isinstance(body, bytes) else json.dumps(body))
        try:
            while True:
                messages.append(json.loads(await ws.recv()))
        except ConnectionClosed as exc:
            return messages, exc.rcvd.code if exc.rcvd is not None else None


BODY = {"messages": [{"role": "user", "content": "Hi"}]}


def texts(messages: list[dict]) -> str:
    """The text of the streamed chunks, joined."""
    return "".join(m.get("text_delta", "") for m in messages if m["type"] == "chunk")


async def test_reply_with_speech_in_order() -> None:
    async with serve_chat() as chat:
        prompt = chat.reply_with("Hello there. Bye.")
        messages, code = await converse(chat, BODY)
    kinds = [m["type"] for m in messages]
    assert kinds[:2] == ["queue_done", "prefill_done"] and kinds[-1] == "done" and code == 1000
    assert messages[1]["input_tokens"] == len(prompt)
    # One token per character, and the end of sequence, which writes no text.
    assert messages[-1] == {
        "type": "done",
        "text": "Hello there. Bye.",
        "generated_tokens": len("Hello there. Bye.") + 1,
        "input_tokens": len(prompt),
        "audio_data": None,
        "tts": {"synthesizer": "recording", "voice": "constant"},
    }
    assert texts(messages) == "Hello there. Bye."
    assert chat.synth.spoken == ["Hello there.", "Bye."]
    audio_chunks = [m for m in messages if m["type"] == "chunk" and "audio_data" in m]
    assert len(audio_chunks) == 2


def run_steps(gate: StepGate, num_steps: int) -> None:
    """Let the engine run ``num_steps`` steps and wait until it waits for the next, blocking
    the event loop the server runs on meanwhile: every output of those steps reaches the
    request's stream before the protocol reads it (a reader that lagged)."""
    target = gate.num_passed + num_steps
    gate.allow(num_steps)
    for _ in range(10_000):
        if gate.num_passed >= target and gate.is_waiting:
            return
        time.sleep(0.001)  # the engine thread's progress, polled and bounded
    raise AssertionError("the engine did not run the steps")


async def test_a_reader_that_lagged_still_gets_one_chunk_per_token() -> None:
    # The request stream folds the outputs of several steps into one when its reader lags;
    # the spec streams one chunk per token all the same.
    async with serve_chat() as chat:
        chat.reply_with("Hello there.")
        gate = chat.client.engine.runner.gate = StepGate()
        try:
            async with connect(f"ws://{chat.url}/ws/chat") as ws:
                await ws.send(json.dumps({**BODY, "tts": {"enabled": False}}))
                await wait_until(lambda: gate.is_waiting, attempts=3000, interval_s=0.01)  # the prefill step
                run_steps(gate, 4)  # four tokens, folded into one output
                gate.set()
                messages = []
                with contextlib.suppress(ConnectionClosed):
                    while True:
                        messages.append(json.loads(await ws.recv()))
        finally:
            gate.set()
    chunks = [m["text_delta"] for m in messages if m["type"] == "chunk"]
    assert chunks == list("Hello there.")  # one token (one character) each
    assert messages[-1]["text"] == "Hello there." and messages[-1]["generated_tokens"] == len("Hello there.") + 1


async def test_reasoning_is_shown_but_never_spoken() -> None:
    body = {**BODY, "enable_thinking": True}
    async with serve_chat() as chat:
        chat.reply_with("<think>secret plan. more.</think>Answer here. Done.", body)
        messages, _ = await converse(chat, body)
    assert "secret plan" in messages[-1]["text"]
    assert chat.synth.spoken == ["Answer here.", "Done."]


async def test_template_that_opens_the_thinking_block_is_honoured() -> None:
    body = {**BODY, "enable_thinking": True}
    async with serve_chat({"tokenizer": fake_tokenizer(chat_template=THINKING_TEMPLATE)}) as chat:
        prompt = chat.reply_with("hidden reasoning. </think>Spoken answer. ", body)
        assert chat.client.engine.tokenizer.decode(prompt).endswith("<think>\n")
        await converse(chat, body)
    assert chat.synth.spoken == ["Spoken answer."]
    assert chat.requests[0].chat_template_kwargs == {"enable_thinking": True}


async def test_binary_frame_request_is_accepted() -> None:
    async with serve_chat() as chat:
        chat.reply_with("ok.")
        messages, _ = await converse(chat, json.dumps({**BODY, "tts": {"enabled": False}}).encode())
    assert messages[-1]["type"] == "done" and messages[-1]["text"] == "ok."
    assert chat.synth.spoken == []


async def test_not_ready_while_loading() -> None:
    async with serve_chat({"loading": threading.Event()}) as chat:
        messages, close_code = await converse(chat, BODY)
    assert messages == [{"type": "error", "error": "Service not ready: the model is still loading"}]
    assert close_code == 1013 and chat.requests == []


class EngineCrash(BaseException):
    """Not an ``Exception``: the engine loop itself dies of it (as of a bug outside a step's guard)."""


async def test_a_dead_engine_or_failed_load_is_an_internal_error_not_loading() -> None:
    # Both were "Service not ready: the model is still loading" (try again later, forever).
    def crash(tokens: Any) -> None:
        raise EngineCrash("secret /etc/passwd")

    dead = [{"type": "error", "error": "Engine stopped; the server must be restarted"}]
    async with serve_chat() as chat:
        chat.client.engine.runner.script = crash
        first, _ = await converse(chat, BODY)  # the request the engine died in
        messages, close_code = await converse(chat, BODY)
    assert first[-1]["type"] == "error" and messages == dead and close_code == 1011
    assert all("secret" not in json.dumps(m) for m in first + messages)
    loading = threading.Event()
    loading.set()
    async with serve_chat({"loading": loading, "load_error": RuntimeError("no weights in /secret")}) as chat:
        with contextlib.suppress(Exception):
            await chat.client.wait_ready()
        assert await converse(chat, BODY) == (dead, 1011)


async def test_queue_full() -> None:
    async with serve_chat({"config": EngineConfig(model="fake", max_queue=1)}) as chat:
        held = chat.client.engine.runner.gate = threading.Event()  # nothing leaves the engine's queue
        waiting = await chat.client.generate(GenerateRequest(prompt="another protocol's request"))
        messages, close_code = await converse(chat, BODY)
        held.set()
        await waiting.aclose()
    assert messages[-1] == {"type": "error", "error": "Queue full"} and close_code == 1013
    assert not any(m["type"] == "done" for m in messages)


async def test_unexpected_error_is_generic_and_leaks_nothing() -> None:
    tokenizer = fake_tokenizer.__wrapped__()  # a tokenizer of its own, broken below

    def broken(*args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("secret /etc/passwd")

    tokenizer.encode = broken
    async with serve_chat({"tokenizer": tokenizer}) as chat:
        messages, close_code = await converse(chat, BODY)
    assert messages[-1] == {"type": "error", "error": "Internal server error"} and close_code == 1011
    assert len(chat.requests) == 1


def fail_after(chat: Chat, prompt: list[int], num_tokens: int, message: str) -> None:
    """Make the engine step fail once the request has ``num_tokens`` generated tokens (a model error)."""

    def script(tokens: Any) -> None:
        if len(tokens) >= len(prompt) + num_tokens:
            raise RuntimeError(message)

    chat.client.engine.runner.script = script


async def test_model_error_mid_reply_is_one_error_aborts_nothing_and_leaks_nothing() -> None:
    async with serve_chat() as chat:
        prompt = chat.reply_with("x")
        fail_after(chat, prompt, 2, "kernel 0xdead failed: secret")
        messages, close_code = await converse(chat, BODY)
        assert chat.num_cancelled() == 0  # the request had failed; closing its stream sends no abort
    assert messages[-1] == {"type": "error", "error": "Generation failed"} and close_code == 1000
    # The text of the two tokens may come merged with the failure (a slow reader): at most theirs.
    assert len(texts(messages)) <= 2 and not any(m["type"] == "done" for m in messages)
    assert all("secret" not in json.dumps(m) for m in messages)


async def test_time_limit_is_one_error() -> None:
    async with serve_chat(**{"http.request_timeout_s": 30.0}) as chat:
        # The engine's clock is an hour ahead: every time limit has passed at its first step.
        chat.client.engine.core.clock = lambda: time.monotonic() + 3600
        messages, close_code = await converse(chat, BODY)
    assert messages[-1] == {"type": "error", "error": "the request reached its time limit"} and close_code == 1000
    assert not any(m["type"] == "done" for m in messages)


async def test_generation_fields_reach_the_engine() -> None:
    async with serve_chat(**{"http.request_timeout_s": 30.0}) as chat:  # the token cap is the frontend's
        chat.reply_with("x")
        await converse(
            chat, {**BODY, "generation": {"max_new_tokens": 400, "temperature": 0.1, "repetition_penalty": 1.2}}
        )
    request = chat.requests[0]
    assert request.protocol == "chat_ws" and request.deadline_s == 30.0
    assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.repetition_penalty) == (
        400,
        0.1,
        1.2,
    )


async def test_http_helpers_when_nothing_is_configured() -> None:
    async with serve_chat() as chat, httpx.AsyncClient(base_url=f"http://{chat.url}") as http:
        assert (await http.get("/api/default_ref_audio")).status_code == 404
        assert (await http.get("/api/recordings/chat_0123456789abcdef")).status_code == 404


@pytest.mark.parametrize(
    "body",
    [
        b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b', "messages": []}',  # was a RecursionError: generic error and 1011
        b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
    ],
)
async def test_hostile_request_is_an_invalid_request_not_an_internal_error(body: bytes) -> None:
    async with serve_chat() as chat:
        messages, close_code = await converse(chat, body)
    assert len(messages) == 1 and messages[0]["type"] == "error" and messages[0]["error"].startswith("invalid request")
    assert close_code == 1000 and chat.requests == []


async def recording_ids(chat: Chat) -> list[str]:
    """The recording ids of one chat's ``done`` messages."""
    return [m["recording_session_id"] for m in (await converse(chat, BODY))[0] if m["type"] == "done"]


async def test_recordings_in_postgres_are_served_by_every_server_sharing_it(pg_url: str, tmp_path: Any) -> None:
    # With --database a recording is a row of the shared database, not a file in the folder of
    # the server that recorded it: another server on the same database serves it, audio too.
    settings = {"chat.record": True, "http.data_dir": str(tmp_path), "storage.database": pg_url}
    async with serve_chat(**settings) as chat, serve_chat(**settings) as other:
        chat.reply_with("Hello.")
        [done] = [m for m in (await converse(chat, BODY))[0] if m["type"] == "done"]
        async with httpx.AsyncClient(base_url=f"http://{other.url}") as http:
            reply = (await http.get(f"/api/recordings/{done['recording_session_id']}")).json()
            wav = await http.get(reply["audio"]["url"])
    assert reply["text"] == done["text"] and reply["request"] == BODY
    assert wav.status_code == 200 and wav.headers["content-type"] == "audio/wav"
    samples, rate = soundfile.read(io.BytesIO(wav.content))
    assert (rate, round(len(samples) / rate, 3)) == (reply["audio"]["sample_rate"], reply["audio"]["duration_s"])
    assert not (tmp_path / "recordings").exists()


async def test_recordings_stay_under_the_configured_cap(tmp_path: Any) -> None:
    # Issue 12 item 2: recordings stored every raw request with no cap or retention. With a
    # cap of two recordings' worth, the third chat's recording deletes the first.
    settings = {"chat.record": True, "http.data_dir": str(tmp_path)}
    async with serve_chat(**settings) as chat:
        chat.reply_with("Hello.")
        ids = await recording_ids(chat)
    size = sum(p.stat().st_size for p in (tmp_path / "recordings" / ids[0]).iterdir())
    async with serve_chat(**settings, **{"chat.record_max_bytes": str(2 * size + size // 2)}) as chat:
        chat.reply_with("Hello.")
        for _ in range(2):
            ids += await recording_ids(chat)
        kept = sorted(p.name for p in (tmp_path / "recordings").iterdir())
        assert kept == sorted(ids[1:])
        async with httpx.AsyncClient(base_url=f"http://{chat.url}") as http:
            assert (await http.get(f"/api/recordings/{ids[0]}")).status_code == 404
            assert (await http.get(f"/api/recordings/{ids[2]}")).status_code == 200


# -- speech recognition (a scripted recognizer; Whisper itself: test_voice_e2e.py) ----------
def voice_body(seconds: float = 0.5, **part: Any) -> dict[str, Any]:
    """A chat whose user message is one audio part (a tone the scripted recognizer "hears")."""
    audio = {"type": "audio", "data": pcm_b64(tone(seconds)), **part}
    return {
        "messages": [{"role": "user", "content": [audio]}],
        "generation": {"max_new_tokens": 4},
        "tts": {"enabled": False},
    }


async def test_what_was_heard_is_sent_first_and_takes_the_parts_place() -> None:
    recognizer = ScriptedRecognizer("what is the capital of france")
    async with serve_chat(asr=AsrService(recognizer)) as chat:
        body = voice_body(language="en")
        body["messages"][0]["content"] = [{"type": "text", "text": "Listen:"}, *body["messages"][0]["content"]]
        messages, code = await converse(chat, body)
    kinds = [m["type"] for m in messages]
    assert kinds[:3] == ["transcript", "queue_done", "prefill_done"] and kinds[-1] == "done" and code == 1000
    assert messages[0] == {
        "type": "transcript",
        "message_index": 0,
        "content_index": 1,
        "kind": "audio",
        "text": "what is the capital of france",
        "language": "en",
        "duration_s": 0.5,
        "speech_s": 0.5,
    }
    assert recognizer.calls == [(8000, "en")]
    assert chat.requests[0].messages[0].content == "Listen:\nwhat is the capital of france"


async def test_a_text_chat_streams_while_a_transcription_runs() -> None:
    gate = threading.Event()
    recognizer = ScriptedRecognizer(gate=gate)
    async with serve_chat(asr=AsrService(recognizer)) as chat:
        async with connect(f"ws://{chat.url}/ws/chat", max_size=None) as voice:
            await voice.send(json.dumps(voice_body()))
            await asyncio.to_thread(recognizer.started.wait, 30)
            # The transcription holds its worker thread until the gate opens; meanwhile a text
            # chat is served from start to end on the same event loop (and chat slot).
            text_messages, code = await converse(chat, {**BODY, "generation": {"max_new_tokens": 6}})
            assert [m["type"] for m in text_messages][-1] == "done" and code == 1000
            assert sum(1 for m in text_messages if m["type"] == "chunk") >= 1
            assert recognizer.num_running == 1 and len(chat.requests) == 1
            gate.set()
            voice_messages = []
            with contextlib.suppress(ConnectionClosed):
                while True:
                    voice_messages.append(json.loads(await voice.recv()))
    kinds = [m["type"] for m in voice_messages]
    assert kinds[:2] == ["transcript", "queue_done"] and kinds[-1] == "done"
    assert kinds.index("transcript") < kinds.index("prefill_done") < kinds.index("chunk")


async def test_a_busy_recognizer_refuses_with_try_again_later() -> None:
    gate = threading.Event()
    recognizer = ScriptedRecognizer(gate=gate)
    async with serve_chat(asr=AsrService(recognizer, max_pending=1)) as chat:
        async with connect(f"ws://{chat.url}/ws/chat", max_size=None) as first:
            await first.send(json.dumps(voice_body()))
            await asyncio.to_thread(recognizer.started.wait, 30)
            messages, code = await converse(chat, voice_body())
            gate.set()
            assert json.loads(await first.recv())["type"] == "transcript"
    assert code == 1013 and [m["type"] for m in messages] == ["error"]
    assert "speech recognition is busy" in messages[0]["error"]


async def test_leaving_during_a_transcription_cancels_it() -> None:
    gate = threading.Event()
    recognizer = ScriptedRecognizer(gate=gate)
    asr = AsrService(recognizer)
    async with serve_chat(asr=asr) as chat:
        async with connect(f"ws://{chat.url}/ws/chat", max_size=None) as voice:
            await voice.send(json.dumps(voice_body()))
            await asyncio.to_thread(recognizer.started.wait, 30)
        await wait_until(lambda: asr.num_pending == 0, attempts=3000, interval_s=0.005)
        assert recognizer.num_cancelled == 1 and asr.counters.num_cancelled_total == 1
        assert chat.requests == []  # nothing reached the engine


async def test_audio_without_speech_recognition_is_refused_as_before() -> None:
    async with serve_chat() as chat:
        messages, code = await converse(chat, voice_body())
    assert code == 1000 and [m["type"] for m in messages] == ["error"]
    assert "cannot take audio input" in messages[0]["error"]


# -- text in images (Tesseract itself; the tiny model end to end: test_ocr_e2e.py) ----------
SIGN = ["EMERGENCY EXIT", "Keep this door closed"]


def image_body(image: Any, question: str = "What does the sign say?") -> dict[str, Any]:
    """A chat whose user message is a question and one image part."""
    parts = [{"type": "text", "text": question}, {"type": "image", "data": image_b64(image)}]
    return {
        "messages": [{"role": "user", "content": parts}],
        "generation": {"max_new_tokens": 4},
        "tts": {"enabled": False},
    }


@needs_tesseract
async def test_text_read_in_an_image_is_sent_first_and_takes_the_parts_place() -> None:
    image = text_image(SIGN)
    async with serve_chat(ocr=OcrService(TesseractReader())) as chat:
        messages, code = await converse(chat, image_body(image))
    kinds = [m["type"] for m in messages]
    assert kinds[:3] == ["image_text", "queue_done", "prefill_done"] and kinds[-1] == "done" and code == 1000
    read = messages[0]
    assert (read["message_index"], read["content_index"]) == (0, 1)
    assert (read["width"], read["height"]) == image.size
    assert char_error_rate("\n".join(SIGN), read["text"]) <= 0.05, read["text"]
    assert read["prompt_text"] == f"[Text read from an image: {read['text']}]"
    assert chat.requests[0].messages[0].content == f"What does the sign say?\n{read['prompt_text']}"


@needs_tesseract
async def test_an_image_without_text_is_described_as_such() -> None:
    from PIL import Image

    async with serve_chat(ocr=OcrService(TesseractReader())) as chat:
        messages, _ = await converse(chat, image_body(Image.new("RGB", (320, 240), (30, 120, 200))))
    assert messages[0]["type"] == "image_text" and messages[0]["text"] == ""
    assert chat.requests[0].messages[0].content == "What does the sign say?\n[An image with no readable text]"


async def test_an_image_over_the_ocr_pixel_cap_is_refused_before_any_reading() -> None:
    reader = GatedReader()
    async with serve_chat(ocr=OcrService(reader, max_pixels=10_000)) as chat:
        messages, code = await converse(chat, image_body(text_image(SIGN)))
    assert code == 1000 and [m["type"] for m in messages] == ["error"]
    assert "messages[0].content[1] (image)" in messages[0]["error"] and "more pixels" in messages[0]["error"]
    assert reader.calls == 0 and chat.requests == []


async def test_a_text_chat_streams_while_an_image_is_read() -> None:
    reader = GatedReader()
    async with serve_chat(ocr=OcrService(reader)) as chat:
        async with connect(f"ws://{chat.url}/ws/chat", max_size=None) as reading:
            await reading.send(json.dumps(image_body(text_image(SIGN))))
            await asyncio.to_thread(reader.started.wait, 30)
            # The reading holds its worker thread until the gate opens; meanwhile a text chat
            # is served from start to end on the same event loop (and chat slot).
            text_messages, code = await converse(chat, {**BODY, "generation": {"max_new_tokens": 6}})
            assert [m["type"] for m in text_messages][-1] == "done" and code == 1000
            assert len(chat.requests) == 1 and chat.requests[0].messages[0].content == "Hi"
            reader.gate.set()
            image_messages = []
            with contextlib.suppress(ConnectionClosed):
                while True:
                    image_messages.append(json.loads(await reading.recv()))
    kinds = [m["type"] for m in image_messages]
    assert kinds[:2] == ["image_text", "queue_done"] and kinds[-1] == "done"
    assert chat.requests[1].messages[0].content.endswith("[Text read from an image: gated]")


async def test_leaving_while_an_image_is_read_sends_nothing_to_the_engine() -> None:
    reader = GatedReader()
    ocr = OcrService(reader)
    async with serve_chat(ocr=ocr) as chat:
        async with connect(f"ws://{chat.url}/ws/chat", max_size=None) as reading:
            await reading.send(json.dumps(image_body(text_image(SIGN))))
            await asyncio.to_thread(reader.started.wait, 30)
        # The running reading keeps its worker place until its thread is done.
        assert ocr.num_pending == 1
        reader.gate.set()
        await wait_until(lambda: ocr.num_pending == 0, attempts=3000, interval_s=0.005)
        assert chat.requests == [] and reader.calls == 1
