"""Smoke test of ``rill bench``: a few requests over every protocol against a live server.

Not a benchmark (no figure is asserted beyond counts): it keeps the load generator and its
drivers working as the protocols evolve. One tiny-model server with every listener on
(HTTP, a temporary Unix socket, gRPC on a free port), one torch thread.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from rill.bench.drivers import DRIVERS, server_protocol
from rill.bench.stats import RequestRecord, percentile, summarize
from rill.bench.workload import jsonl_prompts, poisson_offsets, synthetic_prompts
from rill.cli import main
from rill.errors import ConfigError
from tests.conftest import LiveServer, free_port, start_server

NUM_REQUESTS = 3
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    """A server with every protocol's listener enabled."""
    socket_path = tmp_path_factory.mktemp("uds") / "rill.sock"
    server = start_server(
        tiny_model_dir, **{"uds.no_socket": False, "uds.socket": str(socket_path), "evergreen.grpc_port": free_port()}
    )
    yield server
    server.stop()


def _bench(live: LiveServer, out: Path, *extra: str) -> tuple[int, dict]:
    argv = [
        "bench",
        "--port",
        str(live.port),
        "--socket",
        live.config.uds.socket,
        "--grpc-address",
        f"127.0.0.1:{live.config.evergreen.grpc_port}",
        "--num-requests",
        str(NUM_REQUESTS),
        "--max-tokens",
        str(MAX_TOKENS),
        "--prompt-len",
        "8",
        "--no-progress",
        "--output",
        str(out),
        *extra,
    ]
    code = main(argv)
    return code, json.loads(out.read_text())


def test_every_protocol_completes_its_requests(live: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, document = _bench(live, tmp_path / "all.json", "--protocol", "all", "--concurrency", "2")
    assert code == 0, capsys.readouterr().err
    by_protocol = {r["protocol"]: r for r in document["results"]}
    present = {name for name in DRIVERS if importlib.util.find_spec(f"rill.protocols.{server_protocol(name)}")}
    assert set(by_protocol) == present, document["skipped"]
    for name, summary in by_protocol.items():
        assert summary["num_ok"] == NUM_REQUESTS and summary["errors_by_type"] == {}, (name, summary)
        assert summary["ttft"]["count"] == NUM_REQUESTS, name
        assert summary["output_tokens_per_s"] > 0 and summary["requests_per_s"] > 0, name
    # Protocols that can ask for exactly max_tokens report exactly that many.
    for name in {"openai", "generate-ws", "chat-ws"} & present:
        assert by_protocol[name]["num_output_tokens"] == NUM_REQUESTS * MAX_TOKENS, name
    printed = capsys.readouterr().out
    for label in ("throughput:", "TTFT", "ITL", "end-to-end", "errors: none"):
        assert label in printed
    live.wait_idle()


def test_open_loop_with_records(live: LiveServer, tmp_path: Path) -> None:
    code, document = _bench(
        live,
        tmp_path / "open.json",
        "--protocol",
        "openai",
        "--request-rate",
        "50",
        "--concurrency",
        "0",
        "--save-records",
    )
    assert code == 0
    (summary,) = document["results"]
    assert summary["request_rate"] == 50 and summary["concurrency"] is None
    assert [r["index"] for r in summary["records"]] == list(range(NUM_REQUESTS))
    assert all(r["error"] is None and r["num_output_tokens"] == MAX_TOKENS for r in summary["records"])
    live.wait_idle()


def test_unreachable_listener_is_skipped_with_a_message(
    live: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    code, document = _bench(
        live, tmp_path / "missing.json", "--protocol", "uds", "--socket", str(tmp_path / "nothing-here.sock")
    )
    assert code == 1
    assert "uds" in document["skipped"] and document["results"] == []
    assert "skipping uds" in capsys.readouterr().err


def test_server_errors_are_counted_by_type(live: LiveServer, tmp_path: Path) -> None:
    # A negative temperature is refused by every protocol's validation.
    code, document = _bench(
        live, tmp_path / "errors.json", "--protocol", "openai,generate-ws,uds", "--warmup", "0", "--temperature", "-1"
    )
    assert code == 1
    for summary in document["results"]:
        assert summary["num_ok"] == 0 and sum(summary["errors_by_type"].values()) == NUM_REQUESTS, summary
    kinds = {s["protocol"]: set(s["errors_by_type"]) for s in document["results"]}
    assert kinds == {"openai": {"http_400"}, "generate-ws": {"invalid_request"}, "uds": {"E_PROTO_BAD_REQUEST"}}


# -- pure parts (no server) ------------------------------------------------------------------


def test_percentiles_interpolate_between_ranks() -> None:
    assert percentile([], 50) != percentile([], 50)  # NaN
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([7.0], 90) == 7.0


def test_summary_counts_only_successes_in_throughput() -> None:
    records = [
        RequestRecord(index=0, protocol="x", ttft_s=0.1, e2e_s=1.1, itl_s=[0.1] * 10, num_output_tokens=11),
        RequestRecord(index=1, protocol="x", e2e_s=0.2, num_output_tokens=3, error="http_503"),
        RequestRecord(index=2, protocol="x", e2e_s=0.2, error="http_503"),
    ]
    summary = summarize(records, protocol="x", target="t", wall_s=2.0, concurrency=2)
    assert (summary.num_ok, summary.num_errors, summary.errors_by_type) == (1, 2, {"http_503": 2})
    assert summary.output_tokens_per_s == 5.5 and summary.requests_per_s == 0.5
    assert summary.ttft.p50_ms == pytest.approx(100.0) and summary.tpot.mean_ms == pytest.approx(100.0)


def test_workloads_are_reproducible_and_distinct() -> None:
    first, again = synthetic_prompts(5, 12, 7, seed=3), synthetic_prompts(5, 12, 7, seed=3)
    assert first == again and len({r.prompt for r in first}) == 5
    assert all(len(r.prompt.split()) == 12 and r.max_tokens == 7 for r in first)
    offsets = poisson_offsets(200, 10.0, seed=1)
    assert offsets == poisson_offsets(200, 10.0, seed=1) and offsets == sorted(offsets) and offsets[0] == 0.0
    assert 10 < offsets[-1] < 30  # 199 gaps of mean 0.1 s


def test_jsonl_prompts_cycle_and_refuse_bad_lines(tmp_path: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a", "max_tokens": 3}\n\n{"prompt": "b", "output_len": 5}\n{"prompt": "c"}\n')
    requests = jsonl_prompts(good, 4, default_max_tokens=9)
    assert [(r.prompt, r.max_tokens) for r in requests] == [("a", 3), ("b", 5), ("c", 9), ("a", 3)]
    for text in ('{"prompt": ""}', '{"max_tokens": 3}', "not json", '{"prompt": "a", "max_tokens": 0}'):
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text + "\n")
        with pytest.raises(ConfigError, match="bad.jsonl:1"):
            jsonl_prompts(bad, 1, 4)
