"""The Responses API's store: ownership, bounds, retention, rows left running by a dead server;
on SQLite and on PostgreSQL (``store_where``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rill.errors import RequestNotFound, StorageFull
from rill.response_store import HistoryTooLong, ResponseStore, StoredResponse


def _store(where: str | Path, **bounds: Any) -> ResponseStore:
    args: dict[str, Any] = {"max_count": 100, "max_bytes": 1 << 20, "max_history_bytes": 1 << 16, "retention_s": None}
    return ResponseStore(where, **(args | bounds))


def _row(response_id: str, status: str = "completed", text: str = "hi") -> StoredResponse:
    item = {"id": "msg_1", "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return StoredResponse({"id": response_id, "status": status}, [item], [item])


def test_rows_belong_to_their_principal(store_where: str | Path) -> None:
    store = _store(store_where)
    store.put("key:a", _row("resp_1"), is_new=True)
    assert store.get("resp_1", "key:a").response["status"] == "completed"
    with pytest.raises(RequestNotFound):
        store.get("resp_1", "key:b")
    with pytest.raises(RequestNotFound):
        store.delete("resp_1", "key:b")
    store.delete("resp_1", "key:a")
    with pytest.raises(RequestNotFound):
        store.get("resp_1", "key:a")


def test_count_bytes_and_per_client_bounds(store_where: str | Path) -> None:
    store = _store(store_where, max_count=2)
    store.put("p", _row("r1"), is_new=True)
    store.put("p", _row("r2"), is_new=True, charged_to="10.0.0.2")
    with pytest.raises(StorageFull):
        store.put("p", _row("r3"), is_new=True)
    store.close()
    small = _store(store_where, max_count=100, max_bytes=4000, max_bytes_per_client=1000)
    small.put("anonymous", _row("s1", text="x" * 300), is_new=True, charged_to="10.0.0.1")
    with pytest.raises(StorageFull):
        small.put("anonymous", _row("s2", text="x" * 300), is_new=True, charged_to="10.0.0.1")
    small.put("anonymous", _row("s2", text="x" * 300), is_new=True, charged_to="10.0.0.9")  # another client


def test_history_bound(store_where: str | Path) -> None:
    store = _store(store_where, max_history_bytes=500)
    with pytest.raises(HistoryTooLong) as caught:
        store.put("p", _row("r1", text="y" * 600), is_new=True)
    assert caught.value.field == "previous_response_id"


def test_retention_and_rows_left_running(store_where: str | Path) -> None:
    store = _store(store_where)
    store.put("p", _row("running", status="in_progress"), is_new=True)
    store.close()
    reopened = _store(store_where, retention_s=3600)
    row = reopened.get("running", "p")
    assert row.response["status"] == "failed" and row.response["error"]["code"] == "server_error"
    reopened.close()
    later = _store(store_where, retention_s=1e-9)  # everything is older than this
    with pytest.raises(RequestNotFound):
        later.get("running", "p")


def test_a_server_opening_a_shared_database_fails_only_the_rows_of_servers_gone(pg_url: str) -> None:
    # Replicas share one PostgreSQL database: a server starting must not mark failed the
    # background responses another live server is running, only those of a server that died.
    alive, dying = _store(pg_url), _store(pg_url)
    alive.put("p", _row("running_alive", status="in_progress"), is_new=True)
    dying.put("p", _row("running_dying", status="queued"), is_new=True)
    # Its session ends, as when its process is killed (waited for: its lock is then released).
    alive._db.execute("SELECT pg_terminate_backend(?, 30000)", (dying._db.execute("SELECT pg_backend_pid()").value(),))
    dying.close()
    starting = _store(pg_url)
    assert starting.get("running_alive", "p").response["status"] == "in_progress"
    assert starting.get("running_dying", "p").response["status"] == "failed"
    alive.put("p", _row("running_alive", status="completed"), is_new=False)
    assert starting.get("running_alive", "p").response["status"] == "completed"
    for store in (alive, starting):
        store.close()


def test_a_response_stored_by_one_server_is_read_back_by_another(tiny_model_dir: Path, pg_url: str) -> None:
    # Two `rill serve` processes on one PostgreSQL database, as replicas will be: what one
    # stored, the other reads back and continues.
    import httpx

    from tests.helpers import rill_process

    with (
        rill_process(tiny_model_dir, "--database", pg_url) as (_, first),
        rill_process(tiny_model_dir, "--database", pg_url) as (_, second),
    ):
        model = httpx.get(f"{first}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "input": "Once upon a time", "max_output_tokens": 4, "temperature": 0}
        created = httpx.post(f"{first}/v1/responses", json=body, timeout=60).json()
        assert created["status"] in ("completed", "incomplete")  # incomplete: max_output_tokens
        read = httpx.get(f"{second}/v1/responses/{created['id']}").json()
        assert read == created
        follow_up = {**body, "input": "And then?", "previous_response_id": created["id"]}
        continued = httpx.post(f"{second}/v1/responses", json=follow_up, timeout=60).json()
        assert continued["status"] in ("completed", "incomplete")
        assert continued["previous_response_id"] == created["id"]
        items = httpx.get(f"{first}/v1/responses/{continued['id']}/input_items").json()["data"]
        assert [item["content"][0]["text"] for item in items] == ["And then?"]
