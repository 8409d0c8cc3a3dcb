"""/generate while the real engine loads its model: status messages, then the generation;
and a model that fails to load."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect

from rill.config import EngineConfig
from rill.frontend.inproc import InprocClient

from .conftest import start_server, stop_server
from .test_adapter import is_type, recv, send, until


class HeldClient(InprocClient):
    """An InprocClient whose model load waits until the test releases it (at 30 %)."""

    release = threading.Event()

    def _thread_main(self, engine: Any) -> None:
        self._progress = 30.0
        self.release.wait(60)
        super()._thread_main(engine)


async def test_status_while_loading_then_generation(tiny_model_dir: Path, tmp_path: Path) -> None:
    HeldClient.release = threading.Event()
    client = HeldClient.start(EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_memory="64MiB"))
    live = await start_server(client, data_dir=str(tmp_path))
    try:
        async with connect(live.ws) as ws:
            await send(ws, type="config", prompt="Once upon a time", parameters={"max_tokens": 3, "ignore_eos": True})
            status = await recv(ws)
            assert status["type"] == "status" and status["operation"] == "model_loading"
            assert status["progress"] == 30.0 and "eta_seconds" in status and status["message"]
            HeldClient.release.set()
            msgs = await until(ws, is_type("completion"))
            kinds = [m["type"] for m in msgs]
            assert set(kinds[: kinds.index("init")]) <= {"status"}  # more loading statuses, then init
            assert kinds[kinds.index("init") :] == ["init", "token", "token", "token", "completion"]
            assert msgs[kinds.index("init")]["model"] == "tiny-llama"
    finally:
        HeldClient.release.set()
        await stop_server(live)
        await client.shutdown()


async def test_model_loading_error(tmp_path: Path) -> None:
    client = InprocClient.start(EngineConfig(model=str(tmp_path / "no-such-model")))
    live = await start_server(client, data_dir=str(tmp_path))
    try:
        async with connect(live.ws) as ws:
            await send(ws, type="config", prompt="Once")
            msgs = await until(ws, is_type("error"))
            err = msgs[-1]
            assert err["error"] == "model_loading_error" and err["recoverable"] is False
            assert "no-such-model" not in err["message"]  # no paths or internals
    finally:
        await stop_server(live)
        await client.shutdown()
