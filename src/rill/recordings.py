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

The folder is scanned once, on the first commit (recordings of earlier runs count); after that
an in-memory index in creation order keeps each commit cheap. The database's table is the index
itself, written one server at a time (``Database.write``). Blocking I/O: call the methods from a
worker thread in async code. Thread-safe.
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

from rill.database import Database

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


class RecordingStore:
    """A recordings folder kept under ``max_bytes`` and ``retention_s`` (None: no retention)."""

    def __init__(self, folder: str | Path, max_bytes: int, retention_s: float | None = None) -> None:
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[float, int]] | None = None  # id -> (created_at, bytes), oldest first
        self._num_bytes = 0

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
        with self._lock:
            index = self._load()
            size = _folder_bytes(self.folder / recording_id)
            index.pop(recording_id, None)
            index[recording_id] = (now, size)
            self._num_bytes = sum(num for _, num in index.values())
            if self.retention_s is not None:
                while index:
                    oldest_id, (created_at, _) = next(iter(index.items()))
                    if created_at >= now - self.retention_s:
                        break
                    self._delete(
                        oldest_id,
                        f"older than {self.retention_s / 86400:g} days (--record-retention-days)",
                        logging.INFO,
                    )
            while self._num_bytes > self.max_bytes and index:
                oldest_id = next(iter(index))
                self._delete(
                    oldest_id, f"to keep recordings under {self.max_bytes} bytes (--record-max-bytes)", logging.WARNING
                )

    def num_bytes(self) -> int:
        """Bytes the recordings hold (as of the last commit)."""
        with self._lock:
            return self._num_bytes

    def _load(self) -> OrderedDict[str, tuple[float, int]]:
        if self._index is None:
            found: list[tuple[float, str, int]] = []
            if self.folder.is_dir():
                for entry in os.scandir(self.folder):
                    if entry.is_dir(follow_symlinks=False) and RECORDING_ID.match(entry.name):
                        found.append(
                            (entry.stat(follow_symlinks=False).st_mtime, entry.name, _folder_bytes(Path(entry.path)))
                        )
            self._index = OrderedDict((name, (mtime, size)) for mtime, name, size in sorted(found))
        return self._index

    def _delete(self, recording_id: str, reason: str, level: int) -> None:
        assert self._index is not None
        _, size = self._index.pop(recording_id)
        self._num_bytes -= size
        shutil.rmtree(self.folder / recording_id, ignore_errors=True)
        log.log(level, "deleted recording %s (%d bytes) %s", recording_id, size, reason)


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


class DatabaseRecordings:
    """Recordings in the ``recordings`` table of the stores' database, under ``max_bytes`` and
    ``retention_s`` (None: no retention); the database is opened on first use.

    Args:
        where: a ``postgresql://`` URL (``--database``), or a data folder (its SQLite file).
    """

    def __init__(self, where: str | Path, max_bytes: int, retention_s: float | None = None) -> None:
        self.where = where
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self._db: Database | None = None
        self._open_lock = threading.Lock()

    def _database(self) -> Database:
        with self._open_lock:
            if self._db is None:
                db = Database(self.where)
                with db.setup() as tx:
                    tx.execute(_SCHEMA)
                    tx.execute("CREATE INDEX IF NOT EXISTS recordings_created_at ON recordings (created_at)")
                self._db = db
            return self._db

    def save(self, recording_id: str, request_text: str, reply: dict[str, Any], wav: bytes | None) -> None:
        """Insert and commit the recording, then delete (in the same transaction) those past the
        retention and the oldest past the cap; each deletion is logged once committed."""
        if not RECORDING_ID.match(recording_id):
            raise ValueError(f"not a recording id: {recording_id!r}")
        reply_text = json.dumps(reply)
        size = len(request_text.encode("utf-8", "surrogatepass")) + len(reply_text) + len(wav or b"")
        now = time.time()
        expired: list[tuple[Any, ...]] = []
        evicted: list[tuple[Any, ...]] = []
        with self._database().write("recordings") as tx:
            tx.execute(
                "INSERT INTO recordings (id, created_at, request, reply, audio, num_bytes) VALUES (?, ?, ?, ?, ?, ?)",
                (recording_id, now, request_text, reply_text, wav, size),
            )
            if self.retention_s is not None:
                expired = tx.execute(
                    "DELETE FROM recordings WHERE created_at < ? RETURNING id, num_bytes", (now - self.retention_s,)
                ).rows
            total = int(tx.execute("SELECT COALESCE(SUM(num_bytes), 0) FROM recordings").value())
            if total > self.max_bytes:
                for oldest_id, num_bytes in tx.execute(
                    "SELECT id, num_bytes FROM recordings ORDER BY created_at, id"
                ).rows:
                    if total <= self.max_bytes:
                        break
                    tx.execute("DELETE FROM recordings WHERE id = ?", (oldest_id,))
                    total -= int(num_bytes)
                    evicted.append((oldest_id, num_bytes))
        for oldest_id, num_bytes in expired:
            assert self.retention_s is not None
            log.info(
                "deleted recording %s (%d bytes) older than %g days (--record-retention-days)",
                oldest_id,
                num_bytes,
                self.retention_s / 86400,
            )
        for oldest_id, num_bytes in evicted:
            log.warning(
                "deleted recording %s (%d bytes) to keep recordings under %d bytes (--record-max-bytes)",
                oldest_id,
                num_bytes,
                self.max_bytes,
            )

    def reply(self, recording_id: str) -> dict[str, Any] | None:
        """A recording's reply with its request under ``request``, or None."""
        if not RECORDING_ID.match(recording_id):
            return None
        row = self._database().execute("SELECT request, reply FROM recordings WHERE id = ?", (recording_id,)).one()
        if row is None:
            return None
        reply: dict[str, Any] = json.loads(row[1])
        reply["request"] = json.loads(row[0])
        return reply

    def audio(self, recording_id: str) -> bytes | None:
        """A recording's WAV bytes, or None."""
        if not RECORDING_ID.match(recording_id):
            return None
        wav = self._database().execute("SELECT audio FROM recordings WHERE id = ?", (recording_id,)).value()
        return None if wav is None else bytes(wav)

    def num_bytes(self) -> int:
        """Bytes the recordings hold."""
        return int(self._database().execute("SELECT COALESCE(SUM(num_bytes), 0) FROM recordings").value())

    def close(self) -> None:
        """Close the database connection (if it was opened)."""
        with self._open_lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _folder_bytes(folder: Path) -> int:
    total = 0
    try:
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return total
    return total
