"""Durable feedback store (SQLite in the server's data folder) and ``rill feedback export``.

``/generate`` clients send ``feedback`` messages; the adapter calls ``FeedbackStore.add``,
which commits the row (synchronous=FULL) before returning, and only then acknowledges it,
so an acknowledged record survives the server being killed. ``rill feedback export`` prints
every record as one JSON object per line.

Blocking I/O: call ``add`` from a worker thread (``asyncio.to_thread``) in async code.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

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
    api_key_hint TEXT
)
"""

COLUMNS = ("id", "created_at", "protocol", "request_id", "rating", "text", "position", "model", "prompt",
           "generated_text", "is_generation_finished", "api_key_hint")


class FeedbackStore:
    """One SQLite file; thread-safe (one connection behind a lock)."""

    def __init__(self, data_dir: str | Path) -> None:
        self.path = Path(data_dir) / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        # FULL: the commit is on disk (fsync) before add() returns, i.e. before the ack.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)

    def add(self, record: dict[str, Any], protocol: str = "generate_ws", api_key_hint: str | None = None) -> int:
        """Insert and commit one record; returns its id. Unknown keys are ignored."""
        values = (
            time.time(), protocol, record.get("request_id"), float(record["rating"]), record.get("text"),
            record.get("position"), record.get("model"), record.get("prompt"), record.get("generated_text"),
            None if record.get("is_generation_finished") is None else int(bool(record["is_generation_finished"])),
            api_key_hint,
        )
        with self._lock:
            cur = self._db.execute(
                "INSERT INTO feedback (created_at, protocol, request_id, rating, text, position, model, prompt,"
                " generated_text, is_generation_finished, api_key_hint) VALUES (?,?,?,?,?,?,?,?,?,?,?)", values)
            return int(cur.lastrowid or 0)

    def records(self) -> Iterator[dict[str, Any]]:
        """Every record, oldest first."""
        with self._lock:
            rows = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM feedback ORDER BY id").fetchall()
        for row in rows:
            record = dict(zip(COLUMNS, row))
            if record["is_generation_finished"] is not None:
                record["is_generation_finished"] = bool(record["is_generation_finished"])
            yield record

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()


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
