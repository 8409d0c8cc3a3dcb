"""Per-request O(n) work of the OpenAI routes runs off the event loop (issue 31): the JSON
Schema validators of offered tools, and the decoding of echoed token-id prompts.

``text_call_check`` validates a reply written as a bare JSON call object against the tool's
``parameters``; building a validator (``check_schema``) of a 45 KB schema took ~300 ms, on
the loop, when the reply came. Now the adapter builds every offered tool's validator in the
frontend's grammar pool before the request starts.
"""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from rill.protocols.openai_http import tools
from tests.protocols.openai_http.test_openai_adapter import CALL, WEATHER_TOOL, live_app, make_fake, reply_with


async def test_tool_validators_are_built_in_the_grammar_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []
    real = tools._validator

    def recording(schema: dict[str, Any]) -> Any:
        threads.append(threading.current_thread())
        return real(schema)

    monkeypatch.setattr(tools, "_validator", recording)
    async with make_fake() as fake:
        reply_with(fake, CALL)
        other = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
        chat = {
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER_TOOL, other],
            "tool_choice": "auto",
            "max_tokens": 200,
        }
        async with live_app(fake) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = (await http.post("/v1/chat/completions", json=chat)).json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls", body  # the reply was checked, as before
    assert len(threads) == 2  # both offered tools, built once each
    assert all(t.name.startswith("rill-grammar") for t in threads), threads


class RecordingTokenizer:
    """Delegates to the real tokenizer; records the thread of every decode of more than one id."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.threads: list[threading.Thread] = []

    def decode(self, ids: Any, *args: Any, **kwargs: Any) -> str:
        if len(ids) > 1:
            self.threads.append(threading.current_thread())
        return self.inner.decode(ids, *args, **kwargs)

    def decode_batch(self, sequences: Any, *args: Any, **kwargs: Any) -> list[str]:
        self.threads.append(threading.current_thread())
        return self.inner.decode_batch(sequences, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_echoed_token_id_prompts_are_decoded_off_the_event_loop() -> None:
    async with make_fake() as fake:
        recorder = RecordingTokenizer(fake.engine.tokenizer)
        fake.engine.tokenizer = recorder
        ids = fake.encode("Once upon a time, far away", add_special_tokens=False)
        async with live_app(fake) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            body = (await http.post("/v1/completions", json={"prompt": ids, "echo": True, "max_tokens": 1})).json()
    assert body["choices"][0]["text"].startswith("Once upon a time, far away"), body
    assert recorder.threads and threading.main_thread() not in recorder.threads


@pytest.mark.parametrize("stream", [False, True])
async def test_a_scored_echo_is_built_off_the_event_loop(monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    """Echo with logprobs and prompt logprobs: the per-token entries (thousands for a long
    prompt, ~0.4 s of building for 3,885 tokens with 20 alternatives) are built in a worker,
    so the loop keeps writing other clients' streams meanwhile."""
    from rill.protocols.openai_http import session as session_module

    threads: list[threading.Thread] = []
    real = session_module.ResponseSession._echo

    def recording(self: Any, index: int) -> Any:
        threads.append(threading.current_thread())
        return real(self, index)

    monkeypatch.setattr(session_module.ResponseSession, "_echo", recording)
    async with make_fake() as fake:
        request = {
            "prompt": "Once upon a time, far away",
            "echo": True,
            "logprobs": 3,
            "max_tokens": 2,
            "stream": stream,
            **({} if stream else {"prompt_logprobs": 3}),
        }
        async with live_app(fake) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            reply = await http.post("/v1/completions", json=request)
    assert reply.status_code == 200 and "Once upon a time, far away" in reply.text, reply.text[:300]
    assert threads and threading.main_thread() not in threads
