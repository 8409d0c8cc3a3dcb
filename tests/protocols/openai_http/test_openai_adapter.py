"""The OpenAI API over real loopback HTTP, against the in-process engine client over a
``FakeRunner`` (the real engine code, no model; one character per token).

Covers the routes, every error status of the issue, streaming shapes, ``n``, logprobs,
keep-alive comments, disconnect = cancel, and a tool call the model writes as a JSON object. The same behaviour on the real engine is in
``test_openai_e2e.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from rill import config as config_mod
from rill import middleware, observability
from rill.config import EngineConfig, PolicyConfig
from rill.frontend.inproc import InprocClient
from rill.frontend.policy import SubmissionPolicy
from rill.protocols.openai_http import adapter
from rill.server import Parts, make_deps, make_parts
from rill.testing.fake_client import fake_client, record_requests
from rill.testing.fake_runner import fake_tokenizer, reply_script
from rill.types import GenerateRequest
from tests.helpers import serving, wait_until

MAX_CONTEXT = 1024
STEP_S = 0.005
"""Each engine step's pretend model time: a stream of the whole context lasts seconds."""


@dataclass
class Fake:
    """The client under test, what the protocol submitted to it, and the server's parts it was
    built with (its metrics sink and memory budget)."""

    client: InprocClient
    requests: list[GenerateRequest]
    parts: Parts

    @property
    def engine(self) -> Any:
        """The client's engine (``engine.runner`` is the ``FakeRunner``)."""
        return self.client.engine

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` by the engine's tokenizer."""
        return fake_tokenizer().encode(text, add_special_tokens=add_special_tokens)

    def is_idle(self) -> bool:
        """No request running or waiting in the engine."""
        stats = self.client.stats()
        return stats.num_running == 0 and stats.num_waiting == 0

    def num_cancelled(self) -> int:
        """Requests the engine ended as cancelled (aborted)."""
        return self.client.stats().requests_finished_total.get("cancelled", 0)

    def hold(self) -> threading.Event:
        """Hold every engine step (a long prefill) until the returned event is set."""
        gate = threading.Event()
        self.engine.runner.gate = gate
        return gate


@contextlib.asynccontextmanager
async def make_fake(
    config: EngineConfig | None = None, policy: PolicyConfig | None = None, **args: Any
) -> AsyncIterator[Fake]:
    """A ``Fake`` over ``fake_client`` (``args``: its keyword arguments), built as the server
    builds its client: with a submission policy of ``policy`` and the parts' metrics sink."""
    args.setdefault("max_len", MAX_CONTEXT)
    config = config or EngineConfig(model="fake")
    parts = make_parts(make_config())
    submission_policy = SubmissionPolicy(policy, config, memory=parts.memory)
    async with fake_client(config, policy=submission_policy, metrics=parts.metrics, **args) as client:
        if client.engine is not None:
            client.engine.runner.delay_s = STEP_S
        yield Fake(client, record_requests(client), parts)


async def idle(fake: Fake) -> None:
    """Wait until the engine has nothing running or waiting (a server-side effect)."""
    await wait_until(fake.is_idle, attempts=1000, interval_s=0.01)


def make_config(**overrides: Any) -> Any:
    """A server config for tests (no socket, no gRPC), with ``area.field`` overrides."""
    args = {"uds.no_socket": True, "evergreen.grpc_port": 0, "http.log_level": "warning"}
    args.update(overrides)
    return config_mod.load(args, env={})


@contextlib.asynccontextmanager
async def live_app(fake: Fake, **overrides: Any) -> AsyncIterator[str]:
    """This API, /health and the middleware on a loopback port; yields the base URL.

    Only this protocol's routes are mounted, so other protocols' work in progress cannot
    break these tests (the end-to-end tests use the whole server).
    """
    deps = make_deps(make_config(**overrides), fake.client, fake.parts)
    inner = Starlette(routes=[*observability.routes(deps), *adapter.routes(deps)])
    inner.state.deps = deps
    app = middleware.wrap(inner, deps, render_error=adapter.http_error)
    async with serving(app) as port:
        yield f"http://127.0.0.1:{port}"


def joined(chunks: list[Any]) -> str:
    """The completion text of streamed chunks (the ``[DONE]`` marker and errors skipped)."""
    return "".join(c["choices"][0]["text"] for c in chunks if isinstance(c, dict) and c.get("choices"))


def fail_after(fake: Fake, prompt: str, num_tokens: int) -> None:
    """Make the engine step fail once ``prompt`` has ``num_tokens`` tokens (a model error)."""
    num_prompt = len(fake.encode(prompt))

    def script(tokens: Any) -> None:
        if len(tokens) >= num_prompt + num_tokens:
            raise RuntimeError("the fake model failed")

    fake.engine.runner.script = script


def greedy_text(fake: Fake, prompt: str, num_tokens: int) -> str:
    """What greedy decoding of ``prompt`` writes on the fake model."""
    import numpy as np

    ids = fake.encode(prompt)
    out: list[int] = []
    for _ in range(num_tokens):
        out.append(int(np.argmax(fake.engine.runner.logits_after(ids + out))))
    return fake_tokenizer().decode(out)


async def sse_events(response: httpx.Response) -> list[Any]:
    """Parsed ``data:`` payloads ("[DONE]" kept as a string) and ``":keep-alive"`` comments."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
        elif line.startswith(":"):
            events.append(":" + line[1:].strip())
    return events


@pytest.fixture
async def fake() -> AsyncIterator[Fake]:
    async with make_fake() as made:
        yield made


async def test_models_lists_the_served_model(fake: Fake) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        listing = (await http.get("/v1/models")).json()
        assert listing["object"] == "list"
        # The served model, then the speech models of the audio routes (audio_api.py).
        assert [m["id"] for m in listing["data"]] == ["fake-model", "whisper-base", "piper-en_US-joe-medium"]
        assert listing["data"][0]["max_model_len"] == MAX_CONTEXT
        assert (await http.get("/v1/models/fake-model")).json()["id"] == "fake-model"
        missing = await http.get("/v1/models/other")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"


async def test_completion_not_streamed(fake: Fake) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/completions", json={"model": "fake-model", "prompt": "a b c", "max_tokens": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        [choice] = body["choices"]
        assert len(choice.pop("text")) == 3  # one character per token
        assert choice == {"index": 0, "logprobs": None, "finish_reason": "length"}
        assert body["usage"]["prompt_tokens"] == 6  # BOS + five characters
        assert body["usage"]["completion_tokens"] == 3 and body["usage"]["total_tokens"] == 9
        assert fake.requests[0].protocol == "openai_http"
        assert fake.requests[0].prompt_token_ids == fake.encode("a b c")


async def test_chat_stream_event_order_and_usage(fake: Fake) -> None:
    payload = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/chat/completions", json=payload) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = await sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(content) == 3
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert all("usage" not in c for c in chunks[:-1])
    # The chat template was applied by the adapter and its tokens sent (no second BOS).
    text = fake_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.startswith("<s>") and fake.requests[0].prompt_token_ids == fake.encode(text, add_special_tokens=False)


async def test_completion_stream_without_usage(fake: Fake) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}) as r:
            events = await sse_events(r)
    assert events[-1] == "[DONE]"
    assert len(joined(events)) == 2  # two tokens (outputs may coalesce)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in events[:-1])


async def test_n_choices_with_seeds_and_stop(fake: Fake) -> None:
    text = greedy_text(fake, "q", 5)
    stop = text[2:4]
    assert text.find(stop) == 2
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post(
            "/v1/completions", json={"prompt": "q", "n": 3, "seed": 11, "max_tokens": 5, "stop": stop, "temperature": 0}
        )
        body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == text[:2] and c["finish_reason"] == "stop" for c in body["choices"])
    assert [req.sampling.seed for req in fake.requests] == [11, 12, 13]
    assert all(req.sampling.stop == [stop] for req in fake.requests)
    assert body["usage"]["prompt_tokens"] == 2  # counted once for the three choices
    assert body["usage"]["completion_tokens"] == 3 * 4  # the stop string ends in each choice's fourth token


async def test_multiple_prompts_and_token_prompts(fake: Fake) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/completions", json={"prompt": ["a", "b c"], "n": 2, "max_tokens": 1})
        assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
        assert r.json()["usage"]["prompt_tokens"] == 2 + 4
        r = await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1})
        assert r.status_code == 200
    assert fake.requests[-1].prompt_token_ids == [5, 6, 7]


async def test_sampling_fields_reach_the_engine(fake: Fake) -> None:
    payload = {
        "prompt": "x",
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "seed": 3,
        "stop": ["a", "b"],
        "max_tokens": 2,
        "logit_bias": {"42": -100},
    }
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/v1/completions", json=payload)).status_code == 200
        chat = {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "max_completion_tokens": 4,
            "max_tokens": 9,
        }
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
    s = fake.requests[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.max_tokens) == (0.5, 0.9, 40, 0.05, 3, 2)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, 0.25, 1.1)
    assert s.stop == ["a", "b"] and s.logit_bias == {42: -100.0}
    assert fake.requests[1].sampling.max_tokens == 4  # max_completion_tokens wins


async def test_default_max_tokens_is_the_rest_of_the_context_capped(fake: Fake) -> None:
    fake.engine.runner.delay_s = 0.0  # the whole context is generated
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        await http.post("/v1/completions", json={"prompt": "a b c"})
    assert fake.requests[0].sampling.max_tokens == MAX_CONTEXT - 6
    async with make_fake(policy=PolicyConfig(max_tokens_cap=5)) as capped:  # --max-tokens-cap 5
        async with live_app(capped) as url, httpx.AsyncClient(base_url=url) as http:
            await http.post("/v1/completions", json={"prompt": "a b c"})
            await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 50})
    assert [r.sampling.max_tokens for r in capped.requests] == [5, 5]


async def test_logprobs_shapes(fake: Fake) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        comp = (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 1})).json()
        chat = (
            await http.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 2,
                    "logprobs": True,
                    "top_logprobs": 2,
                },
            )
        ).json()
    lp = comp["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == comp["choices"][0]["text"] and len(lp["tokens"]) == 2
    assert all(v <= 0 for v in lp["token_logprobs"])
    assert len(lp["top_logprobs"][0]) in (1, 2)  # the best token, and the chosen one when it differs
    assert max(lp["top_logprobs"][0].values()) >= lp["token_logprobs"][0]
    assert lp["text_offset"] == [0, 1]
    content = chat["choices"][0]["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == chat["choices"][0]["message"]["content"]
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    tops = content[0]["top_logprobs"]
    assert len(tops) == 2 and tops[0]["logprob"] >= tops[1]["logprob"]
    assert fake.requests[1].sampling.logprobs == 2


# -- errors -----------------------------------------------------------------------------


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_400_invalid_field_names_it(fake: Fake) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/completions", json={"prompt": "x", "temperature": -1}), 400)
        assert e["param"] == "temperature" and e["type"] == "invalid_request_error" and "temperature" in e["message"]
        e = _error(await http.post("/v1/completions", json={"prompt": "x", "top_p": "high"}), 400)
        assert e["param"] == "top_p"
        e = _error(await http.post("/v1/completions", content=b"{not json"), 400)
        assert "JSON" in e["message"]
        e = _error(await http.post("/v1/chat/completions", json={"messages": []}), 400)
        assert e["param"] == "messages"
        e = _error(await http.post("/v1/completions", json={"prompt": "x", "n": 0}), 400)
        assert e["param"] == "n"
    assert fake.requests == []


async def test_400_prompt_longer_than_context_names_both_lengths(fake: Fake) -> None:
    prompt = "w" * (MAX_CONTEXT + 10)
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/completions", json={"prompt": prompt}), 400)
    assert e["code"] == "context_length_exceeded"
    assert str(MAX_CONTEXT + 11) in e["message"] and str(MAX_CONTEXT) in e["message"]


async def test_400_chat_without_template(fake: Fake) -> None:
    async with make_fake(tokenizer=fake_tokenizer(with_chat_template=False)) as bare, live_app(bare) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            e = _error(
                await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400
            )
    assert "chat template" in e["message"]


async def test_404_unknown_model(fake: Fake) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert e["code"] == "model_not_found" and "gpt-9" in e["message"] and e["param"] == "model"


async def test_413_body_too_large(fake: Fake) -> None:
    async with live_app(fake, **{"http.max_body_bytes": 1000}) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/completions", json={"prompt": "x" * 2000}), 413)
        assert "1000" in e["message"]

        async def chunked() -> Any:  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield b" " * 300

        _error(await http.post("/v1/completions", content=chunked()), 413)
    assert fake.requests == []


async def test_429_queue_full_with_retry_after() -> None:
    async with make_fake(EngineConfig(model="fake", max_queue=2)) as fake, live_app(fake) as url:
        async with httpx.AsyncClient(base_url=url) as http:
            await _429_queue_full_with_retry_after(fake, http)


async def _429_queue_full_with_retry_after(fake: Fake, http: httpx.AsyncClient) -> None:
    held = fake.hold()  # nothing leaves the queue meanwhile
    r = await http.post("/v1/completions", json={"prompt": "x", "n": 3, "max_tokens": 2})
    e = _error(r, 429)
    assert r.headers["retry-after"] == "1"
    assert e["code"] == "queue_full"
    held.set()
    # The two accepted choices were withdrawn (counted once the engine has applied the aborts).
    await wait_until(lambda: fake.num_cancelled() == 2, attempts=1000, interval_s=0.01)
    await idle(fake)
    assert fake.client.stats().requests_finished_total == {"cancelled": 2}
    await http.post("/v1/completions", json={"prompt": "x", "temperature": -1})
    metrics = (await http.get("/metrics")).text
    rejected = {
        s.labels["code"]: s.value
        for f in text_string_to_metric_families(metrics)
        for s in f.samples
        if s.name == "rill_requests_rejected_total" and s.labels["protocol"] == "openai_http"
    }
    assert rejected == {"queue_full": 1, "invalid_request": 1}


async def test_503_while_loading() -> None:
    loading = threading.Event()
    async with make_fake(loading=loading) as fake, live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/completions", json={"prompt": "x"}), 503)
        assert e["code"] == "model_loading"
        assert (await http.get("/v1/models")).status_code == 503
        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        loading.set()
        await fake.client.wait_ready()
        assert (await http.get("/health")).status_code == 200
        assert (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code == 200


class EngineCrash(BaseException):
    """Not an ``Exception``: the engine loop itself dies of it (as of a bug outside a step's guard)."""


async def test_503_when_the_engine_is_dead_or_failed_to_load(fake: Fake) -> None:
    def crash(tokens: Any) -> None:
        raise EngineCrash

    fake.engine.runner.script = crash
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        first = await http.post("/v1/completions", json={"prompt": "x"})  # the request the engine died in
        assert first.status_code == 503 and first.json()["error"]["code"] == "engine_dead"
        e = _error(await http.post("/v1/completions", json={"prompt": "x"}), 503)
        assert e["code"] == "engine_dead" and "restart" in e["message"]
    loading = threading.Event()
    loading.set()
    async with make_fake(loading=loading, load_error=RuntimeError("bad weights")) as failed:
        await wait_until(lambda: failed.client.load_error is not None, attempts=500, interval_s=0.01)
        async with live_app(failed) as url, httpx.AsyncClient(base_url=url) as http:
            e = _error(await http.get("/v1/models"), 503)
    assert e["code"] == "engine_dead" and "failed to load" in e["message"] and "weights" not in e["message"]


async def test_401_without_key_when_keys_are_set(fake: Fake, tmp_path: Any) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\nfile-key\n")
    overrides = {"http.api_key": ["k1"], "http.api_key_file": str(key_file)}
    async with live_app(fake, **overrides) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/completions", json={"prompt": "x"}), 401)
        assert e["code"] == "invalid_api_key"
        bad = {"Authorization": "Bearer nope"}
        _error(await http.post("/v1/completions", json={"prompt": "x"}, headers=bad), 401)
        _error(await http.get("/v1/models"), 401)
        _error(await http.get("/metrics"), 401)
        assert (await http.get("/health")).status_code == 200
        for key in ("k1", "file-key"):
            ok = await http.post(
                "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"Authorization": f"Bearer {key}"}
            )
            assert ok.status_code == 200
    assert len(fake.requests) == 2


async def test_generation_error_mid_stream_is_an_error_event(fake: Fake) -> None:
    fail_after(fake, "FAIL", 2)
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions", json={"prompt": "FAIL", "stream": True}) as r:
            events = await sse_events(r)
        r = await http.post("/v1/completions", json={"prompt": "FAIL"})
    assert len(joined(events[:-2])) == 2  # outputs may coalesce
    assert events[-2]["error"]["type"] == "server_error" and events[-2]["error"]["code"] == "generation_error"
    assert events[-1] == "[DONE]"
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_error"


# -- streaming life cycle -----------------------------------------------------------------


async def test_keep_alive_comments_during_a_long_prefill(fake: Fake) -> None:
    held = fake.hold()
    async with live_app(fake, **{"http.sse_keepalive_s": 0.01}) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}) as r:
            lines: list[str] = []
            async for line in r.aiter_lines():
                lines.append(line)
                if line == ": keep-alive" and not held.is_set():
                    held.set()  # the first keep-alive ends the "prefill"
    data = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert ": keep-alive" in lines[:first_data]  # a comment came before any token
    assert len(joined([json.loads(d) for d in data[:-1]])) == 2
    assert data[-1] == "[DONE]"


async def test_disconnect_mid_stream_aborts_at_once(fake: Fake) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream(
            "POST", "/v1/completions", json={"prompt": "x", "max_tokens": 100_000, "stream": True}
        ) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break  # leave after the first token
        await idle(fake)
        metrics = (await http.get("/metrics")).text
    assert fake.num_cancelled() == 1
    values = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert values["rill_num_requests_running"] == 0 and values["rill_kv_cache_used_bytes"] == 0


async def test_disconnect_before_first_token_aborts_without_a_write(fake: Fake, monkeypatch: Any) -> None:
    # No token is produced while the step is held, so only the http.disconnect watcher can
    # notice the client left; its abort applies once the step ends (the request would
    # otherwise run on for the whole context).
    aborted: list[str] = []
    abort = fake.client.abort
    monkeypatch.setattr(fake.client, "abort", lambda request_id: (aborted.append(request_id), abort(request_id)))
    async with live_app(fake) as url:
        for num, stream in enumerate((True, False), start=1):
            held = fake.hold()
            async with httpx.AsyncClient(base_url=url) as http:
                task = asyncio.create_task(http.post("/v1/completions", json={"prompt": "x", "stream": stream}))
                await wait_until(
                    lambda: len(fake.requests) == num and fake.client.stats().num_running == 1,  # noqa: B023
                    attempts=1000,
                    interval_s=0.005,
                )
                task.cancel()  # closes the connection
                with pytest.raises(asyncio.CancelledError):
                    await task
            await wait_until(lambda: len(aborted) == num, attempts=1000, interval_s=0.005)  # noqa: B023 - awaited at once
            held.set()
            await idle(fake)
            assert fake.num_cancelled() == num
            assert fake.client.stats().generation_tokens_total <= num


async def test_many_disconnects_leave_nothing_running(fake: Fake) -> None:
    async def one(http: httpx.AsyncClient, probe: bool = False) -> float:
        async with http.stream(
            "POST",
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 100_000, "stream": True},
        ) as r:
            async for line in r.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break
            if not probe:
                return 0.0
            # While this stream lives, the KV gauge counts it (so the 0 below is not vacuous).
            live = {f.name: f for f in text_string_to_metric_families((await http.get("/metrics")).text)}
            return live["rill_kv_cache_used_bytes"].samples[0].value

    async with live_app(fake) as url:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as http:
            used_while_live = (await asyncio.gather(*(one(http, probe=i == 0) for i in range(100))))[0]
        await idle(fake)
        async with httpx.AsyncClient(base_url=url) as http:
            metrics = (await http.get("/metrics")).text
    assert fake.num_cancelled() == 100
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    assert families["rill_num_requests_running"].samples[0].value == 0
    assert families["rill_kv_cache_used_bytes"].samples[0].value == 0
    cancelled = [
        s
        for s in families["rill_requests"].samples
        if s.name == "rill_requests_total" and s.labels["finish_reason"] == "cancelled"
    ]
    assert cancelled[0].value == 100 and cancelled[0].labels["protocol"] == "openai_http"
    assert used_while_live > 0


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "\xff\xfe"}',  # not UTF-8: was a 500 (UnicodeDecodeError)
        b'{"prompt": "x", "logit_bias": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # was a 500 (RecursionError)
        b'{"prompt": "\\ud800"}',
    ],
)
async def test_hostile_bodies_are_400s_not_500s(fake: Fake, body: bytes) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            e = _error(await http.post(path, content=body, headers={"content-type": "application/json"}), 400)
            assert e["type"] == "invalid_request_error"
            if path == "/v1/completions":  # chat refuses the missing messages (bytes of unknown fields are skipped)
                assert "JSON" in e["message"]
    assert fake.requests == []


# -- a tool call written as a JSON object (tool_choice auto) ------------------------------------

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def reply_with(fake: Fake, text: str) -> None:
    """Make the fake model answer the last submitted request with ``text``, then end of sequence."""
    reply = fake.encode(text, add_special_tokens=False)

    def script(tokens: Any) -> int | None:
        return reply_script(fake.requests[-1].prompt_token_ids, reply)(tokens) if fake.requests else None

    fake.engine.runner.script = script


def _weather_chat(**fields: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
        "max_tokens": 200,
        **fields,
    }


async def test_a_reply_that_is_only_a_fenced_call_comes_back_as_tool_calls(fake: Fake) -> None:
    reply_with(fake, f"```json\n{CALL}\n```")
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        body = (await http.post("/v1/chat/completions", json=_weather_chat())).json()
        async with http.stream("POST", "/v1/chat/completions", json=_weather_chat(stream=True)) as r:
            events = await sse_events(r)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    chunks = [c for c in events[:-1] if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
    (streamed,) = [tc for c in chunks for tc in c["choices"][0]["delta"].get("tool_calls") or []]
    assert streamed["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_the_same_reply_is_the_answer_when_json_was_asked_for(fake: Fake) -> None:
    # Bare and compact: the constraint lets out JSON without free whitespace, and no fence.
    compact = CALL.replace(": ", ":").replace(", ", ",")
    reply_with(fake, compact)
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        auto = (await http.post("/v1/chat/completions", json=_weather_chat())).json()["choices"][0]
        shaped = _weather_chat(response_format={"type": "json_object"})
        body = (await http.post("/v1/chat/completions", json=shaped)).json()
        async with http.stream("POST", "/v1/chat/completions", json={**shaped, "stream": True}) as r:
            events = await sse_events(r)
    assert auto["finish_reason"] == "tool_calls", "without response_format the bare object is a call"
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == compact
    assert "tool_calls" not in choice["message"]
    chunks = [c for c in events[:-1] if c["choices"]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == compact
    assert not any(c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
