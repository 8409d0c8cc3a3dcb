"""Durable feedback store (SQLite in the server's data folder) and ``rill feedback export``.

``/generate`` clients send ``feedback`` messages; the adapter calls ``FeedbackStore.add``,
which commits the row (synchronous=FULL) before returning, and only then acknowledges it,
so an acknowledged record survives the server being killed. ``rill feedback export`` prints
every record as one JSON object per line.

Bounds (``FeedbackStore`` arguments; the server passes ``--feedback-*`` settings):

* ``max_text_bytes``: the prompt, generated text and feedback text of a record are each cut to
  this many UTF-8 bytes; the record's ``truncated`` lists the fields that were cut;
* ``max_store_bytes``: when the database holds this much, a new record is refused with
  ``StorageFull``; nothing stored is deleted to make room;
* ``retention_s``: records older than this are deleted (when a record is added, and at open),
  a documented policy logged at info level; None keeps records until deleted by hand.

Blocking I/O: call ``add`` from a worker thread (``asyncio.to_thread``) in async code.
"""

from __future__ import annotations

import argparse
import json
import logging
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from rill.errors import StorageFull

log = logging.getLogger("rill.feedback")

DB_NAME = "feedback.sqlite3"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    created_at REAL NOT NULL,
    protocol TEXT NOT NULL,
    request_id TEXT,
    rating REAL NOT NULL,
    text TEXT,
    position INTEGER,
    model TEXT,
    prompt TEXT,
    generated_text TEXT,
    is_generation_finished INTEGER,
    api_key_hint TEXT,
    truncated TEXT
)
"""

COLUMNS = ("id", "created_at", "protocol", "request_id", "rating", "text", "position", "model", "prompt",
           "generated_text", "is_generation_finished", "api_key_hint", "truncated")

TEXT_FIELDS = ("text", "prompt", "generated_text")
"""Fields cut to ``max_text_bytes``."""

ROW_OVERHEAD_BYTES = 256
"""Bytes a record takes besides its texts (numbers, short strings, SQLite's row and index
entries); used to refuse a record that would take the store past its cap."""


class FeedbackStore:
    """One SQLite file; thread-safe (one connection behind a lock)."""

    def __init__(self, data_dir: str | Path, *, max_text_bytes: int | None = None, max_store_bytes: int | None = None,
                 retention_s: float | None = None) -> None:
        """Open (or create) the store in ``data_dir``; the bounds are described in the module
        docstring (None: no bound)."""
        self.path = Path(data_dir) / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_text_bytes = max_text_bytes
        self.max_store_bytes = max_store_bytes
        self.retention_s = retention_s
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        # FULL: the commit is on disk (fsync) before add() returns, i.e. before the ack.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(feedback)")}
        if "truncated" not in columns:  # a store written before the column existed
            self._db.execute("ALTER TABLE feedback ADD COLUMN truncated TEXT")
        self._db.execute("CREATE INDEX IF NOT EXISTS feedback_created_at ON feedback (created_at)")
        with self._lock:
            self._expire(time.time())

    def add(self, record: dict[str, Any], protocol: str = "generate_ws", api_key_hint: str | None = None) -> int:
        """Insert and commit one record (texts cut to ``max_text_bytes``); returns its id.
        Unknown keys are ignored.

        Raises:
            StorageFull: the store holds ``max_store_bytes`` already (the record is not stored).
        """
        texts = {name: _cut(record.get(name), self.max_text_bytes) for name in TEXT_FIELDS}
        truncated = ",".join(name for name in TEXT_FIELDS if texts[name][1]) or None
        now = time.time()
        values = (
            now, protocol, record.get("request_id"), float(record["rating"]), texts["text"][0],
            record.get("position"), record.get("model"), texts["prompt"][0], texts["generated_text"][0],
            None if record.get("is_generation_finished") is None else int(bool(record["is_generation_finished"])),
            api_key_hint, truncated,
        )
        num_row_bytes = ROW_OVERHEAD_BYTES + sum(len(text.encode()) for text, _ in texts.values() if text)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._expire(now)
                if self.max_store_bytes is not None and self._used_bytes() + num_row_bytes > self.max_store_bytes:
                    raise StorageFull(f"the feedback store is full ({self.max_store_bytes} bytes, "
                                      "--feedback-max-store-bytes); feedback is not being stored")
                cur = self._db.execute(
                    "INSERT INTO feedback (created_at, protocol, request_id, rating, text, position, model, prompt,"
                    " generated_text, is_generation_finished, api_key_hint, truncated)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", values)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return int(cur.lastrowid or 0)

    def _expire(self, now: float) -> None:
        # The caller holds the lock. Deleting by age is the documented retention policy.
        if self.retention_s is None:
            return
        cur = self._db.execute("DELETE FROM feedback WHERE created_at < ?", (now - self.retention_s,))
        if cur.rowcount:
            log.info("deleted %d feedback records older than %g days (--feedback-retention-days)",
                     cur.rowcount, self.retention_s / 86400)

    def _used_bytes(self) -> int:
        # Pages in use: freed pages (after deletions) are reused before the file grows.
        page_size = self._db.execute("PRAGMA page_size").fetchone()[0]
        num_pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        num_free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
        return int(page_size) * (int(num_pages) - int(num_free))

    def used_bytes(self) -> int:
        """Bytes of the database in use (its pages, minus those freed by deletions)."""
        with self._lock:
            return self._used_bytes()

    def records(self) -> Iterator[dict[str, Any]]:
        """Every record, oldest first."""
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM feedback ORDER BY id").fetchall()
        for row in rows:
            record = dict(zip(COLUMNS, row))
            if record["is_generation_finished"] is not None:
                record["is_generation_finished"] = bool(record["is_generation_finished"])
            record["truncated"] = record["truncated"].split(",") if record["truncated"] else []
            yield record

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()


def _cut(text: Any, max_bytes: int | None) -> tuple[str | None, bool]:
    """``text`` cut to ``max_bytes`` UTF-8 bytes (at a character boundary), and whether it was cut."""
    if text is None:
        return None, False
    text = str(text)
    if max_bytes is None or len(text) * 4 <= max_bytes:
        return text, False
    data = text.encode("utf-8", "surrogatepass")
    if len(data) <= max_bytes:
        return text, False
    return data[:max_bytes].decode("utf-8", "ignore"), True


def _cmd_export(args: argparse.Namespace) -> int:
    data_dir = args.data_dir
    if data_dir is None:
        from rill import config

        data_dir = config.load({}).http.data_dir
    path = Path(data_dir) / DB_NAME
    if not path.exists():
        print(f"rill: no feedback stored yet ({path} does not exist)", file=sys.stderr)
        return 0
    store = FeedbackStore(data_dir)
    try:
        for record in store.records():
            sys.stdout.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        store.close()
    return 0


def register(subparsers: Any) -> None:
    """Add ``rill feedback export [--data-dir DIR]``."""
    parser = subparsers.add_parser("feedback", help="stored client feedback")
    sub = parser.add_subparsers(dest="feedback_command", required=True)
    export = sub.add_parser("export", help="print every feedback record as JSON lines")
    export.add_argument("--data-dir", default=None, help="the server's data folder (default: the configured data_dir)")
    export.set_defaults(func=_cmd_export)
