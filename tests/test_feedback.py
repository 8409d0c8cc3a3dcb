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


# -- issue 12 item 2: bounded stored text, size cap and retention ----------------------------------------


def test_texts_are_cut_to_the_cap_at_a_character_boundary(tmp_path: Path) -> None:
    store = FeedbackStore(tmp_path, max_text_bytes=5)
    store.add({"request_id": "g", "rating": 1, "text": "ok", "prompt": "ééé", "generated_text": "abcdefgh"})
    [record] = store.records()
    assert (record["text"], record["prompt"], record["generated_text"]) == ("ok", "éé", "abcde")
    assert record["truncated"] == ["prompt", "generated_text"]
    store.close()


def test_a_full_store_refuses_new_records_and_keeps_the_old(tmp_path: Path) -> None:
    import pytest

    from rill.errors import StorageFull

    store = FeedbackStore(tmp_path)
    for i in range(20):
        store.add({"request_id": f"g{i}", "rating": 1, "prompt": "p" * 2000})
    used = store.used_bytes()
    store.close()
    capped = FeedbackStore(tmp_path, max_store_bytes=used + 100)
    with pytest.raises(StorageFull, match="full"):
        capped.add({"request_id": "late", "rating": 1, "prompt": "p" * 2000})
    assert [r["request_id"] for r in capped.records()] == [f"g{i}" for i in range(20)]
    capped.close()


def test_retention_deletes_only_records_past_it(tmp_path: Path, monkeypatch) -> None:
    import rill.feedback as feedback_mod

    clock = [1_000_000.0]
    monkeypatch.setattr(feedback_mod.time, "time", lambda: clock[0])
    store = FeedbackStore(tmp_path, retention_s=100)
    store.add({"request_id": "old", "rating": 1})
    clock[0] += 60
    store.add({"request_id": "mid", "rating": 1})
    clock[0] += 60  # "old" is 120 s old now, "mid" 60 s
    store.add({"request_id": "new", "rating": 1})
    assert [r["request_id"] for r in store.records()] == ["mid", "new"]
    store.close()


def test_a_store_from_before_the_truncated_column_is_upgraded(tmp_path: Path) -> None:
    import sqlite3

    db = sqlite3.connect(tmp_path / "feedback.sqlite3")
    db.execute("CREATE TABLE feedback (id INTEGER PRIMARY KEY AUTOINCREMENT, created_at REAL NOT NULL, protocol TEXT "
               "NOT NULL, request_id TEXT, rating REAL NOT NULL, text TEXT, position INTEGER, model TEXT, prompt TEXT, "
               "generated_text TEXT, is_generation_finished INTEGER, api_key_hint TEXT)")
    db.execute("INSERT INTO feedback (created_at, protocol, rating) VALUES (1, 'generate_ws', 1)")
    db.commit()
    db.close()
    store = FeedbackStore(tmp_path)
    store.add({"request_id": "g", "rating": -1})
    assert [(r["rating"], r["truncated"]) for r in store.records()] == [(1.0, []), (-1.0, [])]
    store.close()
