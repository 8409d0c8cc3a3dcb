"""``--max-prompt-logprobs-tokens`` on a real ``rill serve``: a request asking prompt logprobs
of a longer prompt gets a typed ``invalid_request`` (400, OpenAI's error shape, param
``prompt_logprobs``) before anything runs, streamed (SSE) or not, on completions and chat;
shorter prompts, and long ones without prompt logprobs, are served as before."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LiveServer, start_server

LIMIT = 24
LONG = (
    "Once upon a time there was a little fox who lived in a den under an old oak tree. Every morning "
    "the fox ran to the river to drink, and the birds sang songs about the sea and the sky."
)
SHORT = "A small fox"


@pytest.fixture(scope="module")
def limited(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """A server whose requests may ask prompt logprobs of at most ``LIMIT`` prompt tokens."""
    live = start_server(tiny_model_dir, **{"engine.max_prompt_logprobs_tokens": LIMIT})
    yield live
    live.stop()


def _tokens(server: LiveServer, prompt: str) -> int:
    response = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, timeout=60)
    assert response.status_code == 200, response.text
    return len(response.json()["tokens"])


def _assert_refused(response: httpx.Response, num_tokens: int) -> None:
    assert response.status_code == 400, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "prompt_logprobs"
    assert "--max-prompt-logprobs-tokens" in error["message"] and str(num_tokens) in error["message"]


def test_a_long_scored_prompt_is_refused_with_the_openai_error(limited: LiveServer) -> None:
    num_long = _tokens(limited, LONG)
    assert num_long > LIMIT >= _tokens(limited, SHORT)
    url = f"{limited.url}/v1/completions"
    # The audit's shape: echo with logprobs (prompt logprobs of the echoed prompt), n and best_of.
    for body in (
        {"prompt": LONG, "prompt_logprobs": 2, "max_tokens": 1},
        {"prompt": LONG, "echo": True, "logprobs": 5, "prompt_logprobs": 5, "n": 2, "best_of": 4, "max_tokens": 2},
        {"prompt": [SHORT, LONG], "echo": True, "logprobs": 1, "max_tokens": 1},
    ):
        _assert_refused(httpx.post(url, json=body, timeout=60), num_long)
    chat = httpx.post(
        f"{limited.url}/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": LONG}], "prompt_logprobs": 1, "max_tokens": 1},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_logprobs", chat.text
    limited.wait_idle()  # a refused request of several prompts left none of its choices behind


def test_a_streamed_echo_of_a_long_prompt_is_refused_before_any_event(limited: LiveServer) -> None:
    body = {"prompt": LONG, "echo": True, "logprobs": 2, "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{limited.url}/v1/completions", json=body, timeout=60) as response:
        response.read()
        _assert_refused(response, _tokens(limited, LONG))
    limited.wait_idle()


def test_short_scored_prompts_and_unscored_long_ones_are_served(limited: LiveServer) -> None:
    url = f"{limited.url}/v1/completions"
    scored = httpx.post(url, json={"prompt": SHORT, "prompt_logprobs": 1, "max_tokens": 1}, timeout=60)
    assert scored.status_code == 200, scored.text
    [choice] = scored.json()["choices"]
    assert len(choice["prompt_logprobs"]) == _tokens(limited, SHORT)
    plain = httpx.post(url, json={"prompt": LONG, "max_tokens": 2, "logprobs": 1}, timeout=60)
    assert plain.status_code == 200, plain.text
    events: list[dict[str, Any]] = []
    with httpx.stream(
        "POST", url, json={"prompt": SHORT, "echo": True, "logprobs": 1, "max_tokens": 2, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    assert events and "".join(e["choices"][0]["text"] for e in events if e["choices"]).startswith(SHORT)
    limited.wait_idle()
