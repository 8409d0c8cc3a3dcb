"""Tests of ``rill client uds`` (rill.clients.uds): output and every exit code.

Exit codes as uma-serve's uma-cli: 0 eos, 1 usage, 2 error event, 3 connection or framing
error; 130 after Ctrl-C (a cancel is sent and the eos awaited). Against a real server on a
socket in a temporary folder, plus a misbehaving raw server for framing errors.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from rill import cli
from rill.clients.uds import UdsClient
from tests.conftest import LiveServer, start_server

CANDIDATE_PROMPTS = [
    "Once upon a time",
    "The river stone",
    "Ada found the golden lantern near the bridge",
    "Milo counted the silver candles",
]


@pytest.fixture(scope="module")
def uds_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    path = tmp_path_factory.mktemp("uds-cli") / "rill.sock"
    live = start_server(tiny_model_dir, **{"uds.no_socket": False, "uds.socket": str(path)})
    yield live
    live.stop()


@pytest.fixture(scope="module")
def long_prompt(uds_server: LiveServer) -> str:
    """A prompt whose greedy continuation runs 16 tokens without stopping (chosen at run time)."""
    for prompt in CANDIDATE_PROMPTS:
        with UdsClient(sock(uds_server)) as client:
            events = list(client.generate({"id": "probe", "prompt": prompt, "max_tokens": 16}))
        if events[-1].get("reason") == "length":
            return prompt
    pytest.skip("every candidate prompt stops early on this model")


def sock(server: LiveServer) -> str:
    return server.config.uds.socket


def run_cli(*args: str) -> int:
    try:
        return cli.main(["client", "uds", *args])
    except SystemExit as exc:  # argparse usage errors
        return int(exc.code or 0)


def test_streams_tokens_and_exits_0(uds_server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    with UdsClient(sock(uds_server)) as client:
        events = list(client.generate({"id": "ref", "prompt": "Once upon a time", "max_tokens": 5}))
    expected = "".join(e["text"] for e in events if e["event"] == "token")
    code = run_cli("--prompt", "Once upon a time", "--socket", sock(uds_server), "--max-tokens", "5", "--id", "cli-1")
    assert code == 0
    assert capsys.readouterr().out == expected + "\n"


def test_no_stream_prints_the_same_text(uds_server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    args = (
        "--prompt",
        "The river stone",
        "--socket",
        sock(uds_server),
        "--max-tokens",
        "4",
        "--temp",
        "0",
        "--top-p",
        "1",
    )
    assert run_cli(*args) == 0
    streamed = capsys.readouterr().out
    assert run_cli(*args, "--no-stream") == 0
    assert capsys.readouterr().out == streamed


def test_metrics_exits_0(uds_server: LiveServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("--metrics", "--socket", sock(uds_server)) == 0
    frame = json.loads(capsys.readouterr().out)
    assert frame["event"] == "metrics" and "tokens_generated_total" in frame["metrics"]


@pytest.mark.parametrize(
    "args", [(), ("--max-tokens", "many", "--prompt", "x"), ("--prompt", "x", "--bogus"), ("--prompt",)]
)
def test_usage_errors_exit_1(args: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli(*args) == 1
    assert capsys.readouterr().err


def test_error_event_exits_2_with_the_message_on_stderr(
    uds_server: LiveServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli("--prompt", "hi", "--socket", sock(uds_server), "--top-p", "5") == 2
    captured = capsys.readouterr()
    assert "top_p" in captured.err and "E_PROTO_BAD_REQUEST" in captured.err
    assert captured.out == ""


def test_connection_refused_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_cli("--prompt", "hi", "--socket", str(tmp_path / "nobody.sock")) == 3
    assert "cannot connect" in capsys.readouterr().err


def _raw_server(path: Path, reply: bytes) -> threading.Thread:
    """A one-shot server that reads the request frame, writes ``reply`` and closes."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            (length,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
            conn.recv(length, socket.MSG_WAITALL)
            conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _frame(obj: Any) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack("<I", len(body)) + body


@pytest.mark.parametrize(
    "reply",
    [
        b"\x00\x00\x00\x00",  # zero-length frame
        struct.pack("<I", 5) + b"{nope",  # invalid JSON
        struct.pack("<I", 100) + b'{"event":',  # closed in the middle of a frame
        _frame({"id": "x", "event": "token", "text": "a", "token_id": 1}),  # closed before eos
    ],
    ids=["zero-length", "invalid-json", "truncated", "no-eos"],
)
def test_framing_or_connection_errors_exit_3(tmp_path: Path, reply: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "raw.sock"
    thread = _raw_server(path, reply)
    assert run_cli("--prompt", "hi", "--socket", str(path)) == 3
    thread.join(10)
    assert capsys.readouterr().err


def test_ctrl_c_sends_cancel_and_waits_for_the_eos(uds_server: LiveServer, long_prompt: str) -> None:
    before = uds_server.stats().requests_finished_total.get("cancelled", 0)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rill",
            "client",
            "uds",
            "--prompt",
            long_prompt,
            "--socket",
            sock(uds_server),
            "--max-tokens",
            "300",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.read(1)  # the CLI is streaming: its Ctrl-C handler is installed
        assert first
        # Held, the generation cannot reach max_tokens while the signal and the cancel travel
        # (another process, on a loaded machine); released once the cancel took effect.
        with uds_server.hold_engine():
            proc.send_signal(signal.SIGINT)
            uds_server.wait_idle(timeout_s=60)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert b"cancelling" in err
    stats = uds_server.wait_idle()
    assert stats.requests_finished_total.get("cancelled", 0) == before + 1
    assert stats.kv_used_bytes == 0


def test_api_key_flag_is_sent_as_the_request_api_key(tmp_path: Path) -> None:
    path = tmp_path / "raw.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    received: list[dict] = []

    def serve() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            (length,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
            received.append(json.loads(conn.recv(length, socket.MSG_WAITALL)))
            conn.sendall(_frame({"id": received[0]["id"], "event": "eos", "reason": "stop"}))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert run_cli("--prompt", "hi", "--socket", str(path), "--api-key", "k1") == 0
    thread.join(10)
    assert received[0]["api_key"] == "k1"
