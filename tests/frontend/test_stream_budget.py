"""Issue 31: what waits unread in a ``RequestStream`` is charged to the session-memory budget,
so a client that does not read piles up at most its principal's share; past it its request
ends with ``ResourceExhausted``, the engine stops generating it and the memory comes back."""

from __future__ import annotations

from typing import Any

from rill.errors import ResourceExhausted
from rill.frontend.budget import MemoryBudget
from rill.frontend.policy import SubmissionPolicy
from rill.frontend.stream import RequestStream, output_bytes
from rill.testing.fake_client import fake_client
from rill.types import GenerateRequest, RequestOutput, SamplingParams, TokenLogprob, TopLogprob
from tests.helpers import wait_until


class Aborts:
    """The client side a stream calls back: records aborts."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def delta(text: str = "word ", finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        text=text,
        token_ids=[300],
        token_texts=[text],
        finished=finished,
        finish_reason="length" if finished else None,
    )


def stream_of(budget: MemoryBudget, principal: str = "a") -> tuple[RequestStream, Aborts]:
    client = Aborts()
    return RequestStream(client, "r", [1], SamplingParams(), lease=budget.lease(principal)), client  # type: ignore[arg-type]


async def test_unread_output_is_charged_and_given_back_when_read():
    budget = MemoryBudget(total=1 << 20, per_principal=1 << 20)
    stream, _ = stream_of(budget)
    stream.put(delta())
    stream.put(delta())
    assert budget.used == 2 * output_bytes(delta())
    merged = await anext(stream)
    assert merged.text == "word word " and budget.used == 0


async def test_a_reader_past_its_share_gets_an_error_and_its_request_is_cancelled():
    one = output_bytes(delta())
    budget = MemoryBudget(total=100 * one, per_principal=10 * one)
    stream, client = stream_of(budget, "slow")
    other, _ = stream_of(budget, "reader")
    for _ in range(10):
        stream.put(delta())
    assert budget.used_by("slow") == 10 * one and client.aborted == []
    stream.put(delta())  # the 11th unread delta passes the share
    other.put(delta())  # another principal still gets in
    assert client.aborted == ["r"] and budget.used_by("slow") == 0 and budget.used == one
    stream.put(delta())  # later deltas (the engine's cancelled one) are dropped
    stream.put(delta(finished=True))
    final = await anext(stream)
    assert final.finished and final.finish_reason == "error" and isinstance(final.error, ResourceExhausted)
    assert final.text == "" and budget.used_by("slow") == 0
    assert [o async for o in stream] == []


async def test_a_final_delta_is_always_taken_and_closing_gives_everything_back():
    one = output_bytes(delta())
    budget = MemoryBudget(total=100 * one, per_principal=one)
    stream, client = stream_of(budget)
    stream.put(delta())
    stream.put(delta(finished=True))  # over the share, but the last one: kept (one step's worth)
    assert client.aborted == [] and budget.used == one
    await stream.aclose()
    assert budget.used == 0


def test_logprobs_count_with_every_alternative():
    top = [TopLogprob(token_id=i, logprob=-1.0) for i in range(20)]
    plain, with_top = delta(), delta()
    with_top.logprobs = [TokenLogprob(token_id=300, logprob=-0.5, top=top)]
    assert output_bytes(with_top) - output_bytes(plain) == 21 * 96


async def test_a_client_that_does_not_read_is_stopped_at_its_share_by_the_engine_client():
    """Through ``InprocClient``: the budget the server builds its policy with charges every stream."""
    budget = MemoryBudget(total=1 << 20, per_principal=4096)
    async with fake_client(policy=SubmissionPolicy(memory=budget)) as client:
        slow = await client.generate(
            GenerateRequest(
                prompt="hello", principal="key:slow", sampling=SamplingParams(max_tokens=500, ignore_eos=True)
            )
        )
        async with slow:
            await wait_until(lambda: budget.refused >= 1, attempts=2000, interval_s=0.005)
            [output] = [o async for o in slow]
            assert output.finish_reason == "error" and isinstance(output.error, ResourceExhausted)
        assert budget.used == 0
        await wait_until(lambda: client.stats().num_running == 0, attempts=2000, interval_s=0.005)
        # The share is free again: a request whose whole output fits it is never stopped.
        fine = await client.generate(
            GenerateRequest(
                prompt="hello", principal="key:slow", sampling=SamplingParams(max_tokens=5, ignore_eos=True)
            )
        )
        async with fine:
            outputs: list[Any] = [o async for o in fine]
        assert outputs[-1].finish_reason == "length" and budget.used == 0
