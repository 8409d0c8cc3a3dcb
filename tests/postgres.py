"""A throwaway PostgreSQL server for the tests, from Debian's ``postgresql`` package.

``PostgresServer.start()`` finds ``initdb`` and ``pg_ctl`` under ``/usr/lib/postgresql/*/bin``
(the newest version), initialises a cluster in a new temporary folder and starts it listening
on a Unix socket in that folder only (no TCP port), with ``fsync`` on as in production. Each
test gets a database of its own (``new_database``: about 40 ms). ``stop()`` stops the server at
once and deletes the folder.

PostgreSQL refuses to run as root: as root (CI), the cluster belongs to the ``postgres`` user
the Debian package creates, and the tests connect over the socket as its superuser ``rill``
(trust authentication: the socket's folder is the only way in).

The fixtures (``tests/conftest.py``) skip the PostgreSQL tests, naming the reason, when the
binaries are missing, and fail them instead when ``RILL_REQUIRE_POSTGRES=1`` (``.ci/run``
sets it and installs the package), so CI never skips them silently.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPERUSER = "rill"
START_TIMEOUT_S = 60


class Unavailable(Exception):
    """PostgreSQL cannot be started here (the message says why)."""


def find_bin() -> Path:
    """The ``bin`` folder of the newest PostgreSQL under ``/usr/lib/postgresql``."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    if not found:
        raise Unavailable(
            "PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb; apt-get install postgresql)"
        )
    return max(found, key=lambda path: int(path.parent.name) if path.parent.name.isdigit() else 0)


@dataclass
class PostgresServer:
    """A running throwaway cluster."""

    bin_dir: Path
    folder: Path
    run_as: dict[str, Any]
    _names: Any = None

    @classmethod
    def start(cls) -> PostgresServer:
        """Initialise and start a cluster in a new temporary folder.

        Raises:
            Unavailable: the binaries are missing, or (as root) there is no ``postgres`` user.
        """
        bin_dir = find_bin()
        run_as: dict[str, Any] = {}
        folder = Path(tempfile.mkdtemp(prefix="rill-pg-"))
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError as exc:
                shutil.rmtree(folder)
                raise Unavailable("running as root, and there is no postgres user to run PostgreSQL as") from exc
            os.chown(folder, user.pw_uid, user.pw_gid)
            run_as = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        server = cls(bin_dir, folder, run_as)
        try:
            server._pg(
                "initdb",
                "--pgdata",
                str(folder / "data"),
                "--username",
                SUPERUSER,
                "--auth",
                "trust",
                "--encoding",
                "UTF8",
                "--no-instructions",
            )
            options = f"-k {folder} -c listen_addresses= -c fsync=on -c max_connections=50"
            server._pg(
                "pg_ctl",
                "start",
                "--pgdata",
                str(folder / "data"),
                "--wait",
                "--timeout",
                str(START_TIMEOUT_S),
                "--log",
                str(folder / "server.log"),
                "-o",
                options,
            )
        except BaseException:
            server.stop()
            raise
        return server

    def _pg(self, program: str, *args: str) -> None:
        result = subprocess.run(
            [str(self.bin_dir / program), *args],
            capture_output=True,
            text=True,
            cwd=self.folder,
            timeout=START_TIMEOUT_S + 30,
            **self.run_as,
        )
        if result.returncode != 0:
            log = self.folder / "server.log"
            detail = log.read_text() if log.exists() else ""
            raise RuntimeError(f"{program} failed ({result.returncode}): {result.stderr}{result.stdout}\n{detail}")

    def url(self, dbname: str = "postgres") -> str:
        """The URL of database ``dbname`` over the cluster's socket."""
        return f"postgresql://{SUPERUSER}@/{dbname}?host={self.folder}"

    def new_database(self) -> str:
        """Create an empty database; its URL."""
        import psycopg

        if self._names is None:
            self._names = itertools.count(1)
        name = f"test_{next(self._names)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        """Stop the server at once (no checkpoint: its data is thrown away) and delete the folder."""
        try:
            if (self.folder / "data" / "postmaster.pid").exists():
                self._pg("pg_ctl", "stop", "--pgdata", str(self.folder / "data"), "--mode", "immediate", "--wait")
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
