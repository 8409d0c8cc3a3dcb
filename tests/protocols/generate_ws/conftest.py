"""Fixtures: a real uvicorn server on loopback around the in-process engine client over a
``FakeRunner`` (the real engine code, no model)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn

from rill.config import EngineConfig, HttpConfig, PolicyConfig, ServerConfig
from rill.deps import Deps
from rill.frontend.inproc import InprocClient
from rill.server import build_app, make_deps
from rill.testing.fake_client import fake_client, record_requests
from rill.types import GenerateRequest
from tests.helpers import port_of, start_uvicorn, stop_uvicorn

MAX_CONTEXT = 2048
STEP_S = 0.002
"""Each engine step's pretend model time: a long stream lasts seconds, as the tests need."""


class LiveServer:
    """A running server: ``url`` is ``http://127.0.0.1:PORT``; ``ws`` the ``/generate`` URL;
    ``requests`` what the protocol submitted to ``client``."""

    def __init__(
        self,
        server: uvicorn.Server,
        task: asyncio.Task,
        client: InprocClient,
        deps: Deps,
        requests: list[GenerateRequest],
    ) -> None:
        self.server, self.task, self.client, self.deps, self.requests = server, task, client, deps, requests
        port = port_of(server)
        self.url = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}/generate"

    @property
    def engine(self) -> Any:
        """The client's engine (``engine.runner`` is the ``FakeRunner``)."""
        return self.client.engine

    def is_idle(self) -> bool:
        """No request running or waiting in the engine."""
        stats = self.client.stats()
        return stats.num_running == 0 and stats.num_waiting == 0 and stats.num_paused == 0

    def num_cancelled(self) -> int:
        """Requests the engine ended as cancelled (aborted)."""
        return self.client.stats().requests_finished_total.get("cancelled", 0)


async def start_server(client: InprocClient, **http: Any) -> LiveServer:
    """The whole app around ``client`` on a free loopback port (``http``: ``HttpConfig`` and
    ``PolicyConfig`` fields)."""
    policy = {f.name: http.pop(f.name) for f in dataclasses.fields(PolicyConfig) if f.name in http}
    config = ServerConfig(http=dataclasses.replace(HttpConfig(), port=0, **http), policy=PolicyConfig(**policy))
    deps = make_deps(config, client)
    requests = record_requests(client)
    server, task = await start_uvicorn(build_app(deps))
    return LiveServer(server, task, client, deps, requests)


async def stop_server(live: LiveServer) -> None:
    """Stop the server (not its client)."""
    await stop_uvicorn(live.server, live.task)


@pytest.fixture
async def make_server(tmp_path: Any) -> AsyncIterator[Any]:
    """``await make_server(max_len=..., num_rows=..., loading=..., load_error=..., step_s=..., **http_config_fields)``."""
    async with contextlib.AsyncExitStack() as stack:
        servers: list[LiveServer] = []

        async def make(
            *,
            max_len: int = MAX_CONTEXT,
            num_rows: int = 16,
            loading: threading.Event | None = None,
            load_error: BaseException | None = None,
            step_s: float = STEP_S,
            **http: Any,
        ) -> LiveServer:
            http.setdefault("data_dir", str(tmp_path / "data"))
            client = await stack.enter_async_context(
                fake_client(
                    EngineConfig(model="fake"),
                    loading=loading,
                    load_error=load_error,
                    max_len=max_len,
                    num_rows=num_rows,
                )
            )
            if client.engine is not None:
                client.engine.runner.delay_s = step_s
            live = await start_server(client, **http)
            servers.append(live)
            return live

        yield make
        for live in servers:
            await stop_server(live)
