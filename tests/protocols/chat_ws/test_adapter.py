"""The /ws/chat adapter against a scripted engine client and a recording synthesizer (no
model, no espeak): engine failures, loading, binary requests, reasoning never spoken,
HTTP helpers when nothing is configured."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from rill import config as rill_config
from rill.errors import GenerationError, QueueFull, RillError
from rill.frontend.stream import RequestStream
from rill.protocols.chat_ws import adapter
from rill.server import Deps
from rill.types import GenerateRequest, ModelInfo, RequestEvent, RequestOutput, Usage


class ScriptedClient:
    """Replies with ``script`` (text pieces) one per loop turn; ``fail`` ends with that error."""

    load_error: BaseException | None = None  # EngineClient: set when the model failed to load

    def __init__(self, script: list[str], *, ready: bool = True, fail: BaseException | None = None,
                 raise_on_generate: BaseException | None = None, rendered: str = "<prompt>") -> None:
        self.model_info = ModelInfo(name="fake-chat", architecture="Fake", max_context_tokens=512, vocab_size=100,
                                    dtype="float32", device="cpu")
        self.script, self.ready, self.fail, self.raise_on_generate = script, ready, fail, raise_on_generate
        self.rendered = rendered
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []

    def is_ready(self) -> bool:
        return self.ready

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          **kwargs: Any) -> str:
        return self.rendered

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def generate(self, request: GenerateRequest) -> RequestStream:
        if self.raise_on_generate is not None:
            raise self.raise_on_generate
        self.requests.append(request)
        stream = RequestStream(self, f"r{len(self.requests)}", [1, 2, 3, 4], request.sampling)
        asyncio.get_running_loop().create_task(self._produce(stream))
        return stream

    async def _produce(self, stream: RequestStream) -> None:
        stream.put(RequestOutput(request_id=stream.request_id, events=[RequestEvent.PREFILL_DONE]))
        for i, piece in enumerate(self.script):
            await asyncio.sleep(0)
            stream.put(RequestOutput(request_id=stream.request_id, text=piece, token_ids=[10 + i],
                                     usage=Usage(prompt_tokens=4, completion_tokens=i + 1)))
        await asyncio.sleep(0)
        if self.fail is not None:
            stream.put(RequestOutput(request_id=stream.request_id, finished=True, finish_reason="error", error=self.fail))
        else:
            stream.put(RequestOutput(request_id=stream.request_id, finished=True, finish_reason="stop",
                                     usage=Usage(prompt_tokens=4, completion_tokens=len(self.script))))


class RecordingSynth:
    """Test double: records what it is asked to say; 10 samples of a constant per character."""

    name = "recording"

    def __init__(self) -> None:
        self.spoken: list[str] = []

    def check(self, *, language: str | None, mode: str, has_ref_audio: bool) -> None:
        pass

    def synthesize(self, text: str, language: str | None, cancel: threading.Event) -> np.ndarray:
        self.spoken.append(text)
        return np.full(10 * len(text), 0.25, np.float32)


def make_app(client: ScriptedClient, **settings: Any) -> tuple[TestClient, RecordingSynth]:
    cfg = rill_config.load({"chat.chat_max_active": 1, **settings}, env={})
    synth = RecordingSynth()
    deps = Deps(config=cfg, client=client, extras={adapter.SYNTH_EXTRA: synth})
    return TestClient(Starlette(routes=adapter.routes(deps))), synth


def converse(test_client: TestClient, body: dict | bytes) -> tuple[list[dict], int | None]:
    messages: list[dict] = []
    with test_client.websocket_connect("/ws/chat") as ws:
        if isinstance(body, bytes):
            ws.send_bytes(body)
        else:
            ws.send_text(json.dumps(body))
        try:
            while True:
                messages.append(ws.receive_json())
        except WebSocketDisconnect as exc:
            return messages, exc.code


BODY = {"messages": [{"role": "user", "content": "Hi"}]}


def test_reply_with_speech_in_order() -> None:
    app, synth = make_app(ScriptedClient(["Hello", " there.", " Bye."]))
    messages, code = converse(app, BODY)
    kinds = [m["type"] for m in messages]
    assert kinds[:2] == ["queue_done", "prefill_done"] and kinds[-1] == "done" and code == 1000
    assert messages[1]["input_tokens"] == 4
    assert messages[-1] == {"type": "done", "text": "Hello there. Bye.", "generated_tokens": 3, "input_tokens": 4,
                            "audio_data": None}
    assert synth.spoken == ["Hello there.", "Bye."]
    audio_chunks = [m for m in messages if m["type"] == "chunk" and "audio_data" in m]
    assert len(audio_chunks) == 2


def test_reasoning_is_shown_but_never_spoken() -> None:
    app, synth = make_app(ScriptedClient(["<think>", "secret plan. ", "more.</think>", "Answer here. ", "Done."]))
    messages, _ = converse(app, {**BODY, "enable_thinking": True})
    assert "secret plan" in messages[-1]["text"]
    assert synth.spoken == ["Answer here.", "Done."]


def test_template_that_opens_the_thinking_block_is_honoured() -> None:
    client = ScriptedClient(["hidden reasoning. ", "</think>", "Spoken answer. "], rendered="<|assistant|>\n<think>\n")
    app, synth = make_app(client)
    converse(app, {**BODY, "enable_thinking": True})
    assert synth.spoken == ["Spoken answer."]
    assert client.requests[0].chat_template_kwargs == {"enable_thinking": True}


def test_binary_frame_request_is_accepted() -> None:
    app, _ = make_app(ScriptedClient(["ok."]))
    messages, _ = converse(app, json.dumps({**BODY, "tts": {"enabled": False}}).encode())
    assert messages[-1]["type"] == "done" and messages[-1]["text"] == "ok."


@pytest.mark.parametrize(("client", "error", "code"), [
    (ScriptedClient([], ready=False), "Service not ready: the model is still loading", 1013),
    (ScriptedClient([], raise_on_generate=QueueFull()), "Queue full", 1013),
    (ScriptedClient([], raise_on_generate=RuntimeError("secret /etc/passwd")), "Internal server error", 1011),
    (ScriptedClient(["a", "b"], fail=GenerationError("kernel 0xdead failed")), "Generation failed", 1000),
    (ScriptedClient(["a"], fail=RillError("request ran past its deadline")), "request ran past its deadline", 1000),
])
def test_failures_send_one_error_and_close(client: ScriptedClient, error: str, code: int) -> None:
    app, _ = make_app(client)
    messages, close_code = converse(app, BODY)
    assert messages[-1] == {"type": "error", "error": error} and close_code == code
    assert not any(m["type"] == "done" for m in messages)


def test_engine_failure_mid_reply_aborts_nothing_twice_and_leaks_nothing() -> None:
    client = ScriptedClient(["a"], fail=GenerationError("secret"))
    app, _ = make_app(client)
    messages, _ = converse(app, BODY)
    assert all("secret" not in json.dumps(m) for m in messages)
    assert client.aborted == []  # the request had finished; closing its stream sends no abort


def test_generation_fields_reach_the_engine() -> None:
    client = ScriptedClient(["x"])
    app, _ = make_app(client, **{"http.request_timeout_s": 30.0})  # the token cap is the frontend's
    converse(app, {**BODY, "generation": {"max_new_tokens": 400, "temperature": 0.1, "repetition_penalty": 1.2}})
    request = client.requests[0]
    assert request.protocol == "chat_ws" and request.deadline_s == 30.0
    assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.repetition_penalty) == (400, 0.1, 1.2)


def test_http_helpers_when_nothing_is_configured() -> None:
    app, _ = make_app(ScriptedClient([]))
    assert app.get("/api/default_ref_audio").status_code == 404
    assert app.get("/api/recordings/chat_0123456789abcdef").status_code == 404


@pytest.mark.parametrize("body", [
    b'{"x": ' + b"[" * 5000 + b"]" * 5000 + b', "messages": []}',  # was a RecursionError: generic error and 1011
    b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
])
def test_hostile_request_is_an_invalid_request_not_an_internal_error(body: bytes) -> None:
    client = ScriptedClient(["never"])
    app, _ = make_app(client)
    messages, close_code = converse(app, body)
    assert len(messages) == 1 and messages[0]["type"] == "error" and messages[0]["error"].startswith("invalid request")
    assert close_code == 1000 and client.requests == []


def test_recordings_stay_under_the_configured_cap(tmp_path: Any) -> None:
    # Issue 12 item 2: recordings stored every raw request with no cap or retention. With a
    # cap of two recordings' worth, the third chat's recording deletes the first.
    app, _ = make_app(ScriptedClient(["Hello."]), **{"chat.record": True, "http.data_dir": str(tmp_path)})
    [first_done] = [m for m in converse(app, BODY)[0] if m["type"] == "done"]
    size = sum(p.stat().st_size for p in (tmp_path / "recordings" / first_done["recording_session_id"]).iterdir())
    app, _ = make_app(ScriptedClient(["Hello."]), **{"chat.record": True, "http.data_dir": str(tmp_path),
                                                      "chat.record_max_bytes": str(2 * size + size // 2)})
    ids = [first_done["recording_session_id"]]
    for _ in range(2):
        ids += [m["recording_session_id"] for m in converse(app, BODY)[0] if m["type"] == "done"]
    kept = sorted(p.name for p in (tmp_path / "recordings").iterdir())
    assert kept == sorted(ids[1:])
    assert app.get(f"/api/recordings/{ids[0]}").status_code == 404 and app.get(f"/api/recordings/{ids[2]}").status_code == 200
