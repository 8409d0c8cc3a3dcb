"""``benchmarks/cluster.py``'s goal lines: the ratio of each round and, over several rounds,
the median that the verdict reads (nothing is timed here: the summaries are made up)."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import pytest

from tests.bench.helpers import load_benchmark


@pytest.fixture(scope="module")
def cluster() -> ModuleType:
    """The benchmark script as a module (it imports ``compare`` from its own folder)."""
    return load_benchmark("cluster.py", "cluster_bench")


def summary(tokens_per_s: float, ttft_p50_ms: float) -> SimpleNamespace:
    """What ``goal_lines`` reads of a ``rill.bench.stats.Summary``."""
    return SimpleNamespace(output_tokens_per_s=tokens_per_s, ttft=SimpleNamespace(p50_ms=ttft_p50_ms))


def one_round(single32: float, r1_32: float, single_ttft: float, r1_ttft: float, r1t: float, r2t: float) -> dict:
    return {
        "single": {1: summary(90.0, single_ttft), 32: summary(single32, 900.0)},
        "r1": {1: summary(60.0, r1_ttft), 32: summary(r1_32, 1000.0)},
        "r1-1t": {1: summary(60.0, 60.0), 32: summary(r1t, 1600.0)},
        "r2-1t": {1: summary(60.0, 60.0), 32: summary(r2t, 900.0)},
    }


def test_one_round_reads_its_own_ratios(cluster: ModuleType) -> None:
    lines = cluster.goal_lines([one_round(400.0, 380.0, 40.0, 55.0, 250.0, 390.0)], [1, 32])
    assert lines == [
        "--replicas 1 keeps, of single-process tokens/s at c=32: 95% (goal >= 90 %: met)",
        "--replicas 1 adds to TTFT p50 at c=1: 15 ms (goal <= 20 ms: met)",
        "two 1-thread replicas, of one at c=32: 1.56x (goal >= 1.6x: NOT met)",
    ]


def test_several_rounds_are_judged_on_the_median_ratio(cluster: ModuleType) -> None:
    rounds = [
        one_round(400.0, 300.0, 40.0, 80.0, 250.0, 420.0),  # 75 %, +40 ms, 1.68x
        one_round(500.0, 460.0, 40.0, 50.0, 250.0, 380.0),  # 92 %, +10 ms, 1.52x
        one_round(300.0, 285.0, 40.0, 58.0, 200.0, 330.0),  # 95 %, +18 ms, 1.65x
    ]
    kept, added, gain = cluster.goal_lines(rounds, [1, 32])
    assert kept == (
        "--replicas 1 keeps, of single-process tokens/s at c=32: 92% (rounds: 75%, 92%, 95%; median) "
        "(goal >= 90 %: met)"
    )
    assert (
        added
        == "--replicas 1 adds to TTFT p50 at c=1: 18 ms (rounds: 40 ms, 10 ms, 18 ms; median) (goal <= 20 ms: met)"
    )
    assert gain.startswith("two 1-thread replicas, of one at c=32: 1.65x (rounds: 1.68x, 1.52x, 1.65x; median)")
    assert gain.endswith("(goal >= 1.6x: met)")


def test_a_goal_whose_servers_did_not_run_has_no_line(cluster: ModuleType) -> None:
    only = {"single": {32: summary(400.0, 900.0)}, "r1": {32: summary(340.0, 1000.0)}}
    kept, added = cluster.goal_lines([only], [32])
    assert kept.endswith("85% (goal >= 90 %: NOT met)")
    assert added.startswith("--replicas 1 adds to TTFT p50 at c=32:")  # no c=1 level: the top one
