"""``EngineClient``: the protocol declares what adapters use, the clients provide it, and
``state()`` is the one answer to "can the engine take requests?" (issue 32).

The members adapters use are read from the source (every ``client.X`` / ``….client.X`` under
``rill/protocols``, ``rill/observability.py``, ``rill/playground`` and the stream's controls),
so a new use of an undeclared member fails here. ``state()`` is driven through each phase on
the in-process client over a ``FakeRunner``, with ``/health``, ``require_model`` and
``wait_ready`` checked against it.
"""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

import rill
from rill import observability
from rill.config import EngineConfig
from rill.errors import EngineDead, ModelLoadError, ModelNotReady
from rill.frontend.client import EngineClient, EngineState, ModelLoadFailed
from rill.frontend.inproc import InprocClient
from rill.testing.fake_client import LOADING_PERCENT, FakeClient, fake_client
from rill.types import GenerateRequest, SamplingParams
from tests.helpers import wait_until

SRC = Path(rill.__file__).parent
USERS = [SRC / "protocols", SRC / "observability.py", SRC / "playground", SRC / "frontend" / "stream.py"]


def declared_members() -> set[str]:
    """The members ``EngineClient`` declares (``typing.get_protocol_members`` from Python 3.13 on)."""
    names = set(vars(EngineClient).get("__annotations__", {}))
    return names | {name for name in vars(EngineClient) if not name.startswith("_")}


def members_used_by_adapters() -> dict[str, str]:
    """Each member read off an engine client in the adapters' code, with one place it is read."""
    files = [path for root in USERS for path in ([root] if root.is_file() else sorted(root.rglob("*.py")))]
    used: dict[str, str] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = node.value
            is_client = (isinstance(owner, ast.Name) and owner.id == "client") or (
                isinstance(owner, ast.Attribute) and owner.attr == "client"
            )
            if is_client:
                used.setdefault(node.attr, f"{path.relative_to(SRC)}:{node.lineno}")
    return used


def test_the_protocol_declares_every_member_adapters_use() -> None:
    declared = declared_members()
    used = members_used_by_adapters()
    assert {"generate", "submit", "abort", "state", "queue_position", "stats", "decode", "render_chat"} <= set(used)
    undeclared = {name: where for name, where in used.items() if name not in declared}
    assert not undeclared, f"used by adapters but not declared by EngineClient: {undeclared}"


async def test_the_in_process_and_fake_clients_provide_every_declared_member() -> None:
    declared = declared_members()
    for cls in (InprocClient, FakeClient):
        missing = {
            name
            for name in declared - {"model_info"}
            if not callable(getattr(cls, name, None)) and not isinstance(getattr(cls, name, None), property)
        }
        assert not missing, (cls.__name__, missing)
    async with fake_client() as client:
        assert isinstance(client, FakeClient) and isinstance(client, EngineClient)
        assert all(hasattr(client, name) for name in declared)


def _health(client: Any) -> httpx.AsyncClient:
    deps = SimpleNamespace(client=client, metrics=None, embeddings=None)
    app = Starlette(routes=observability.routes(deps))  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://rill")


async def test_state_reports_loading_then_ready() -> None:
    loading = threading.Event()
    async with fake_client(EngineConfig(model="/models/tiny"), loading=loading) as client, _health(client) as http:
        await wait_until(lambda: client.state().progress == LOADING_PERCENT, attempts=500, interval_s=0.01)
        state = client.state()
        assert (state.phase, state.progress) == ("loading", LOADING_PERCENT) and isinstance(state.error, ModelNotReady)
        with pytest.raises(ModelNotReady):
            client.require_model()
        with pytest.raises(ModelNotReady):
            await client.generate(GenerateRequest(prompt="x"))
        health = await http.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert health.json()["progress"] == LOADING_PERCENT
        assert client.served_model_name == "tiny"  # the name it will be served under
        loading.set()
        await client.wait_ready()
        assert client.state() == EngineState(phase="ready")
        assert client.require_model() is client.model_info
        assert (await http.get("/health")).json() == {"status": "ok", "model": client.model_info.name}


async def test_state_reports_a_failed_load_with_the_one_error_requests_get() -> None:
    loading = threading.Event()
    async with (
        fake_client(loading=loading, load_error=RuntimeError("secret weights path")) as client,
        _health(client) as http,
    ):
        loading.set()
        with pytest.raises(ModelLoadFailed) as waited:
            await client.wait_ready()
        state = client.state()
        assert state.phase == "failed" and isinstance(state.error, ModelLoadFailed)
        # One error, found by every protocol's table: as a failed load, or as a dead engine.
        assert isinstance(state.error, ModelLoadError) and isinstance(state.error, EngineDead)
        assert state.error.code == "engine_dead" and "secret" not in state.error.message
        assert type(waited.value) is type(state.error) and waited.value.message == state.error.message
        with pytest.raises(ModelLoadFailed):
            client.require_model()
        health = await http.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "error", "error": "model failed to load"}


class EngineCrash(BaseException):
    """Not an ``Exception``: the engine loop itself dies of it."""


async def test_state_reports_a_stopped_engine() -> None:
    async with fake_client() as client, _health(client) as http:

        def crash(tokens: Any) -> None:
            raise EngineCrash

        client.runner.script = crash
        stream = await client.generate(GenerateRequest(prompt="x", sampling=SamplingParams(max_tokens=4)))
        [final] = [output async for output in stream]
        assert isinstance(final.error, EngineDead)
        state = client.state()
        assert state.phase == "stopped" and type(state.error) is EngineDead and "restart" in state.error.message
        with pytest.raises(EngineDead):
            await client.generate(GenerateRequest(prompt="x"))
        with pytest.raises(EngineDead):
            await client.wait_ready()
        health = await http.get("/health")
        assert health.status_code == 503 and health.json() == {"status": "error", "error": "engine stopped"}


async def test_a_shut_down_client_is_stopped() -> None:
    async with fake_client() as client:
        assert client.state().phase == "ready"
        await client.shutdown()
        assert client.state().phase == "stopped"
        with pytest.raises(EngineDead):
            client.require_model()
