"""Batch ``/ws`` WebSocket driver (shared/specs/batch-websocket.md).

One connection per request with a one-prompt batch (greedy ``do_sample: false``; the
protocol has no ignore-eos, so eos may end a generation before ``max_new_tokens``).
Each ``PROGRESS`` event is one engine step's new text for the prompt (one token when the
client keeps up); ``COMPLETE.new_tokens_count`` is the token count.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from websockets.asyncio.client import connect

from rill.bench.drivers import BenchError, SocketPerRequestDriver, Timer
from rill.bench.stats import RequestRecord
from rill.bench.workload import BenchRequest

SERVER_PROTOCOL = "batch_ws"


class Driver(SocketPerRequestDriver):
    """A new socket per request, one prompt per batch."""

    name = "batch-ws"

    async def run(self, request: BenchRequest, timer: Timer) -> RequestRecord:
        """Send one batch of one prompt; read events until its ``COMPLETE`` or ``ERROR``."""
        headers = self.auth_headers()
        request_id = f"bench-{request.index}-{uuid.uuid4().hex[:8]}"
        config: dict[str, Any] = {
            "max_new_tokens": request.max_tokens,
            "do_sample": self.options.temperature > 0,
            "num_beams": 1,
        }
        if self.options.temperature > 0:
            config["temperature"] = self.options.temperature
        payload = {
            "prompts": [{"request_id": request_id, "prompt": request.prompt}],
            "only_new_tokens": True,
            "stream_response": True,
            "generation_config": config,
        }
        async with connect(
            f"{self.target.ws_url}/ws", additional_headers=headers, max_size=None, open_timeout=None, ping_interval=None
        ) as ws:
            await ws.send(json.dumps(payload))
            async for raw in ws:
                events = json.loads(raw)
                for event in events if isinstance(events, list) else [events]:
                    kind = event.get("type")
                    if kind is None and "error" in event:
                        raise BenchError("socket_error", str(event["error"]))
                    if event.get("request_id") != request_id:
                        continue
                    if kind == "PROGRESS":
                        timer.tokens()
                    elif kind == "COMPLETE":
                        return timer.done(event.get("new_tokens_count"))
                    elif kind == "ERROR":
                        raise BenchError("batch_error", str(event.get("error", "")))
        raise BenchError("disconnected", "the server closed the socket before COMPLETE")
