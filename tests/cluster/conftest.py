"""Fixtures of the cluster tests: ``rill serve --replicas 2`` as a process of its own, on Ray's
local instance or on a two-node cluster simulated with ``ray.cluster_utils.Cluster``.

Ray is rill's optional ``ray`` extra (``make test`` installs it): without it these tests are
skipped with the reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port

try:
    import ray.serve  # noqa: F401 - rill's optional ray extra
except ImportError:
    # `make test` installs the extra; .ci/run sets RILL_REQUIRE_RAY=1 so CI never skips these silently.
    if os.environ.get("RILL_REQUIRE_RAY") == "1":
        raise
    pytest.skip("the cluster tests need Ray: pip install 'rill[ray]'", allow_module_level=True)

READY_TIMEOUT_S = 300
"""Start-up bound (Ray, then two replicas loading a model on a loaded 2-core machine): a
bound on waiting, never a pass condition."""

REPLICA_TITLE = "ray::ServeReplica:rill:rill-engine"
"""How Ray titles an engine replica's process."""


@dataclass
class ClusterServer:
    """A running ``rill serve --replicas``: its process, URLs and socket."""

    proc: subprocess.Popen[bytes]
    url: str
    ws_url: str
    socket: Path
    grpc_address: str
    database: str | None = None
    api_key: str | None = None

    def metrics(self) -> str:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        response = httpx.get(f"{self.url}/metrics", headers=headers, timeout=30)
        response.raise_for_status()
        return response.text

    def replica_values(self, name: str) -> dict[str, float]:
        """One ``rill_replica_*`` family from ``/metrics``: value by replica id."""
        values: dict[str, float] = {}
        for line in self.metrics().splitlines():
            if line.startswith(name + "{"):
                labels, value = line.rsplit(" ", 1)
                replica = labels.split('replica="', 1)[1].split('"', 1)[0]
                values[replica] = float(value)
        return values

    def replica_pids(self) -> list[int]:
        """The process ids of the engine replicas started under this server."""
        return [pid for pid in _descendants(self.proc.pid) if _cmdline(pid).startswith(REPLICA_TITLE)]


def wait_for(condition: Any, timeout_s: float, what: str) -> Any:
    """Poll ``condition`` until it returns something true (a bounded wait on a server-side
    effect, never a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.2)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start_cluster_server(model_dir: Path, folder: Path, *flags: str) -> ClusterServer:
    """``rill serve --replicas 2 --num-threads 1`` on ``model_dir`` with every listener (HTTP,
    the Unix socket, gRPC), once ``/health`` answers 200."""
    port, grpc_port = free_port(), free_port()
    sock = folder / "rill.sock"
    command = [sys.executable, "-m", "rill", "serve", "--model", str(model_dir), "--port", str(port)]
    command += ["--socket", str(sock), "--grpc-port", str(grpc_port), "--data-dir", str(folder / "data")]
    command += ["--dtype", "float32", "--kv-cache-memory", "64MiB", "--num-threads", "1"]
    command += ["--replicas", "2", "--log-level", "warning", *flags]
    log = (folder / "server.log").open("wb")
    env = os.environ | {"HF_HUB_OFFLINE": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:  # a start-up wait, not a timing assertion
        if proc.poll() is not None:
            raise AssertionError((folder / "server.log").read_text()[-4000:])
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            stop(proc)
            raise AssertionError("the cluster never became ready:\n" + (folder / "server.log").read_text()[-4000:])
        time.sleep(0.2)
    return ClusterServer(proc, url, f"ws://127.0.0.1:{port}", sock, f"127.0.0.1:{grpc_port}")


def stop(proc: subprocess.Popen[bytes]) -> int | None:
    """Stop the server (it removes its replicas and its Ray instance), killing its whole
    process group if it does not end in time. Its exit status after SIGTERM (None: killed)."""
    status = proc.poll()
    if status is None:
        proc.send_signal(signal.SIGTERM)
        try:
            status = proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever Ray left behind
    except ProcessLookupError:
        pass
    proc.wait()
    return status


LONG_CONTEXT = 2048
"""Context of ``long_model_dir``'s model, in tokens."""


@pytest.fixture(scope="session")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-init Llama with a context of ``LONG_CONTEXT`` tokens: a generation can last
    long enough that a control made at its first token surely finds it running."""
    from rill.testing.checkpoints import make_checkpoint

    folder = tmp_path_factory.mktemp("long-context") / "tiny-llama"
    return make_checkpoint(folder, arch="llama", max_position_embeddings=LONG_CONTEXT)


@pytest.fixture(scope="module")
def cluster(long_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, postgres: Any) -> Iterator[ClusterServer]:
    """Two engine replicas on Ray's local instance, the stores on PostgreSQL."""
    folder = tmp_path_factory.mktemp("cluster")
    database = str(postgres.new_database())
    server = start_cluster_server(long_model_dir, folder, "--database", database)
    server.database = database
    try:
        yield server
    finally:
        stop(server.proc)
