"""``SubmissionPolicy``: what gets into the engine, decided once for every protocol.

Over the in-process client and a ``FakeRunner`` engine (one character per token): a
submission's ``max_tokens`` fitted to each prompt's room and the server's cap, one validation
per submission and per ``modify``, per-candidate seeds and prompt logprobs, the time limit,
and all-or-none admission of a submission's choices.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from rill.config import EngineConfig, PolicyConfig
from rill.errors import InvalidRequest, QueueFull
from rill.frontend.client import Submission
from rill.frontend.policy import SubmissionPolicy
from rill.testing.fake_client import fake_client
from rill.types import MAX_TOKENS_LIMIT, GenerateRequest, InvalidParameter, SamplingParams
from tests.helpers import wait_until

CONTEXT = 100


def policy(**config: Any) -> SubmissionPolicy:
    return SubmissionPolicy(PolicyConfig(**config), EngineConfig(model="fake"))


async def plan(client: Any, **fields: Any) -> list[Any]:
    fields.setdefault("sampling", SamplingParams(max_tokens=MAX_TOKENS_LIMIT))
    return await client.policy.plan(Submission(request_id="r", **fields), client._require_engine)


@pytest.fixture
def count_validations(monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """Every ``SamplingParams`` validated from now on."""
    seen: list[SamplingParams] = []
    original = SamplingParams.validate

    def counted(self: SamplingParams, *args: Any, **kwargs: Any) -> SamplingParams:
        seen.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SamplingParams, "validate", counted)
    return seen


async def test_max_tokens_is_fitted_to_each_prompt_and_validated_once(count_validations: list) -> None:
    async with fake_client(max_len=CONTEXT) as client:
        choices = await plan(client, prompts=["a" * 29, "b" * 9, [5] * 99])  # 30, 10 and 99 tokens with BOS
        assert [c.params.max_tokens for c in choices] == [70, 90, 1]  # the rest of each prompt's context
        assert len(count_validations) == 1  # prompts differ only in the lowered max_tokens
        asked = await plan(client, prompts=["a" * 29], sampling=SamplingParams(max_tokens=500, min_tokens=600))
        assert (asked[0].params.max_tokens, asked[0].params.min_tokens) == (70, 70)  # lowered, not refused
        few = await plan(client, prompts=["a" * 29], sampling=SamplingParams(max_tokens=10, min_tokens=20))
        assert (few[0].params.max_tokens, few[0].params.min_tokens) == (10, 10)


async def test_the_cap_bounds_fitted_and_given_max_tokens() -> None:
    async with fake_client(max_len=CONTEXT, policy=policy(max_tokens_cap=16)) as client:
        assert [c.params.max_tokens for c in await plan(client, prompts=["a" * 29])] == [16]
        one = await client.policy.plan_one(
            GenerateRequest(prompt="a", sampling=SamplingParams(max_tokens=50)), client._require_engine
        )
        assert one.params.max_tokens == 16
        huge = await client.policy.plan_one(
            GenerateRequest(prompt="a", sampling=SamplingParams(max_tokens=2**40)), client._require_engine
        )
        assert huge.params.max_tokens == 16  # capped before validation: runs with the cap


async def test_prefill_only_where_the_submission_allows_it() -> None:
    async with fake_client(max_len=CONTEXT) as client:
        zero = SamplingParams(max_tokens=0, min_tokens=3)
        [choice] = await plan(client, prompts=["a"], sampling=zero, allow_prefill_only=True)
        assert (choice.params.max_tokens, choice.params.min_tokens) == (0, 0)
        with pytest.raises(InvalidParameter) as refused:
            await plan(client, prompts=["a"], sampling=zero)
        assert refused.value.field == "max_tokens"


async def test_candidates_get_their_own_seed_and_only_the_first_prompt_logprobs() -> None:
    async with fake_client(max_len=CONTEXT) as client:
        sampling = SamplingParams(max_tokens=5, seed=2**63 - 1, prompt_logprobs=1)
        choices = await plan(client, prompts=["ab", "c"], sampling=sampling, num_candidates=3)
        assert [c.request_id for c in choices] == [f"r-{k}" for k in range(6)]
        assert [c.params.seed for c in choices] == [2**63 - 1, 0, 1] * 2  # wraps within the seed range
        assert [c.params.prompt_logprobs for c in choices] == [1, None, None] * 2
        assert [len(c.prompt_ids) for c in choices] == [3, 3, 3, 2, 2, 2]
        unseeded = await plan(client, prompts=["a"], sampling=SamplingParams(max_tokens=5), num_candidates=2)
        assert [c.params.seed for c in unseeded] == [None, None]


async def test_a_bad_value_is_refused_before_anything_starts() -> None:
    async with fake_client(max_len=CONTEXT) as client:
        with pytest.raises(InvalidParameter) as refused:
            await client.submit(Submission(prompts=["a"], sampling=SamplingParams(temperature=-1), request_id="r"))
        assert refused.value.field == "temperature"
        with pytest.raises(InvalidParameter) as vocab:
            await client.submit(
                Submission(prompts=["a"], sampling=SamplingParams(logit_bias={10**6: 1.0}), request_id="r")
            )
        assert vocab.value.field == "logit_bias"  # validated with the vocabulary
        assert client.stats().num_waiting == 0


async def test_the_time_limit_is_the_shorter_one() -> None:
    limited = policy(request_timeout_s=30.0)
    assert (limited.deadline_s(None), limited.deadline_s(10.0), limited.deadline_s(60.0)) == (30.0, 10.0, 30.0)
    assert (policy().deadline_s(None), policy().deadline_s(5.0)) == (None, 5.0)
    async with fake_client(max_len=CONTEXT, policy=policy(request_timeout_s=30.0)) as client:
        [choice] = await plan(client, prompts=["a"])
        assert choice.deadline_s == 30.0


async def test_a_modify_is_patched_validated_once_and_capped(count_validations: list) -> None:
    capped = policy(max_tokens_cap=8)
    old = SamplingParams(max_tokens=4)
    new = capped.modified(old, {"max_tokens": 50, "temperature": 0.5}, vocab_size=300)
    assert (new.max_tokens, new.temperature, len(count_validations)) == (8, 0.5, 1)
    with pytest.raises(InvalidParameter) as unknown:
        capped.modified(old, {"temprature": 0.5}, vocab_size=300)
    assert unknown.value.field == "temprature"
    with pytest.raises(InvalidParameter) as outside:
        capped.modified(old, {"stop_token_ids": [300]}, vocab_size=300)
    assert outside.value.field == "stop_token_ids"


async def test_a_submission_is_admitted_all_or_none() -> None:
    async with fake_client(EngineConfig(model="fake", max_queue=2), max_len=CONTEXT) as client:
        client.runner.gate = threading.Event()  # nothing leaves the queue meanwhile
        with pytest.raises(QueueFull):
            await client.submit(
                Submission(prompts=["a"], sampling=SamplingParams(max_tokens=5), num_candidates=3, request_id="r")
            )
        client.runner.gate.set()
        # The two admitted were withdrawn (counted once the engine has applied the aborts).
        await wait_until(
            lambda: client.stats().requests_finished_total.get("cancelled", 0) == 2, attempts=1000, interval_s=0.01
        )
        await _until_idle(client)
        assert client.stats().requests_finished_total == {"cancelled": 2}
        with pytest.raises(InvalidRequest, match="empty"):
            await client.submit(Submission(prompts=[[]], sampling=SamplingParams(max_tokens=5), request_id="e"))


async def _until_idle(client: Any) -> None:
    def idle() -> bool:
        stats = client.stats()
        return stats.num_running == 0 and stats.num_waiting == 0

    await wait_until(idle, attempts=1000, interval_s=0.01)
