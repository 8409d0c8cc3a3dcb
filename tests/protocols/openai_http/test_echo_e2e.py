"""``echo``, prompt logprobs, ``max_tokens`` 0 and ``best_of`` on a real ``rill serve``.

Prompt logprobs are checked against transformers' own forward pass over the same float32
checkpoint (the server's fixture model), through the token ids the server's ``/tokenize`` gives.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.conftest import LiveServer

PROMPT = (
    "Once upon a time there was a little fox who lived in a den under an old oak tree. Every morning "
    "the fox ran to the river to drink."
)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> torch.nn.Module:
    """The server's checkpoint in transformers, float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def _post(server: LiveServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def _completion(server: LiveServer, **body: Any) -> dict[str, Any]:
    response = _post(server, "/v1/completions", {"prompt": PROMPT, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _token_ids(server: LiveServer, prompt: str) -> list[int]:
    response = _post(server, "/tokenize", {"prompt": prompt})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def _reference_logprobs(reference: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)


def _streamed(server: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={"prompt": PROMPT, **body, "stream": True}, timeout=120
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :]))
    return chunks


def test_echo_logprobs_equal_transformers(server: LiveServer, reference: torch.nn.Module) -> None:
    ids = _token_ids(server, PROMPT)
    ref = _reference_logprobs(reference, ids)
    body = _completion(server, echo=True, logprobs=3, max_tokens=0)
    [choice] = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == len(ids)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # as OpenAI did
    diffs = [abs(lp["token_logprobs"][j] - ref[j - 1][ids[j]].item()) for j in range(1, len(ids))]
    assert max(diffs) < 1e-3, max(diffs)
    for j in range(1, len(ids)):
        top = lp["top_logprobs"][j]  # the prompt token and the 3 most likely, keyed by text (texts may repeat)
        assert lp["tokens"][j] in top and 1 <= len(top) <= 4
        assert math.isclose(max(top.values()), ref[j - 1].max().item(), abs_tol=1e-3)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    # The same prompt again is in the prefix cache, yet every position gets its logprob again.
    again = _completion(server, echo=True, logprobs=3, max_tokens=0)["choices"][0]["logprobs"]
    assert again["tokens"] == lp["tokens"]
    assert all(
        a is None and b is None or math.isclose(a, b, abs_tol=1e-5)
        for a, b in zip(again["token_logprobs"], lp["token_logprobs"])
    )
    server.wait_idle()


def test_echo_streamed_equals_not_streamed(server: LiveServer) -> None:
    body = {"echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    whole = _completion(server, **body)["choices"][0]
    chunks = _streamed(server, body)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole["text"] and text.startswith(PROMPT) and len(text) > len(PROMPT)
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)  # the echo comes first, whole
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for key in merged:
                merged[key] += (choice["logprobs"] or {}).get(key, [])
    assert merged["tokens"] == whole["logprobs"]["tokens"]
    assert merged["text_offset"] == whole["logprobs"]["text_offset"]
    assert len(merged["tokens"]) == len(_token_ids(server, PROMPT)) + 4
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    # n choices: each echoes the prompt with its logprobs, computed once (by the first choice).
    pair = _streamed(server, {**body, "n": 2})
    for index in (0, 1):
        mine = [c["choices"][0] for c in pair if c["choices"] and c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == whole["text"]
        values = [t for c in mine for t in c["logprobs"]["token_logprobs"]]
        assert values[0] is None and len(values) == len(whole["logprobs"]["token_logprobs"])
        # Batched with the other choice, the float sums differ in the last bits.
        assert all(
            math.isclose(a, b, abs_tol=1e-4) for a, b in zip(values[1:], whole["logprobs"]["token_logprobs"][1:])
        )
    # Without logprobs, echo is the prompt text only.
    assert _completion(server, echo=True, max_tokens=2)["choices"][0]["text"].startswith(PROMPT)
    server.wait_idle()


def test_vllm_prompt_logprobs_on_both_routes(server: LiveServer) -> None:
    ids = _token_ids(server, PROMPT)
    echoed = _completion(server, echo=True, logprobs=2, max_tokens=1)["choices"][0]["logprobs"]
    body = _completion(server, prompt_logprobs=2, max_tokens=1)
    [choice] = body["choices"]
    assert "logprobs" not in choice or choice["logprobs"] is None
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for j in range(1, len(ids)):
        entry = entries[j]
        assert str(ids[j]) in entry and 2 <= len(entry) <= 3
        mine = entry[str(ids[j])]
        assert math.isclose(mine["logprob"], echoed["token_logprobs"][j], abs_tol=1e-5)
        assert mine["decoded_token"] == echoed["tokens"][j]
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and mine["rank"] >= 1
    plain = _completion(server, max_tokens=1)["choices"][0]
    assert "prompt_logprobs" not in plain  # left out unless asked

    chat = _post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Tell me a story."}], "prompt_logprobs": 0, "max_tokens": 2},
    )
    assert chat.status_code == 200, chat.text
    chat_entries = chat.json()["prompt_logprobs"]
    assert chat_entries[0] is None and len(chat_entries) == chat.json()["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat_entries[1:])
    server.wait_idle()


def test_best_of_returns_the_candidate_with_the_highest_mean_logprob(server: LiveServer) -> None:
    body = {"max_tokens": 6, "temperature": 1.0, "seed": 11, "ignore_eos": True, "logprobs": 0}
    candidates = _completion(server, n=3, **body)["choices"]
    means = [sum(c["logprobs"]["token_logprobs"]) / 6 for c in candidates]
    assert len({c["text"] for c in candidates}) > 1
    best = _completion(server, n=1, best_of=3, **body)
    assert [c["text"] for c in best["choices"]] == [candidates[means.index(max(means))]["text"]]
    assert best["usage"]["completion_tokens"] == 18  # every candidate was generated
    two = _completion(server, n=2, best_of=3, **body)["choices"]
    order = sorted(range(3), key=lambda i: -means[i])[:2]
    assert [c["text"] for c in two] == [candidates[i]["text"] for i in order]
    assert [c["index"] for c in two] == [0, 1]
    server.wait_idle()


def test_openai_client_echo(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    result = client.completions.create(model="tiny-llama", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    assert result.choices[0].text == PROMPT
    assert result.choices[0].logprobs.token_logprobs[0] is None


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 99},
            "prompt_logprobs",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "hi", "best_of": 1, "n": 2}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "best_of": 1000}, "best_of"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 50}, "logprobs"),
    ],
)
def test_bad_input_is_an_openai_400_naming_the_field(server: LiveServer, path: str, body: dict, param: str) -> None:
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
