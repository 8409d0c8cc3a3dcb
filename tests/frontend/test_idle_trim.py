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
