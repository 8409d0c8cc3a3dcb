"""``/generate`` WebSocket driver (shared/specs/generate-websocket.md).

One connection per request (a client of this protocol usually keeps one socket per
conversation; the connect handshake is part of what the protocol costs, so it is inside
the TTFT). Sends ``config``; each ``token`` message is one token; ``completion`` carries the
usage; ``error`` fails the request with its ``error`` code.
"""

from __future__ import annotations

import json
from typing import Any

from websockets.asyncio.client import connect

from rill.bench.drivers import BenchError, SocketPerRequestDriver, Timer
from rill.bench.stats import RequestRecord
from rill.bench.workload import BenchRequest

SERVER_PROTOCOL = "generate_ws"


class Driver(SocketPerRequestDriver):
    """A new socket per request."""

    name = "generate-ws"

    async def run(self, request: BenchRequest, timer: Timer) -> RequestRecord:
        """Send one ``config`` and read until ``completion`` or ``error``."""
        headers = self.auth_headers()
        parameters: dict[str, Any] = {"max_tokens": request.max_tokens, "temperature": self.options.temperature}
        if self.options.ignore_eos:
            parameters["ignore_eos"] = True
        async with connect(
            f"{self.target.ws_url}/generate",
            additional_headers=headers,
            max_size=None,
            open_timeout=None,
            ping_interval=None,
        ) as ws:
            await ws.send(json.dumps({"type": "config", "prompt": request.prompt, "parameters": parameters}))
            async for raw in ws:
                message = json.loads(raw)
                kind = message.get("type")
                if kind == "token":
                    timer.tokens()
                elif kind == "completion":
                    usage = message.get("usage") or {}
                    return timer.done(usage.get("completion_tokens"), usage.get("prompt_tokens"))
                elif kind == "error":
                    raise BenchError(str(message.get("error", "error")), str(message.get("message", "")))
        raise BenchError("disconnected", "the server closed the socket before the completion")
