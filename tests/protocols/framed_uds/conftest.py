"""Fixtures for framed_uds tests: a framed-JSON client and a listener on a temporary socket, over
the real in-process engine client on a ``FakeRunner`` (no model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from rill import config as config_mod
from rill.config import EngineConfig
from rill.frontend.inproc import InprocClient
from rill.protocols.framed_uds import adapter
from rill.server import Deps
from rill.testing.fake_client import fake_client as start_fake_client
from rill.testing.fake_client import record_requests
from rill.types import GenerateRequest

MAX_CONTEXT = 1024
STEP_S = 0.002
"""Each engine step's pretend model time: a 1000-token stream lasts seconds, as the tests need."""


class FramedClient:
    """A test client speaking uint32-LE length + JSON frames over a Unix socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, path: str) -> FramedClient:
        reader, writer = await asyncio.open_unix_connection(path)
        return cls(reader, writer)

    async def send(self, obj: Any) -> None:
        payload = json.dumps(obj).encode()
        self.writer.write(struct.pack("<I", len(payload)) + payload)
        await self.writer.drain()

    async def send_raw(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def recv(self) -> dict[str, Any] | None:
        """The next event, or None at EOF."""
        try:
            header = await self.reader.readexactly(4)
            (length,) = struct.unpack("<I", header)
            return json.loads(await self.reader.readexactly(length))
        except (asyncio.IncompleteReadError, ConnectionResetError):
            return None

    async def until_end(self) -> list[dict[str, Any]]:
        """Events up to and including the next eos or error (or EOF)."""
        events = []
        while (event := await self.recv()) is not None:
            events.append(event)
            if event["event"] in ("eos", "error"):
                break
        return events

    async def is_closed(self) -> bool:
        """True when the server closed the connection (EOF is next)."""
        return await self.reader.read(1) == b""

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def uds_config(path: Path, **overrides: Any) -> Any:
    """A ServerConfig with the Unix socket at ``path``."""
    values = {"uds.socket": str(path), "evergreen.grpc_port": 0} | overrides
    return config_mod.load(values, env={})


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "rill.sock"


@contextlib.asynccontextmanager
async def engine_client(**config: Any) -> AsyncIterator[InprocClient]:
    """The in-process client over a ``FakeRunner`` of ``MAX_CONTEXT`` tokens per row."""
    async with start_fake_client(EngineConfig(model="fake", **config), max_len=MAX_CONTEXT) as client:
        client.engine.runner.delay_s = STEP_S
        yield client


@pytest.fixture
async def fake_client() -> AsyncIterator[InprocClient]:
    async with engine_client() as client:
        yield client


@pytest.fixture
def requests(fake_client: InprocClient) -> list[GenerateRequest]:
    """What the adapter submitted to ``fake_client``."""
    return record_requests(fake_client)


class Listener:
    """A started framed_uds listener over the fake engine."""

    def __init__(self, path: Path, client: InprocClient, requests: list[GenerateRequest], stop: Any) -> None:
        self.path, self.client, self.requests, self.stop = path, client, requests, stop

    async def connect(self) -> FramedClient:
        return await FramedClient.connect(str(self.path))


@pytest.fixture
async def make_listener(
    sock_path: Path, fake_client: InprocClient, requests: list[GenerateRequest]
) -> AsyncIterator[Any]:
    stoppers = []

    async def make(**overrides: Any) -> Listener:
        config = uds_config(sock_path, **overrides)
        deps = Deps(config=config, client=fake_client, api_keys=config.api_keys())
        stop = await adapter.start(deps)
        stoppers.append(stop)
        return Listener(sock_path, fake_client, requests, stop)

    yield make
    for stop in stoppers:
        await stop()
