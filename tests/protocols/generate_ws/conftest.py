"""Fixtures: a real uvicorn server on loopback around a FakeClient (no model)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, AsyncIterator

import pytest
import uvicorn

from rill.config import HttpConfig, ServerConfig
from rill.server import Deps, build_app
from tests.helpers import port_of, start_uvicorn, stop_uvicorn

from .fakes import FakeClient


class LiveServer:
    """A running server: ``url`` is ``http://127.0.0.1:PORT``; ``ws`` the ``/generate`` URL."""

    def __init__(self, server: uvicorn.Server, task: asyncio.Task, client: FakeClient, deps: Deps) -> None:
        self.server, self.task, self.client, self.deps = server, task, client, deps
        port = port_of(server)
        self.url = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}/generate"


async def start_server(client: Any, **http: Any) -> LiveServer:
    config = ServerConfig(http=dataclasses.replace(HttpConfig(), port=0, **http))
    deps = Deps(config=config, client=client, api_keys=config.api_keys())
    server, task = await start_uvicorn(build_app(deps))
    return LiveServer(server, task, client, deps)


async def stop_server(live: LiveServer) -> None:
    await stop_uvicorn(live.server, live.task)


@pytest.fixture
async def make_server(tmp_path: Any) -> AsyncIterator[Any]:
    """``await make_server(client=FakeClient(), **http_config_fields)``."""
    servers: list[LiveServer] = []

    async def make(client: Any = None, **http: Any) -> LiveServer:
        http.setdefault("data_dir", str(tmp_path / "data"))
        live = await start_server(client or FakeClient(step_delay_s=0.002), **http)
        servers.append(live)
        return live

    yield make
    for live in servers:
        await stop_server(live)
