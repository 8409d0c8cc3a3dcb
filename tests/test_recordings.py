"""rill.recordings: the chat recordings folder, and the recordings in the stores' database
(``--database``), stay under their size cap and retention (issue 12 item 2: recordings stored
raw requests with no cap or retention)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from rill import recordings
from rill.recordings import DatabaseRecordings, RecordingStore


def write(folder: Path, recording_id: str, num_bytes: int, mtime: float | None = None) -> None:
    (folder / recording_id).mkdir(parents=True)
    (folder / recording_id / "request.json").write_bytes(b"x" * num_bytes)
    if mtime is not None:
        os.utime(folder / recording_id, (mtime, mtime))


def rid(i: int) -> str:
    return f"chat_{i:016x}"


def test_the_oldest_recordings_are_deleted_first_to_stay_under_the_cap(tmp_path: Path, caplog) -> None:
    store = RecordingStore(tmp_path, max_bytes=2500)
    for i in range(5):
        write(tmp_path, rid(i), 1000)
        with caplog.at_level(logging.WARNING, logger="rill.recordings"):
            store.commit(rid(i))
    assert sorted(p.name for p in tmp_path.iterdir()) == [rid(3), rid(4)]
    assert store.num_bytes() == 2000
    assert sum("record-max-bytes" in r.getMessage() for r in caplog.records) == 3  # never silently


def test_recordings_of_earlier_runs_count_and_retention_deletes_old_ones(tmp_path: Path, monkeypatch) -> None:
    now = 2_000_000_000.0
    monkeypatch.setattr(recordings.time, "time", lambda: now)
    write(tmp_path, rid(1), 100, mtime=now - 10 * 86400)  # ten days old
    write(tmp_path, rid(2), 100, mtime=now - 86400)
    (tmp_path / "not-a-recording").mkdir()
    store = RecordingStore(tmp_path, max_bytes=10_000, retention_s=5 * 86400)
    write(tmp_path, rid(3), 100)
    store.commit(rid(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [rid(2), rid(3), "not-a-recording"]
    assert store.num_bytes() == 200


def test_a_recording_larger_than_the_cap_is_not_kept(tmp_path: Path) -> None:
    store = RecordingStore(tmp_path, max_bytes=50)
    write(tmp_path, rid(1), 100)
    store.commit(rid(1))
    assert list(tmp_path.iterdir()) == [] and store.num_bytes() == 0


@pytest.mark.parametrize("name, ok", [(rid(1), True), ("..", False), ("chat_../x", False)])
def test_path_of_takes_recording_ids_only(tmp_path: Path, name: str, ok: bool) -> None:
    assert (RecordingStore(tmp_path, 1).path_of(name) is not None) == ok


# -- --database: the recordings in the stores' database, on SQLite and PostgreSQL ----------------------


def save(store: DatabaseRecordings, i: int, num_bytes: int) -> None:
    """A recording whose request, reply and audio take about ``num_bytes``."""
    store.save(rid(i), json.dumps({"i": i}), {"text": "x"}, b"w" * num_bytes)


def test_the_database_keeps_the_newest_recordings_under_the_cap(store_where: str | Path, caplog) -> None:
    store = DatabaseRecordings(store_where, max_bytes=2500)
    with caplog.at_level(logging.WARNING, logger="rill.recordings"):
        for i in range(5):
            save(store, i, 1000)
    assert [store.reply(rid(i)) is not None for i in range(5)] == [False, False, False, True, True]
    assert store.reply(rid(4)) == {"text": "x", "request": {"i": 4}} and store.audio(rid(4)) == b"w" * 1000
    assert store.audio(rid(0)) is None and 2000 < store.num_bytes() <= 2500
    assert sum("record-max-bytes" in r.getMessage() for r in caplog.records) == 3  # never silently
    store.close()


def test_the_database_deletes_recordings_past_the_retention(store_where: str | Path, monkeypatch) -> None:
    clock = [2_000_000_000.0]
    monkeypatch.setattr(recordings.time, "time", lambda: clock[0])
    store = DatabaseRecordings(store_where, max_bytes=10_000, retention_s=5 * 86400)
    save(store, 1, 10)
    clock[0] += 4 * 86400
    save(store, 2, 10)
    clock[0] += 2 * 86400  # the first is six days old, the second two
    save(store, 3, 10)
    assert [store.reply(rid(i)) is not None for i in (1, 2, 3)] == [False, True, True]
    store.close()


def test_the_database_does_not_keep_a_recording_larger_than_the_cap(store_where: str | Path) -> None:
    store = DatabaseRecordings(store_where, max_bytes=50)
    save(store, 1, 100)
    assert store.reply(rid(1)) is None and store.num_bytes() == 0
    assert store.reply("..") is None and store.audio("chat_../x") is None
    store.close()


def test_a_recording_written_again_counts_once(tmp_path: Path) -> None:
    """The folder's running total replaces a recording's old size (commit of the same id)."""
    store = RecordingStore(tmp_path, max_bytes=10_000)
    write(tmp_path, rid(1), 100)
    store.commit(rid(1))
    (tmp_path / rid(1) / "request.json").write_bytes(b"x" * 300)
    store.commit(rid(1))
    assert store.num_bytes() == 300


def _sum(where: str | Path) -> int:
    from rill.database import Database

    db = Database(where)
    try:
        return int(db.execute("SELECT COALESCE(SUM(num_bytes), 0) FROM recordings").value())
    finally:
        db.close()


def test_the_databases_running_total_follows_every_insert_and_delete(store_where: str | Path) -> None:
    """The total is the recordings' sum however they went: saved, evicted (more than one batch
    of the oldest at once), or saved by another server sharing the database."""
    store = DatabaseRecordings(store_where, max_bytes=3000)
    other = DatabaseRecordings(store_where, max_bytes=3000)  # another server
    for i in range(40):
        save(store if i % 2 else other, i, 40)
    assert store.num_bytes() == other.num_bytes() == _sum(store_where)
    save(store, 100, 2800)  # most of the 40 are deleted to make room, oldest first
    kept = [i for i in range(40) if store.reply(rid(i)) is not None]
    assert kept == list(range(40 - len(kept), 40)) and len(kept) < 40 - 2 * recordings._EVICTION_BATCH
    assert store.reply(rid(100)) is not None
    assert store.num_bytes() == _sum(store_where) <= 3000
    store.close()
    other.close()


def test_a_recordings_table_of_an_earlier_version_gets_its_total_at_open(store_where: str | Path) -> None:
    from rill.database import Database

    store = DatabaseRecordings(store_where, max_bytes=10_000)
    save(store, 1, 100)
    save(store, 2, 200)
    expected = store.num_bytes()
    store.close()
    db = Database(store_where)
    db.execute("DROP TABLE recordings_usage")  # as an earlier version left it
    db.close()
    reopened = DatabaseRecordings(store_where, max_bytes=10_000)
    assert reopened.num_bytes() == expected == _sum(store_where)
    reopened.close()
