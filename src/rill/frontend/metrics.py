"""Prometheus metrics of rill (the only importer of ``prometheus_client``).

Two sources feed one registry per ``Metrics`` object (one per server, so tests can build
many servers in one process):

* per-request figures, pushed by the engine client through ``observe_request`` when a
  request ends (``MetricsSink``): latency, phase-time and token-count histograms and the
  finished-request counters; refusals counted by adapters through ``observe_rejection``;
* engine gauges and counters, pulled from ``client.stats()`` at scrape time by a custom
  collector, so they are never stale and cost nothing between scrapes.

Every metric carries a ``model_name`` label. Names follow Prometheus conventions (``rill_``
prefix, base units, ``_total`` on counters), and where vLLM has the same figure the name is
vLLM's with ``rill_`` in place of ``vllm:`` and the same type, so vLLM's Grafana dashboard
reads rill after one relabel rule (``docs/metrics.md``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

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

from rill.types import EngineStats

log = logging.getLogger("rill.metrics")

# ``*_created`` timestamp series double the output and no dashboard reads them (vLLM drops
# them too). The switch is process-wide; this module is rill's only prometheus_client user.
disable_created_metrics()  # type: ignore[no-untyped-call]

CONTENT_TYPE = CONTENT_TYPE_LATEST
"""Content type of the text exposition format served at ``/metrics``."""

# Buckets reach further than vLLM's: on a CPU a long prefill takes seconds, not milliseconds.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_PHASE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 240.0, 480.0, 960.0)
# 1, 2, 5, 10, 20, 50, ... as vLLM counts tokens per request; a prompt may hold up to
# --max-prompt-chars tokens, so the ladder goes to a million.
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5) if m * 10**e <= 1_000_000)

_REQUEST = ["model_name", "protocol"]


class EngineView(Protocol):
    """What the registry reads of the engine client (``rill.frontend.client.EngineClient`` has it)."""

    @property
    def served_model_name(self) -> str:
        """The ``model_name`` label."""
        ...

    def stats(self) -> EngineStats:
        """The engine's gauges and counters (may raise while there is no engine)."""
        ...

    def replica_stats(self) -> dict[str, EngineStats]:
        """Each engine replica's gauges and counters by replica id (empty for one in-process engine)."""
        ...


class GateView(Protocol):
    """What the registry reads of the connection gate (``rill.connections.ConnectionGate``)."""

    total: int
    refused: int
    evicted: int


class Metrics:
    """The server's Prometheus registry; implements ``rill.frontend.client.MetricsSink``.

    The server makes it before the engine client (which receives it as its sink) and then
    has it ``watch`` that client.

    Args:
        client: the engine client to ``watch`` now, or None (later).
        gate: the server's connection gate (connection gauges), or None.
        model_name: the ``model_name`` label until a client is watched.
        memory: the server's ``rill.frontend.budget.MemoryBudget`` (session-memory gauges), or None.
    """

    def __init__(
        self, client: EngineView | None = None, gate: GateView | None = None, model_name: str = "", memory: Any = None
    ) -> None:
        self.client: EngineView | None = None
        self.gate = gate
        self.default_model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.ttft = self._histogram(
            "rill_time_to_first_token_seconds", "Time from arrival to the first generated token", _TTFT_BUCKETS
        )
        self.inter_token = self._histogram(
            "rill_inter_token_latency_seconds", "Time between two generated tokens", _ITL_BUCKETS
        )
        self.per_output_token = self._histogram(
            "rill_time_per_output_token_seconds",
            "Time per generated token after the first (vLLM's older name of inter-token latency)",
            _ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "rill_e2e_request_latency_seconds", "Time from arrival to the end of a request", _E2E_BUCKETS
        )
        self.queue = self._histogram(
            "rill_request_queue_time_seconds", "Time a request waited before its first step", _QUEUE_BUCKETS
        )
        self.prefill = self._histogram(
            "rill_request_prefill_time_seconds", "Time from a request's first step to its first token", _PHASE_BUCKETS
        )
        self.decode = self._histogram(
            "rill_request_decode_time_seconds", "Time from a request's first token to its last", _PHASE_BUCKETS
        )
        self.inference = self._histogram(
            "rill_request_inference_time_seconds", "Time from a request's first step to its last token", _PHASE_BUCKETS
        )
        self.prompt_tokens = self._histogram(
            "rill_request_prompt_tokens", "Prompt tokens of each finished request", _TOKEN_BUCKETS
        )
        self.generation_tokens = self._histogram(
            "rill_request_generation_tokens", "Tokens generated by each finished request", _TOKEN_BUCKETS
        )
        self.max_generation_tokens = self._histogram(
            "rill_request_max_num_generation_tokens",
            "Most tokens generated by one sequence of a request (a rill request is one sequence)",
            _TOKEN_BUCKETS,
        )
        self.success = Counter(
            "rill_request_success",
            "Finished requests by finish reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.requests = Counter(
            "rill_requests",
            "Finished requests by protocol and finish reason",
            [*_REQUEST, "finish_reason"],
            registry=self.registry,
        )
        self.rejected = Counter(
            "rill_requests_rejected",
            "Requests refused before reaching the engine, by error code",
            [*_REQUEST, "code"],
            registry=self.registry,
        )
        if gate is not None:
            self.registry.register(_ConnectionCollector(gate, self.model_name))
        if memory is not None:
            self.registry.register(_MemoryCollector(memory, self.model_name))
        if client is not None:
            self.watch(client)

    def watch(self, client: EngineView) -> None:
        """Read ``client``'s gauges at scrape time and label everything with its
        ``served_model_name`` from now on (one client per registry; watching it again changes
        nothing)."""
        if self.client is client:
            return
        if self.client is not None:
            raise ValueError("this registry already watches another engine client")
        self.client = client
        self.registry.register(_EngineCollector(client, self.model_name))

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, _REQUEST, buckets=buckets, registry=self.registry)

    def model_name(self) -> str:
        """The ``model_name`` label: the watched client's ``served_model_name`` (the loaded
        model's name, or the name it will be served under), else ``model_name`` as given."""
        return self.client.served_model_name if self.client is not None else self.default_model_name

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
        prefill_s: float | None = None,
        decode_s: float | None = None,
    ) -> None:
        """Record one finished request (called by the engine client on the event loop)."""
        labels = (self.model_name(), protocol)
        self.requests.labels(*labels, finish_reason).inc()
        self.success.labels(labels[0], finish_reason).inc()
        self.e2e.labels(*labels).observe(max(0.0, e2e_s))
        for histogram, value in (
            (self.queue, queue_s),
            (self.ttft, ttft_s),
            (self.prefill, prefill_s),
            (self.decode, decode_s),
        ):
            if value is not None:
                histogram.labels(*labels).observe(max(0.0, value))
        if prefill_s is not None and decode_s is not None:
            self.inference.labels(*labels).observe(max(0.0, prefill_s + decode_s))
        self.prompt_tokens.labels(*labels).observe(num_prompt_tokens)
        self.generation_tokens.labels(*labels).observe(num_generated_tokens)
        self.max_generation_tokens.labels(*labels).observe(num_generated_tokens)
        itl, tpot = self.inter_token.labels(*labels), self.per_output_token.labels(*labels)
        for gap in inter_token_s:
            itl.observe(max(0.0, gap))
            tpot.observe(max(0.0, gap))

    def observe_rejection(self, *, protocol: str, code: str) -> None:
        """Count a request refused before it started (bad field, queue full, loading, ...)."""
        self.rejected.labels(self.model_name(), protocol, code).inc()

    def render(self) -> bytes:
        """The registry in Prometheus text format (``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


def _kv_usage(stats: EngineStats) -> float:
    capacity = stats.kv_capacity_bytes
    return stats.kv_used_bytes / capacity if capacity else 0.0


def _hit_ratio(stats: EngineStats) -> float:
    queries = stats.prefix_cache_queries_tokens
    return stats.prefix_cache_hits_tokens / queries if queries else 0.0


_ENGINE_METRICS: tuple[tuple[str, str, bool, Callable[[EngineStats], float]], ...] = (
    ("rill_num_requests_running", "Requests in the running batch", False, lambda s: s.num_running),
    ("rill_num_requests_waiting", "Requests waiting to be scheduled", False, lambda s: s.num_waiting),
    ("rill_num_requests_paused", "Requests paused by their client", False, lambda s: s.num_paused),
    ("rill_kv_cache_usage_perc", "Share of the KV cache held by live requests (0-1, as vLLM)", False, _kv_usage),
    # The same figure under vLLM's older name: its published dashboard's cache panel still
    # reads gpu_cache_usage_perc (a 0-1 fraction there too, whatever the device).
    (
        "rill_gpu_cache_usage_perc",
        "Share of the KV cache held by live requests (0-1, vLLM's older name)",
        False,
        _kv_usage,
    ),
    ("rill_kv_cache_used_bytes", "KV cache bytes held by live requests", False, lambda s: s.kv_used_bytes),
    (
        "rill_kv_cache_cached_bytes",
        "KV cache bytes held by reusable prefix-cache entries",
        False,
        lambda s: s.kv_cached_bytes,
    ),
    ("rill_kv_cache_capacity_bytes", "KV cache memory budget", False, lambda s: s.kv_capacity_bytes),
    (
        "rill_prefix_cache_hit_ratio",
        "Prompt tokens found in the prefix cache / prompt tokens looked up",
        False,
        _hit_ratio,
    ),
    (
        "rill_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache",
        True,
        lambda s: s.prefix_cache_queries_tokens,
    ),
    ("rill_prefix_cache_hits", "Prompt tokens found in the prefix cache", True, lambda s: s.prefix_cache_hits_tokens),
    ("rill_prompt_tokens", "Prompt tokens processed", True, lambda s: s.prompt_tokens_total),
    ("rill_generation_tokens", "Tokens generated", True, lambda s: s.generation_tokens_total),
    ("rill_engine_steps", "Engine steps run", True, lambda s: s.num_steps_total),
    (
        "rill_num_preemptions",
        "Requests preempted under KV memory pressure",
        True,
        lambda s: s.num_preemptions_total,
    ),
    (
        "rill_spec_decode_draft_tokens",
        "Speculative draft tokens verified",
        True,
        lambda s: s.spec_draft_tokens_total,
    ),
    (
        "rill_spec_decode_accepted_tokens",
        "Speculative draft tokens accepted (emitted as drafted)",
        True,
        lambda s: s.spec_accepted_tokens_total,
    ),
    ("rill_engine_step_seconds", "Moving average of one engine step", False, lambda s: s.step_ms_ewma / 1000.0),
    (
        "rill_engine_allied_processes",
        "Processes whose CPU the engine's thread governor counts as its own (a replica's front doors)",
        False,
        lambda s: s.allied_processes,
    ),
    (
        "rill_engine_linked_frontends",
        "Outputs streams to server processes on the replica's machine sent over a local socket rather than Ray",
        False,
        lambda s: s.linked_frontends,
    ),
)
"""Each engine figure: name, help, whether it is a counter, and how to read it from ``EngineStats``."""


class _EngineCollector(Collector):
    """Reads ``client.stats()`` once per scrape and exposes it as gauges and counters; with
    engine replicas (``rill.cluster``), also each replica's under ``rill_replica_*`` names with
    a ``replica`` label (the unlabelled families are the replicas' sum)."""

    def __init__(self, client: EngineView, model_name: Callable[[], str]) -> None:
        self.client = client
        self.model_name = model_name

    def describe(self) -> Iterable[Metric]:
        # Describing by collecting would call stats() at registration, before the engine runs.
        return []

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self.client.stats()
        except Exception:  # a scrape must not fail because the engine is loading or gone
            log.debug("engine stats unavailable", exc_info=True)
            return
        model = self.model_name()
        for name, doc, is_counter, read in _ENGINE_METRICS:
            yield (_counter if is_counter else _gauge)(model, name, doc, read(stats))
        per_replica = self.client.replica_stats()
        if not per_replica:
            return
        for name, doc, is_counter, read in _ENGINE_METRICS:
            family_name = name.replace("rill_", "rill_replica_", 1)
            family: GaugeMetricFamily | CounterMetricFamily
            if is_counter:
                family = CounterMetricFamily(
                    family_name, f"{doc} (one engine replica)", labels=["model_name", "replica"]
                )
            else:
                family = GaugeMetricFamily(family_name, f"{doc} (one engine replica)", labels=["model_name", "replica"])
            for replica, stats in sorted(per_replica.items()):
                family.add_metric([model, replica], read(stats))
            yield family


class _ConnectionCollector(Collector):
    """Open and refused client connections, read from the connection gate at scrape time."""

    def __init__(self, gate: GateView, model_name: Callable[[], str]) -> None:
        self.gate = gate
        self.model_name = model_name

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        model = self.model_name()
        yield _gauge(model, "rill_connections_open", "Client connections open, all listeners", self.gate.total)
        yield _counter(
            model, "rill_connections_refused", "Client connections refused at the connection limits", self.gate.refused
        )
        yield _counter(
            model,
            "rill_connections_evicted",
            "Idle client connections closed at the connection limit to let another address in",
            self.gate.evicted,
        )


class _MemoryCollector(Collector):
    """The session-memory budget (``rill.frontend.budget.MemoryBudget``), read at scrape time."""

    def __init__(self, memory: Any, model_name: Callable[[], str]) -> None:
        self.memory = memory
        self.model_name = model_name

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        model = self.model_name()
        yield _gauge(
            model,
            "rill_session_memory_used_bytes",
            "Session memory held for clients (Evergreen sessions, kept generations, unread outputs)",
            self.memory.used,
        )
        yield _gauge(
            model,
            "rill_session_memory_capacity_bytes",
            "Session memory budget (--max-session-memory)",
            self.memory.total,
        )
        yield _counter(
            model,
            "rill_session_memory_refused",
            "Charges refused at the session-memory budget or a principal's share",
            self.memory.refused,
        )


def _gauge(model_name: str, name: str, doc: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


def _counter(model_name: str, name: str, doc: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family
