"""rill.database: URLs and their passwords, the start-up errors of ``--database``, and what the
two backends must do alike (placeholders, text, one writer at a time, a lost connection)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from rill import cli
from rill.database import Database, check_url, redact
from rill.errors import ConfigError, StorageFull
from rill.feedback import FeedbackStore
from tests.conftest import free_port


@pytest.mark.parametrize(
    "url, shown",
    [
        ("postgresql://rill:s3cret@db.example:5432/rill", "postgresql://rill:***@db.example:5432/rill"),
        ("postgres://rill:p%40ss@h1:5432,h2:5433/rill", "postgres://rill:***@h1:5432,h2:5433/rill"),
        (
            "postgresql://rill@db/rill?sslmode=require&password=s3cret",
            "postgresql://rill@db/rill?sslmode=require&password=***",
        ),
        ("postgresql://rill@/rill?host=/run/postgresql", "postgresql://rill@/rill?host=/run/postgresql"),
        ("postgresql:///rill", "postgresql:///rill"),
    ],
)
def test_redact_hides_only_the_password(url: str, shown: str) -> None:
    assert redact(url) == shown


@pytest.mark.parametrize("url", ["mysql://u:s3cret@h/db", "data/folder", "", "sqlite:///x.db"])
def test_only_postgresql_urls_are_taken(url: str) -> None:
    with pytest.raises(ConfigError, match="^database must be a postgresql://") as caught:
        check_url(url, "database")
    assert "s3cret" not in str(caught.value)


def test_check_config_shows_the_url_without_its_password(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check-config", "--database", "postgresql://rill:s3cret@db.example/rill"]) == 0
    out = capsys.readouterr().out
    assert '"database": "postgresql://rill:***@db.example/rill"' in out and "s3cret" not in out


def test_a_database_that_is_not_a_url_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check-config", "--database", "/var/lib/rill/db"]) == 2
    assert capsys.readouterr().err.startswith("rill: error: database must be a postgresql://")


def test_an_unreachable_database_stops_serve_at_start_up_with_the_setting_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"postgresql://rill:s3cret@127.0.0.1:{free_port()}/rill"  # nothing listens there
    assert cli.main(["serve", "--model", "demo", "--database", url, "--no-socket", "--grpc-port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rill: error: --database {redact(url)}: cannot connect to the database: ")
    assert "s3cret" not in err and "Traceback" not in err


def test_feedback_export_of_an_unreachable_database_names_it(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"postgresql://rill:s3cret@127.0.0.1:{free_port()}/rill"
    assert cli.main(["feedback", "export", "--database", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rill: error: --database postgresql://rill:***@") and "s3cret" not in err


def test_without_psycopg_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if the postgres extra were not installed
    with pytest.raises(ConfigError, match=r"pip install 'rill\[postgres\]'"):
        Database("postgresql://rill@127.0.0.1/rill")


def test_placeholders_and_percent_signs_mean_the_same_on_both(store_where: str | Path) -> None:
    db = Database(store_where)
    assert db.execute("SELECT ? || '%' || ?", ("50", "!")).value() == "50%!"
    db.close()


def test_a_nul_character_in_feedback_is_stored_on_both(store_where: str | Path) -> None:
    # PostgreSQL's text cannot hold NUL: it is stored as U+FFFD there rather than refused.
    store = FeedbackStore(store_where)
    store.add({"request_id": "g", "rating": 1, "text": "a\x00b", "prompt": "p\x00"})
    [record] = store.records()
    nul = "\ufffd" if isinstance(store_where, str) else "\x00"
    assert (record["text"], record["prompt"]) == (f"a{nul}b", f"p{nul}")
    store.close()


def test_two_stores_writing_at_once_never_pass_a_principal_quota(store_where: str | Path) -> None:
    # Two connections, as two servers sharing one database: the quota is read and the record
    # written by one writer at a time, so together they store exactly what the quota holds.
    stores = [FeedbackStore(store_where, max_principal_bytes=10_000) for _ in range(2)]
    stored = [0, 0]

    def fill(index: int) -> None:
        for i in range(40):
            try:
                stores[index].add({"request_id": f"{index}-{i}", "rating": 1, "text": "x" * 500}, principal="key:a")
                stored[index] += 1
            except StorageFull:
                pass

    threads = [threading.Thread(target=fill, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    per_record = 256 + 500
    assert sum(stored) == 10_000 // per_record and stores[0].principal_bytes("key:a") == sum(stored) * per_record
    for store in stores:
        store.close()


def end_session(db: Database, pid: int) -> None:
    """End the PostgreSQL session ``pid`` from ``db``'s, as the database does when a server's
    process dies, and wait until it has ended (its locks released)."""
    db.execute("SELECT pg_terminate_backend(?, 30000)", (pid,))


def test_a_lost_connection_is_replaced_and_the_liveness_lock_taken_again(pg_url: str) -> None:
    import psycopg

    db, other = Database(pg_url), Database(pg_url)
    db.hold_liveness()
    assert other.is_alive(db.instance_id)
    end_session(other, db.execute("SELECT pg_backend_pid()").value())
    assert not other.is_alive(db.instance_id)  # its session is gone
    with pytest.raises(psycopg.OperationalError):
        db.execute("SELECT 1")  # the call that meets the break fails: nothing it did is acknowledged
    assert db.execute("SELECT 1").value() == 1
    assert other.is_alive(db.instance_id)
    db.close()
    other.close()


def test_check_config_never_shows_api_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["check-config", "--api-key", "sk-very-secret-0123456789"]) == 0
    out = capsys.readouterr().out
    assert "sk-very-secret" not in out and '"***"' in out
