"""Multimodal chat ``/ws/chat`` driver (shared/specs/chat-websocket.md), text only.

One connection per request, as the protocol requires: one user message, streaming on,
speech off (a benchmark of the language model, not of TTS), greedy unless a temperature is
given; ``min_new_tokens`` = ``max_new_tokens`` when ignoring eos. Each ``chunk`` with
``text_delta`` counts as a token-bearing message; ``done.generated_tokens`` is the count.
The server runs at most ``--chat-max-active`` chats at once and queues the rest
(``queued`` / ``queue_update`` messages are part of the TTFT).
"""

from __future__ import annotations

import json
from typing import Any

from websockets.asyncio.client import connect

from rill.bench.drivers import BenchError, SocketPerRequestDriver, Timer
from rill.bench.stats import RequestRecord
from rill.bench.workload import BenchRequest

SERVER_PROTOCOL = "chat_ws"


class Driver(SocketPerRequestDriver):
    """A new socket per chat."""

    name = "chat-ws"

    async def run(self, request: BenchRequest, timer: Timer) -> RequestRecord:
        """Send the one chat request; read until ``done`` or ``error``."""
        headers = self.auth_headers()
        generation: dict[str, Any] = {"max_new_tokens": request.max_tokens}
        if self.options.temperature > 0:
            generation["temperature"] = self.options.temperature
        else:
            generation["do_sample"] = False
        if self.options.ignore_eos:
            generation["min_new_tokens"] = request.max_tokens
        payload = {
            "messages": [{"role": "user", "content": request.prompt}],
            "streaming": True,
            "generation": generation,
            "tts": {"enabled": False},
        }
        async with connect(
            f"{self.target.ws_url}/ws/chat",
            additional_headers=headers,
            max_size=None,
            open_timeout=None,
            ping_interval=None,
        ) as ws:
            await ws.send(json.dumps(payload))
            async for raw in ws:
                message = json.loads(raw)
                kind = message.get("type")
                if kind == "chunk" and message.get("text_delta"):
                    timer.tokens()
                elif kind == "done":
                    return timer.done(message.get("generated_tokens"), message.get("input_tokens"))
                elif kind == "error":
                    raise BenchError("chat_error", str(message.get("error", "")))
        raise BenchError("disconnected", "the server closed the socket before done")
