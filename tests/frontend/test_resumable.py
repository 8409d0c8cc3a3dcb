"""The resumable-stream mechanism: replay, live follow, grace expiry, bounds, principals."""

from __future__ import annotations

import asyncio

import pytest

from rill.errors import PositionOutOfRange, RequestNotFound, ResourceExhausted, ResumeExpired
from rill.frontend.resumable import StreamRegistry


def _registry(grace_s: float = 60.0, max_streams: int = 4, max_stream_bytes: int = 1000) -> StreamRegistry[str]:
    return StreamRegistry(
        grace_s=grace_s, max_streams=max_streams, max_stream_bytes=max_stream_bytes, max_streams_per_client=max_streams
    )


async def test_replay_then_live_follow() -> None:
    registry = _registry()
    stream = registry.open("r1", "alice")
    for word in ("a", "b", "c"):
        stream.append(word, 1)
    seen: list[tuple[int, str]] = []
    got_c = asyncio.Event()

    async def read() -> None:
        async for position, event in registry.get("r1", "alice").follow(after=0):
            seen.append((position, event))
            if event == "c":
                got_c.set()

    reader = asyncio.create_task(read())
    await got_c.wait()
    stream.append("d", 1)
    stream.finish()
    await reader
    assert seen == [(1, "b"), (2, "c"), (3, "d")]


async def test_another_principal_and_unknown_ids_are_not_found() -> None:
    registry = _registry()
    registry.open("r1", "alice")
    with pytest.raises(RequestNotFound) as caught:
        registry.get("r1", "mallory")
    assert not isinstance(caught.value, ResumeExpired)
    with pytest.raises(RequestNotFound):
        registry.get("nope", "alice")


async def test_position_past_the_end_is_invalid() -> None:
    registry = _registry()
    stream = registry.open("r1", "alice")
    stream.append("a", 1)
    stream.check_position(0)  # the next event is awaited: fine while running
    with pytest.raises(PositionOutOfRange) as caught:
        stream.check_position(5)
    # Neutral: the position and the last one; each protocol names its own field.
    assert (caught.value.position, caught.value.last_position, caught.value.field) == (5, 0, None)
    stream.finish()
    stream.check_position(0)  # all seen: a resume reads nothing and ends
    with pytest.raises(PositionOutOfRange):
        stream.check_position(1)
    with pytest.raises(PositionOutOfRange):
        stream.check_position(-2)


async def test_unheld_running_stream_is_cancelled_after_grace() -> None:
    registry = _registry(grace_s=0.0)
    stream = registry.open("r1", "alice")
    cancelled = asyncio.Event()
    stream.cancel = cancelled.set
    stream.append("a", 1)
    async for _ in stream.follow():
        break  # the connection goes away after one event
    await registry.wait_forgotten("r1")
    assert cancelled.is_set()
    with pytest.raises(ResumeExpired):
        registry.get("r1", "alice")
    with pytest.raises(RequestNotFound) as caught:
        registry.get("r1", "mallory")  # a stranger learns nothing about the id
    assert not isinstance(caught.value, ResumeExpired)


async def test_follower_holds_the_stream_and_background_runs_alone() -> None:
    registry = _registry(grace_s=0.0)
    stream = registry.open("bg", "alice", keeps_running=True)
    cancelled: list[bool] = []
    stream.cancel = lambda: cancelled.append(True)
    stream.append("a", 1)
    async for _ in stream.follow():
        break
    await asyncio.sleep(0)  # let a (wrong) zero-second timer run if one was started
    assert registry.peek("bg", "alice") is stream and not cancelled
    stream.finish()
    await registry.wait_forgotten("bg")
    assert not cancelled  # finished: forgotten, never cancelled


async def test_memory_bound_drops_oldest_and_resume_before_them_expires() -> None:
    registry = _registry(max_stream_bytes=10)
    stream = registry.open("r1", "alice")
    for i in range(5):
        stream.append(f"e{i}", 4)  # 20 bytes: only the last two events fit
    assert stream.next_position == 5
    with pytest.raises(ResumeExpired):
        stream.check_position(0)
    stream.finish()
    assert [p for p, _ in [item async for item in stream.follow(after=2)]] == [3, 4]


async def test_stream_count_is_bounded() -> None:
    registry = _registry(max_streams=2)
    registry.open("a", "p")
    registry.open("b", "p")
    with pytest.raises(ResourceExhausted):
        registry.open("c", "p")
    registry.forget("a")
    registry.open("c", "p")


async def test_close_cancels_running_streams() -> None:
    registry = _registry()
    stream = registry.open("r1", "alice", keeps_running=True)
    cancelled: list[bool] = []
    stream.cancel = lambda: cancelled.append(True)
    registry.close()
    assert cancelled == [True] and len(registry) == 0


async def test_one_client_cannot_take_every_stream() -> None:
    registry = StreamRegistry[str](grace_s=60.0, max_streams=8, max_stream_bytes=100)  # a quarter: 2 each
    registry.open("a1", "anonymous", charged_to="10.0.0.1")
    registry.open("a2", "anonymous", charged_to="10.0.0.1")
    with pytest.raises(ResourceExhausted):
        registry.open("a3", "anonymous", charged_to="10.0.0.1")
    registry.open("b1", "anonymous", charged_to="10.0.0.2")  # another client still gets one
    registry.forget("a1")
    registry.open("a3", "anonymous", charged_to="10.0.0.1")


async def test_get_gives_an_unheld_stream_a_fresh_grace_period(monkeypatch: pytest.MonkeyPatch) -> None:
    # The loop's clock is frozen and moved by hand: which timer fires is decided by the
    # deadlines alone, not by how fast this machine runs.
    now = [1000.0]
    monkeypatch.setattr(asyncio.get_running_loop(), "time", lambda: now[0])
    registry = _registry(grace_s=10.0)
    stream = registry.open("r1", "alice")
    cancelled: list[bool] = []
    stream.cancel = lambda: cancelled.append(True)
    stream.append("a", 1)
    reader = stream.follow()
    await anext(reader)
    await reader.aclose()  # the reader leaves at t=1000: expiry due at 1010
    now[0] = 1009.0
    assert registry.get("r1", "alice") is stream  # a resume starts: expiry moves to 1019
    now[0] = 1015.0
    for _ in range(3):
        await asyncio.sleep(0)  # the loop runs every timer due by now
    assert registry.peek("r1", "alice") is stream and not cancelled
    now[0] = 1019.5
    await registry.wait_forgotten("r1")
    assert cancelled == [True]


async def test_a_reader_that_falls_behind_while_reading_expires_at_its_next_event() -> None:
    """Events dropped for the memory bound while the reader handles one (or waits for the
    next) end its read with ``ResumeExpired``, after the last event it could still read."""
    registry = _registry(max_stream_bytes=8)
    stream = registry.open("r1", "alice")
    stream.append("e0", 4)
    stream.append("e1", 4)
    reader = stream.follow()
    assert await anext(reader) == (0, "e0")
    for i in (2, 3):
        stream.append(f"e{i}", 4)  # e1 is dropped while the reader handles e0
    with pytest.raises(ResumeExpired):
        await anext(reader)
    live = stream.follow(after=2)
    assert await anext(live) == (3, "e3")
    waiting = asyncio.ensure_future(anext(live))
    for i in (4, 5, 6):
        stream.append(f"e{i}", 4)  # e4 is dropped before the waiting reader wakes
    with pytest.raises(ResumeExpired):
        await waiting
