"""The Responses API's store: ownership, bounds, retention, rows left running by a dead server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rill.errors import RequestNotFound, StorageFull
from rill.response_store import HistoryTooLong, ResponseStore, StoredResponse


def _store(path: Path, **bounds: Any) -> ResponseStore:
    args: dict[str, Any] = {"max_count": 100, "max_bytes": 1 << 20, "max_history_bytes": 1 << 16, "retention_s": None}
    return ResponseStore(path, **(args | bounds))


def _row(response_id: str, status: str = "completed", text: str = "hi") -> StoredResponse:
    item = {"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return StoredResponse({"id": response_id, "status": status}, [item], [item])


def test_rows_belong_to_their_principal(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put("key:a", _row("resp_1"), is_new=True)
    assert store.get("resp_1", "key:a").response["status"] == "completed"
    with pytest.raises(RequestNotFound):
        store.get("resp_1", "key:b")
    with pytest.raises(RequestNotFound):
        store.delete("resp_1", "key:b")
    store.delete("resp_1", "key:a")
    with pytest.raises(RequestNotFound):
        store.get("resp_1", "key:a")


def test_count_bytes_and_per_client_bounds(tmp_path: Path) -> None:
    store = _store(tmp_path, max_count=2)
    store.put("p", _row("r1"), is_new=True)
    store.put("p", _row("r2"), is_new=True, charged_to="10.0.0.2")
    with pytest.raises(StorageFull):
        store.put("p", _row("r3"), is_new=True)
    small = _store(tmp_path / "b", max_bytes=4000, max_bytes_per_client=1000)
    small.put("anonymous", _row("r1", text="x" * 300), is_new=True, charged_to="10.0.0.1")
    with pytest.raises(StorageFull):
        small.put("anonymous", _row("r2", text="x" * 300), is_new=True, charged_to="10.0.0.1")
    small.put("anonymous", _row("r2", text="x" * 300), is_new=True, charged_to="10.0.0.9")  # another client


def test_history_bound(tmp_path: Path) -> None:
    store = _store(tmp_path, max_history_bytes=500)
    with pytest.raises(HistoryTooLong) as caught:
        store.put("p", _row("r1", text="y" * 600), is_new=True)
    assert caught.value.field == "previous_response_id"


def test_retention_and_rows_left_running(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.put("p", _row("running", status="in_progress"), is_new=True)
    store.close()
    reopened = _store(tmp_path, retention_s=3600)
    row = reopened.get("running", "p")
    assert row.response["status"] == "failed" and row.response["error"]["code"] == "server_error"
    reopened.close()
    later = _store(tmp_path, retention_s=1e-9)  # everything is older than this
    with pytest.raises(RequestNotFound):
        later.get("running", "p")
