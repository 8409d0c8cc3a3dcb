"""Durable feedback store (the server's database: SQLite in the data folder, or PostgreSQL with
``--database``) and ``rill feedback export``.

``/generate`` clients send ``feedback`` messages; the adapter calls ``FeedbackStore.add``,
which commits the row (``rill.database``: synced to disk, or to PostgreSQL's WAL) before
returning, and only then acknowledges it, so an acknowledged record survives the server being
killed. ``rill feedback export`` prints every record as one JSON object per line.

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
  ``StorageFull``; nothing stored is deleted to make room (SQLite: the file's pages in use;
  PostgreSQL, whose files do not shrink after deletions: the bytes charged to the records);
* ``max_principal_bytes``: a principal (an API key, or a client address without keys:
  ``rill.auth.principal``) whose records take this much is refused with ``StorageFull``
  while others can still store theirs; a record is charged its own bytes and those of the
  texts it was first to store;
* ``retention_s``: records older than this are deleted (when a record is added, and at open),
  a documented policy logged at info level; None keeps records until deleted by hand.

The charges are summed per principal in the ``feedback_usage`` table by triggers on every
insert and delete, so they hold for every server sharing a PostgreSQL database and follow
records deleted by hand. Records are written one at a time (``Database.write``), so two
servers cannot both pass a bound with the last room there was.

Blocking I/O: call ``add`` from a worker thread (``asyncio.to_thread``) in async code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from rill.database import SQLITE_FILE, Database, Transaction, delete_expired, is_url, log_expired, probe
from rill.errors import StorageFull

log = logging.getLogger("rill.feedback")

DB_NAME = SQLITE_FILE
"""The SQLite file in the data folder."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback (
    id {id},
    created_at {float} NOT NULL,
    protocol TEXT NOT NULL,
    request_id TEXT,
    rating {float} NOT NULL,
    text TEXT,
    position {int},
    model TEXT,
    prompt TEXT,
    generated_text TEXT,
    is_generation_finished {int},
    api_key_hint TEXT,
    truncated TEXT,
    prompt_id {int},
    generated_id {int},
    principal TEXT,
    num_bytes {int}
)
"""
# ``prompt`` and ``generated_text`` hold texts of records written before the ``texts`` table.

_TEXTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS texts (
    id {id},
    digest {bytes} NOT NULL UNIQUE,
    body TEXT NOT NULL
)
"""

_USAGE_SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback_usage (
    principal TEXT PRIMARY KEY,
    num_bytes {int} NOT NULL
)
"""
# One row per principal ('' for records charged to nobody): the sum of its records' num_bytes.

_ADDED_COLUMNS = {
    "truncated": "TEXT",
    "prompt_id": "INTEGER",
    "generated_id": "INTEGER",
    "principal": "TEXT",
    "num_bytes": "INTEGER",
}
"""Columns a store written by an earlier version may lack (added at open)."""

_TEXTS_CLEANUP = """
DELETE FROM texts WHERE id IN (old.prompt_id, old.generated_id)
    AND NOT EXISTS (SELECT 1 FROM feedback WHERE prompt_id = texts.id)
    AND NOT EXISTS (SELECT 1 FROM feedback WHERE generated_id = texts.id)
"""

_CHARGE = """
INSERT INTO feedback_usage (principal, num_bytes) VALUES (COALESCE(new.principal, ''), COALESCE(new.num_bytes, 0))
    ON CONFLICT (principal) DO UPDATE SET num_bytes = feedback_usage.num_bytes + excluded.num_bytes
"""

_REFUND = """
UPDATE feedback_usage SET num_bytes = num_bytes - COALESCE(old.num_bytes, 0)
    WHERE principal = COALESCE(old.principal, '')
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
"""Bytes a record takes besides its texts (numbers, short strings, the database's row and index
entries); used to refuse a record that would take the store past its cap."""

TEXT_OVERHEAD_BYTES = 128
"""Bytes a shared text takes besides its own (its digest twice, in the row and the index)."""


class FeedbackStore:
    """The feedback tables of the server's database; thread-safe (one connection behind a lock).

    Args:
        where: the data folder (its SQLite file) or a ``postgresql://`` URL (``--database``).
        max_text_bytes, max_store_bytes, max_principal_bytes, retention_s: the bounds of the
            module docstring (None: no bound).

    Raises:
        Unreachable: the database cannot be reached (``rill.database``).
    """

    def __init__(
        self,
        where: str | Path,
        *,
        max_text_bytes: int | None = None,
        max_store_bytes: int | None = None,
        max_principal_bytes: int | None = None,
        retention_s: float | None = None,
    ) -> None:
        self.max_text_bytes = max_text_bytes
        self.max_store_bytes = max_store_bytes
        self.max_principal_bytes = max_principal_bytes
        self.retention_s = retention_s
        self._db = Database(where)
        self.location = self._db.location
        try:
            with self._db.setup() as tx:
                self._create_tables(tx)
            self._expire(time.time())
        except BaseException:
            self._db.close()
            raise

    def _create_tables(self, tx: Transaction) -> None:
        """Create the tables, or upgrade those an earlier version wrote (their records stay as
        they are and are read alike)."""
        tx.execute(_SCHEMA)
        self._db.add_columns(tx, "feedback", _ADDED_COLUMNS)
        tx.execute(_TEXTS_SCHEMA)
        tx.execute("CREATE INDEX IF NOT EXISTS feedback_created_at ON feedback (created_at)")
        tx.execute("CREATE INDEX IF NOT EXISTS feedback_prompt_id ON feedback (prompt_id)")
        tx.execute("CREATE INDEX IF NOT EXISTS feedback_generated_id ON feedback (generated_id)")
        self._db.create_trigger(tx, "feedback_texts_cleanup", "AFTER DELETE ON feedback", _TEXTS_CLEANUP)
        if not self._db.table_exists("feedback_usage", tx):
            # Created with the triggers that keep it, in the same transaction: no record is missed.
            tx.execute(_USAGE_SCHEMA)
            tx.execute(
                "INSERT INTO feedback_usage (principal, num_bytes) SELECT COALESCE(principal, ''),"
                " SUM(COALESCE(num_bytes, 0)) FROM feedback GROUP BY COALESCE(principal, '')"
            )
        self._db.create_trigger(tx, "feedback_charge", "AFTER INSERT ON feedback", _CHARGE)
        self._db.create_trigger(tx, "feedback_refund", "AFTER DELETE ON feedback", _REFUND)

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
        # Expired records go in a transaction of their own: a refused record below must not
        # roll their deletion back (a full store would then never free anything).
        self._expire(now)
        with self._db.write("feedback") as tx:
            found = {name: _find_text(tx, texts[name][0]) for name in ("prompt", "generated_text")}
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
            self._check_room(tx, principal, num_bytes)
            stored: dict[bytes | None, int] = {
                digest: int(
                    tx.execute("INSERT INTO texts (digest, body) VALUES (?, ?) RETURNING id", (digest, text)).value()
                )
                for digest, text in new_texts.items()
            }
            ids = {
                name: text_id if text_id is not None else stored.get(digest)
                for name, (text_id, digest) in found.items()
            }
            finished = record.get("is_generation_finished")
            row_id = tx.execute(
                "INSERT INTO feedback (created_at, protocol, request_id, rating, text, position, model, prompt_id,"
                " generated_id, is_generation_finished, api_key_hint, truncated, principal, num_bytes)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?) RETURNING id",
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
                    None if finished is None else int(bool(finished)),
                    api_key_hint,
                    truncated,
                    principal,
                    num_bytes,
                ),
            ).value()
        return int(row_id)

    def _check_room(self, tx: Transaction, principal: str | None, num_bytes: int) -> None:
        # In the insert's transaction, as the only writer: what is read here holds until it commits.
        if self.max_store_bytes is not None and self._used_bytes(tx) + num_bytes > self.max_store_bytes:
            raise StorageFull(
                f"the feedback store is full ({self.max_store_bytes} bytes, "
                "--feedback-max-store-bytes); feedback is not being stored"
            )
        if principal is not None and self.max_principal_bytes is not None:
            used = _charged(tx, principal)
            if used + num_bytes > self.max_principal_bytes:
                raise StorageFull(
                    f"your feedback takes {used} bytes of the store, the most "
                    f"one client may keep ({self.max_principal_bytes} bytes, "
                    "--feedback-max-bytes-per-principal); further feedback is not stored"
                )

    def _expire(self, now: float) -> None:
        # Deleting by age is the documented retention policy; the triggers refund the charges
        # and delete the texts no record names any more.
        if self.retention_s is None:
            return
        with self._db.write("feedback") as tx:
            deleted = delete_expired(tx, "feedback", self.retention_s, now)
        log_expired(log, deleted, "feedback records", self.retention_s, "--feedback-retention-days")

    def _used_bytes(self, tx: Transaction | None = None) -> int:
        file_bytes = self._db.file_bytes(tx)
        if file_bytes is not None:
            return file_bytes
        run = self._db.execute if tx is None else tx.execute
        return int(run("SELECT COALESCE(SUM(num_bytes), 0) FROM feedback_usage").value())

    def used_bytes(self) -> int:
        """Bytes the store counts against ``max_store_bytes`` (see the module docstring)."""
        return self._used_bytes()

    def principal_bytes(self, principal: str) -> int:
        """Bytes charged to ``principal``'s records (what ``max_principal_bytes`` bounds)."""
        value = self._db.execute("SELECT num_bytes FROM feedback_usage WHERE principal = ?", (principal,)).value()
        return int(value or 0)

    def records(self) -> Iterator[dict[str, Any]]:
        """Every record, oldest first, each with its own prompt and generated text."""
        rows = self._db.execute(_SELECT).rows
        for row in rows:
            record = dict(zip(COLUMNS, row))
            if record["is_generation_finished"] is not None:
                record["is_generation_finished"] = bool(record["is_generation_finished"])
            record["truncated"] = record["truncated"].split(",") if record["truncated"] else []
            yield record

    def close(self) -> None:
        """Close the database connection."""
        self._db.close()


def _find_text(tx: Transaction, text: str | None) -> tuple[int | None, bytes | None]:
    """The id of ``text`` if it is stored already (else None), and its digest."""
    if text is None:
        return None, None
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    text_id = tx.execute("SELECT id FROM texts WHERE digest = ?", (digest,)).value()
    return (None if text_id is None else int(text_id)), digest


def _charged(tx: Transaction, principal: str) -> int:
    """Bytes charged to ``principal``'s records."""
    value = tx.execute("SELECT num_bytes FROM feedback_usage WHERE principal = ?", (principal,)).value()
    return int(value or 0)


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


def export(where: str | Path, out: TextIO) -> int:
    """Write every record of the store in ``where`` (a data folder or a ``postgresql://`` URL)
    to ``out``, one JSON object per line (``rill feedback export``, whose command line lives in
    ``rill.cli``); returns the exit code. A database without a store is said so on stderr and
    exports nothing (nothing is created).

    Raises:
        ConfigError: the database cannot be reached.
    """
    if is_url(where):
        probe(str(where))
        db = Database(where)
        try:
            missing = None if db.table_exists("feedback") else f"{db.location} has no feedback table"
        finally:
            db.close()
    else:
        path = Path(where) / DB_NAME
        missing = None if path.exists() else f"{path} does not exist"
    if missing is not None:
        print(f"rill: no feedback stored yet ({missing})", file=sys.stderr)
        return 0
    store = FeedbackStore(where)
    try:
        for record in store.records():
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        store.close()
    return 0
