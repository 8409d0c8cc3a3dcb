"""The event loop stays free while a huge prompt is admitted (issue 12, item 6).

A gated tokenizer stands in front of the real one: a big tokenization blocks, in whatever
thread runs it, until the test opens the gate. Meanwhile the test asks ``/health`` and reads
the first token of another client's stream, which the engine only starts producing after
the big request is already blocked. Had the tokenizer run on the event loop, neither
could be answered and the test would fail on its read timeout (a hang guard, not a
measurement: nothing here depends on how fast the machine is).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from rill.errors import InvalidRequest
from tests.conftest import LiveServer, start_server

BIG_CHARS = 3_000_000
LIST_STOPPED = "the test's tokenizer stops a long prompt list here"
GATE_TIMEOUT_S = 300  # only reached if the test itself is broken


class GatedTokenizer:
    """Delegates to the real tokenizer; a big ``encode_batch`` (or chat render) waits for ``release``.

    A list of 1,000 prompts or more is refused once released (``InvalidRequest`` from inside
    the tokenizer): tokenized for real, 200,000 prompts would go on to be built into requests
    that the queue bound refuses anyway, 20 s of work that has nothing to do with this test.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()
        self.timed_out = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True, **kwargs: Any) -> list[list[int]]:
        if len(texts) >= 1000 or sum(map(len, texts)) >= 100_000:
            self._wait()
        if len(texts) >= 1000:
            raise InvalidRequest(LIST_STOPPED, field="prompt")
        return self.inner.encode_batch(texts, add_special_tokens=add_special_tokens, **kwargs)

    def apply_chat_template(self, messages: Sequence[Any], /, *args: Any, **kwargs: Any) -> str:
        self._wait()
        return self.inner.apply_chat_template(messages, *args, **kwargs)

    def _wait(self) -> None:
        self.entered.set()
        self.timed_out = not self.release.wait(GATE_TIMEOUT_S)


@pytest.fixture(scope="module")
def roomy_server(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """A server whose bounds let a 3 MB prompt and a 200k-prompt list reach the tokenizer."""
    live = start_server(
        tiny_model_dir, **{"engine.max_prompt_chars": 4_000_000, "http.max_choices_per_request": 200_000}
    )
    yield live
    live.stop()


@pytest.fixture
def gate(roomy_server: LiveServer) -> Iterator[GatedTokenizer]:
    """The gated tokenizer, installed where admission finds it (the engine's own copy stays)."""
    engine = roomy_server.client.engine
    real = engine.tokenizer
    gated = GatedTokenizer(real)
    engine.tokenizer = gated
    try:
        yield gated
    finally:
        gated.release.set()
        engine.tokenizer = real


def _big_requests() -> dict[str, tuple[str, dict[str, Any]]]:
    text = ("the quick brown fox jumps over the lazy dog " * (BIG_CHARS // 44 + 1))[:BIG_CHARS]
    return {
        "3MB-prompt": ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        "3MB-chat-message": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": text}], "max_tokens": 1},
        ),
        "200k-prompt-list": ("/v1/completions", {"prompt": [f"p{i} fox" for i in range(200_000)], "max_tokens": 1}),
    }


def _first_token(lines: Iterator[str]) -> str:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            text = json.loads(line[6:])["choices"][0]["text"]
            if text:
                return text
    raise AssertionError("the other stream ended without a token")


@pytest.mark.parametrize("case", list(_big_requests()))
def test_health_and_another_stream_are_served_while_a_huge_prompt_is_tokenized(
    roomy_server: LiveServer, gate: GatedTokenizer, case: str
) -> None:
    path, body = _big_requests()[case]
    outcome: dict[str, httpx.Response] = {}
    sender = threading.Thread(
        target=lambda: outcome.update(big=httpx.post(roomy_server.url + path, json=body, timeout=GATE_TIMEOUT_S))
    )
    other = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=roomy_server.url, timeout=60) as http, contextlib.ExitStack() as stack:
        with roomy_server.hold_engine():
            stream = stack.enter_context(http.stream("POST", "/v1/completions", json=other))
            assert stream.status_code == 200  # submitted and queued: no token exists yet
            sender.start()
            assert gate.entered.wait(GATE_TIMEOUT_S), "the big prompt never reached the tokenizer"
        # The engine runs again; its tokens reach the client only through the event loop.
        assert _first_token(stream.iter_lines())
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert not gate.release.is_set()  # both answered while the big prompt was still being tokenized
        gate.release.set()
    sender.join(GATE_TIMEOUT_S)
    assert not gate.timed_out
    big = outcome["big"]
    assert big.status_code == 400, big.text
    error = big.json()["error"]
    if case.startswith("3MB"):
        assert error["code"] == "context_length_exceeded"  # tokenized for real: 1.6M tokens
    else:
        assert error["message"] == LIST_STOPPED
    roomy_server.wait_idle(60)


class CountingTokenizer:
    """Delegates to the real tokenizer and counts every call that could tokenize a prompt."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        if name in ("encode", "encode_batch", "apply_chat_template"):
            self.calls += 1
        return getattr(self.inner, name)


async def test_a_prompt_over_the_character_bound_is_refused_before_tokenizing(server: LiveServer) -> None:
    from websockets.asyncio.client import connect

    bound = server.client.config.max_prompt_chars
    text = "x" * (bound + 1)
    engine = server.client.engine
    counting = CountingTokenizer(engine.tokenizer)
    engine.tokenizer = counting
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            completion = await http.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
            chat = await http.post(
                "/v1/chat/completions",
                json={
                    "messages": [
                        {"role": "user", "content": text[: bound // 2]},
                        {"role": "user", "content": text[: bound // 2 + 1]},
                    ],
                    "max_tokens": 1,
                },
            )
        async with connect(f"{server.ws_url}/generate", max_size=None) as ws:
            await ws.send(json.dumps({"type": "config", "prompt": text, "parameters": {"max_tokens": 1}}))
            ws_error = json.loads(await ws.recv())
    finally:
        engine.tokenizer = counting.inner
    for response in (completion, chat):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "--max-prompt-chars" in error["message"] and error["param"] == "prompt"
    assert ws_error["type"] == "error" and ws_error["error"] == "invalid_request"
    assert "--max-prompt-chars" in ws_error["message"]
    assert counting.calls == 0
    server.wait_idle()
