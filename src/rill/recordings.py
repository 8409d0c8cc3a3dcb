"""Chat recordings (``--record``), with a size cap and a retention, in one of two stores:

* ``RecordingStore``: the recordings folder in the data folder (the default), one sub-folder
  per recorded chat (``request.json``, ``reply.json``, ``reply.wav``);
* ``DatabaseRecordings``: a table of the stores' PostgreSQL database (``--database``), so that
  every server sharing it serves every recording, whichever server recorded it (files in one
  server's folder, or an index of them, would not reach the others).

After a recording is saved, each store deletes, each deletion logged:

* recordings older than ``retention_s`` (the documented retention, ``--record-retention-days``);
* the oldest recordings, until the store holds at most ``max_bytes``
  (``--record-max-bytes``); a single recording larger than the cap is deleted at once.

Each store is opened when the server starts (with ``--record``), and keeps a running total of
its bytes, so a save costs the same however many recordings there are: the folder is scanned
once, at open (recordings of earlier runs count), into an in-memory index in creation order;
the database keeps its total in the ``recordings_usage`` row, which triggers on every insert
and delete keep (so it holds for every server sharing a PostgreSQL database), and its table,
written one server at a time (``Database.write``), is the index. The oldest recordings are
deleted one after another only while the total is over the cap. Blocking I/O: call the methods
from a worker thread in async code. Thread-safe.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any, Protocol

from rill.database import Database, Transaction, delete_expired

log = logging.getLogger("rill.recordings")

RECORDING_ID = re.compile(r"^chat_[0-9a-f]{16}$")
"""How a recording (and its folder) is named."""


class Recordings(Protocol):
    """What ``/ws/chat`` needs of a recordings store."""

    def save(self, recording_id: str, request_text: str, reply: dict[str, Any], wav: bytes | None) -> None:
        """Store a recording (the chat's request as sent, the reply, the reply's WAV audio if
        spoken), then delete expired and oldest recordings past the cap."""
        ...

    def reply(self, recording_id: str) -> dict[str, Any] | None:
        """A recording's reply with its request (under ``request``), or None."""
        ...

    def audio(self, recording_id: str) -> Path | bytes | None:
        """A recording's WAV audio (a file, or its bytes), or None."""
        ...

    def num_bytes(self) -> int:
        """Bytes the recordings hold."""
        ...

    def close(self) -> None:
        """Release what the store holds open (the server stops)."""
        ...


class RecordingStore:
    """A recordings folder kept under ``max_bytes`` and ``retention_s`` (None: no retention);
    opening scans the folder once (blocking)."""

    def __init__(self, folder: str | Path, max_bytes: int, retention_s: float | None = None) -> None:
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self._lock = threading.Lock()
        self._index = self._scan()  # id -> (created_at, bytes), oldest first
        self._num_bytes = sum(size for _, size in self._index.values())

    def path_of(self, recording_id: str) -> Path | None:
        """The folder of a recording, or None for a name that is not a recording id."""
        return self.folder / recording_id if RECORDING_ID.match(recording_id) else None

    def save(self, recording_id: str, request_text: str, reply: dict[str, Any], wav: bytes | None) -> None:
        """Write ``request.json``, ``reply.wav`` (if any) and ``reply.json`` (last: a folder
        without it is no recording yet), then ``commit``."""
        folder = self.path_of(recording_id)
        if folder is None:
            raise ValueError(f"not a recording id: {recording_id!r}")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "request.json").write_text(request_text)
        if wav is not None:
            (folder / "reply.wav").write_bytes(wav)
        (folder / "reply.json").write_text(json.dumps(reply))
        self.commit(recording_id)

    def reply(self, recording_id: str) -> dict[str, Any] | None:
        """A recording's ``reply.json`` with its ``request.json`` under ``request``, or None."""
        folder = self.path_of(recording_id)
        if folder is None or not (folder / "reply.json").is_file():
            return None
        reply: dict[str, Any] = json.loads((folder / "reply.json").read_text())
        reply["request"] = json.loads((folder / "request.json").read_text())
        return reply

    def audio(self, recording_id: str) -> Path | None:
        """A recording's ``reply.wav``, or None."""
        folder = self.path_of(recording_id)
        return folder / "reply.wav" if folder is not None and (folder / "reply.wav").is_file() else None

    def commit(self, recording_id: str) -> None:
        """Count the recording just written, then delete expired and oldest recordings."""
        now = time.time()
        size = _folder_bytes(self.folder / recording_id)
        with self._lock:
            index = self._index
            _, replaced = index.pop(recording_id, (now, 0))
            index[recording_id] = (now, size)
            self._num_bytes += size - replaced
            if self.retention_s is not None:
                while index:
                    oldest_id, (created_at, _) = next(iter(index.items()))
                    if created_at >= now - self.retention_s:
                        break
                    self._delete(oldest_id, _expired_reason(self.retention_s), logging.INFO)
            while self._num_bytes > self.max_bytes and index:
                self._delete(next(iter(index)), _evicted_reason(self.max_bytes), logging.WARNING)

    def num_bytes(self) -> int:
        """Bytes the recordings hold (as of the last commit)."""
        with self._lock:
            return self._num_bytes

    def close(self) -> None:
        """Nothing is held open."""

    def _scan(self) -> OrderedDict[str, tuple[float, int]]:
        found: list[tuple[float, str, int]] = []
        if self.folder.is_dir():
            for entry in os.scandir(self.folder):
                if entry.is_dir(follow_symlinks=False) and RECORDING_ID.match(entry.name):
                    found.append(
                        (entry.stat(follow_symlinks=False).st_mtime, entry.name, _folder_bytes(Path(entry.path)))
                    )
        return OrderedDict((name, (mtime, size)) for mtime, name, size in sorted(found))

    def _delete(self, recording_id: str, reason: str, level: int) -> None:
        _, size = self._index.pop(recording_id)
        self._num_bytes -= size
        shutil.rmtree(self.folder / recording_id, ignore_errors=True)
        _log_deleted(recording_id, size, reason, level)


_SCHEMA = """
CREATE TABLE IF NOT EXISTS recordings (
    id TEXT PRIMARY KEY,
    created_at {float} NOT NULL,
    request TEXT NOT NULL,
    reply TEXT NOT NULL,
    audio {bytes},
    num_bytes {int} NOT NULL
)
"""

_USAGE_SCHEMA = """
CREATE TABLE IF NOT EXISTS recordings_usage (
    id {int} PRIMARY KEY,
    num_bytes {int} NOT NULL
)
"""
# One row (id 0): the sum of the recordings' num_bytes, kept by the two triggers below.

_CHARGE = "UPDATE recordings_usage SET num_bytes = num_bytes + new.num_bytes WHERE id = 0"
_REFUND = "UPDATE recordings_usage SET num_bytes = num_bytes - old.num_bytes WHERE id = 0"

_EVICTION_BATCH = 16
"""The oldest recordings read at a time while the total is over the cap."""


class DatabaseRecordings:
    """Recordings in the ``recordings`` table of the stores' database, under ``max_bytes`` and
    ``retention_s`` (None: no retention); opening connects to the database (blocking).

    Args:
        where: a ``postgresql://`` URL (``--database``), or a data folder (its SQLite file).

    Raises:
        Unreachable: the database cannot be reached (``rill.database``).
    """

    def __init__(self, where: str | Path, max_bytes: int, retention_s: float | None = None) -> None:
        self.where = where
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self._db = Database(where)
        try:
            with self._db.setup() as tx:
                tx.execute(_SCHEMA)
                tx.execute("CREATE INDEX IF NOT EXISTS recordings_created_at ON recordings (created_at)")
                if not self._db.table_exists("recordings_usage", tx):
                    # Created with its triggers in the same transaction: no recording is missed.
                    tx.execute(_USAGE_SCHEMA)
                    tx.execute(
                        "INSERT INTO recordings_usage (id, num_bytes) SELECT 0, COALESCE(SUM(num_bytes), 0) FROM recordings"
                    )
                self._db.create_trigger(tx, "recordings_charge", "AFTER INSERT ON recordings", _CHARGE)
                self._db.create_trigger(tx, "recordings_refund", "AFTER DELETE ON recordings", _REFUND)
        except BaseException:
            self._db.close()
            raise

    def save(self, recording_id: str, request_text: str, reply: dict[str, Any], wav: bytes | None) -> None:
        """Insert and commit the recording, then delete (in the same transaction) those past the
        retention and the oldest past the cap; each deletion is logged once committed."""
        if not RECORDING_ID.match(recording_id):
            raise ValueError(f"not a recording id: {recording_id!r}")
        reply_text = json.dumps(reply)
        size = len(request_text.encode("utf-8", "surrogatepass")) + len(reply_text) + len(wav or b"")
        now = time.time()
        evicted: list[tuple[Any, ...]] = []
        with self._db.write("recordings") as tx:
            tx.execute(
                "INSERT INTO recordings (id, created_at, request, reply, audio, num_bytes) VALUES (?, ?, ?, ?, ?, ?)",
                (recording_id, now, request_text, reply_text, wav, size),
            )
            expired = delete_expired(tx, "recordings", self.retention_s, now, returning="id, num_bytes").rows
            total = _usage(tx)
            while total > self.max_bytes:
                oldest = tx.execute(
                    "SELECT id, num_bytes FROM recordings ORDER BY created_at, id LIMIT ?", (_EVICTION_BATCH,)
                ).rows
                if not oldest:  # nothing left to delete (a total edited by hand)
                    break
                for oldest_id, num_bytes in oldest:
                    if total <= self.max_bytes:
                        break
                    tx.execute("DELETE FROM recordings WHERE id = ?", (oldest_id,))
                    total -= int(num_bytes)
                    evicted.append((oldest_id, num_bytes))
        for oldest_id, num_bytes in expired:
            assert self.retention_s is not None
            _log_deleted(oldest_id, num_bytes, _expired_reason(self.retention_s), logging.INFO)
        for oldest_id, num_bytes in evicted:
            _log_deleted(oldest_id, num_bytes, _evicted_reason(self.max_bytes), logging.WARNING)

    def reply(self, recording_id: str) -> dict[str, Any] | None:
        """A recording's reply with its request under ``request``, or None."""
        if not RECORDING_ID.match(recording_id):
            return None
        row = self._db.execute("SELECT request, reply FROM recordings WHERE id = ?", (recording_id,)).one()
        if row is None:
            return None
        reply: dict[str, Any] = json.loads(row[1])
        reply["request"] = json.loads(row[0])
        return reply

    def audio(self, recording_id: str) -> bytes | None:
        """A recording's WAV bytes, or None."""
        if not RECORDING_ID.match(recording_id):
            return None
        wav = self._db.execute("SELECT audio FROM recordings WHERE id = ?", (recording_id,)).value()
        return None if wav is None else bytes(wav)

    def num_bytes(self) -> int:
        """Bytes the recordings hold."""
        return _usage(self._db)

    def close(self) -> None:
        """Close the database connection."""
        self._db.close()


def _usage(db: Database | Transaction) -> int:
    return int(db.execute("SELECT num_bytes FROM recordings_usage WHERE id = 0").value())


def _expired_reason(retention_s: float) -> str:
    return f"older than {retention_s / 86400:g} days (--record-retention-days)"


def _evicted_reason(max_bytes: int) -> str:
    return f"to keep recordings under {max_bytes} bytes (--record-max-bytes)"


def _log_deleted(recording_id: str, num_bytes: int, reason: str, level: int) -> None:
    log.log(level, "deleted recording %s (%d bytes) %s", recording_id, num_bytes, reason)


def _folder_bytes(folder: Path) -> int:
    total = 0
    try:
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return total
    return total
