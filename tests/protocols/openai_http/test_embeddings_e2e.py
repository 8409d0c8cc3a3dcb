"""``POST /v1/embeddings`` on a real ``rill serve``: the tiny chat model beside all-MiniLM-L6-v2
(from the pinned wheel), over loopback.

The issue's "Done when": the ``openai`` client's ``embeddings.create`` (base64, its default,
and float; a batch; token ids) and LangChain's ``OpenAIEmbeddings`` get sentence-transformers'
vectors (cosine >= 0.999 on 100 texts). Bad requests get OpenAI's error shape with their
status; the embedding model is listed in ``/v1/models``; a chat stream keeps producing tokens
while the embedding worker is held inside a forward pass; a server without
``--embedding-model`` answers 404.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import tokenizers

from tests.conftest import LiveServer, start_server

NAME = "all-minilm-l6-v2"


@pytest.fixture(scope="module")
def embed_server(tiny_model_dir: Path, minilm_dir: Path) -> Iterator[LiveServer]:
    live = start_server(
        tiny_model_dir,
        **{
            "embeddings.embedding_model": str(minilm_dir),
            "embeddings.embedding_served_model_name": NAME,
            "embeddings.embedding_max_inputs": 128,
            "embeddings.embedding_max_queued_inputs": 512,
        },
    )
    yield live
    live.stop()


def _openai(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _cosines(a: Any, b: Any) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_openai_client_gets_sentence_transformers_vectors(
    embed_server: LiveServer, minilm_reference: tuple[list[str], np.ndarray]
) -> None:
    texts, expected = minilm_reference
    client = _openai(embed_server)
    answer = client.embeddings.create(model=NAME, input=texts)  # the client asks for base64 and decodes it
    assert answer.model == NAME and [d.index for d in answer.data] == list(range(100))
    vectors = [d.embedding for d in answer.data]
    assert _cosines(vectors, expected).min() >= 0.999
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > 100

    # Both encodings carry the same float32 numbers (the same inputs, batched alike).
    floats = client.embeddings.create(model=NAME, input=texts[:3], encoding_format="float")
    packed = client.embeddings.create(model=NAME, input=texts[:3])  # base64, decoded by the client
    assert [len(d.embedding) for d in floats.data] == [384] * 3
    np.testing.assert_array_equal(np.float32([d.embedding for d in floats.data]), [d.embedding for d in packed.data])
    raw = httpx.post(f"{embed_server.url}/v1/embeddings", json={"input": texts[4], "encoding_format": "base64"}).json()
    assert isinstance(raw["data"][0]["embedding"], str) and raw["object"] == "list" and raw["model"] == NAME
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vector.shape == (384,) and _cosines([vector], expected[4:5]).min() >= 0.999
    same = client.embeddings.create(model=NAME, input=texts[4], dimensions=384, encoding_format="float")
    np.testing.assert_array_equal(np.float32(same.data[0].embedding), vector)


def test_token_id_inputs(embed_server: LiveServer, minilm_dir: Path) -> None:
    tokenizer = tokenizers.Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    texts = ["Token ids go in as they are.", "Special tokens included."]
    ids = [tokenizer.encode(text).ids for text in texts]
    client = _openai(embed_server)
    by_text = [d.embedding for d in client.embeddings.create(model=NAME, input=texts).data]
    by_ids = client.embeddings.create(model=NAME, input=ids)
    assert _cosines([d.embedding for d in by_ids.data], by_text).min() > 0.99999
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))
    single = client.embeddings.create(model=NAME, input=ids[0]).data[0].embedding
    assert _cosines([single], by_text[:1]).min() > 0.99999


def test_langchain_openai_embeddings(embed_server: LiveServer, minilm_reference: tuple[list[str], np.ndarray]) -> None:
    from langchain_openai import OpenAIEmbeddings

    texts, expected = minilm_reference
    # check_embedding_ctx_length=False: otherwise LangChain counts tokens with tiktoken, whose
    # encodings it would download, and sends OpenAI's token ids instead of the texts.
    embeddings = OpenAIEmbeddings(
        model=NAME, base_url=f"{embed_server.url}/v1", api_key="unused", check_embedding_ctx_length=False
    )
    documents = embeddings.embed_documents(texts[:40])
    assert _cosines(documents, expected[:40]).min() >= 0.999
    assert _cosines([embeddings.embed_query(texts[50])], expected[50:51]).min() >= 0.999


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"input": []}, 400, "input", "invalid_request"),
        ({"input": [[]]}, 400, "input", "invalid_request"),
        ({"input": ["a", 1]}, 400, "input", "invalid_request"),
        ({}, 400, "input", "invalid_request"),
        ({"input": ["a"] * 129}, 400, "input", "invalid_request"),
        ({"input": "word " * 300}, 400, "input", "context_length_exceeded"),
        ({"input": [[101, 30522, 102]]}, 400, "input", "invalid_request"),
        ({"input": "a", "model": "text-embedding-3-small"}, 404, "model", "model_not_found"),
        ({"input": "a", "dimensions": 256}, 400, "dimensions", "invalid_request"),
        ({"input": "a", "dimensions": 0}, 400, "dimensions", "invalid_request"),
        ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format", "invalid_request"),
        ({"input": "a", "truncate_prompt_tokens": 1000}, 400, "truncate_prompt_tokens", "invalid_request"),
    ],
)
def test_bad_requests_get_the_openai_error_shape(
    embed_server: LiveServer, body: dict[str, Any], status: int, param: str, code: str
) -> None:
    response = httpx.post(f"{embed_server.url}/v1/embeddings", json={"model": NAME} | body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and error["message"]
    assert error["type"] == "invalid_request_error"


def test_truncate_prompt_tokens_cuts_instead_of_refusing(embed_server: LiveServer) -> None:
    body = {"model": NAME, "input": ["word " * 300, "short"], "truncate_prompt_tokens": -1}
    answer = httpx.post(f"{embed_server.url}/v1/embeddings", json=body, timeout=30).json()
    assert len(answer["data"]) == 2 and answer["usage"]["prompt_tokens"] == 256 + 3


def test_the_embedding_model_is_listed(embed_server: LiveServer) -> None:
    client = _openai(embed_server)
    listed = {model.id: model for model in client.models.list().data}
    assert set(listed) == {"tiny-llama", NAME, "whisper-base", "piper-en_US-joe-medium"}  # audio routes' too
    card = httpx.get(f"{embed_server.url}/v1/models/{NAME}").json()
    assert card["id"] == NAME and card["max_model_len"] == 256
    health = httpx.get(f"{embed_server.url}/health").json()
    assert health == {"status": "ok", "model": "tiny-llama", "embedding_model": NAME}


def test_a_chat_stream_keeps_going_while_a_batch_is_embedded(embed_server: LiveServer) -> None:
    service = embed_server.state["deps"].embeddings
    embedder = service.embedder
    inside, release = threading.Event(), threading.Event()
    original = embedder.pooled

    def held(batch: Any) -> np.ndarray:
        inside.set()
        assert release.wait(60), "the test never released the embedding worker"
        return original(batch)

    embedder.pooled = held
    answers: list[httpx.Response] = []
    batch = threading.Thread(
        target=lambda: answers.append(
            httpx.post(
                f"{embed_server.url}/v1/embeddings",
                json={"model": NAME, "input": [f"text number {i}" for i in range(128)]},
                timeout=120,
            )
        )
    )
    try:
        batch.start()
        assert inside.wait(60), "the embeddings request never reached a forward pass"
        # The worker is inside a forward pass of the batch: a whole chat stream runs meanwhile.
        events = []
        body = {
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "Tell me about rivers."}],
            "max_tokens": 16,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.stream("POST", f"{embed_server.url}/v1/chat/completions", json=body, timeout=60) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        # All 16 tokens came (a loaded machine may send several in one delta).
        assert events[-1]["usage"]["completion_tokens"] == 16
        choices = [e["choices"][0] for e in events if e["choices"]]
        assert choices[-1]["finish_reason"] == "length"
        assert "".join(c["delta"].get("content") or "" for c in choices)
        assert not answers and batch.is_alive()  # the batch is still held: the chat did not wait for it
    finally:
        release.set()
        batch.join(120)
        del embedder.pooled  # the class's method again
    assert answers[0].status_code == 200 and len(answers[0].json()["data"]) == 128


def test_without_an_embedding_model_the_route_says_how_to_get_one(server: LiveServer) -> None:
    response = httpx.post(f"{server.url}/v1/embeddings", json={"model": "x", "input": "hello"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["code"] == "model_not_found" and "--embedding-model" in error["message"]
    listed = [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]]
    assert listed == ["tiny-llama", "whisper-base", "piper-en_US-joe-medium"]


def test_an_embedding_model_that_cannot_load_stops_the_server(tiny_model_dir: Path) -> None:
    try:
        live = start_server(tiny_model_dir, wait_ready=False, **{"embeddings.embedding_model": "no-such-model"})
    except RuntimeError as exc:  # it failed before the port was even listening
        error: BaseException = exc
    else:
        live.thread.join(60)
        assert not live.thread.is_alive(), "the server kept running without its embedding model"
        error = live.state["error"]
    assert "--embedding-model 'no-such-model': no such folder" in str(error)
