"""``rill.frontend.metrics``: per-request histograms, scrape-time engine gauges, text format."""

from __future__ import annotations

import threading

from prometheus_client.parser import text_string_to_metric_families

from rill.config import EngineConfig
from rill.frontend.metrics import Metrics
from rill.testing.fake_client import FAKE_MODEL_NAME, fake_client
from rill.testing.fake_runner import StepGate
from rill.types import EngineStats, GenerateRequest, SamplingParams


class _Client:
    """Stats of the test's choosing: the gauges' arithmetic over exact values, and a client
    whose ``stats()`` fails (the in-process client over a FakeRunner stands in where the
    engine's own state is what a test needs)."""

    served_model_name = "m"

    def __init__(self, stats: EngineStats | None) -> None:
        self.value = stats

    def stats(self) -> EngineStats:
        if self.value is None:
            raise RuntimeError("engine not started")
        return self.value

    def replica_stats(self) -> dict[str, EngineStats]:
        return {}


def _samples(metrics: Metrics) -> dict[tuple[str, tuple], float]:
    """Samples by name and labels; each must carry ``model_name`` (checked, then left out of the key)."""
    found = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = dict(s.labels)
            assert labels.pop("model_name", None) == metrics.model_name(), (s.name, s.labels)
            found[(s.name, tuple(sorted(labels.items())))] = s.value
    return found


def test_request_figures_fill_histograms_and_counters() -> None:
    metrics = Metrics(_Client(EngineStats()))
    for reason in ("stop", "length", "stop"):
        metrics.observe_request(
            protocol="p",
            finish_reason=reason,
            queue_s=0.01,
            ttft_s=0.2,
            inter_token_s=[0.01, 0.02],
            e2e_s=1.5,
            num_prompt_tokens=3,
            num_generated_tokens=3,
        )
    metrics.observe_request(
        protocol="p",
        finish_reason="cancelled",
        queue_s=None,
        ttft_s=None,
        inter_token_s=[],
        e2e_s=0.1,
        num_prompt_tokens=3,
        num_generated_tokens=0,
    )
    s = _samples(metrics)
    p = (("protocol", "p"),)
    assert s[("rill_time_to_first_token_seconds_count", p)] == 3  # no first token, no TTFT sample
    assert s[("rill_request_queue_time_seconds_count", p)] == 3
    assert s[("rill_e2e_request_latency_seconds_count", p)] == 4
    assert s[("rill_inter_token_latency_seconds_count", p)] == 6
    assert abs(s[("rill_e2e_request_latency_seconds_sum", p)] - 4.6) < 1e-9
    assert s[("rill_requests_total", (("finish_reason", "stop"), ("protocol", "p")))] == 2
    assert s[("rill_requests_total", (("finish_reason", "cancelled"), ("protocol", "p")))] == 1
    assert not any(name.endswith("_created") for name, _ in s)


def test_engine_gauges_are_read_at_scrape_time() -> None:
    client = _Client(
        EngineStats(
            num_running=3,
            num_waiting=2,
            num_paused=1,
            kv_capacity_bytes=1000,
            kv_used_bytes=250,
            prefix_cache_queries_tokens=40,
            prefix_cache_hits_tokens=10,
            prompt_tokens_total=40,
            generation_tokens_total=99,
        )
    )
    metrics = Metrics(client)
    s = _samples(metrics)
    assert (
        s[("rill_num_requests_running", ())],
        s[("rill_num_requests_waiting", ())],
        s[("rill_num_requests_paused", ())],
    ) == (3, 2, 1)
    assert s[("rill_kv_cache_usage_perc", ())] == 0.25 and s[("rill_kv_cache_used_bytes", ())] == 250
    assert s[("rill_gpu_cache_usage_perc", ())] == 0.25  # vLLM's older name for the same fraction
    assert s[("rill_kv_cache_capacity_bytes", ())] == 1000
    assert s[("rill_prefix_cache_hit_ratio", ())] == 0.25
    assert s[("rill_prefix_cache_hits_total", ())] == 10 and s[("rill_prefix_cache_queries_total", ())] == 40
    assert s[("rill_prompt_tokens_total", ())] == 40 and s[("rill_generation_tokens_total", ())] == 99
    client.value = EngineStats(num_running=0)
    s = _samples(metrics)
    assert s[("rill_num_requests_running", ())] == 0
    assert s[("rill_kv_cache_usage_perc", ())] == 0 and s[("rill_prefix_cache_hit_ratio", ())] == 0  # no 0/0
    assert s[("rill_gpu_cache_usage_perc", ())] == 0


def test_scrape_survives_an_engine_without_stats() -> None:
    metrics = Metrics(_Client(None))
    metrics.observe_rejection(protocol="p", code="model_loading")
    s = _samples(metrics)
    assert s[("rill_requests_rejected_total", (("code", "model_loading"), ("protocol", "p")))] == 1
    assert ("rill_num_requests_running", ()) not in s


def test_each_server_has_its_own_registry() -> None:
    a, b = Metrics(_Client(EngineStats())), Metrics(_Client(EngineStats()))
    a.observe_rejection(protocol="p", code="x")
    assert ("rill_requests_rejected_total", (("code", "x"), ("protocol", "p"))) not in _samples(b)


async def test_vllm_named_request_histograms_and_the_model_label() -> None:
    # The in-process client over a FakeRunner: the label follows its model's load (the name it
    # will be served under, then the loaded model's), the gauges its engine's state (a request
    # held after its prefill holds KV).
    loading = threading.Event()
    async with fake_client(EngineConfig(model="/models/before-load"), loading=loading) as client:
        metrics = Metrics(client, model_name="ignored once a client is watched")
        assert metrics.model_name() == "before-load"
        loading.set()
        await client.wait_ready()
        gate = client.engine.runner.gate = StepGate()
        stream = await client.generate(GenerateRequest(prompt="x", sampling=SamplingParams(max_tokens=100)))
        gate.allow()  # the prefill
        await anext(aiter(stream))
        _observe_two_requests(metrics)
        stats = client.stats()
        s = _samples(metrics)
        await stream.aclose()
    _check_two_requests(s)
    assert (
        stats.kv_used_bytes > 0 and s[("rill_kv_cache_usage_perc", ())] == stats.kv_used_bytes / stats.kv_capacity_bytes
    )
    assert s[("rill_num_requests_running", ())] == 1
    assert metrics.model_name() == FAKE_MODEL_NAME  # _samples checked every sample carries it


def _observe_two_requests(metrics: Metrics) -> None:
    """Two requests' figures: one of 30 prompt and 7 generated tokens, one with no token."""
    metrics.observe_request(
        protocol="p",
        finish_reason="length",
        queue_s=0.5,
        ttft_s=1.0,
        inter_token_s=[0.1] * 6,
        e2e_s=2.0,
        num_prompt_tokens=30,
        num_generated_tokens=7,
        prefill_s=0.5,
        decode_s=0.9,
    )
    metrics.observe_request(
        protocol="q",
        finish_reason="stop",
        queue_s=0.1,
        ttft_s=None,
        inter_token_s=[],
        e2e_s=0.2,
        num_prompt_tokens=3,
        num_generated_tokens=0,
    )


def _check_two_requests(s: dict[tuple[str, tuple], float]) -> None:
    """The vLLM-named histograms and counters of ``_observe_two_requests``' figures."""
    p = (("protocol", "p"),)
    assert s[("rill_request_prompt_tokens_sum", p)] == 30 and s[("rill_request_prompt_tokens_count", p)] == 1
    assert s[("rill_request_prompt_tokens_bucket", (("le", "20.0"), *p))] == 0
    assert s[("rill_request_prompt_tokens_bucket", (("le", "50.0"), *p))] == 1
    assert s[("rill_request_generation_tokens_sum", p)] == 7
    assert s[("rill_request_max_num_generation_tokens_sum", p)] == 7
    assert s[("rill_request_prefill_time_seconds_sum", p)] == 0.5
    assert s[("rill_request_decode_time_seconds_sum", p)] == 0.9
    assert abs(s[("rill_request_inference_time_seconds_sum", p)] - 1.4) < 1e-9
    assert s[("rill_time_per_output_token_seconds_count", p)] == 6
    q = (("protocol", "q"),)
    assert s[("rill_request_generation_tokens_count", q)] == 1  # a request with no token still counts
    assert ("rill_request_prefill_time_seconds_count", q) not in s  # no first token: no prefill time
    assert s[("rill_request_success_total", (("finished_reason", "length"),))] == 1
    assert s[("rill_request_success_total", (("finished_reason", "stop"),))] == 1


def test_the_configured_name_labels_refusals_before_the_model_loads() -> None:
    metrics = Metrics(model_name="before-load")  # as the server makes it, before its engine client
    metrics.observe_rejection(protocol="p", code="model_loading")
    families = text_string_to_metric_families(metrics.render().decode())
    [sample] = [s for f in families for s in f.samples if s.name == "rill_requests_rejected_total"]
    assert sample.labels == {"model_name": "before-load", "protocol": "p", "code": "model_loading"}
