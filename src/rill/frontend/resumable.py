"""Streams that outlive their connection: a generation's events, kept so a client that lost
its connection can re-attach and read on from where it was.

One mechanism for every protocol that offers resume (each names a position its own way). The protocol's producer (a task that
reads the engine's outputs and turns them into the protocol's events) appends each event to a
``ResumableStream``; every connection that shows the stream is a follower that reads the
events after a position, then follows live. The producer does not depend on any follower:
when the last one goes away the generation runs on.

Lifetime (``StreamRegistry``): a stream is *held* while it has a follower, or while it runs
with ``keeps_running`` (a background response, which runs with no connection by design).
When it stops being held, a grace timer starts (``grace_s``); if nothing re-attaches before
it fires, a stream still running is cancelled (its producer's ``cancel`` aborts the engine
request, which frees its KV in the next engine step) and the stream is forgotten. A resume
after that gets ``ResumeExpired``; a resume of an id that was never known, or that belongs to
another principal, gets ``RequestNotFound`` (the two look alike to a stranger on purpose).

Bounds: at most ``max_streams`` streams at once, ``max_streams_per_client`` of them charged
to one client (``ResourceExhausted`` past either), each
keeping at most ``max_stream_bytes`` of events: past it the oldest events are dropped and a
resume from before them gets ``ResumeExpired``; the server-wide bound is the product.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncGenerator, Callable
from typing import Generic, TypeVar

from rill.errors import InvalidRequest, PositionOutOfRange, RequestNotFound, ResourceExhausted, ResumeExpired

log = logging.getLogger("rill.resumable")

E = TypeVar("E")

_REMEMBERED_EXPIRED = 4096  # ids of forgotten streams kept to tell "expired" from "unknown"


class ResumableStream(Generic[E]):
    """The events of one generation, in order, for any number of followers.

    Positions are 0-based and count every event ever appended (also those dropped for the
    memory bound), so a position a client saw stays valid.
    """

    def __init__(
        self,
        stream_id: str,
        principal: str,
        *,
        max_bytes: int,
        keeps_running: bool,
        on_unheld: Callable[[ResumableStream[E]], None],
    ) -> None:
        self.id = stream_id
        self.principal = principal
        self.keeps_running = keeps_running
        self.max_bytes = max_bytes
        self.finished = False
        self.cancel: Callable[[], None] | None = None
        """Set by the producer: stops the generation (called once, when the grace period ends
        on a stream still running)."""
        self._events: collections.deque[tuple[E, int]] = collections.deque()
        self._first = 0  # position of _events[0]
        self._bytes = 0
        self._followers = 0
        self._wake = asyncio.Event()
        self._on_unheld = on_unheld

    # -- producer side -------------------------------------------------------------------
    @property
    def next_position(self) -> int:
        """The position the next event gets (the number of events appended so far)."""
        return self._first + len(self._events)

    def append(self, event: E, size: int) -> int:
        """Add one event of ``size`` bytes; returns its position. Old events are dropped to
        stay within ``max_bytes`` (the newest is always kept)."""
        if self.finished:
            raise RuntimeError(f"stream {self.id} is finished")
        position = self.next_position
        self._events.append((event, size))
        self._bytes += size
        while self._bytes > self.max_bytes and len(self._events) > 1:
            _, dropped = self._events.popleft()
            self._bytes -= dropped
            self._first += 1
        self._notify()
        return position

    def finish(self) -> None:
        """No more events: followers read what is left and stop."""
        if self.finished:
            return
        self.finished = True
        self._notify()
        self._on_unheld(self)

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    # -- follower side -------------------------------------------------------------------
    @property
    def is_held(self) -> bool:
        """True while someone reads the stream, or while it runs in the background."""
        return self._followers > 0 or (self.keeps_running and not self.finished)

    def check_position(self, after: int) -> None:
        """Raise unless the events after position ``after`` (-1: from the start) can be read:
        ``PositionOutOfRange`` for a position no event has (yet),
        ``ResumeExpired`` when they were dropped for the memory bound."""
        if after < -1 or after >= self.next_position:
            raise PositionOutOfRange(after, self.next_position - 1)
        if after + 1 < self._first:
            raise ResumeExpired(
                f"the events after position {after} are no longer kept (the stream keeps the last "
                f"{self.max_bytes} bytes of events; the oldest kept is {self._first})"
            )

    async def follow(self, after: int = -1) -> AsyncGenerator[tuple[int, E], None]:
        """The events after position ``after`` with their positions, then live ones until the
        stream finishes. Reading counts as holding the stream (no grace timer runs)."""
        self.check_position(after)
        self._followers += 1
        try:
            position = after + 1
            while True:
                if position < self._first:
                    # A slow reader fell behind the memory bound while it read (the consumer
                    # of each event yielded may take any time).
                    raise ResumeExpired(f"the events after position {position - 1} are no longer kept")
                if position < self.next_position:
                    event, _ = self._events[position - self._first]
                    yield position, event
                    position += 1
                elif self.finished:
                    return
                else:
                    await self._wake.wait()
        finally:
            self._followers -= 1
            if not self.is_held:
                self._on_unheld(self)


class StreamRegistry(Generic[E]):
    """The resumable streams of one server, by id, with their grace timers.

    Args:
        grace_s: how long a stream no one holds is kept (and, when still running, run on).
        max_streams: most streams kept at once.
        max_stream_bytes: most bytes of events one stream keeps.
        max_streams_per_client: most streams charged to one client (default: a quarter of
            ``max_streams``), so that one client cannot take every stream.
    """

    def __init__(
        self, *, grace_s: float, max_streams: int, max_stream_bytes: int, max_streams_per_client: int | None = None
    ) -> None:
        self.grace_s = grace_s
        self.max_streams = max_streams
        self.max_streams_per_client = max_streams_per_client or max(1, max_streams // 4)
        self._charges: dict[str, str] = {}  # stream id -> who it is charged to
        self._charged: dict[str, int] = {}  # who -> streams kept
        self.max_stream_bytes = max_stream_bytes
        self._streams: dict[str, ResumableStream[E]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._expired: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._forgotten = asyncio.Event()

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, stream_id: object) -> bool:
        return stream_id in self._streams

    def open(
        self, stream_id: str, principal: str, *, keeps_running: bool = False, charged_to: str | None = None
    ) -> ResumableStream[E]:
        """A new stream owned by ``principal``; ``ResourceExhausted`` when ``max_streams`` are
        kept already, or ``max_streams_per_client`` of ``charged_to`` (who asked: an API key's
        principal or a client address; ``principal`` when None)."""
        if stream_id in self._streams:
            raise InvalidRequest(f"a stream with id {stream_id!r} exists already", field="id")
        if len(self._streams) >= self.max_streams:
            raise ResourceExhausted(
                f"the server keeps {self.max_streams} resumable streams already; retry when one has ended"
            )
        charge = charged_to or principal
        if self._charged.get(charge, 0) >= self.max_streams_per_client:
            raise ResourceExhausted(
                f"this client has {self.max_streams_per_client} resumable streams kept already "
                "(running, or ended less than the grace period ago); retry when one has ended"
            )
        stream: ResumableStream[E] = ResumableStream(
            stream_id,
            principal,
            max_bytes=self.max_stream_bytes,
            keeps_running=keeps_running,
            on_unheld=self._start_timer,
        )
        self._streams[stream_id] = stream
        self._charges[stream_id] = charge
        self._charged[charge] = self._charged.get(charge, 0) + 1
        return stream

    def get(self, stream_id: str, principal: str) -> ResumableStream[E]:
        """The stream ``stream_id`` of ``principal`` (one no one holds gets a fresh grace
        period): ``RequestNotFound`` if unknown or another principal's, ``ResumeExpired`` if it
        was forgotten after its grace period."""
        stream = self._streams.get(stream_id)
        if stream is not None and stream.principal == principal:
            # A stream no one holds gets a fresh grace period: the caller's follower may start
            # reading a loop turn later (in its own task), and the old timer must not expire
            # the stream in between. A timer that fires while a follower reads does nothing;
            # the follower's leaving starts a new one.
            self._start_timer(stream)
            return stream
        if self._expired.get(stream_id) == principal:
            raise ResumeExpired(
                f"stream {stream_id!r} ended or lost its reader more than {self.grace_s:g} s ago and is no longer kept"
            )
        raise RequestNotFound(f"no resumable stream {stream_id!r}")

    def peek(self, stream_id: str, principal: str) -> ResumableStream[E] | None:
        """The stream if it is kept for ``principal``, without touching its timer."""
        stream = self._streams.get(stream_id)
        return stream if stream is not None and stream.principal == principal else None

    def forget(self, stream_id: str) -> None:
        """Drop a stream now (cancelling it if it runs), as if its grace period had ended."""
        stream = self._streams.get(stream_id)
        if stream is not None:
            self._expire(stream)

    def _start_timer(self, stream: ResumableStream[E]) -> None:
        if stream.is_held or self._streams.get(stream.id) is not stream:
            return
        old = self._timers.pop(stream.id, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._timers[stream.id] = loop.call_later(self.grace_s, self._expire_if_unheld, stream)

    def _expire_if_unheld(self, stream: ResumableStream[E]) -> None:
        self._timers.pop(stream.id, None)
        if not stream.is_held:
            self._expire(stream)

    def _expire(self, stream: ResumableStream[E]) -> None:
        if self._streams.get(stream.id) is not stream:
            return
        del self._streams[stream.id]
        charge = self._charges.pop(stream.id)
        self._charged[charge] -= 1
        if not self._charged[charge]:
            del self._charged[charge]
        timer = self._timers.pop(stream.id, None)
        if timer is not None:
            timer.cancel()
        self._expired[stream.id] = stream.principal
        while len(self._expired) > _REMEMBERED_EXPIRED:
            self._expired.popitem(last=False)
        if not stream.finished and stream.cancel is not None:
            log.info("resumable stream %s had no reader for %.3g s: cancelled", stream.id, self.grace_s)
            stream.cancel()
        self._forgotten.set()
        self._forgotten = asyncio.Event()

    async def wait_forgotten(self, stream_id: str) -> None:
        """Return once ``stream_id`` is no longer kept (tests; shutdown)."""
        while stream_id in self._streams:
            await self._forgotten.wait()

    def close(self) -> None:
        """Cancel every running stream and forget all (server shutdown)."""
        for stream in list(self._streams.values()):
            self._expire(stream)
