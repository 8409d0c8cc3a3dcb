"""Pure statistics of a load run: per-request records in, one ``Summary`` out.

Nothing here does I/O or reads a clock: drivers fill ``RequestRecord``s (times in seconds,
relative to the request's own start), the runner adds the wall time, and ``summarize``
computes throughput and percentiles. ``format_report`` renders the summary as text.

Definitions (the same for every protocol and every peer):

* TTFT: request start (before connecting, so a protocol's handshake counts) to the first
  message that carries generated text or a token.
* ITL (inter-token latency): the gap between consecutive token-bearing messages; a
  message known to carry k tokens contributes k gaps of a k-th of it.
* TPOT: per request, (end-to-end − TTFT) / (output tokens − 1).
* Throughput counts successful requests and their output tokens over the run's wall time.
"""

from __future__ import annotations

import math
from collections import Counter

import msgspec

PERCENTILES = (50, 90, 99)


class RequestRecord(msgspec.Struct, kw_only=True):
    """What one request of a run measured.

    ``error`` is a short kind (``http_429``, ``queue_full``, ``UNAVAILABLE``, ``timeout``,
    ``connect_error`` …) when the request failed, else None. ``num_output_tokens`` is the
    server's own count when the protocol reports one, else the number of token-bearing
    messages. ``num_prompt_tokens`` is None when the protocol does not say.
    """

    index: int
    protocol: str
    start_s: float = 0.0  # since the run began
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = []
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    error: str | None = None
    error_message: str | None = None

    @property
    def is_ok(self) -> bool:
        """True when the request completed without an error."""
        return self.error is None


class Distribution(msgspec.Struct, kw_only=True):
    """Mean and percentiles of one latency, in milliseconds (NaN when nothing was measured)."""

    count: int = 0
    mean_ms: float = math.nan
    p50_ms: float = math.nan
    p90_ms: float = math.nan
    p99_ms: float = math.nan
    max_ms: float = math.nan


class Summary(msgspec.Struct, kw_only=True):
    """The figures of one run (what ``rill bench`` prints and writes as JSON)."""

    protocol: str
    target: str
    concurrency: int | None
    request_rate: float | None
    num_requests: int
    num_ok: int
    num_errors: int
    errors_by_type: dict[str, int]
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    num_output_tokens: int
    num_prompt_tokens: int | None
    ttft: Distribution
    itl: Distribution
    tpot: Distribution
    e2e: Distribution
    extra: dict[str, object] = {}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0–100) with linear interpolation between ranks; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values_s: list[float]) -> Distribution:
    """``Distribution`` of values given in seconds."""
    if not values_s:
        return Distribution()
    ms = [v * 1000.0 for v in values_s]
    return Distribution(
        count=len(ms),
        mean_ms=sum(ms) / len(ms),
        p50_ms=percentile(ms, 50),
        p90_ms=percentile(ms, 90),
        p99_ms=percentile(ms, 99),
        max_ms=max(ms),
    )


def summarize(
    records: list[RequestRecord],
    *,
    protocol: str,
    target: str,
    wall_s: float,
    concurrency: int | None = None,
    request_rate: float | None = None,
) -> Summary:
    """Throughput, latency distributions and errors of a run.

    Args:
        records: one per request that was started (failed ones included).
        wall_s: from the first request's start to the last one's end.
    """
    ok = [r for r in records if r.is_ok]
    num_tokens = sum(r.num_output_tokens for r in ok)
    prompt_counts = [r.num_prompt_tokens for r in ok if r.num_prompt_tokens is not None]
    tpot = [
        (r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1)
        for r in ok
        if r.e2e_s is not None and r.ttft_s is not None and r.num_output_tokens > 1
    ]
    errors = Counter(r.error for r in records if r.error is not None)
    return Summary(
        protocol=protocol,
        target=target,
        concurrency=concurrency,
        request_rate=request_rate,
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        errors_by_type=dict(sorted(errors.items())),
        wall_s=wall_s,
        requests_per_s=len(ok) / wall_s if wall_s > 0 else math.nan,
        output_tokens_per_s=num_tokens / wall_s if wall_s > 0 else math.nan,
        num_output_tokens=num_tokens,
        num_prompt_tokens=sum(prompt_counts) if prompt_counts else None,
        ttft=distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl=distribution([gap for r in ok for gap in r.itl_s]),
        tpot=distribution(tpot),
        e2e=distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
    )


def format_report(summary: Summary) -> str:
    """A human-readable block: load, throughput, latency table, errors."""
    load = f"concurrency {summary.concurrency}" if summary.concurrency else "unbounded concurrency"
    if summary.request_rate:
        load += f", Poisson arrivals at {summary.request_rate:g} req/s"
    lines = [
        f"protocol {summary.protocol} → {summary.target} ({load})",
        f"requests: {summary.num_ok} ok, {summary.num_errors} failed of {summary.num_requests} in {summary.wall_s:.2f} s",
        (
            f"throughput: {summary.requests_per_s:.2f} req/s, {summary.output_tokens_per_s:.1f} output tokens/s "
            f"({summary.num_output_tokens} tokens)"
        ),
        f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}{'n':>8}",
    ]
    for name, dist in (
        ("TTFT", summary.ttft),
        ("ITL", summary.itl),
        ("TPOT", summary.tpot),
        ("end-to-end", summary.e2e),
    ):
        lines.append(
            f"{name:<14}{dist.mean_ms:>10.1f}{dist.p50_ms:>10.1f}{dist.p90_ms:>10.1f}{dist.p99_ms:>10.1f}"
            f"{dist.max_ms:>10.1f}{dist.count:>8}"
        )
    if summary.errors_by_type:
        lines.append("errors: " + ", ".join(f"{kind} ×{count}" for kind, count in summary.errors_by_type.items()))
    else:
        lines.append("errors: none")
    return "\n".join(lines)
