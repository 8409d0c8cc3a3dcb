"""How a reader waits on a ``RequestStream``: ``__anext__`` until a delta comes, and
``next_within`` (the SSE writers' wait, keep-alives between deltas) at most a given time."""

from __future__ import annotations

import asyncio

import pytest

from rill.frontend.stream import RequestStream
from rill.types import SamplingParams
from tests.frontend.test_stream_budget import Aborts, delta


def new_stream() -> RequestStream:
    return RequestStream(Aborts(), "r", [1], SamplingParams())  # type: ignore[arg-type]


async def test_next_within_gives_none_when_nothing_came_in_time_and_the_delta_once_it_comes():
    stream = new_stream()
    assert await stream.next_within(0.01) is None
    assert stream._waiters == []  # the timed-out wait left nothing behind
    asyncio.get_running_loop().call_soon(stream.put, delta("a"))
    got = await stream.next_within(60.0)
    assert got is not None and got.text == "a"
    stream.put(delta("b"))
    stream.put(delta("c", finished=True))
    got = await stream.next_within(0.01)  # pending already: no wait at all
    assert got is not None and got.text == "bc" and got.finished
    with pytest.raises(StopAsyncIteration):
        await stream.next_within(0.01)
    with pytest.raises(StopAsyncIteration):
        await stream.next_within(None)


async def test_a_cancelled_reader_leaves_no_waiter_and_another_reader_still_gets_the_delta():
    stream = new_stream()
    leaving = asyncio.create_task(stream.next_within(60.0))
    staying = asyncio.create_task(anext(stream))
    await asyncio.sleep(0)  # both wait now
    assert len(stream._waiters) == 2
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert len(stream._waiters) == 1
    stream.put(delta("x"))
    got = await staying
    assert got.text == "x" and stream._waiters == []


async def test_no_limit_waits_for_the_delta_as_anext_does():
    stream = new_stream()
    reader = asyncio.create_task(stream.next_within(None))
    await asyncio.sleep(0)
    assert not reader.done()
    stream.put(delta("z", finished=True))
    got = await reader
    assert got is not None and got.text == "z" and stream.is_finished
