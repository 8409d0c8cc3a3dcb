"""The WebSocket first-message timeout: an accepted WebSocket that sends nothing is closed (1008)."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import Message, Receive, Send

from rill.connections import GuardedProtocol


class FirstMessageWatch:
    """Closes an accepted WebSocket (1008) that sends no message within the time allowed.

    Wraps the app's ``receive`` and ``send``: the clock starts when the app accepts and stops
    at the first message (or disconnect). After the close, the app's pending ``receive``
    sees the disconnect, and its sends are dropped (the peer is being closed). Meanwhile the
    connection (``rill.connections.GuardedProtocol``, when known) is marked idle, so the
    connection gate may close it to make room for another client.
    """

    def __init__(
        self, receive: Receive, send: Send, timeout_s: float, connection: GuardedProtocol | None = None
    ) -> None:
        self._receive = receive
        self._send = send
        self.timeout_s = timeout_s
        self._connection = connection
        self._timer: asyncio.Task[None] | None = None
        self.heard = False
        self.closed = False

    async def receive(self) -> Message:
        """The app's ``receive``: the first message (or a disconnect) stops the clock."""
        message = await self._receive()
        if message["type"] in ("websocket.receive", "websocket.disconnect"):
            self.heard = True
            self.stop()
            if self._connection is not None:
                self._connection.set_idle(False)
        return message

    async def send(self, message: Message) -> None:
        """The app's ``send``: the accept starts the clock; after the timeout's close, nothing is sent."""
        if self.closed:
            return
        if message["type"] == "websocket.close":
            self.closed = True
            self.stop()
        await self._send(message)
        if message["type"] == "websocket.accept" and not self.heard:
            self._timer = asyncio.create_task(self._expire())
            if self._connection is not None:
                self._connection.set_idle(True)

    def stop(self) -> None:
        """Stop the clock (the app has finished, closed, or heard from the client)."""
        if self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()
        self._timer = None

    async def _expire(self) -> None:
        await asyncio.sleep(self.timeout_s)
        if self.heard or self.closed:
            return
        self.closed = True
        self._timer = None
        reason = f"no message within {self.timeout_s:g} s of connecting"
        with contextlib.suppress(Exception):  # the peer may already be gone
            await self._send({"type": "websocket.close", "code": 1008, "reason": reason})
