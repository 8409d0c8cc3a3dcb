"""StreamWriter: a connection's sends, straight to the peer or recorded in a resumable stream
that the peer follows; order kept across the switch; detaching starts the grace timer."""

from __future__ import annotations

import asyncio

import pytest

from rill.errors import ResumeExpired
from rill.frontend.resumable import StreamRegistry
from rill.protocols._shared.driver import Gone
from rill.protocols._shared.resume import StreamWriter


class Peer:
    """Collects what it is sent; ``gate`` (when set) holds every write until it opens."""

    def __init__(self, gate: asyncio.Event | None = None) -> None:
        self.got: list[str] = []
        self.closed: tuple[int, str] | None = None
        self.gate = gate
        self.wrote = asyncio.Event()

    async def write(self, message: str) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.got.append(message)
        self.wrote.set()

    async def close(self, code: int, reason: str) -> None:
        self.closed = (code, reason)


def writer(lost: list[ResumeExpired] | None = None) -> StreamWriter[str, str, Peer]:
    async def on_lost(peer: Peer, exc: ResumeExpired) -> None:
        (lost if lost is not None else []).append(exc)
        await peer.close(1008, "lost")

    return StreamWriter(lambda message, index: (f"{index}:{message}", len(message)), lambda event: event, on_lost)


def registry(grace_s: float = 60.0, max_stream_bytes: int = 1000) -> StreamRegistry[str]:
    return StreamRegistry(grace_s=grace_s, max_streams=4, max_stream_bytes=max_stream_bytes)


async def test_sends_go_straight_to_the_peer_when_nothing_records() -> None:
    w, peer = writer(), Peer()
    w.peer = peer
    await w.send("a")
    await w.send("b")
    assert peer.got == ["a", "b"]
    w.peer = None
    with pytest.raises(Gone):
        await w.send("c")


async def test_recorded_sends_reach_the_peer_and_direct_ones_wait_behind_them() -> None:
    gate = asyncio.Event()
    w, peer, streams = writer(), Peer(gate), registry()
    w.peer = peer
    await w.record(streams.open("g1", "alice"))
    for word in ("a", "b", "c"):
        await w.send(word)  # appended at once: the slow peer holds no one up
    w.end()
    direct = asyncio.create_task(w.send("after"))
    await asyncio.sleep(0)
    assert not direct.done()  # waits for the follower, which waits for the peer
    gate.set()
    await direct
    assert peer.got == ["0:a", "1:b", "2:c", "after"]


async def test_a_peer_that_leaves_starts_the_grace_timer_and_another_reads_on() -> None:
    w, first, streams = writer(), Peer(), registry(grace_s=60.0)
    w.peer = first
    stream = streams.open("g1", "alice")
    cancelled: list[bool] = []
    stream.cancel = lambda: cancelled.append(True)
    await w.record(stream)
    await w.send("a")
    await first.wrote.wait()
    await w.detach()
    assert w.peer is None and not stream.is_held  # the grace timer runs
    await w.send("b")  # recording goes on with no reader
    second = Peer()
    await w.follow(second, streams.get("g1", "alice"), after=0)
    await second.wrote.wait()
    await w.send("c")
    w.end()
    await w.drain()
    assert first.got == ["0:a"] and second.got == ["1:b", "2:c"] and not cancelled


async def test_no_one_comes_back_the_registry_cancels_the_stream() -> None:
    w, peer, streams = writer(), Peer(), registry(grace_s=0.0)
    w.peer = peer
    stream = streams.open("g1", "alice")
    cancelled = asyncio.Event()
    stream.cancel = cancelled.set
    await w.record(stream)
    await w.send("a")
    await peer.wrote.wait()
    await w.detach()
    await streams.wait_forgotten("g1")
    assert cancelled.is_set()


async def test_a_peer_that_falls_behind_the_memory_bound_is_told_and_closed() -> None:
    gate = asyncio.Event()
    lost: list[ResumeExpired] = []
    w, peer, streams = writer(lost), Peer(gate), registry(max_stream_bytes=4)
    w.peer = peer
    await w.record(streams.open("g1", "alice"))
    await w.send("ab")
    await asyncio.sleep(0)  # the follower takes "ab" and waits on the peer
    for word in ("cd", "ef", "gh"):
        await w.send(word)  # only the newest 4 bytes are kept: "cd" is dropped
    gate.set()
    w.end()
    await w.drain()
    assert peer.got == ["0:ab"] and len(lost) == 1 and peer.closed == (1008, "lost")


async def test_a_new_peer_replaces_the_old_one_with_no_moment_without_a_peer() -> None:
    """While the old peer's follower is being stopped the new peer is already the writer's
    (a finished recording seen with no peer would end its conversation)."""
    w, streams = writer(), registry()
    old, new = Peer(asyncio.Event()), Peer()  # the old peer's writes never finish
    w.peer = old
    stream = streams.open("g1", "alice")
    await w.record(stream)
    await w.send("a")
    seen: list[Peer | None] = []
    write, writing = old.write, asyncio.Event()

    async def noting(message: str) -> None:
        writing.set()
        try:
            await write(message)
        except asyncio.CancelledError:
            seen.append(w.peer)
            raise

    old.write = noting  # type: ignore[method-assign]
    await writing.wait()
    await w.follow(new, stream, -1)
    assert seen == [new] and w.peer is new
    await new.wrote.wait()
    assert new.got == ["0:a"] and old.got == []
