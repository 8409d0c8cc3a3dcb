"""Framed Unix-socket driver (shared/specs/framed-uds.md: uint32-LE length + JSON).

One connection per request (asyncio streams over a unix socket connected the blocking way,
see ``Driver._connect``; framing from the protocol's pure ``framing`` module). Each ``token`` event is one token; ``eos`` ends the request; an
``error`` event fails it with its ``E_*`` code. The protocol has no ignore-eos, so eos may
end a generation before ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import json
import socket

from rill.bench.drivers import BenchError, Options, Target, Timer
from rill.bench.stats import RequestRecord
from rill.bench.workload import BenchRequest
from rill.protocols.framed_uds.framing import FrameDecoder, encode_frame

SERVER_PROTOCOL = "framed_uds"
MAX_EVENT_BYTES = 16 * 1024 * 1024


class Driver:
    """A new unix-socket connection per request."""

    name = "uds"

    def __init__(self, target: Target, options: Options) -> None:
        self.target = target
        self.options = options

    async def open(self) -> None:
        """Nothing is shared between requests."""

    async def close(self) -> None:
        """Nothing to release."""

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # NOTE: a blocking connect in a worker thread, as a plain client does. A non-blocking
        # AF_UNIX connect fails with EAGAIN when the listen backlog is full, and asyncio takes
        # that for "in progress" and hands back a socket that was never connected (its first
        # write then fails with "Connection lost"): a burst of connections would show errors
        # no real client sees. A blocking connect waits for the server to accept.
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            await asyncio.to_thread(sock.connect, self.target.socket)
            sock.setblocking(False)
            return await asyncio.open_unix_connection(sock=sock)
        except OSError as exc:
            sock.close()
            raise BenchError("connect_error", f"{self.target.socket}: {exc.strerror or exc}") from exc
        except BaseException:
            sock.close()
            raise

    async def run(self, request: BenchRequest, timer: Timer) -> RequestRecord:
        """Send one request frame; read events until ``eos`` or ``error``."""
        reader, writer = await self._connect()
        request_id = f"bench-{request.index}"
        frame = {
            "id": request_id,
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": self.options.temperature,
            "stream": True,
        }
        decoder = FrameDecoder(MAX_EVENT_BYTES)
        try:
            writer.write(encode_frame(json.dumps(frame).encode()))
            await writer.drain()
            while data := await reader.read(65536):
                for payload in decoder.feed(data):
                    event = json.loads(payload)
                    kind = event.get("event")
                    if kind == "token":
                        timer.tokens()
                    elif kind == "eos":
                        if event.get("reason") == "error":
                            raise BenchError("eos_error", "the request ended with reason error")
                        return timer.done()
                    elif kind == "error":
                        raise BenchError(str(event.get("code", "error")), str(event.get("message", "")))
            raise BenchError("disconnected", "the server closed the socket before eos")
        finally:
            writer.close()
