"""rill.feedback: the durable store and `rill feedback export`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rill.feedback import FeedbackStore


def test_store_round_trip_and_ids(tmp_path: Path) -> None:
    store = FeedbackStore(tmp_path / "d")
    first = store.add({"request_id": "gen_1", "rating": 1, "text": "good", "position": 3, "model": "m",
                       "prompt": "p", "generated_text": "g", "is_generation_finished": True}, api_key_hint="abcd")
    second = store.add({"request_id": "gen_2", "rating": -0.5})
    assert second == first + 1
    records = list(FeedbackStore(tmp_path / "d").records())  # another connection sees both commits
    assert [r["request_id"] for r in records] == ["gen_1", "gen_2"]
    assert records[0]["rating"] == 1.0 and records[0]["is_generation_finished"] is True
    assert records[0]["api_key_hint"] == "abcd" and records[0]["protocol"] == "generate_ws"
    assert records[1]["text"] is None and records[1]["is_generation_finished"] is None
    store.close()


def test_export_prints_json_lines(tmp_path: Path) -> None:
    store = FeedbackStore(tmp_path)
    store.add({"request_id": "gen_1", "rating": 1, "text": "héllo\nworld"})
    store.add({"request_id": "gen_2", "rating": 0})
    store.close()
    out = subprocess.run([sys.executable, "-m", "rill", "feedback", "export", "--data-dir", str(tmp_path)],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0])["text"] == "héllo\nworld" and json.loads(lines[1])["request_id"] == "gen_2"


def test_export_without_a_store_says_so(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "rill", "feedback", "export", "--data-dir", str(tmp_path / "none")],
                         capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout == "" and "no feedback stored yet" in res.stderr


def test_feedback_survives_sigkill_after_the_ack(tiny_model_dir: Path, tmp_path: Path) -> None:
    import os
    import signal
    import time

    import httpx
    from websockets.sync.client import connect

    from tests.conftest import free_port

    port, data_dir = free_port(), tmp_path / "data"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rill", "serve", "--model", str(tiny_model_dir), "--port", str(port),
         "--data-dir", str(data_dir), "--no-socket", "--grpc-port", "0", "--dtype", "float32",
         "--kv-cache-memory", "64MiB", "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 90
        while True:  # poll readiness (a start-up wait, not a timing assertion)
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.1)
        with connect(f"ws://127.0.0.1:{port}/generate") as ws:
            ws.send(json.dumps({"type": "config", "prompt": "Once upon a time", "parameters": {"max_tokens": 2}}))
            init = json.loads(ws.recv())
            assert init["type"] == "init"
            while json.loads(ws.recv())["type"] != "completion":
                pass
            ws.send(json.dumps({"type": "feedback", "rating": -1, "text": "kill -9 me", "position": 1}))
            ack = json.loads(ws.recv())
            assert ack["type"] == "status" and ack["operation"] == "feedback_received"
            proc.send_signal(signal.SIGKILL)  # right after the acknowledgement
        proc.wait(30)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = subprocess.run([sys.executable, "-m", "rill", "feedback", "export", "--data-dir", str(data_dir)],
                         capture_output=True, text=True, check=True).stdout
    records = [json.loads(line) for line in out.splitlines()]
    assert [(r["id"], r["rating"], r["text"], r["position"], r["request_id"]) for r in records] == \
        [(ack["feedback_id"], -1.0, "kill -9 me", 1, ack["request_id"])]
    assert records[0]["request_id"] == init["request_id"] and records[0]["generated_text"] is not None
