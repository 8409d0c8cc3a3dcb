"""rill.feedback: the durable store and `rill feedback export`, on SQLite and on PostgreSQL
(``store_where``: a data folder, or a new database of the throwaway cluster)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rill.database import Database
from rill.feedback import FeedbackStore


def query(where: str | Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The rows of ``sql`` run on the store's database through a connection of its own."""
    db = Database(where)
    try:
        return db.execute(sql, params).rows
    finally:
        db.close()


def test_store_round_trip_and_ids(store_where: str | Path) -> None:
    store = FeedbackStore(store_where)
    first = store.add(
        {
            "request_id": "gen_1",
            "rating": 1,
            "text": "good",
            "position": 3,
            "model": "m",
            "prompt": "p",
            "generated_text": "g",
            "is_generation_finished": True,
        },
        api_key_hint="abcd",
    )
    second = store.add({"request_id": "gen_2", "rating": -0.5})
    assert second == first + 1
    records = list(FeedbackStore(store_where).records())  # another connection sees both commits
    assert [r["request_id"] for r in records] == ["gen_1", "gen_2"]
    assert records[0]["rating"] == 1.0 and records[0]["is_generation_finished"] is True
    assert records[0]["api_key_hint"] == "abcd" and records[0]["protocol"] == "generate_ws"
    assert records[1]["text"] is None and records[1]["is_generation_finished"] is None
    store.close()


def where_flags(where: str | Path) -> list[str]:
    """The flags naming ``where`` to ``rill serve`` and ``rill feedback export``."""
    return ["--database", where] if isinstance(where, str) else ["--data-dir", str(where)]


def export(where: str | Path) -> subprocess.CompletedProcess[str]:
    """``rill feedback export`` of ``where``, run as a command."""
    command = [sys.executable, "-m", "rill", "feedback", "export", *where_flags(where)]
    return subprocess.run(command, capture_output=True, text=True)


def test_export_prints_json_lines(store_where: str | Path) -> None:
    store = FeedbackStore(store_where)
    store.add({"request_id": "gen_1", "rating": 1, "text": "héllo\nworld"})
    store.add({"request_id": "gen_2", "rating": 0})
    store.close()
    lines = export(store_where).stdout.splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0])["text"] == "héllo\nworld" and json.loads(lines[1])["request_id"] == "gen_2"


def test_export_without_a_store_says_so(store_where: str | Path) -> None:
    res = export(store_where)
    assert res.returncode == 0 and res.stdout == "" and "no feedback stored yet" in res.stderr
    if isinstance(store_where, str):  # and it created nothing
        assert query(store_where, "SELECT to_regclass('feedback') IS NULL") == [(True,)]


def test_feedback_survives_sigkill_after_the_ack(tiny_model_dir: Path, store_where: str | Path) -> None:
    import signal

    from websockets.sync.client import connect

    from tests.helpers import rill_process

    with rill_process(tiny_model_dir, *where_flags(store_where)) as (proc, url):
        with connect(url.replace("http", "ws") + "/generate") as ws:
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
    res = export(store_where)
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(r["id"], r["rating"], r["text"], r["position"], r["request_id"]) for r in records] == [
        (ack["feedback_id"], -1.0, "kill -9 me", 1, ack["request_id"])
    ]
    assert records[0]["request_id"] == init["request_id"] and records[0]["generated_text"] is not None


# -- issue 12 item 2: bounded stored text, size cap and retention ----------------------------------------


def test_texts_are_cut_to_the_cap_at_a_character_boundary(store_where: str | Path) -> None:
    store = FeedbackStore(store_where, max_text_bytes=5)
    store.add({"request_id": "g", "rating": 1, "text": "ok", "prompt": "ééé", "generated_text": "abcdefgh"})
    [record] = store.records()
    assert (record["text"], record["prompt"], record["generated_text"]) == ("ok", "éé", "abcde")
    assert record["truncated"] == ["prompt", "generated_text"]
    store.close()


def test_a_full_store_refuses_new_records_and_keeps_the_old(store_where: str | Path) -> None:
    from rill.errors import StorageFull

    store = FeedbackStore(store_where)
    for i in range(20):
        store.add({"request_id": f"g{i}", "rating": 1, "prompt": "p" * 2000})
    used = store.used_bytes()
    store.close()
    capped = FeedbackStore(store_where, max_store_bytes=used + 100)
    with pytest.raises(StorageFull, match="full"):
        capped.add({"request_id": "late", "rating": 1, "prompt": "p" * 2000})
    assert [r["request_id"] for r in capped.records()] == [f"g{i}" for i in range(20)]
    capped.close()


def test_retention_deletes_only_records_past_it(store_where: str | Path, monkeypatch) -> None:
    import rill.feedback as feedback_mod

    clock = [1_000_000.0]
    monkeypatch.setattr(feedback_mod.time, "time", lambda: clock[0])
    store = FeedbackStore(store_where, retention_s=100)
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
    db.execute(
        "CREATE TABLE feedback (id INTEGER PRIMARY KEY AUTOINCREMENT, created_at REAL NOT NULL, protocol TEXT "
        "NOT NULL, request_id TEXT, rating REAL NOT NULL, text TEXT, position INTEGER, model TEXT, prompt TEXT, "
        "generated_text TEXT, is_generation_finished INTEGER, api_key_hint TEXT)"
    )
    db.execute("INSERT INTO feedback (created_at, protocol, rating) VALUES (1, 'generate_ws', 1)")
    db.commit()
    db.close()
    store = FeedbackStore(tmp_path)
    store.add({"request_id": "g", "rating": -1})
    assert [(r["rating"], r["truncated"]) for r in store.records()] == [(1.0, []), (-1.0, [])]
    store.close()


# -- issue 31 finding 6: a prompt stored once, a quota per principal ---------------------------------------


PROMPT = "Summarise the following report. " + "The quarterly figures rose again. " * 400  # ~13 KB


def test_a_hundred_feedback_records_on_one_generation_store_its_prompt_once(store_where: str | Path) -> None:
    store = FeedbackStore(store_where)
    store.add({"request_id": "warm", "rating": 1})  # the tables' first pages exist before measuring
    before = store.used_bytes()
    for i in range(100):
        store.add(
            {
                "request_id": "gen_1",
                "rating": 1,
                "text": "good",
                "position": i,
                "prompt": PROMPT,
                "generated_text": "The figures rose.",
                "is_generation_finished": True,
            },
            principal="peer:10.0.0.1",
        )
    grown = store.used_bytes() - before
    # Before: every record held its own copy, 100 x 13 KB = 1.3 MB for 100 short ratings.
    assert grown < len(PROMPT) + 100 * 400, grown
    records = [r for r in store.records() if r["request_id"] == "gen_1"]
    assert len(records) == 100 and {r["prompt"] for r in records} == {PROMPT}
    assert [r["position"] for r in records] == list(range(100))
    assert {r["generated_text"] for r in records} == {"The figures rose."}
    store.close()
    assert query(store_where, "SELECT COUNT(*) FROM texts WHERE body = ?", (PROMPT,)) == [(1,)]


def test_a_principal_over_its_quota_is_refused_while_another_still_stores(store_where: str | Path) -> None:
    from rill.errors import StorageFull
    from rill.feedback import ROW_OVERHEAD_BYTES, TEXT_OVERHEAD_BYTES

    store = FeedbackStore(store_where, max_store_bytes=1 << 30, max_principal_bytes=20_000)
    stored = 0
    with pytest.raises(StorageFull, match="feedback-max-bytes-per-principal"):
        for i in range(100):  # each record a new generation: a new 2 KB text each time
            store.add({"request_id": f"a{i}", "rating": 1, "prompt": f"{i} " + "x" * 2000}, principal="key:aaaa")
            stored += 1
    # Each record is charged its row and the new text it brought: the quota holds 8 of them.
    per_record = ROW_OVERHEAD_BYTES + TEXT_OVERHEAD_BYTES + 2002
    assert stored == 20_000 // per_record == 8 and store.principal_bytes("key:aaaa") == 8 * per_record
    other = store.add({"request_id": "b0", "rating": -1, "prompt": "y" * 2000}, principal="key:bbbb")
    assert other > 0 and [r["request_id"] for r in store.records()] == [f"a{i}" for i in range(8)] + ["b0"]
    store.close()
    # The charge survives a restart (read back from the stored records).
    reopened = FeedbackStore(store_where, max_principal_bytes=20_000)
    with pytest.raises(StorageFull):
        reopened.add({"request_id": "late", "rating": 1, "prompt": "z" * 5000}, principal="key:aaaa")
    reopened.add({"request_id": "b1", "rating": 1, "prompt": "z" * 5000}, principal="key:bbbb")
    reopened.close()


def test_retention_frees_the_quota_and_the_texts_no_record_names(store_where: str | Path, monkeypatch) -> None:
    import rill.feedback as feedback_mod
    from rill.errors import StorageFull

    clock = [1_000_000.0]
    monkeypatch.setattr(feedback_mod.time, "time", lambda: clock[0])
    store = FeedbackStore(store_where, retention_s=100, max_principal_bytes=6000)
    store.add({"request_id": "old", "rating": 1, "prompt": "p" * 5000}, principal="peer:10.0.0.1")
    with pytest.raises(StorageFull):
        store.add({"request_id": "new", "rating": 1, "prompt": "q" * 5000}, principal="peer:10.0.0.1")
    clock[0] += 120  # "old" has expired: its bytes and its prompt go with it
    store.add({"request_id": "new", "rating": 1, "prompt": "q" * 5000}, principal="peer:10.0.0.1")
    assert [(r["request_id"], r["prompt"]) for r in store.records()] == [("new", "q" * 5000)]
    store.close()
    assert query(store_where, "SELECT COUNT(*) FROM texts") == [(1,)]
    query(store_where, "DELETE FROM feedback")  # deleting by hand removes the texts and frees the quota too
    assert query(store_where, "SELECT COUNT(*) FROM texts") == [(0,)]
    assert FeedbackStore(store_where).principal_bytes("peer:10.0.0.1") == 0


def test_a_store_written_by_the_previous_layout_opens_and_exports(tmp_path: Path) -> None:
    import sqlite3

    db = sqlite3.connect(tmp_path / "feedback.sqlite3")  # the layout with texts inline in every row
    db.execute(
        "CREATE TABLE feedback (id INTEGER PRIMARY KEY AUTOINCREMENT, created_at REAL NOT NULL, protocol TEXT "
        "NOT NULL, request_id TEXT, rating REAL NOT NULL, text TEXT, position INTEGER, model TEXT, prompt TEXT, "
        "generated_text TEXT, is_generation_finished INTEGER, api_key_hint TEXT, truncated TEXT)"
    )
    db.execute("CREATE INDEX feedback_created_at ON feedback (created_at)")
    for i in range(2):
        db.execute(
            "INSERT INTO feedback (created_at, protocol, request_id, rating, prompt, generated_text) "
            "VALUES (?, 'generate_ws', 'gen_old', 1, ?, 'out')",
            (float(i), PROMPT),
        )
    db.commit()
    db.close()
    store = FeedbackStore(tmp_path)
    for _ in range(3):
        store.add(
            {"request_id": "gen_new", "rating": -1, "prompt": PROMPT, "generated_text": "out"},
            principal="peer:10.0.0.2",
        )
    store.close()
    records = [json.loads(line) for line in export(tmp_path).stdout.splitlines()]
    assert [r["request_id"] for r in records] == ["gen_old"] * 2 + ["gen_new"] * 3
    assert {r["prompt"] for r in records} == {PROMPT} and {r["generated_text"] for r in records} == {"out"}
    db = sqlite3.connect(tmp_path / "feedback.sqlite3")
    # The new records share one copy; the old ones keep theirs.
    assert db.execute("SELECT COUNT(*) FROM texts WHERE body = ?", (PROMPT,)).fetchone() == (1,)
    db.close()
