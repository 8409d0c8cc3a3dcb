"""The rate limits as ``InprocClient.generate`` applies them, over the FakeRunner engine.

The limiter's clock is injected and never moves, so nothing refills behind the test's back;
the engine's gate holds a request running while the test looks at what it reserved.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest

from rill.errors import InvalidRequest, RateLimited
from rill.frontend.ratelimit import RateLimits
from rill.testing.fake_client import fake_client
from rill.testing.fake_runner import StepGate
from rill.types import GenerateRequest, RequestEvent, SamplingParams
from tests.helpers import limit

BURST = 10


def ask(max_tokens: int, principal: str | None = "key:a", prompt: str = "hello") -> GenerateRequest:
    return GenerateRequest(prompt=prompt, sampling=SamplingParams(max_tokens=max_tokens), principal=principal)


async def run_to_end(client: object, request: GenerateRequest) -> int:
    """Submit ``request`` and read it to its end; the completion tokens it used."""
    stream = await client.generate(request)  # type: ignore[attr-defined]
    used = 0
    async with stream:
        async for output in stream:
            used = output.usage.completion_tokens
    return used


async def test_requests_per_window_by_principal() -> None:
    async with fake_client() as client:
        limit(client, RateLimits(requests=2, window_s=60.0), clock=lambda: 0.0)
        for principal in ("key:a", "key:a", "key:b", None, None):
            await run_to_end(client, ask(1, principal))
        with pytest.raises(RateLimited) as refused:
            await client.generate(ask(1, "key:a"))
        assert refused.value.retry_after_s == 60.0
        with pytest.raises(RateLimited):
            await client.generate(ask(1, None))  # callers naming nobody share one principal
        await run_to_end(client, ask(1, "key:b"))  # b's second of two


async def test_a_request_refused_for_another_reason_counts_for_nothing() -> None:
    async with fake_client() as client:
        limit(client, RateLimits(requests=2, window_s=60.0, tokens_per_s=1.0, burst=BURST), clock=lambda: 0.0)
        client.engine.runner.gate = threading.Event()  # the first request stays running
        first = await client.generate(
            GenerateRequest(prompt="hello", request_id="dup", principal="key:a", sampling=SamplingParams(max_tokens=1))
        )
        for refused in (
            GenerateRequest(prompt="hello", request_id="dup", principal="key:a"),  # id in use
            ask(1, prompt="x" * 10_000_000),
        ):  # over the prompt size bound
            with pytest.raises(InvalidRequest):
                await client.generate(refused)
        client.engine.runner.gate.set()
        await run_to_end(client, ask(BURST - 1))  # the window's second request; the tokens were all there
        with pytest.raises(RateLimited):
            await client.generate(ask(1))
        async with first:
            async for _ in first:
                pass


async def test_tokens_are_held_while_a_request_runs_and_the_unused_come_back() -> None:
    async with fake_client() as client:
        limit(client, RateLimits(tokens_per_s=1.0, burst=BURST), clock=lambda: 0.0)
        runner = client.engine.runner
        eos = client.engine.tokenizer.eos_token_id
        prompt_len = len(client.engine.tokenizer.encode("hello"))
        runner.script = lambda tokens: eos if len(tokens) >= prompt_len + 3 else None  # ends after a few tokens
        runner.gate = threading.Event()  # nothing runs until set
        held = await client.generate(ask(8))
        with pytest.raises(RateLimited) as refused:
            await client.generate(ask(3))  # 8 of 10 are held
        assert "3 tokens asked" in str(refused.value)
        runner.gate.set()
        used = 0
        async with held:
            async for output in held:
                used = output.usage.completion_tokens
        assert 1 <= used < 8
        left = BURST - used
        with pytest.raises(RateLimited):
            await client.generate(ask(left + 1))  # the used tokens stay spent (the clock stands still)
        await run_to_end(client, ask(left))  # the unused ones came back


async def test_modify_raising_max_tokens_reserves_the_difference_first() -> None:
    async with fake_client() as client:
        limit(client, RateLimits(tokens_per_s=1.0, burst=BURST), clock=lambda: 0.0)
        client.engine.runner.gate = threading.Event()  # nothing runs until set
        held = await client.generate(
            GenerateRequest(prompt="hello", principal="key:a", sampling=SamplingParams(max_tokens=4, ignore_eos=True))
        )
        assert (await held.modify({"max_tokens": 9})).max_tokens == 9  # 5 more of the 6 left
        with pytest.raises(RateLimited):
            await client.generate(ask(2))  # 1 left
        with pytest.raises(RateLimited) as refused:
            await held.modify({"max_tokens": 12, "temperature": 0.5})
        assert "3 more tokens" in str(refused.value)
        client.engine.runner.gate.set()
        used = 0
        async with held:
            async for output in held:
                used = output.usage.completion_tokens
        assert used == 9  # the engine never got the refused max_tokens
        with pytest.raises(RateLimited):
            await client.generate(ask(2))  # 9 of 10 stay spent
        await run_to_end(client, ask(1))


async def test_lowering_then_raising_max_tokens_again_needs_nothing_more() -> None:
    async with fake_client() as client:
        limit(client, RateLimits(tokens_per_s=1.0, burst=BURST), clock=lambda: 0.0)
        client.engine.runner.gate = threading.Event()
        held = await client.generate(ask(9))
        await held.modify({"max_tokens": 5})
        assert (await held.modify({"max_tokens": 9})).max_tokens == 9  # 9 were reserved all along; 1 left
        with pytest.raises(RateLimited):
            await client.generate(ask(2))
        client.engine.runner.gate.set()
        async with held:
            async for _ in held:
                pass


async def test_regenerated_tokens_stay_spent() -> None:
    """Before, ``regenerate`` restarted the count: a principal could generate without end on
    one reservation. Now the discarded attempt's tokens are charged and the new attempt
    reserves as many first."""
    async with fake_client() as client:
        gate, stream = await _after_three_tokens(client, burst=20)
        await _until(lambda: gate.is_waiting)  # step 4 is planned: the first attempt makes 4 tokens
        await stream.regenerate()  # reserves the 3 it has seen: 20 - 8 - 3 = 9 left
        gate.set()
        used = 0
        async with stream:
            async for output in stream:
                used = output.usage.completion_tokens
        assert used == 8  # the second attempt, in full
        # 4 + 8 = 12 tokens made against 11 reserved: one more is charged, 8 are left.
        with pytest.raises(RateLimited):
            await client.generate(ask(9))
        await run_to_end(client, ask(8))


async def _after_three_tokens(client: Any, burst: int) -> tuple[StepGate, Any]:
    """A request of 8 tokens (eos ignored) under a token bucket of ``burst``, read to its third
    token; its engine steps wait at the returned gate from the fourth on."""
    limit(client, RateLimits(tokens_per_s=1.0, burst=burst), clock=lambda: 0.0)
    gate = client.engine.runner.gate = StepGate()
    stream = await client.generate(
        GenerateRequest(prompt="hello", principal="key:a", sampling=SamplingParams(max_tokens=8, ignore_eos=True))
    )
    gate.allow(3)  # the prefill's token and two more
    async for output in stream:
        if output.usage.completion_tokens == 3:
            break
    return gate, stream


async def _until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Wait until the engine thread makes ``condition`` true (it never turns false by itself)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.001)


async def test_a_regenerate_the_bucket_cannot_pay_for_is_refused_and_the_stream_goes_on() -> None:
    async with fake_client() as client:
        gate, stream = await _after_three_tokens(client, burst=BURST)
        with pytest.raises(RateLimited) as refused:
            await stream.regenerate()  # 3 asked, 2 left
        assert refused.value.retry_after_s == pytest.approx(1.0)
        gate.set()
        used, restarted = 0, False
        async with stream:
            async for output in stream:
                used = output.usage.completion_tokens
                restarted |= RequestEvent.REGENERATING in output.events
        assert used == 8 and not restarted  # the refused regenerate never reached the engine


async def test_a_second_regenerate_before_the_first_is_done_reserves_nothing_more() -> None:
    async with fake_client() as client:
        gate, stream = await _after_three_tokens(client, burst=13)
        await stream.regenerate()  # 3 discarded + 8: 11 of 13 reserved
        await stream.regenerate()  # the same discard: 2 left would not cover 3 more
        gate.set()
        used = 0
        async with stream:
            async for output in stream:
                used = output.usage.completion_tokens
        assert used == 8
        with pytest.raises(RateLimited):
            await client.generate(ask(3))  # at least 3 + 8 of the 13 were made (4 + 8 if step 4 ran first)
