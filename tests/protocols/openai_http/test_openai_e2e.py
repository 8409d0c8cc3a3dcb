"""The OpenAI API on a real ``rill serve`` (tiny random-init model) over loopback.

These are the issue's "Done when" checks: the official ``openai`` client lists the model,
streams a chat completion and a completion and gets usage; errors keep their status and
body; 100 clients that leave mid-stream leave nothing running and no KV in use; ``/metrics``
parses and its histograms count this test's requests. Random weights write gibberish, so
only behaviour is asserted (event order, counts, equality between runs, errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import LiveServer, start_server


def _openai(server: LiveServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """Samples by name and labels; every sample must carry the served model's ``model_name``
    (checked here, then left out of the key)."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name", None) == "tiny-llama", (s.name, s.labels)
            found[(s.name, tuple(sorted(labels.items())))] = s.value
    return found


def test_openai_client_lists_streams_and_gets_usage(server: LiveServer) -> None:
    client = _openai(server)
    models = client.models.list().data
    # The chat model first, then the speech models of OpenAI's audio routes.
    assert [m.id for m in models[1:]] == ["whisper-base", "piper-en_US-joe-medium"]
    model = models[0].id

    # Sampled (temperature 1) from a random model: without ignore_eos an early end-of-sequence
    # token (~1 % of such 8-token replies) would break the exact counts below.
    no_eos = {"ignore_eos": True}
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Tell me about rivers."}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=no_eos,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 8
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    streamed_chat = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    pieces = list(
        client.completions.create(
            model=model,
            prompt="The river",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=no_eos,
        )
    )
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 6
    assert pieces[-2].choices[0].finish_reason == "length"
    streamed_text = "".join(p.choices[0].text for p in pieces if p.choices)

    # Greedy runs repeat: the non-streamed answers equal the streamed ones.
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me about rivers."}], max_tokens=8, temperature=0
    )
    again = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me about rivers."}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content == again.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    text = client.completions.create(model=model, prompt="The river", max_tokens=6, temperature=0)
    assert text.usage is not None and text.usage.prompt_tokens == pieces[-1].usage.prompt_tokens
    assert streamed_chat and streamed_text  # the random model still writes something
    server.wait_idle()


def test_seeded_choices_repeat_between_runs(server: LiveServer) -> None:
    client = _openai(server)
    model = client.models.list().data[0].id
    kwargs: dict[str, Any] = dict(model=model, prompt="Once", max_tokens=5, n=3, seed=7, temperature=1.0)
    first, second = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage is not None and first.usage.completion_tokens == 15
    lp = client.completions.create(model=model, prompt="Once", max_tokens=3, logprobs=2, temperature=0).choices[0]
    assert lp.logprobs is not None and len(lp.logprobs.tokens or []) == 3
    assert all(len(top) >= 2 for top in lp.logprobs.top_logprobs or [])
    server.wait_idle()


def test_errors_on_the_real_engine(server: LiveServer) -> None:
    client = _openai(server)
    model = client.models.list().data[0].id
    max_len = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="no-such-model", prompt="x")
    assert not_found.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=model, prompt="word " * (max_len + 50))
    message = too_long.value.body["message"]
    assert too_long.value.body["code"] == "context_length_exceeded"
    assert str(max_len) in message and any(ch.isdigit() for ch in message.replace(str(max_len), ""))
    with pytest.raises(openai.BadRequestError) as bad_field:
        client.completions.create(model=model, prompt="x", top_p=7)
    assert bad_field.value.body["param"] == "top_p"
    server.wait_idle()


def test_keys_and_limits_on_a_served_instance(tiny_model_dir: Path) -> None:
    live = start_server(tiny_model_dir, **{"http.api_key": ["sesame"], "http.max_body_bytes": 2048})
    try:
        assert httpx.get(f"{live.url}/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            _openai(live, key="wrong").models.list()
        refused = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        client = _openai(live, key="sesame")
        assert client.models.list().data
        big = httpx.post(
            f"{live.url}/v1/completions", json={"prompt": "x" * 5000}, headers={"Authorization": "Bearer sesame"}
        )
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    finally:
        live.stop()


def test_503_while_the_model_loads(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Hold the real loader on an event so "loading" lasts exactly as long as the test needs.
    from rill.frontend import inproc

    release = threading.Event()
    real_build = inproc.build_engine

    def slow_engine(*args: Any, **kwargs: Any) -> Any:
        release.wait(60)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(inproc, "build_engine", slow_engine)
    live = start_server(tiny_model_dir, wait_ready=False)
    try:
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        for response in (
            httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"}),
            httpx.post(f"{live.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}),
            httpx.get(f"{live.url}/v1/models"),
        ):
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "model_loading"
            assert response.headers["retry-after"] == "1"
        release.set()
        deadline = time.monotonic() + 60
        while httpx.get(f"{live.url}/health").status_code != 200:  # polls readiness, bounded
            assert time.monotonic() < deadline
            time.sleep(0.02)
        ok = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    finally:
        release.set()
        live.stop()


async def test_429_when_the_queue_is_full(tiny_model_dir: Path) -> None:
    # One sequence runs and one waits: with the engine held, a third request can only be refused.
    live = await asyncio.to_thread(start_server, tiny_model_dir, **{"engine.max_num_seqs": 1, "engine.max_queue": 1})
    body = {"prompt": "a long story", "max_tokens": 500, "ignore_eos": True, "stream": True}
    try:
        async with httpx.AsyncClient(base_url=live.url, timeout=60) as http, contextlib.AsyncExitStack() as stack:
            running = await stack.enter_async_context(http.stream("POST", "/v1/completions", json=body))
            assert running.status_code == 200
            lines = running.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass  # its first token: it has left the queue and holds the only sequence slot
            with live.hold_engine():
                waiting = await stack.enter_async_context(http.stream("POST", "/v1/completions", json=body))
                refused = await stack.enter_async_context(http.stream("POST", "/v1/completions", json=body))
                assert (waiting.status_code, refused.status_code) == (200, 429)
                await refused.aread()
                assert refused.headers["retry-after"].isdigit()
                assert refused.json()["error"]["code"] == "queue_full"
                assert refused.json()["error"]["type"] == "rate_limit_error"
        await asyncio.to_thread(live.wait_idle)
    finally:
        await asyncio.to_thread(live.stop)


async def test_hundred_disconnects_leave_no_running_request_and_no_kv(server: LiveServer) -> None:
    async def leave_after_first_token(http: httpx.AsyncClient) -> None:
        async with http.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "Tell a long story", "max_tokens": 400, "stream": True, "ignore_eos": True},
        ) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return  # leave mid-stream: the connection closes here

    before = _samples(httpx.get(f"{server.url}/metrics").text)
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
        await asyncio.gather(*(leave_after_first_token(http) for _ in range(100)))
    stats = await asyncio.to_thread(server.wait_idle)  # polls engine state until idle, bounded
    assert stats.num_running == 0 and stats.kv_used_bytes == 0
    after = _samples(httpx.get(f"{server.url}/metrics").text)
    assert after[("rill_num_requests_running", ())] == 0
    assert after[("rill_num_requests_waiting", ())] == 0
    assert after[("rill_kv_cache_used_bytes", ())] == 0
    assert after[("rill_kv_cache_usage_perc", ())] == 0
    key = ("rill_requests_total", (("finish_reason", "cancelled"), ("protocol", "openai_http")))
    assert after[key] - before.get(key, 0) == 100


def test_metrics_parse_and_histograms_count_the_requests(server: LiveServer) -> None:
    labels = (("protocol", "openai_http"),)
    names = [
        "rill_time_to_first_token_seconds_count",
        "rill_e2e_request_latency_seconds_count",
        "rill_request_queue_time_seconds_count",
    ]
    before = _samples(httpx.get(f"{server.url}/metrics").text)
    client = _openai(server)
    model = client.models.list().data[0].id
    for i in range(3):
        done = client.completions.create(
            model=model, prompt=f"metrics {i}", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert done.usage.completion_tokens == 4
    server.wait_idle()
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = _samples(response.text)
    for name in names:
        assert after[(name, labels)] - before.get((name, labels), 0) == 3, name
    itl = "rill_inter_token_latency_seconds_count"
    assert after[(itl, labels)] - before.get((itl, labels), 0) == 3 * 3  # 4 tokens → 3 gaps each
    for name in (
        "rill_num_requests_running",
        "rill_num_requests_waiting",
        "rill_num_requests_paused",
        "rill_kv_cache_usage_perc",
        "rill_kv_cache_used_bytes",
        "rill_kv_cache_capacity_bytes",
        "rill_prefix_cache_hit_ratio",
        "rill_prefix_cache_hits_total",
        "rill_prefix_cache_queries_total",
        "rill_prompt_tokens_total",
        "rill_generation_tokens_total",
    ):
        assert (name, ()) in after, name
    assert after[("rill_generation_tokens_total", ())] - before[("rill_generation_tokens_total", ())] == 12
    assert after[("rill_kv_cache_capacity_bytes", ())] > 0


# What vLLM's published Grafana dashboard (examples/online_serving/prometheus_grafana) and
# its newer KV gauge read, with the Prometheus type each must have.
VLLM_DASHBOARD = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
}


def _relabel(name: str) -> str:
    """The one ``metric_relabel_configs`` rule of docs/metrics.md, as Prometheus applies it
    (RE2, anchored at both ends, ``$1`` for the group)."""
    match = re.fullmatch(r"rill_(.*)", name)
    return "vllm:" + match.group(1) if match else name


def test_vllm_dashboard_names_after_one_relabel(server: LiveServer) -> None:
    before = _samples(httpx.get(f"{server.url}/metrics").text)
    client = _openai(server)
    model = client.models.list().data[0].id
    prompt_tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "dashboards"}).json()["count"]
    for _ in range(2):
        done = client.completions.create(
            model=model, prompt="dashboards", max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert done.usage is not None and done.usage.prompt_tokens == prompt_tokens
    server.wait_idle()
    text = httpx.get(f"{server.url}/metrics").text
    after = _samples(text)  # also checks model_name="tiny-llama" on every sample
    families = {_relabel(f.name): f.type for f in text_string_to_metric_families(text)}
    for name, kind in VLLM_DASHBOARD.items():
        family = name.removesuffix("_total") if kind == "counter" else name
        assert families.get(family) == kind, (name, families.get(family))
    labels = (("protocol", "openai_http"),)

    def grew(name: str, extra: tuple = ()) -> float:
        key = (name, tuple(sorted(labels + extra)))
        return after[key] - before.get(key, 0)

    assert grew("rill_request_prompt_tokens_sum") == 2 * prompt_tokens
    assert grew("rill_request_generation_tokens_sum") == 10
    assert grew("rill_request_generation_tokens_bucket", (("le", "5.0"),)) == 2
    assert grew("rill_request_generation_tokens_bucket", (("le", "2.0"),)) == 0
    for phase in ("prefill", "decode"):
        assert grew(f"rill_request_{phase}_time_seconds_count") == 2
        assert grew(f"rill_request_{phase}_time_seconds_sum") > 0
    success = ("rill_request_success_total", (("finished_reason", "length"),))
    assert after[success] - before.get(success, 0) == 2
