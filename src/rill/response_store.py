"""Stored responses of the Responses API (``store: true``), in the server's database.

The feedback store's database (``rill.database``: SQLite in the data folder, or PostgreSQL with
``--database``, shared by every server given it), a table of its own. A row holds one response object (JSON), the input items of its request,
and its *history*: every item of the conversation up to and including its output, which a
later request continues with ``previous_response_id``. Rows are keyed by response id and
belong to a principal (``rill.auth.principal``): every read, delete and continuation checks
it, and another principal's id looks exactly like an unknown one.

A response is written when it is created (status ``queued``/``in_progress``: acknowledged,
so a background response survives as a row even if the server dies) and again when it ends;
a row left ``queued``/``in_progress`` by a server that died is marked ``failed`` at open. A
running row names its server (``owner``, ``Database.hold_liveness``): a server opening a
PostgreSQL database that others share marks only the rows of servers that are gone.

Bounds: ``max_count`` rows and ``max_bytes`` bytes, of which ``max_bytes_per_client`` for the
rows one client asked for (``StorageFull`` for a new row past any; nothing stored is deleted
to make room), ``retention_s`` (older rows are deleted
at open and when a row is added), and ``max_history_bytes`` per row (``HistoryTooLong``).

Blocking I/O: call the methods from a worker thread (``asyncio.to_thread``) in async code.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rill.database import Database, Result, delete_expired, log_expired
from rill.errors import InvalidRequest, RequestNotFound, StorageFull

log = logging.getLogger("rill.responses")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    principal TEXT NOT NULL,
    created_at {float} NOT NULL,
    status TEXT NOT NULL,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL,
    history TEXT NOT NULL,
    num_bytes {int} NOT NULL,
    charged_to TEXT NOT NULL,
    owner {int}
)
"""

_RUNNING = ("queued", "in_progress")
"""Statuses of a response that has not ended."""


class HistoryTooLong(InvalidRequest):
    """The conversation a response would store (the history it continues, its input and
    output) is longer than ``--responses-max-history-bytes``."""

    code = "history_too_long"


@dataclass(frozen=True)
class StoredResponse:
    """One row: the response object, its request's input items and its conversation so far."""

    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    history: list[dict[str, Any]]


class ResponseStore:
    """The ``responses`` table of the server's database; thread-safe (one connection behind a lock).

    Args:
        where: the data folder (its SQLite file) or a ``postgresql://`` URL (``--database``).
        max_count, max_bytes, max_history_bytes, retention_s, max_bytes_per_client: the bounds
            of the module docstring (``max_bytes_per_client`` None: an eighth of ``max_bytes``).

    Raises:
        Unreachable: the database cannot be reached (``rill.database``).
    """

    def __init__(
        self,
        where: str | Path,
        *,
        max_count: int,
        max_bytes: int,
        max_history_bytes: int,
        retention_s: float | None,
        max_bytes_per_client: int | None = None,
    ) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.max_history_bytes = max_history_bytes
        self.retention_s = retention_s
        self.max_bytes_per_client = max_bytes_per_client or max(1, max_bytes // 8)
        self._db = Database(where)
        try:
            with self._db.setup() as tx:
                tx.execute(_SCHEMA)
                self._db.add_columns(tx, "responses", {"owner": "INTEGER"})
                tx.execute("CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at)")
                tx.execute("CREATE INDEX IF NOT EXISTS responses_charged_to ON responses (charged_to)")
            self._owner = self._db.hold_liveness()
            with self._db.write("responses") as tx:
                deleted = delete_expired(tx, "responses", self.retention_s, time.time())
            self._log_expired(deleted)
            self._fail_orphans()
        except BaseException:
            self._db.close()
            raise

    def _fail_orphans(self) -> None:
        """Mark ``failed`` the rows left running by servers that are gone."""
        running = self._db.execute("SELECT DISTINCT owner FROM responses WHERE status IN (?, ?)", _RUNNING).rows
        num_failed = 0
        for (owner,) in running:
            if self._db.is_alive(owner):
                continue
            with self._db.write("responses") as tx:
                where = "status IN (?, ?) AND " + ("owner IS NULL" if owner is None else "owner = ?")
                args = (*_RUNNING, *(() if owner is None else (owner,)))
                for response_id, text in tx.execute(f"SELECT id, response FROM responses WHERE {where}", args).rows:
                    response = json.loads(text)
                    response["status"] = "failed"
                    response["error"] = {
                        "code": "server_error",
                        "message": "the server stopped before the response ended",
                    }
                    tx.execute(
                        "UPDATE responses SET status = 'failed', response = ? WHERE id = ?",
                        (json.dumps(response), response_id),
                    )
                    num_failed += 1
        if num_failed:
            log.info("%d stored responses were running when their server stopped: marked failed", num_failed)

    def check_history(self, history: list[dict[str, Any]]) -> None:
        """``HistoryTooLong`` when ``history`` alone is over ``max_history_bytes``."""
        size = len(json.dumps(history))
        if size > self.max_history_bytes:
            raise HistoryTooLong(
                f"the conversation is {size} bytes, over this server's {self.max_history_bytes} "
                "(--responses-max-history-bytes); start a new conversation",
                field="previous_response_id",
            )

    def put(self, principal: str, stored: StoredResponse, *, is_new: bool, charged_to: str | None = None) -> None:
        """Insert (``is_new``) or replace the row of ``stored.response['id']`` and commit.
        ``principal`` owns the row; its bytes are charged to ``charged_to`` (who asked: an API
        key's principal or a client address; ``principal`` when None).

        Raises:
            StorageFull: a new row would take the store past ``max_count`` or ``max_bytes``,
                or its client past ``max_bytes_per_client``.
            HistoryTooLong: the row's history is over ``max_history_bytes``.
        """
        self.check_history(stored.history)
        response_text = json.dumps(stored.response)
        items_text = json.dumps(stored.input_items)
        history_text = json.dumps(stored.history)
        size = len(response_text) + len(items_text) + len(history_text)
        response_id = stored.response["id"]
        now = time.time()
        if not is_new:
            self._db.execute(
                "UPDATE responses SET status = ?, response = ?, history = ?, num_bytes = ? WHERE id = ? AND principal = ?",
                (stored.response["status"], response_text, history_text, size, response_id, principal),
            )
            return
        with self._db.write("responses") as tx:
            deleted = delete_expired(tx, "responses", self.retention_s, now)
            count, total = tx.execute("SELECT COUNT(*), COALESCE(SUM(num_bytes), 0) FROM responses").one()  # type: ignore[misc]
            count, total = int(count), int(total)
            if count >= self.max_count or total + size > self.max_bytes:
                raise StorageFull(
                    f"the response store is full ({count} responses, {total} bytes; caps "
                    f"{self.max_count} and {self.max_bytes}); send store: false or delete stored responses"
                )
            charge = charged_to or principal
            mine = int(
                tx.execute("SELECT COALESCE(SUM(num_bytes), 0) FROM responses WHERE charged_to = ?", (charge,)).value()
            )
            if mine + size > self.max_bytes_per_client:
                raise StorageFull(
                    f"this client's stored responses take {mine} bytes, and its share of the store is "
                    f"{self.max_bytes_per_client}; send store: false or delete stored responses"
                )
            tx.execute(
                "INSERT INTO responses (id, principal, created_at, status, response, input_items, history,"
                " num_bytes, charged_to, owner) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    response_id,
                    principal,
                    now,
                    stored.response["status"],
                    response_text,
                    items_text,
                    history_text,
                    size,
                    charge,
                    self._owner,
                ),
            )
        self._log_expired(deleted)

    def get(self, response_id: str, principal: str) -> StoredResponse:
        """The row of ``response_id``; ``RequestNotFound`` if absent or another principal's."""
        row = self._db.execute(
            "SELECT response, input_items, history FROM responses WHERE id = ? AND principal = ?",
            (response_id, principal),
        ).one()
        if row is None:
            raise RequestNotFound(f"no response with id {response_id!r}")
        return StoredResponse(json.loads(row[0]), json.loads(row[1]), json.loads(row[2]))

    def delete(self, response_id: str, principal: str) -> None:
        """Delete a row; ``RequestNotFound`` if absent or another principal's."""
        result = self._db.execute("DELETE FROM responses WHERE id = ? AND principal = ?", (response_id, principal))
        if result.rowcount == 0:
            raise RequestNotFound(f"no response with id {response_id!r}")

    def _log_expired(self, deleted: Result) -> None:
        log_expired(log, deleted, "stored responses", self.retention_s, "--responses-retention-days")

    def close(self) -> None:
        """Close the database connection."""
        self._db.close()
