"""A connection's outgoing messages when its protocol offers resume: straight to the peer, or,
while a resumable stream is recorded, into the stream, which the peer follows.

``rill.frontend.resumable`` keeps a generation's events so that a client that lost its
connection can read on from where it was. ``StreamWriter`` is one connection's side of it,
for a transport that sends a session's messages (the driver calls the transport's ``send``):

* ``record(stream)``: from now on ``send`` appends to ``stream`` (the producer never waits
  for a reader, and keeps going when there is none), and the peer follows the stream;
* ``end()``: the recorded part is over: the stream is finished, and ``send`` writes to the
  peer again, once the follower has written everything recorded before (order is kept);
* ``follow(peer, stream, after)``: ``peer`` reads ``stream`` from after position ``after``:
  what was recorded since, then live (a resume);
* ``detach()``: the peer is gone, or another connection took the stream over: stop following,
  which starts the stream's grace timer unless someone else reads it.

Not pure (asyncio tasks): listed in ``NOT_PURE`` of ``tests/protocols/test_purity.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, Protocol, TypeVar

from rill.errors import ResumeExpired
from rill.frontend.resumable import ResumableStream
from rill.protocols._shared.driver import Gone

log = logging.getLogger("rill.protocols.resume")

M = TypeVar("M")
E = TypeVar("E")


class Peer(Protocol):
    """Where a connection's messages go (a socket)."""

    async def write(self, message: Any) -> None:
        """Write one message; raise ``Gone`` once the peer has left."""
        ...

    async def close(self, code: int, reason: str) -> None:
        """Close the connection."""
        ...


P = TypeVar("P", bound=Peer)


class StreamWriter(Generic[M, E, P]):
    """One connection's outgoing messages (see the module docstring).

    Args:
        to_event: a message as the stream keeps it, given its position; returns the event and
            the bytes it counts against the stream's bound.
        to_message: the message an event keeps, as sent.
        on_lost: called with the peer when it fell so far behind that the events it has not
            read were dropped for the stream's memory bound (it cannot read on: tell it, close).
    """

    def __init__(
        self,
        to_event: Callable[[M, int], tuple[E, int]],
        to_message: Callable[[E], M],
        on_lost: Callable[[P, ResumeExpired], Awaitable[None]],
    ) -> None:
        self._to_event = to_event
        self._to_message = to_message
        self._on_lost = on_lost
        self.peer: P | None = None
        self.recording: ResumableStream[E] | None = None
        self._follower: asyncio.Task[None] | None = None

    async def send(self, message: M) -> None:
        """Record ``message``, or write it to the peer after what its follower still has to
        write. Raises ``Gone`` when nothing records and no peer is attached."""
        stream = self.recording
        if stream is not None:
            event, size = self._to_event(message, stream.next_position)
            stream.append(event, size)
            return
        await self.drain()
        if self.peer is None:
            raise Gone
        await self.peer.write(message)

    async def record(self, stream: ResumableStream[E]) -> None:
        """Record what is sent from now on in ``stream``; the peer (if any) follows it."""
        await self.drain()
        self.recording = stream
        if self.peer is not None:
            self._start(self.peer, stream, -1)

    def end(self) -> ResumableStream[E] | None:
        """Stop recording: finish the stream (its followers read what is left) and return it."""
        stream, self.recording = self.recording, None
        if stream is not None:
            stream.finish()
        return stream

    async def follow(self, peer: P, stream: ResumableStream[E], after: int) -> None:
        """Make ``peer`` read ``stream`` after position ``after``, then live. The same peer
        first reads what its follower still has; another one replaces the current peer."""
        if peer is self.peer:
            await self.drain()
            self._start(peer, stream, after)
            return
        # The new peer's follower starts before the old one is stopped (they write to
        # different peers): the writer never has no peer in between, when a finished
        # recording would take it for a conversation no one attends.
        old = self._follower
        self._start(peer, stream, after)
        await self._stop(old)

    async def detach(self) -> None:
        """The peer is gone or replaced: stop following (what it did not read stays recorded)."""
        task, self._follower, self.peer = self._follower, None, None
        await self._stop(task)

    @staticmethod
    async def _stop(task: asyncio.Task[None] | None) -> None:
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def drain(self) -> None:
        """Wait until the follower has written everything of a finished stream (nothing to wait
        for while recording: the stream has no end yet)."""
        task = self._follower
        if self.recording is None and task is not None and task is not asyncio.current_task():
            # Not ``await task``: a caller cancelled meanwhile must not cancel the follower.
            await asyncio.wait({task})

    def _start(self, peer: P, stream: ResumableStream[E], after: int) -> None:
        self.peer = peer
        self._follower = asyncio.create_task(self._follow(peer, stream, after))

    async def _follow(self, peer: P, stream: ResumableStream[E], after: int) -> None:
        try:
            async for _, event in stream.follow(after):
                await peer.write(self._to_message(event))
        except Gone:
            return
        except ResumeExpired as exc:  # the peer read too slowly: what it missed was dropped
            with contextlib.suppress(Gone):
                await self._on_lost(peer, exc)
        except Exception:  # a bug: this peer stops reading; the stream and its producer go on
            log.exception("following resumable stream %s failed", stream.id)
