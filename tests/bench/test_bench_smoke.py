"""Smoke test of ``rill bench``: a few requests over every protocol against a live server.

Not a benchmark (no figure is asserted beyond counts): it keeps the load generator and its
drivers working as the protocols evolve. One tiny-model server with every listener on
(HTTP, a temporary Unix socket, gRPC on a free port), one torch thread.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rill.bench.drivers import DRIVERS
from rill.cli import main
from tests.conftest import LiveServer, free_port, start_server

NUM_REQUESTS = 3
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    """A server with every protocol's listener enabled."""
    socket_path = tmp_path_factory.mktemp("uds") / "rill.sock"
    server = start_server(tiny_model_dir, **{"uds.no_socket": False, "uds.socket": str(socket_path),
                                             "evergreen.grpc_port": free_port()})
    yield server
    server.stop()


def _bench(live: LiveServer, out: Path, *extra: str) -> tuple[int, dict]:
    argv = ["bench", "--port", str(live.port), "--socket", live.config.uds.socket,
            "--grpc-address", f"127.0.0.1:{live.config.evergreen.grpc_port}",
            "--num-requests", str(NUM_REQUESTS), "--max-tokens", str(MAX_TOKENS), "--prompt-len", "8",
            "--no-progress", "--output", str(out), *extra]
    code = main(argv)
    return code, json.loads(out.read_text())


def test_every_protocol_completes_its_requests(live: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, document = _bench(live, tmp_path / "all.json", "--protocol", "all", "--concurrency", "2")
    assert code == 0, capsys.readouterr().err
    by_protocol = {r["protocol"]: r for r in document["results"]}
    assert set(by_protocol) == set(DRIVERS), document["skipped"]
    for name, summary in by_protocol.items():
        assert summary["num_ok"] == NUM_REQUESTS and summary["errors_by_type"] == {}, (name, summary)
        assert summary["ttft"]["count"] == NUM_REQUESTS, name
        assert summary["output_tokens_per_s"] > 0 and summary["requests_per_s"] > 0, name
    # Protocols that can ask for exactly max_tokens report exactly that many.
    for name in ("openai", "generate-ws", "chat-ws"):
        assert by_protocol[name]["num_output_tokens"] == NUM_REQUESTS * MAX_TOKENS, name
    printed = capsys.readouterr().out
    for label in ("throughput:", "TTFT", "ITL", "end-to-end", "errors: none"):
        assert label in printed
    live.wait_idle()


def test_open_loop_with_records(live: LiveServer, tmp_path: Path) -> None:
    code, document = _bench(live, tmp_path / "open.json", "--protocol", "openai", "--request-rate", "50",
                            "--concurrency", "0", "--save-records")
    assert code == 0
    (summary,) = document["results"]
    assert summary["request_rate"] == 50 and summary["concurrency"] is None
    assert [r["index"] for r in summary["records"]] == list(range(NUM_REQUESTS))
    assert all(r["error"] is None and r["num_output_tokens"] == MAX_TOKENS for r in summary["records"])
    live.wait_idle()


def test_unreachable_listener_is_skipped_with_a_message(live: LiveServer, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    code, document = _bench(live, tmp_path / "missing.json", "--protocol", "uds", "--socket",
                            str(tmp_path / "nothing-here.sock"))
    assert code == 1
    assert "uds" in document["skipped"] and document["results"] == []
    assert "skipping uds" in capsys.readouterr().err


def test_server_errors_are_counted_by_type(live: LiveServer, tmp_path: Path) -> None:
    # A negative temperature is refused by every protocol's validation.
    code, document = _bench(live, tmp_path / "errors.json", "--protocol", "openai,generate-ws,uds", "--warmup", "0",
                            "--temperature", "-1")
    assert code == 1
    for summary in document["results"]:
        assert summary["num_ok"] == 0 and sum(summary["errors_by_type"].values()) == NUM_REQUESTS, summary
    kinds = {s["protocol"]: set(s["errors_by_type"]) for s in document["results"]}
    assert kinds == {"openai": {"http_400"}, "generate-ws": {"invalid_request"}, "uds": {"E_PROTO_BAD_REQUEST"}}
