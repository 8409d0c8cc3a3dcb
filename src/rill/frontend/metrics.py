"""Prometheus metrics of rill (the only importer of ``prometheus_client``).

Two sources feed one registry per ``Metrics`` object (one per server, so tests can build
many servers in one process):

* per-request figures, pushed by the engine client through ``observe_request`` when a
  request ends (``MetricsSink``): latency histograms and ``rill_requests_total``;
* engine gauges and counters, pulled from ``client.stats()`` at scrape time by a custom
  collector, so they are never stale and cost nothing between scrapes.

Names follow Prometheus conventions: ``rill_`` prefix, base units (seconds, bytes, ratios),
``_total`` on counters.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("rill.metrics")

# ``*_created`` timestamp series double the output and no dashboard reads them (vLLM drops
# them too). The switch is process-wide; this module is rill's only prometheus_client user.
disable_created_metrics()

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""Content type of the text exposition format served at ``/metrics``."""

# Buckets reach further than vLLM's: on a CPU a long prefill takes seconds, not milliseconds.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The server's Prometheus registry; implements ``rill.frontend.client.MetricsSink``.

    Args:
        client: the engine client whose ``stats()`` the gauges read at scrape time.
        gate: the server's ``rill.connections.ConnectionGate`` (connection gauges), or None.
    """

    def __init__(self, client: Any, gate: Any = None) -> None:
        self.client = client
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = Histogram("rill_time_to_first_token_seconds", "Time from arrival to the first generated token",
                              ["protocol"], buckets=_TTFT_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("rill_inter_token_latency_seconds", "Time between two generated tokens",
                                     ["protocol"], buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("rill_e2e_request_latency_seconds", "Time from arrival to the end of a request",
                             ["protocol"], buckets=_E2E_BUCKETS, registry=self.registry)
        self.queue = Histogram("rill_request_queue_time_seconds", "Time a request waited before its first step",
                               ["protocol"], buckets=_QUEUE_BUCKETS, registry=self.registry)
        self.requests = Counter("rill_requests", "Finished requests by protocol and finish reason",
                                ["protocol", "finish_reason"], registry=self.registry)
        self.rejected = Counter("rill_requests_rejected", "Requests refused before reaching the engine, by error code",
                                ["protocol", "code"], registry=self.registry)
        self.registry.register(_EngineCollector(client))
        if gate is not None:
            self.registry.register(_ConnectionCollector(gate))

    def observe_request(
        self,
        *,
        protocol: str,
        finish_reason: str,
        queue_s: float | None,
        ttft_s: float | None,
        inter_token_s: list[float],
        e2e_s: float,
        num_prompt_tokens: int,
        num_generated_tokens: int,
    ) -> None:
        """Record one finished request (called by the engine client on the event loop)."""
        self.requests.labels(protocol, finish_reason).inc()
        self.e2e.labels(protocol).observe(max(0.0, e2e_s))
        if queue_s is not None:
            self.queue.labels(protocol).observe(max(0.0, queue_s))
        if ttft_s is not None:
            self.ttft.labels(protocol).observe(max(0.0, ttft_s))
        itl = self.inter_token.labels(protocol)
        for gap in inter_token_s:
            itl.observe(max(0.0, gap))

    def observe_rejection(self, *, protocol: str, code: str) -> None:
        """Count a request refused before it started (bad field, queue full, loading, ...)."""
        self.rejected.labels(protocol, code).inc()

    def render(self) -> bytes:
        """The registry in Prometheus text format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    """Reads ``client.stats()`` once per scrape and exposes it as gauges and counters."""

    def __init__(self, client: Any, gate: Any = None) -> None:
        self.client = client

    def describe(self) -> Iterable[Metric]:
        # Describing by collecting would call stats() at registration, before the engine runs.
        return []

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self.client.stats()
        except Exception:  # a scrape must not fail because the engine is loading or gone
            log.debug("engine stats unavailable", exc_info=True)
            return
        yield _gauge("rill_num_requests_running", "Requests in the running batch", stats.num_running)
        yield _gauge("rill_num_requests_waiting", "Requests waiting to be scheduled", stats.num_waiting)
        yield _gauge("rill_num_requests_paused", "Requests paused by their client", stats.num_paused)
        capacity = stats.kv_capacity_bytes
        yield _gauge("rill_kv_cache_usage_ratio", "Share of the KV cache held by live requests (0-1)",
                     stats.kv_used_bytes / capacity if capacity else 0.0)
        yield _gauge("rill_kv_cache_used_bytes", "KV cache bytes held by live requests", stats.kv_used_bytes)
        yield _gauge("rill_kv_cache_cached_bytes", "KV cache bytes held by reusable prefix-cache entries",
                     stats.kv_cached_bytes)
        yield _gauge("rill_kv_cache_capacity_bytes", "KV cache memory budget", capacity)
        queries, hits = stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens
        yield _gauge("rill_prefix_cache_hit_ratio", "Prompt tokens found in the prefix cache / prompt tokens looked up",
                     hits / queries if queries else 0.0)
        yield _counter("rill_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", queries)
        yield _counter("rill_prefix_cache_hits", "Prompt tokens found in the prefix cache", hits)
        yield _counter("rill_prompt_tokens", "Prompt tokens processed", stats.prompt_tokens_total)
        yield _counter("rill_generation_tokens", "Tokens generated", stats.generation_tokens_total)
        yield _counter("rill_engine_steps", "Engine steps run", stats.num_steps_total)
        yield _counter("rill_preemptions", "Requests preempted under KV memory pressure", stats.num_preemptions_total)
        yield _gauge("rill_engine_step_seconds", "Moving average of one engine step", stats.step_ms_ewma / 1000.0)


class _ConnectionCollector(Collector):
    """Open and refused client connections, read from the connection gate at scrape time."""

    def __init__(self, gate: Any) -> None:
        self.gate = gate

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        yield _gauge("rill_connections_open", "Client connections open, all listeners", self.gate.total)
        yield _counter("rill_connections_refused", "Client connections refused at the connection limits",
                       self.gate.refused)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
