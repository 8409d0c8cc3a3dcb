"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes) on a real server.

Token ids are compared with the model's own tokenizer (``transformers``), so a route that
tokenized differently from generation, or dropped the chat template, would fail.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import LiveServer, start_server


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path) -> object:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def test_tokenize_prompt_matches_the_tokenizer_and_generation(server: LiveServer, hf_tokenizer: object) -> None:
    text = "The river runs to the sea."
    body = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()
    expected = hf_tokenizer(text)["input_ids"]  # type: ignore[operator]
    max_len = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    assert body == {"count": len(expected), "max_model_len": max_len, "tokens": expected}
    bare = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == hf_tokenizer(text, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    assert bare["count"] < body["count"]  # the tiny tokenizer adds a BOS
    # The same count the completions route reports as usage.
    done = httpx.post(f"{server.url}/v1/completions", json={"prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == body["count"]
    server.wait_idle()


def test_tokenize_messages_applies_the_chat_template(server: LiveServer, hf_tokenizer: object) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    body = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    assert body["tokens"] == hf_tokenizer(rendered, add_special_tokens=False)["input_ids"]  # type: ignore[operator]
    no_prompt = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert no_prompt["count"] < body["count"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == body["count"]
    server.wait_idle()


def test_detokenize_round_trips(server: LiveServer, hf_tokenizer: object) -> None:
    text = "Round trip, with punctuation!"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    body = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()
    assert body == {"prompt": hf_tokenizer.decode(tokens)}  # type: ignore[attr-defined]
    assert body["prompt"].strip() == text


@pytest.mark.parametrize(
    ("path", "payload", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other-model"}, "model"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_input_is_an_openai_400(server: LiveServer, path: str, payload: dict, param: str) -> None:
    response = httpx.post(f"{server.url}{path}", json=payload)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    assert error["param"] == param


def test_bounds_and_auth(tiny_model_dir: Path) -> None:
    live = start_server(tiny_model_dir, **{"engine.max_prompt_chars": 100, "http.api_key": ["sekrit-key-123"]})
    try:
        auth = {"Authorization": "Bearer sekrit-key-123"}
        refused = httpx.post(f"{live.url}/tokenize", json={"prompt": "hi"})
        assert refused.status_code == 401 and "error" in refused.json()
        assert httpx.post(f"{live.url}/detokenize", json={"tokens": [1]}).status_code == 401
        ok = httpx.post(f"{live.url}/tokenize", json={"prompt": "hi"}, headers=auth)
        assert ok.status_code == 200 and ok.json()["count"] >= 1
        big = httpx.post(f"{live.url}/tokenize", json={"prompt": "x" * 101}, headers=auth)
        assert big.status_code == 400 and big.json()["error"]["code"] is not None
        many = httpx.post(f"{live.url}/detokenize", json={"tokens": [1] * 101}, headers=auth)
        assert many.status_code == 400
        # Longer than the context but within the character bound: counted.
        long_live = start_server(tiny_model_dir, **{"engine.max_model_len": 64})
        try:
            counted = httpx.post(f"{long_live.url}/tokenize", json={"prompt": "word " * 200}).json()
            assert counted["count"] > 64 and counted["max_model_len"] == 64
        finally:
            long_live.stop()
    finally:
        live.stop()
