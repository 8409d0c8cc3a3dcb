"""The OpenAI API over real loopback HTTP, against the scripted ``FakeClient``.

Covers the routes, every error status of the issue, streaming shapes, ``n``, logprobs,
keep-alive comments and disconnect = cancel. The same behaviour on the real engine is in
``test_openai_e2e.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .fakes import KV_BYTES_PER_REQUEST, MAX_CONTEXT, FakeClient, live_app


async def sse_events(response: httpx.Response) -> list[Any]:
    """Parsed ``data:`` payloads ("[DONE]" kept as a string) and ``":keep-alive"`` comments."""
    events: list[Any] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
        elif line.startswith(":"):
            events.append(":" + line[1:].strip())
    return events


@pytest.fixture
async def fake() -> FakeClient:
    return FakeClient()


async def test_models_lists_the_served_model(fake: FakeClient) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        listing = (await http.get("/v1/models")).json()
        assert listing["object"] == "list"
        assert [m["id"] for m in listing["data"]] == ["fake-model"]
        assert listing["data"][0]["max_model_len"] == MAX_CONTEXT
        assert (await http.get("/v1/models/fake-model")).json()["id"] == "fake-model"
        missing = await http.get("/v1/models/other")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "model_not_found"


async def test_completion_not_streamed(fake: FakeClient) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/completions", json={"model": "fake-model", "prompt": "a b c", "max_tokens": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["choices"] == [{"index": 0, "text": " w0 w1 w2", "logprobs": None, "finish_reason": "length"}]
        assert body["usage"]["prompt_tokens"] == 4  # BOS + three words
        assert body["usage"]["completion_tokens"] == 3 and body["usage"]["total_tokens"] == 7
        assert fake.requests[0].protocol == "openai_http"
        assert fake.requests[0].prompt_token_ids == fake.encode("a b c")


async def test_chat_stream_event_order_and_usage(fake: FakeClient) -> None:
    payload = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
               "stream": True, "stream_options": {"include_usage": True}}
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
    assert content == " w0 w1 w2"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert all("usage" not in c for c in chunks[:-1])
    # The chat template was applied by the adapter and its tokens sent (no second BOS).
    assert fake.requests[0].prompt_token_ids == fake.encode("<s> user: hi assistant:", add_special_tokens=False)


async def test_completion_stream_without_usage(fake: FakeClient) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}) as r:
            events = await sse_events(r)
    assert events[-1] == "[DONE]"
    assert [c["choices"][0]["text"] for c in events[:-1]] == [" w0", " w1"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in events[:-1])


async def test_n_choices_with_seeds_and_stop(fake: FakeClient) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/completions", json={"prompt": "q", "n": 3, "seed": 11, "max_tokens": 5,
                                                     "stop": "w2"})
        body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["text"] == " w0 w1 " and c["finish_reason"] == "stop" for c in body["choices"])
    assert [req.sampling.seed for req in fake.requests] == [11, 12, 13]
    assert all(req.sampling.stop == ["w2"] for req in fake.requests)
    assert body["usage"]["prompt_tokens"] == 2  # counted once for the three choices
    assert body["usage"]["completion_tokens"] == 9


async def test_multiple_prompts_and_token_prompts(fake: FakeClient) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/completions", json={"prompt": ["a", "b c"], "n": 2, "max_tokens": 1})
        assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
        assert r.json()["usage"]["prompt_tokens"] == 2 + 3
        r = await http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1})
        assert r.status_code == 200
    assert fake.requests[-1].prompt_token_ids == [5, 6, 7]


async def test_sampling_fields_reach_the_engine(fake: FakeClient) -> None:
    payload = {"prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "presence_penalty": 0.5,
               "frequency_penalty": 0.25, "repetition_penalty": 1.1, "seed": 3, "stop": ["a", "b"],
               "max_tokens": 2, "logit_bias": {"42": -100}}
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        assert (await http.post("/v1/completions", json=payload)).status_code == 200
        chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_completion_tokens": 4, "max_tokens": 9}
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
    s = fake.requests[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.max_tokens) == (0.5, 0.9, 40, 0.05, 3, 2)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, 0.25, 1.1)
    assert s.stop == ["a", "b"] and s.logit_bias == {42: -100.0}
    assert fake.requests[1].sampling.max_tokens == 4  # max_completion_tokens wins


async def test_default_max_tokens_is_the_rest_of_the_context_capped(fake: FakeClient) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        await http.post("/v1/completions", json={"prompt": "a b c"})
    assert fake.requests[0].sampling.max_tokens == MAX_CONTEXT - 4
    capped = FakeClient()
    async with live_app(capped, **{"http.max_tokens_cap": 5}) as url, httpx.AsyncClient(base_url=url) as http:
        await http.post("/v1/completions", json={"prompt": "a b c"})
        await http.post("/v1/completions", json={"prompt": "a", "max_tokens": 50})
    assert [r.sampling.max_tokens for r in capped.requests] == [5, 5]


async def test_logprobs_shapes(fake: FakeClient) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        comp = (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 1})).json()
        chat = (await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                              "max_tokens": 2, "logprobs": True,
                                                              "top_logprobs": 2})).json()
    lp = comp["choices"][0]["logprobs"]
    assert lp["tokens"] == ["<100>", "<101>"] and lp["token_logprobs"] == [-0.25, -0.25]
    assert lp["top_logprobs"][0] == {"<100>": -0.25, "<101>": -1.5}
    assert lp["text_offset"] == [0, 5]
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["<100>", "<101>"]
    assert content[0]["bytes"] == list(b"<100>")
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["<100>", "<101>"]
    assert fake.requests[1].sampling.logprobs == 2


# -- errors -----------------------------------------------------------------------------

def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def test_400_invalid_field_names_it(fake: FakeClient) -> None:
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


async def test_400_prompt_longer_than_context_names_both_lengths(fake: FakeClient) -> None:
    prompt = " ".join(["w"] * (MAX_CONTEXT + 10))
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/completions", json={"prompt": prompt}), 400)
    assert e["code"] == "context_length_exceeded"
    assert str(MAX_CONTEXT + 11) in e["message"] and str(MAX_CONTEXT) in e["message"]


async def test_400_chat_without_template(fake: FakeClient) -> None:
    bare = FakeClient(has_chat_template=False)
    async with live_app(bare) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400)
    assert "chat template" in e["message"]


async def test_404_unknown_model(fake: FakeClient) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404)
    assert e["code"] == "model_not_found" and "gpt-9" in e["message"] and e["param"] == "model"


async def test_413_body_too_large(fake: FakeClient) -> None:
    async with live_app(fake, **{"http.max_body_bytes": 1000}) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/completions", json={"prompt": "x" * 2000}), 413)
        assert "1000" in e["message"]

        async def chunked() -> Any:  # no Content-Length: the limit is enforced while reading
            for _ in range(10):
                yield b" " * 300

        _error(await http.post("/v1/completions", content=chunked()), 413)
    assert fake.requests == []


async def test_429_queue_full_with_retry_after(fake: FakeClient) -> None:
    fake.max_live = 2
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        r = await http.post("/v1/completions", json={"prompt": "x", "n": 3, "max_tokens": 2})
        e = _error(r, 429)
        assert r.headers["retry-after"] == "3"  # ceil(2.5)
        assert e["code"] == "queue_full"
        await asyncio.wait_for(fake.idle.wait(), 5)
        assert len(fake.aborted) == 2  # the two accepted choices were withdrawn
        await http.post("/v1/completions", json={"prompt": "x", "temperature": -1})
        metrics = (await http.get("/metrics")).text
    rejected = {s.labels["code"]: s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                if s.name == "rill_requests_rejected_total" and s.labels["protocol"] == "openai_http"}
    assert rejected == {"queue_full": 1, "invalid_request": 1}


async def test_503_while_loading(fake: FakeClient) -> None:
    fake.ready, info, fake.model_info = False, fake.model_info, None
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/completions", json={"prompt": "x"}), 503)
        assert e["code"] == "model_loading"
        assert (await http.get("/v1/models")).status_code == 503
        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        fake.ready, fake.model_info = True, info
        assert (await http.get("/health")).status_code == 200
        assert (await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})).status_code == 200


async def test_503_when_the_engine_is_dead_or_failed_to_load(fake: FakeClient) -> None:
    fake.ready = False  # model_info is set: it was loaded, then the engine stopped
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        e = _error(await http.post("/v1/completions", json={"prompt": "x"}), 503)
        assert e["code"] == "engine_dead" and "restart" in e["message"]
        fake.model_info, fake.load_error = None, RuntimeError("bad weights")  # type: ignore[attr-defined]
        e = _error(await http.get("/v1/models"), 503)
        assert e["code"] == "engine_dead" and "failed to load" in e["message"] and "weights" not in e["message"]


async def test_401_without_key_when_keys_are_set(fake: FakeClient, tmp_path: Any) -> None:
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
            ok = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                                 headers={"Authorization": f"Bearer {key}"})
            assert ok.status_code == 200
    assert len(fake.requests) == 2


async def test_generation_error_mid_stream_is_an_error_event(fake: FakeClient) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions", json={"prompt": "FAIL", "stream": True}) as r:
            events = await sse_events(r)
        r = await http.post("/v1/completions", json={"prompt": "FAIL"})
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == " w0 w1"  # outputs may coalesce
    assert events[-2]["error"]["type"] == "server_error" and events[-2]["error"]["code"] == "generation_error"
    assert events[-1] == "[DONE]"
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_error"


# -- streaming life cycle -----------------------------------------------------------------

async def test_keep_alive_comments_during_a_long_prefill(fake: FakeClient) -> None:
    fake.hold.clear()
    async with live_app(fake, **{"http.sse_keepalive_s": 0.01}) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True}) as r:
            lines: list[str] = []
            async for line in r.aiter_lines():
                lines.append(line)
                if line == ": keep-alive" and not fake.hold.is_set():
                    fake.hold.set()  # the first keep-alive ends the "prefill"
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert ": keep-alive" in lines[:first_data]  # a comment came before any token
    assert [json.loads(d)["choices"][0]["text"] for d in data[:-1]] == [" w0", " w1"]
    assert data[-1] == "[DONE]"


async def test_disconnect_mid_stream_aborts_at_once(fake: FakeClient) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        async with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 100_000,
                                                                "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break  # leave after the first token
        await asyncio.wait_for(fake.idle.wait(), 5)
        metrics = (await http.get("/metrics")).text
    assert len(fake.aborted) == 1
    values = {s.name: s.value for f in text_string_to_metric_families(metrics) for s in f.samples}
    assert values["rill_num_requests_running"] == 0 and values["rill_kv_cache_used_bytes"] == 0


async def test_disconnect_before_first_token_aborts_without_a_write(fake: FakeClient) -> None:
    # No token is ever produced, so only the http.disconnect watcher can notice the client left.
    fake.hold.clear()
    async with live_app(fake) as url:
        for stream in (True, False):
            async with httpx.AsyncClient(base_url=url) as http:
                task = asyncio.create_task(http.post("/v1/completions", json={"prompt": "x", "stream": stream}))
                while not fake.live:
                    await asyncio.sleep(0.005)
                task.cancel()  # closes the connection
                with pytest.raises(asyncio.CancelledError):
                    await task
            await asyncio.wait_for(fake.idle.wait(), 5)
    assert len(fake.aborted) == 2


async def test_many_disconnects_leave_nothing_running(fake: FakeClient) -> None:
    async def one(http: httpx.AsyncClient, probe: bool = False) -> float:
        async with http.stream("POST", "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "x"}], "max_tokens": 100_000, "stream": True}) as r:
            async for line in r.aiter_lines():
                if '"content":" w' in line:
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
        await asyncio.wait_for(fake.idle.wait(), 10)
        async with httpx.AsyncClient(base_url=url) as http:
            metrics = (await http.get("/metrics")).text
    assert len(fake.aborted) == 100
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    assert families["rill_num_requests_running"].samples[0].value == 0
    assert families["rill_kv_cache_used_bytes"].samples[0].value == 0
    cancelled = [s for s in families["rill_requests"].samples
                 if s.name == "rill_requests_total" and s.labels["finish_reason"] == "cancelled"]
    assert cancelled[0].value == 100 and cancelled[0].labels["protocol"] == "openai_http"
    assert used_while_live >= KV_BYTES_PER_REQUEST


@pytest.mark.parametrize("body", [
    b'{"prompt": "\xff\xfe"}',  # not UTF-8: was a 500 (UnicodeDecodeError)
    b'{"prompt": "x", "logit_bias": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # was a 500 (RecursionError)
    b'{"prompt": "\\ud800"}',
])
async def test_hostile_bodies_are_400s_not_500s(fake: FakeClient, body: bytes) -> None:
    async with live_app(fake) as url, httpx.AsyncClient(base_url=url) as http:
        for path in ("/v1/completions", "/v1/chat/completions"):
            e = _error(await http.post(path, content=body, headers={"content-type": "application/json"}), 400)
            assert e["type"] == "invalid_request_error"
            if path == "/v1/completions":  # chat refuses the missing messages (bytes of unknown fields are skipped)
                assert "JSON" in e["message"]
    assert fake.requests == []
