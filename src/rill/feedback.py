"""Durable feedback store (SQLite in the server's data folder) and ``rill feedback export``.

``/generate`` clients send ``feedback`` messages; the adapter calls ``FeedbackStore.add``,
which commits the row (synchronous=FULL) before returning, and only then acknowledges it,
so an acknowledged record survives the server being killed. ``rill feedback export`` prints
every record as one JSON object per line.

Storage: the prompt and the generated text of a record are kept once, in the ``texts``
table keyed by their SHA-256, and referenced by the record (``prompt_id``,
``generated_id``): every feedback message on one generation names the same prompt, and
after the generation has finished the same text, so a short rating costs a row of its own
rather than another copy of a long prompt. A text no record references any more is deleted
with the last record that did (a trigger, so deleting records by hand cleans up too).
Records written before this layout keep their texts inline and are read alike.

Bounds (``FeedbackStore`` arguments; the server passes ``--feedback-*`` settings):

* ``max_text_bytes``: the prompt, generated text and feedback text of a record are each cut to
  this many UTF-8 bytes; the record's ``truncated`` lists the fields that were cut;
* ``max_store_bytes``: when the database holds this much, a new record is refused with
  ``StorageFull``; nothing stored is deleted to make room;
* ``max_principal_bytes``: a principal (an API key, or a client address without keys:
  ``rill.auth.principal``) whose records take this much is refused with ``StorageFull``
  while others can still store theirs; a record is charged its own bytes and those of the
  texts it was first to store;
* ``retention_s``: records older than this are deleted (when a record is added, and at open),
  a documented policy logged at info level; None keeps records until deleted by hand.

Blocking I/O: call ``add`` from a worker thread (``asyncio.to_thread``) in async code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

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
    truncated TEXT,
    prompt_id INTEGER,
    generated_id INTEGER,
    principal TEXT,
    num_bytes INTEGER
)
"""
# ``prompt`` and ``generated_text`` hold texts of records written before the ``texts`` table.

_TEXTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS texts (
    id INTEGER PRIMARY KEY,
    digest BLOB NOT NULL UNIQUE,
    body TEXT NOT NULL
)
"""

_ADDED_COLUMNS = {
    "truncated": "TEXT",
    "prompt_id": "INTEGER",
    "generated_id": "INTEGER",
    "principal": "TEXT",
    "num_bytes": "INTEGER",
}
"""Columns a store written by an earlier version may lack (added at open)."""

_CLEANUP_TRIGGER = """
CREATE TRIGGER IF NOT EXISTS feedback_texts_cleanup AFTER DELETE ON feedback
BEGIN
    DELETE FROM texts WHERE id IN (old.prompt_id, old.generated_id)
        AND NOT EXISTS (SELECT 1 FROM feedback WHERE prompt_id = texts.id)
        AND NOT EXISTS (SELECT 1 FROM feedback WHERE generated_id = texts.id);
END
"""

COLUMNS = (
    "id",
    "created_at",
    "protocol",
    "request_id",
    "rating",
    "text",
    "position",
    "model",
    "prompt",
    "generated_text",
    "is_generation_finished",
    "api_key_hint",
    "truncated",
)

_SELECT = (
    "SELECT f.id, f.created_at, f.protocol, f.request_id, f.rating, f.text, f.position, f.model,"
    " COALESCE(p.body, f.prompt), COALESCE(g.body, f.generated_text), f.is_generation_finished, f.api_key_hint,"
    " f.truncated FROM feedback f LEFT JOIN texts p ON p.id = f.prompt_id LEFT JOIN texts g ON g.id = f.generated_id"
    " ORDER BY f.id"
)

TEXT_FIELDS = ("text", "prompt", "generated_text")
"""Fields cut to ``max_text_bytes``."""

ROW_OVERHEAD_BYTES = 256
"""Bytes a record takes besides its texts (numbers, short strings, SQLite's row and index
entries); used to refuse a record that would take the store past its cap."""

TEXT_OVERHEAD_BYTES = 128
"""Bytes a shared text takes besides its own (its digest twice, in the row and the index)."""


class FeedbackStore:
    """One SQLite file; thread-safe (one connection behind a lock)."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        max_text_bytes: int | None = None,
        max_store_bytes: int | None = None,
        max_principal_bytes: int | None = None,
        retention_s: float | None = None,
    ) -> None:
        """Open (or create) the store in ``data_dir``; the bounds are described in the module
        docstring (None: no bound). A store written by an earlier version is upgraded in
        place: its records stay as they are and are read alike."""
        self.path = Path(data_dir) / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_text_bytes = max_text_bytes
        self.max_store_bytes = max_store_bytes
        self.max_principal_bytes = max_principal_bytes
        self.retention_s = retention_s
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        # FULL: the commit is on disk (fsync) before add() returns, i.e. before the ack.
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(feedback)")}
        for name, kind in _ADDED_COLUMNS.items():
            if name not in columns:  # a store written before the column existed
                self._db.execute(f"ALTER TABLE feedback ADD COLUMN {name} {kind}")
        self._db.execute(_TEXTS_SCHEMA)
        self._db.execute("CREATE INDEX IF NOT EXISTS feedback_created_at ON feedback (created_at)")
        self._db.execute("CREATE INDEX IF NOT EXISTS feedback_prompt_id ON feedback (prompt_id)")
        self._db.execute("CREATE INDEX IF NOT EXISTS feedback_generated_id ON feedback (generated_id)")
        self._db.execute(_CLEANUP_TRIGGER)
        # Bytes charged to each principal, kept up to date by add() and _expire(); read once
        # at open, so records deleted by hand while the server was down count no more.
        self._usage: dict[str, int] = {}
        with self._lock:
            self._expire(time.time())
            self._usage = {
                principal: int(total)
                for principal, total in self._db.execute(
                    "SELECT principal, SUM(num_bytes) FROM feedback WHERE principal IS NOT NULL GROUP BY principal"
                )
            }

    def add(
        self,
        record: dict[str, Any],
        protocol: str = "generate_ws",
        api_key_hint: str | None = None,
        principal: str | None = None,
    ) -> int:
        """Insert and commit one record (texts cut to ``max_text_bytes``); returns its id.
        Unknown keys are ignored. ``principal`` (``rill.auth.principal``) is whom the record's
        bytes are charged to (None: nobody's quota, the store's cap only).

        Raises:
            StorageFull: the store holds ``max_store_bytes`` already, or ``principal``'s
                records ``max_principal_bytes`` (the record is not stored).
        """
        texts = {name: _cut(record.get(name), self.max_text_bytes) for name in TEXT_FIELDS}
        truncated = ",".join(name for name in TEXT_FIELDS if texts[name][1]) or None
        now = time.time()
        with self._lock:
            # Expired records go in a transaction of their own: a refused record below must not
            # roll their deletion back (a full store would then never free anything).
            self._expire(now)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                found = {name: self._find_text(texts[name][0]) for name in ("prompt", "generated_text")}
                # By digest: a generated text equal to its prompt is stored (and charged) once.
                new_texts = {
                    digest: texts[name][0]
                    for name, (text_id, digest) in found.items()
                    if text_id is None and digest is not None
                }
                num_bytes = (
                    ROW_OVERHEAD_BYTES
                    + _num_bytes(texts["text"][0])
                    + sum(TEXT_OVERHEAD_BYTES + _num_bytes(text) for text in new_texts.values())
                )
                self._check_room(principal, num_bytes)
                stored: dict[bytes | None, int] = {
                    digest: self._store_text(digest, text)  # type: ignore[arg-type]  # a digest means a text
                    for digest, text in new_texts.items()
                }
                ids = {
                    name: text_id if text_id is not None else stored.get(digest)
                    for name, (text_id, digest) in found.items()
                }
                cur = self._db.execute(
                    "INSERT INTO feedback (created_at, protocol, request_id, rating, text, position, model, prompt_id,"
                    " generated_id, is_generation_finished, api_key_hint, truncated, principal, num_bytes)"
                    " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                    (
                        now,
                        protocol,
                        record.get("request_id"),
                        float(record["rating"]),
                        texts["text"][0],
                        record.get("position"),
                        record.get("model"),
                        ids["prompt"],
                        ids["generated_text"],
                        None
                        if record.get("is_generation_finished") is None
                        else int(bool(record["is_generation_finished"])),
                        api_key_hint,
                        truncated,
                        principal,
                        num_bytes,
                    ),
                )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            if principal is not None:
                self._usage[principal] = self._usage.get(principal, 0) + num_bytes
            return int(cur.lastrowid or 0)

    def _find_text(self, text: str | None) -> tuple[int | None, bytes | None]:
        """The id of ``text`` if it is stored already (else None), and its digest."""
        if text is None:
            return None, None
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        row = self._db.execute("SELECT id FROM texts WHERE digest = ?", (digest,)).fetchone()
        return (int(row[0]) if row else None), digest

    def _store_text(self, digest: bytes, text: str) -> int:
        return int(self._db.execute("INSERT INTO texts (digest, body) VALUES (?, ?)", (digest, text)).lastrowid or 0)

    def _check_room(self, principal: str | None, num_bytes: int) -> None:
        # The caller holds the lock, in the insert's transaction.
        if self.max_store_bytes is not None and self._used_bytes() + num_bytes > self.max_store_bytes:
            raise StorageFull(
                f"the feedback store is full ({self.max_store_bytes} bytes, "
                "--feedback-max-store-bytes); feedback is not being stored"
            )
        if (
            principal is not None
            and self.max_principal_bytes is not None
            and self._usage.get(principal, 0) + num_bytes > self.max_principal_bytes
        ):
            raise StorageFull(
                f"your feedback takes {self._usage.get(principal, 0)} bytes of the store, the most "
                f"one client may keep ({self.max_principal_bytes} bytes, "
                "--feedback-max-bytes-per-principal); further feedback is not stored"
            )

    def _expire(self, now: float) -> None:
        # The caller holds the lock. Deleting by age is the documented retention policy.
        if self.retention_s is None:
            return
        cutoff = now - self.retention_s
        self._db.execute("BEGIN IMMEDIATE")
        try:
            freed = self._db.execute(
                "SELECT principal, SUM(num_bytes) FROM feedback WHERE created_at < ?"
                " AND principal IS NOT NULL GROUP BY principal",
                (cutoff,),
            ).fetchall()
            cur = self._db.execute("DELETE FROM feedback WHERE created_at < ?", (cutoff,))
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        for principal, total in freed:
            left = self._usage.get(principal, 0) - int(total or 0)
            if left > 0:
                self._usage[principal] = left
            else:
                self._usage.pop(principal, None)
        if cur.rowcount:
            log.info(
                "deleted %d feedback records older than %g days (--feedback-retention-days)",
                cur.rowcount,
                self.retention_s / 86400,
            )

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

    def principal_bytes(self, principal: str) -> int:
        """Bytes charged to ``principal``'s records (what ``max_principal_bytes`` bounds)."""
        with self._lock:
            return self._usage.get(principal, 0)

    def records(self) -> Iterator[dict[str, Any]]:
        """Every record, oldest first, each with its own prompt and generated text."""
        with self._lock:
            rows = self._db.execute(_SELECT).fetchall()
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


def _num_bytes(text: str | None) -> int:
    return 0 if text is None else len(text.encode("utf-8", "surrogatepass"))


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


def export(data_dir: str | Path, out: TextIO) -> int:
    """Write every record of the store in ``data_dir`` to ``out``, one JSON object per line
    (``rill feedback export``, whose command line lives in ``rill.cli``); returns the exit
    code. A folder without a store is said so on stderr and exports nothing."""
    path = Path(data_dir) / DB_NAME
    if not path.exists():
        print(f"rill: no feedback stored yet ({path} does not exist)", file=sys.stderr)
        return 0
    store = FeedbackStore(data_dir)
    try:
        for record in store.records():
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        store.close()
    return 0
