"""Scoring requests (prompt logprobs, ``n``/``best_of`` candidates) beside running streams.

A request asking prompt logprobs computes the logits of every prompt position, which the
prefix cache cannot serve. These tests check that such work is held to the same protected
prefill cap as any other prefill while streams decode (the streams get a token every step),
that the candidates of one scoring prompt compute that prompt once, that a cached prompt or
an already-scored part is reused where its logits are not needed, and that none of it
changes a single logprob or token.

All run on the FakeRunner engine (``tests.engine.fake_core``): deterministic, milliseconds.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest

from rill.engine.request import AbortCommand, AddCommand, Request, RequestStatus
from rill.engine.scheduler import MIN_SHARED_PREFILL_TOKENS
from rill.types import TokenLogprob
from tests.engine.fake_core import PROMPTS, Result, assert_idle, make_engine, make_request, solo, step

CAP = 16  # the protected prefill cap pinned before every step (the core's cost feedback moves it)
LOGITS_CAP = 64  # an all-logits chunk's own bound (what the core sets from the vocabulary)


@dataclass
class Planned:
    """What one step's plan held: the cap it was made under and each item's kind and size."""

    cap: int
    num_decode_tokens: int
    num_prefill_tokens: int
    items: list[tuple[str, bool, int]]  # (request id, all logits, tokens fed)


def record_plans(engine) -> list[Planned]:
    """Record every step's plan as the scheduler makes it (a list filled as steps run)."""
    scheduler = engine.core.scheduler
    plans: list[Planned] = []
    real_schedule = scheduler.schedule

    def schedule():
        cap = scheduler.prefill_chunk_tokens
        plan = real_schedule()
        plans.append(
            Planned(
                cap,
                plan.num_decode_tokens,
                plan.num_prefill_tokens,
                [
                    (item.request.request_id, item.work[0].all_logits, len(item.work[0].token_ids))
                    for item in plan.scheduled
                ],
            )
        )
        return plan

    scheduler.schedule = schedule  # type: ignore[method-assign]
    return plans


def random_prompt(engine, length: int, seed: int) -> list[int]:
    """``length`` random ordinary token ids (no shared prefix with any other seed's)."""
    rng = random.Random(seed)
    special = set(engine.tokenizer.special_token_ids)
    ids: list[int] = []
    while len(ids) < length:
        token = rng.randrange(engine.model_info.vocab_size)
        if token not in special:
            ids.append(token)
    return ids


def candidates(engine, ids: list[int], num: int, seed: int = 5, scoring: bool = True) -> list[Request]:
    """A request's ``num`` candidates as ``/v1/completions`` makes them (``best_of``): every one
    has its own seed; with ``scoring``, the first asks prompt logprobs."""
    return [
        make_request(
            engine,
            f"c{i}",
            ids,
            seed=seed + i,
            logprobs=5,
            max_tokens=4,
            ignore_eos=True,
            prompt_logprobs=5 if scoring and i == 0 else None,
        )
        for i in range(num)
    ]


def prompt_logprobs_of(request_id: str, outputs: list) -> list[TokenLogprob | None]:
    """The prompt logprobs ``request_id`` got (exactly once)."""
    carrying = [out.prompt_logprobs for out in outputs if out.request_id == request_id and out.prompt_logprobs]
    assert len(carrying) == 1, "prompt logprobs come exactly once"
    return carrying[0]


def assert_same_logprobs(got: list[TokenLogprob | None], want: list[TokenLogprob | None]) -> None:
    """Entry by entry: the same token, rank and alternatives, logprobs equal to float precision."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    assert [(e.token_id, e.rank, [a.token_id for a in e.top]) for e in got[1:]] == [
        (e.token_id, e.rank, [a.token_id for a in e.top]) for e in want[1:]
    ]
    assert all(math.isclose(a.logprob, b.logprob, abs_tol=1e-6) for a, b in zip(got[1:], want[1:]))


def start_stream(engine, results: dict[str, Result]) -> None:
    """One long stream, decoding by the time this returns."""
    engine.core.apply(AddCommand(make_request(engine, "stream", PROMPTS[4], max_tokens=400, ignore_eos=True)))
    step(engine, results)
    step(engine, results)
    assert engine.core.requests["stream"].num_output_tokens_counted == 2


@pytest.mark.parametrize("scoring", [True, False], ids=["prompt-logprobs", "plain"])
def test_a_scoring_request_and_its_candidates_stay_under_the_protected_cap(scoring: bool) -> None:
    """A 400-token prompt with best_of 4 (with prompt logprobs, or without) beside one decoding
    stream: every step's prefill (the all-logits chunks included) stays under the protected
    cap, the stream gets a token every step, the prompt's positions are computed once (the
    three other candidates copy them), and every logprob and token is the one each request
    gets alone. Four candidates of one prompt count as one request starting, so they do not
    lift the cap as a burst of four different prompts would."""
    engine = make_engine(num_rows=16, max_len=512, max_num_batched_tokens=512)
    core = engine.core
    core.scheduler.max_logits_chunk_tokens = LOGITS_CAP
    results: dict[str, Result] = {}
    start_stream(engine, results)
    ids = random_prompt(engine, 400, seed=1)
    group = candidates(engine, ids, 4, scoring=scoring)
    plans = record_plans(engine)
    outputs = []
    for request in group:
        core.apply(AddCommand(request))
    num_steps = 0
    while any(not request.is_finished for request in group):
        num_steps += 1
        assert num_steps < 500, "the candidates did not finish"
        core.scheduler.prefill_chunk_tokens = CAP
        before = core.requests["stream"].num_output_tokens_counted
        outputs += step(engine, results)
        plan = plans[-1]
        assert plan.num_prefill_tokens <= plan.cap, (num_steps, plan)
        assert core.requests["stream"].num_output_tokens_counted == before + 1, (num_steps, plan)
    assert num_steps > len(ids) // CAP  # the prompt really was spread over many steps
    # c0 computes every position once (with prompt logprobs, in all-logits chunks) ...
    c0_chunks = [(all_logits, n) for p in plans for rid, all_logits, n in p.items if rid == "c0"][:-3]  # less 3 decodes
    assert sum(n for _, n in c0_chunks) == len(ids) and all(all_logits == scoring for all_logits, _ in c0_chunks)
    # ... and each other candidate copies the prompt, computing at most its last few tokens:
    # what it was fed, less its decodes (every token it generated but the last).
    for request in group[1:]:
        fed = sum(n for p in plans for rid, _, n in p.items if rid == request.request_id)
        own = fed - (request.num_output_tokens_counted - 1)
        assert own < MIN_SHARED_PREFILL_TOKENS, (request.request_id, own)
        assert request.num_cached_prompt_tokens == len(ids) - own
    for request in group:
        alone = solo(request, max_len=512)
        assert results[request.request_id].token_ids == alone.token_ids, request.request_id
    if scoring:
        alone_engine = make_engine(max_len=512)
        alone_engine.core.apply(AddCommand(candidates(alone_engine, ids, 1)[0]))
        alone_outputs = []
        while alone_engine.core.has_work():
            alone_outputs += alone_engine.core.step()
        assert_same_logprobs(prompt_logprobs_of("c0", outputs), prompt_logprobs_of("c0", alone_outputs))
    core.apply(AbortCommand("stream"))
    while core.has_work():
        core.step()
    assert_idle(engine)


def test_a_burst_still_starts_whole_but_a_scoring_chunk_keeps_the_cap() -> None:
    """Three distinct prompts and a scoring prompt arriving beside one stream: the burst
    exception still lets the three start at once (the batch fills up), while the scoring
    request, which a larger budget would not start any sooner, keeps chunks under the cap."""
    engine = make_engine(num_rows=16, max_len=512, max_num_batched_tokens=512)
    core = engine.core
    core.scheduler.max_logits_chunk_tokens = LOGITS_CAP
    results: dict[str, Result] = {}
    start_stream(engine, results)
    plans = record_plans(engine)
    burst = [make_request(engine, f"b{i}", random_prompt(engine, 60, seed=10 + i), max_tokens=2) for i in range(3)]
    scored = make_request(engine, "scored", random_prompt(engine, 200, seed=20), max_tokens=1, prompt_logprobs=2)
    for request in [*burst, scored]:
        core.apply(AddCommand(request))
    core.scheduler.prefill_chunk_tokens = CAP
    step(engine, results)
    assert all(request.num_computed >= 60 for request in burst), [r.num_computed for r in burst]
    [(_, _, n)] = [item for item in plans[-1].items if item[0] == "scored"]
    assert 0 < n <= CAP, n
    while not scored.is_finished:
        core.scheduler.prefill_chunk_tokens = CAP
        step(engine, results)
        assert all(n <= CAP for rid, all_logits, n in plans[-1].items if all_logits), plans[-1]
    assert results["scored"].finish_reason == "length"


def test_the_candidates_of_a_repeated_scoring_prompt_copy_the_cached_prompt_at_once() -> None:
    """A prompt already in the prefix cache, scored again with best_of 2: the candidate asking
    prompt logprobs recomputes every position (it needs their logits), but the other one copies
    the cached prompt and has its first token in the first step instead of waiting for that
    recomputation."""
    engine = make_engine(num_rows=16, max_len=512, max_num_batched_tokens=512)
    core = engine.core
    core.scheduler.max_logits_chunk_tokens = 32
    ids = random_prompt(engine, 200, seed=3)
    results: dict[str, Result] = {}
    core.apply(AddCommand(make_request(engine, "first", ids, max_tokens=1)))
    while core.has_work():
        step(engine, results)
    group = candidates(engine, ids, 2)
    for request in group:
        core.apply(AddCommand(request))
    step(engine, results)
    c0, c1 = group
    assert c0.num_computed == 32 and c0.num_cached_prompt_tokens == 0
    assert c1.status is RequestStatus.RUNNING and c1.num_cached_prompt_tokens == len(ids) - 1
    assert len(results["c1"].token_ids) == 1  # its first token came in the first step
    outputs = []
    while core.has_work():
        outputs += step(engine, results)
    for request in group:
        assert results[request.request_id].token_ids == solo(request, max_len=512).token_ids
    assert results["c0"].usage.cached_tokens == 0
    assert_idle(engine)


def test_a_preempted_scoring_request_reuses_the_positions_it_already_scored() -> None:
    """A scoring request preempted half-way through its prefill gets its cached part back on
    resumption for the positions it has scored (their logits are not needed again): each prompt
    position's logits are computed once, and the logprobs are those it gets alone."""
    engine = make_engine(num_rows=2, max_num_seqs=1, max_num_batched_tokens=32)
    core = engine.core
    core.scheduler.max_logits_chunk_tokens = 8
    plans = record_plans(engine)
    scored = make_request(engine, "scored", PROMPTS[5], priority=5, prompt_logprobs=3, max_tokens=2)
    outputs = []
    core.apply(AddCommand(scored))
    for _ in range(5):
        outputs += core.step()
    assert scored.num_computed == 40
    core.apply(AddCommand(make_request(engine, "urgent", PROMPTS[4], priority=0, max_tokens=3)))
    outputs += core.step()
    assert scored.status is RequestStatus.WAITING and scored.num_computed == 0  # preempted
    while core.has_work():
        outputs += core.step()
    scored_positions = sum(n for p in plans for rid, all_logits, n in p.items if rid == "scored" and all_logits)
    assert scored_positions == len(scored.prompt_ids)
    alone_engine = make_engine()
    alone = make_request(alone_engine, "scored", PROMPTS[5], prompt_logprobs=3, max_tokens=2)
    alone_engine.core.apply(AddCommand(alone))
    alone_outputs = []
    while alone_engine.core.has_work():
        alone_outputs += alone_engine.core.step()
    assert_same_logprobs(prompt_logprobs_of("scored", outputs), prompt_logprobs_of("scored", alone_outputs))
    assert_idle(engine)


def test_candidates_copying_a_long_prompt_start_one_per_step_beside_a_stream() -> None:
    """Each candidate that copies the 400-token prompt moves its keys and values into a row
    that joins the decoding ones; beside a stream, at most one starts per step, so a step
    carries one such copy, never three."""
    engine = make_engine(num_rows=16, max_len=512, max_num_batched_tokens=512)
    core = engine.core
    results: dict[str, Result] = {}
    start_stream(engine, results)
    ids = random_prompt(engine, 400, seed=3)
    group = candidates(engine, ids, 4, scoring=False)
    plans = record_plans(engine)
    for request in group:
        core.apply(AddCommand(request))
    while any(not request.is_finished for request in group):
        assert len(plans) < 500, "the candidates did not finish"
        core.scheduler.prefill_chunk_tokens = CAP
        step(engine, results)
    first_steps = [
        next(i for i, plan in enumerate(plans) if any(rid == r.request_id for rid, _, _ in plan.items))
        for r in group[1:]
    ]
    assert all(r.num_cached_prompt_tokens >= 256 for r in group[1:])  # each copied the prompt
    assert len(set(first_steps)) == 3, first_steps  # in three different steps
    for request in group:
        assert results[request.request_id].token_ids == solo(request, max_len=512).token_ids
    core.apply(AbortCommand("stream"))
    while core.has_work():
        core.step()
    assert_idle(engine)
