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
