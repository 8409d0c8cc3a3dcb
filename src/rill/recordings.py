"""The chat recordings folder (``--record``): one sub-folder per recorded chat, with a size
cap and a retention.

``RecordingStore.commit`` is called after a recording's files are written. It then deletes,
each deletion logged:

* recordings older than ``retention_s`` (the documented retention, ``--record-retention-days``);
* the oldest recordings, until the folder holds at most ``max_bytes``
  (``--record-max-bytes``); a single recording larger than the cap is deleted at once.

The folder is scanned once, on the first commit (recordings of earlier runs count); after that
an in-memory index in creation order keeps each commit cheap. Blocking I/O: call ``commit``
from a worker thread in async code. Thread-safe.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("rill.recordings")

RECORDING_ID = re.compile(r"^chat_[0-9a-f]{16}$")
"""How a recording's folder is named."""


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


def _folder_bytes(folder: Path) -> int:
    total = 0
    try:
        for entry in os.scandir(folder):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return total
    return total
