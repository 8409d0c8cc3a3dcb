"""WebSocket compression is the operator's choice (``--ws-compression``): by default a client
offering permessage-deflate gets plain frames (a token's frame is small, and compressing each
costs the server CPU a frame and zlib state a connection); asked for, it is negotiated and the
streams work through it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from websockets.asyncio.client import connect

from tests.conftest import LiveServer, start_server


async def _generate(live: LiveServer) -> tuple[list[str], list[Any]]:
    """Stream one short generation on ``/generate``; the message types and the extensions in force."""
    async with connect(live.ws_url + "/generate") as ws:  # offers permessage-deflate, as browsers do
        extensions = list(ws.protocol.extensions)
        config = {"type": "config", "prompt": "Once upon a time", "parameters": {"max_tokens": 6, "temperature": 0}}
        await ws.send(json.dumps(config))
        kinds: list[str] = []
        while not kinds or kinds[-1] not in ("completion", "error"):
            kinds.append(json.loads(await ws.recv())["type"])
    return kinds, extensions


async def test_a_client_offering_compression_gets_plain_frames_by_default(server: LiveServer) -> None:
    kinds, extensions = await _generate(server)
    assert extensions == []
    assert kinds[0] == "init" and "token" in kinds and kinds[-1] == "completion"


async def test_with_ws_compression_the_server_negotiates_permessage_deflate(tiny_model_dir: Path) -> None:
    live = start_server(tiny_model_dir, **{"http.ws_compression": True})
    try:
        kinds, extensions = await _generate(live)
    finally:
        live.stop()
    assert [extension.name for extension in extensions] == ["permessage-deflate"]
    assert kinds[0] == "init" and "token" in kinds and kinds[-1] == "completion"
