"""The engine thread gives the C heap's free memory back when it goes idle after work."""

from __future__ import annotations

import threading

import pytest

from rill.frontend import inproc
from rill.testing.fake_client import fake_client
from rill.types import GenerateRequest, SamplingParams


async def test_the_engine_trims_the_heap_once_it_is_idle_after_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    trimmed = threading.Event()

    def trim() -> int:
        trims.append(1)
        trimmed.set()
        return 1

    monkeypatch.setattr(inproc, "malloc_trim", lambda: trim)
    async with fake_client() as client:
        assert not trims  # idle from the start: nothing was stepped, nothing to give back
        stream = await client.generate(GenerateRequest(prompt="hello", sampling=SamplingParams(max_tokens=3)))
        async with stream:
            outputs = [o async for o in stream]
        assert outputs[-1].finished
        # The trim runs on the engine thread once it has nothing to do (at most every 2 s).
        assert trimmed.wait(30)
    assert len(trims) == 1


def test_the_idle_trim_waits_for_what_the_last_outputs_become() -> None:
    """The engine goes idle as its last outputs leave; their responses are built and freed just
    after, so the trim waits ``IDLE_SETTLE_S`` of idleness first (a command meanwhile, here the
    stop, means it never ran)."""
    import queue

    from rill.frontend import engine_loop

    class Core:
        steps = 1

        def has_work(self) -> bool:
            return self.steps > 0

        def step(self) -> list:
            self.steps -= 1
            return []

    class Inbox:
        def __init__(self) -> None:
            self.waits: list[float | None] = []

        def get_nowait(self) -> object:
            raise queue.Empty

        def get(self, timeout: float | None = None) -> object:
            self.waits.append(timeout)
            return engine_loop.STOP

    trims: list[int] = []
    inbox = Inbox()
    engine_loop.run(Core(), inbox, lambda outputs: None, lambda: trims.append(1))  # type: ignore[arg-type]
    assert trims == []
    [wait] = inbox.waits
    assert wait is not None and engine_loop.IDLE_SETTLE_S - 0.5 < wait <= engine_loop.IDLE_SETTLE_S
