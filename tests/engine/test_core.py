"""EngineCore on a real tiny checkpoint, driven step by step (no threads, no sockets).

The stepping helpers (``run``, ``Result``, ``assert_idle``) are those of the FakeRunner tests
(``tests.engine.fake_core``): they drive any ``Engine``."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from rill.config import EngineConfig
from rill.engine.builder import Engine, build_engine
from rill.engine.request import (
    AbortCommand,
    AddCommand,
    ModifyCommand,
    PauseCommand,
    RegenerateCommand,
    Request,
    ResumeCommand,
)
from rill.errors import CacheMiss
from rill.types import RequestEvent, SamplingParams
from tests.engine.fake_core import Result, assert_idle, run

PROMPTS = [
    "Once upon a time there was a little fox",
    "The sun rose over the quiet village and",
    "Mia found a red ball in the garden.",
    'Tom said, "Let us go to the park!"',
    "A big dog ran",
    "In the morning the birds sang songs about the sea, the sky and the tall green trees",
]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    """A float32 engine on the tiny model with room for 64+ sequences."""
    return build_engine(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            kv_cache_memory="64MiB",
            max_model_len=512,
            max_num_seqs=64,
            max_queue=4096,
        )
    )


def make_request(engine: Engine, request_id: str, prompt: str, **params: object) -> Request:
    """An engine request for ``prompt`` with the given sampling parameters."""
    return Request(
        request_id=request_id,
        prompt_ids=engine.tokenizer.encode(prompt),
        params=SamplingParams(**params),
        eos_token_ids=engine.eos_token_ids,
        arrival_time=time.monotonic(),
        seq_no=0,
    )


MIXED = [
    dict(temperature=0.0),
    dict(temperature=0.8, seed=11),
    dict(temperature=1.2, top_k=20, seed=12),
    dict(temperature=0.7, top_p=0.9, seed=13),
    dict(temperature=1.0, min_p=0.05, seed=14),
    dict(temperature=0.9, repetition_penalty=1.3, seed=15),
    dict(temperature=0.6, presence_penalty=0.8, frequency_penalty=0.5, seed=16),
    dict(temperature=0.0, repetition_penalty=1.2),
]


def test_64_concurrent_mixed_requests_equal_their_solo_runs(engine: Engine) -> None:
    specs = []
    for i in range(64):
        params = dict(MIXED[i % len(MIXED)], max_tokens=12 + (i % 5) * 4, ignore_eos=True)
        specs.append((f"c{i}", PROMPTS[i % len(PROMPTS)] + f" {i}", params))
    together = run(engine, [make_request(engine, rid, prompt, **params) for rid, prompt, params in specs])
    assert_idle(engine)
    for rid, prompt, params in specs:
        solo = run(engine, [make_request(engine, rid, prompt, **params)])[rid]
        assert together[rid].token_ids == solo.token_ids, (rid, params)
        assert together[rid].text == solo.text
        assert len(solo.token_ids) == params["max_tokens"]
        assert together[rid].finish_reason == "length"
    assert_idle(engine)


def test_random_control_of_1000_requests_leaves_nothing_behind(engine: Engine) -> None:
    rng = random.Random(1234)
    core = engine.core
    requests = [
        make_request(
            engine,
            f"k{i}",
            PROMPTS[i % len(PROMPTS)],
            temperature=rng.choice([0.0, 0.8]),
            seed=i,
            max_tokens=rng.randint(2, 12),
        )
        for i in range(1000)
    ]
    live: set[str] = set()  # added and not finished: the only ids a client can steer
    paused: set[str] = set()
    finished: dict[str, str] = {}
    tokens_while_paused: list[str] = []
    generated: dict[str, int] = {}
    pending = list(requests)
    step = 0
    while pending or core.has_work() or paused:
        step += 1
        assert step < 50000
        for _ in range(rng.randint(0, 40)):
            if pending:
                request = pending.pop()
                live.add(request.request_id)
                core.apply(AddCommand(request))
        for rid in rng.sample(sorted(live), min(len(live), 6)):
            action = rng.choice(["abort", "pause", "resume", "modify", "regenerate", "none"])
            if action == "abort":
                core.apply(AbortCommand(rid))
            elif action == "pause":
                core.apply(PauseCommand(rid))
                paused.add(rid)
            elif action == "resume":
                core.apply(ResumeCommand(rid))
                paused.discard(rid)
            elif action == "modify":
                core.apply(
                    ModifyCommand(
                        rid, SamplingParams(temperature=rng.choice([0.0, 1.1]), max_tokens=rng.randint(2, 12))
                    )
                )
            elif action == "regenerate":
                core.apply(RegenerateCommand(rid))
                paused.discard(rid)  # regenerate also resumes
        # Some paused requests are never resumed: resume them late so they can finish.
        if not pending and (step % 50 == 0 or not core.has_work()):
            for rid in list(paused):
                core.apply(ResumeCommand(rid))
                paused.discard(rid)
        for out in core.step():
            # Counted by usage: a token generated before the pause whose text was held back comes
            # with a later output (the final one, if the paused request is aborted).
            num_before, generated[out.request_id] = generated.get(out.request_id, 0), out.usage.completion_tokens
            if (
                out.usage.completion_tokens > num_before
                and out.request_id in paused
                and RequestEvent.RESUMED not in out.events
                and RequestEvent.REGENERATING not in out.events
            ):
                tokens_while_paused.append(out.request_id)
            if out.finished:
                assert out.request_id not in finished, "two final outputs"
                finished[out.request_id] = out.finish_reason
                live.discard(out.request_id)
                paused.discard(out.request_id)
    assert tokens_while_paused == []
    assert len(finished) == 1000
    assert set(finished.values()) <= {"stop", "length", "cancelled"}
    assert "cancelled" in finished.values() and "length" in finished.values()
    assert_idle(engine)


def test_pause_produces_nothing_and_resume_continues_the_same_stream(engine: Engine) -> None:
    reference = run(
        engine, [make_request(engine, "p-ref", PROMPTS[0], temperature=0.0, max_tokens=16, ignore_eos=True)]
    )["p-ref"]
    core = engine.core
    core.apply(AddCommand(make_request(engine, "p", PROMPTS[0], temperature=0.0, max_tokens=16, ignore_eos=True)))
    tokens: list[int] = []
    paused_steps = 0
    while True:
        outs = {o.request_id: o for o in core.step()}
        out = outs.get("p")
        if out is not None:
            tokens += out.token_ids
            if out.finished:
                break
        if len(tokens) == 5 and paused_steps == 0:
            core.apply(PauseCommand("p"))
            for _ in range(5):  # the engine has nothing to do for it while paused
                paused = {o.request_id: o for o in core.step()}.get("p")
                assert paused is None or (paused.token_ids == [] and RequestEvent.PAUSED in paused.events)
                paused_steps += 1
            assert core.stats().num_paused == 1 and core.stats().num_running == 0
            assert core.stats().kv_used_tokens > 0  # it keeps its KV while memory allows
            core.apply(ResumeCommand("p"))
    assert tokens == reference.token_ids
    assert_idle(engine)


def test_modify_to_greedy_continues_like_a_greedy_run(engine: Engine) -> None:
    core = engine.core
    core.apply(
        AddCommand(make_request(engine, "m", PROMPTS[1], temperature=1.5, seed=5, max_tokens=20, ignore_eos=True))
    )
    tokens: list[int] = []
    switched_at = None
    while True:
        out = {o.request_id: o for o in core.step()}.get("m")
        if out is not None:
            if RequestEvent.MODIFIED in out.events:
                assert len(tokens) == switched_at  # the change came at the next token, none earlier
            tokens += out.token_ids
            if out.finished:
                break
        if len(tokens) == 6 and switched_at is None:
            switched_at = len(tokens)
            core.apply(ModifyCommand("m", SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))
    # The greedy continuation of prompt + first 6 tokens must equal the rest of the stream.
    prompt_ids = engine.tokenizer.encode(PROMPTS[1]) + tokens[:switched_at]
    request = Request(
        request_id="m-ref",
        prompt_ids=prompt_ids,
        params=SamplingParams(temperature=0.0, max_tokens=20 - switched_at, ignore_eos=True),
        eos_token_ids=engine.eos_token_ids,
        arrival_time=time.monotonic(),
        seq_no=0,
    )
    continuation = run(engine, [request])["m-ref"]
    assert tokens[switched_at:] == continuation.token_ids
    assert_idle(engine)


def test_regenerate_with_seed_reproduces_and_reuses_the_prompt_cache(engine: Engine) -> None:
    core = engine.core
    core.apply(
        AddCommand(make_request(engine, "g", PROMPTS[5], temperature=1.0, seed=99, max_tokens=10, ignore_eos=True))
    )
    first: list[int] = []
    second: list[int] = []
    regenerated = False
    hits_before = None
    while True:
        out = {o.request_id: o for o in core.step()}.get("g")
        if out is None:
            continue
        if RequestEvent.REGENERATING in out.events:
            regenerated = True
        (second if regenerated else first).extend(out.token_ids)
        if out.finished:
            break
        if len(first) == 10 - 3 and not regenerated and hits_before is None:
            hits_before = core.stats().prefix_cache_hits_tokens
            core.apply(RegenerateCommand("g"))
    num_prompt = len(engine.tokenizer.encode(PROMPTS[5]))
    full = run(
        engine, [make_request(engine, "g2", PROMPTS[5], temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)]
    )["g2"]
    assert second == full.token_ids
    assert first == full.token_ids[: len(first)]
    # Only the last prompt token was recomputed: the rest came from the row's cache.
    assert core.stats().prefix_cache_hits_tokens - hits_before >= num_prompt - 1
    assert_idle(engine)


def test_stop_strings_across_tokens_stop_tokens_and_logprobs(engine: Engine) -> None:
    base = run(
        engine, [make_request(engine, "s0", PROMPTS[0], temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)]
    )["s0"]
    assert len(base.logprobs) == len(base.token_ids) == 24
    for lp, token in zip(base.logprobs, base.token_ids):
        assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0].logprob >= lp.top[-1].logprob
    # A stop string spanning a token boundary: take text from the middle of the greedy output.
    text = base.text
    cut = len(text) // 2
    stop = text[cut : cut + 3]
    assert stop.strip(), "fixture text should not be blank here"
    stopped = run(
        engine, [make_request(engine, "s1", PROMPTS[0], temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])]
    )["s1"]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == text[: text.index(stop)]
    # A stop token id ends the request without emitting it.
    stop_id = base.token_ids[4]
    by_id = run(
        engine,
        [
            make_request(
                engine, "s2", PROMPTS[0], temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id]
            )
        ],
    )["s2"]
    first = base.token_ids.index(stop_id)
    assert by_id.token_ids == base.token_ids[:first] and by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    assert_idle(engine)


def test_eos_and_min_tokens(engine: Engine) -> None:
    base = run(engine, [make_request(engine, "e0", PROMPTS[2], temperature=0.0, max_tokens=8, ignore_eos=True)])["e0"]
    eos = base.token_ids[3]
    engine_eos = engine.eos_token_ids
    try:
        engine.eos_token_ids = frozenset({eos})
        early = run(engine, [make_request(engine, "e1", PROMPTS[2], temperature=0.0, max_tokens=8)])["e1"]
        assert early.finish_reason == "stop" and early.token_ids == base.token_ids[:3]
        assert early.usage.completion_tokens == 4  # the eos counts as generated, but is not emitted
        forced = run(engine, [make_request(engine, "e2", PROMPTS[2], temperature=0.0, max_tokens=8, min_tokens=6)])[
            "e2"
        ]
        assert eos not in forced.token_ids[:6] and len(forced.token_ids) >= 6
    finally:
        engine.eos_token_ids = engine_eos
    assert_idle(engine)


def test_multi_turn_prefix_reuse_prefills_only_new_tokens(engine: Engine) -> None:
    core = engine.core
    first = run(engine, [make_request(engine, "t1", PROMPTS[5], temperature=0.0, max_tokens=8, ignore_eos=True)])["t1"]
    prompt_ids = (
        engine.tokenizer.encode(PROMPTS[5])
        + first.token_ids
        + engine.tokenizer.encode(" And then", add_special_tokens=False)
    )
    before = core.stats()
    request = Request(
        request_id="t2",
        prompt_ids=prompt_ids,
        params=SamplingParams(temperature=0.0, max_tokens=4),
        eos_token_ids=engine.eos_token_ids,
        arrival_time=time.monotonic(),
        seq_no=0,
    )
    second = run(engine, [request])["t2"]
    after = core.stats()
    reused = after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens
    # At least everything of turn one but its last (never fed) token came from the cache
    # (an earlier test may have cached a longer identical greedy run), and never the new tail.
    assert len(engine.tokenizer.encode(PROMPTS[5])) + len(first.token_ids) - 1 <= reused <= len(prompt_ids) - 1
    assert second.usage.cached_tokens == reused
    assert_idle(engine)


def test_cached_prefix_requirement_reports_a_miss(engine: Engine) -> None:
    request = make_request(engine, "miss", "zebra quantum xylophone " * 5, temperature=0.0, max_tokens=2)
    request.require_cached_prefix_tokens = 10
    result = run(engine, [request])["miss"]
    assert result.finish_reason == "error" and isinstance(result.error, CacheMiss)
    assert_idle(engine)


def test_beam_search_streams_only_agreed_tokens_and_matches_its_final_text(engine: Engine) -> None:
    core = engine.core
    core.apply(AddCommand(make_request(engine, "b", PROMPTS[3], num_beams=4, max_tokens=12, ignore_eos=True)))
    chunks: list[str] = []
    tokens: list[int] = []
    while core.has_work():
        for out in core.step():
            chunks.append(out.text)
            tokens += out.token_ids
            if out.finished:
                final = out
    assert final.finish_reason == "length"
    assert "".join(chunks) == engine.tokenizer.decode(tokens)
    assert len(tokens) == 12
    # Deterministic: a second run gives the same best beam.
    again = run(engine, [make_request(engine, "b2", PROMPTS[3], num_beams=4, max_tokens=12, ignore_eos=True)])["b2"]
    assert again.token_ids == tokens
    assert_idle(engine)


def test_identical_prompts_share_one_prefill(engine: Engine) -> None:
    core = engine.core
    prompt = "Seven quiet penguins collected blue shells while the old lighthouse keeper sang about storms and ships"
    before = core.stats()
    results = run(
        engine, [make_request(engine, f"n{i}", prompt, temperature=0.9, seed=i, max_tokens=4) for i in range(4)]
    )
    after = core.stats()
    num_prompt = len(engine.tokenizer.encode(prompt))
    assert all(r.finish_reason in ("length", "stop") for r in results.values())
    # Three of the four reused the first one's prompt KV (all but the last prompt token).
    assert after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens == 3 * (num_prompt - 1)
    assert_idle(engine)


def test_preemption_under_memory_pressure_favours_priority(tiny_model_dir: Path) -> None:
    # Two rows only: a third, more urgent request preempts the least urgent running one.
    small = build_engine(
        EngineConfig(
            model=str(tiny_model_dir), dtype="float32", kv_cache_memory="128KiB", max_model_len=128, max_num_seqs=2
        )
    )
    assert small.runner.num_rows == 2
    core = small.core
    low = [
        make_request(small, f"low{i}", PROMPTS[i], temperature=0.0, max_tokens=20, ignore_eos=True) for i in range(2)
    ]
    for r in low:
        r.priority = 5
    ref = {
        r.request_id: run(
            small, [make_request(small, r.request_id, PROMPTS[i], temperature=0.0, max_tokens=20, ignore_eos=True)]
        )[r.request_id]
        for i, r in enumerate(low)
    }
    urgent = make_request(small, "urgent", PROMPTS[3], temperature=0.0, max_tokens=5, ignore_eos=True)
    order: list[str] = []

    def on_step(step: int, results: dict[str, Result]) -> None:
        if step == 3:
            core.apply(AddCommand(urgent))
        for rid, res in results.items():
            if res.finish_reason and rid not in order:
                order.append(rid)

    results = run(small, low, on_step=on_step)
    assert order[0] == "urgent"
    assert core.stats().num_preemptions_total >= 1
    assert any(RequestEvent.PREEMPTED in results[r.request_id].events for r in low)
    for r in low:  # preempted requests are recomputed and finish with the same tokens
        assert results[r.request_id].token_ids == ref[r.request_id].token_ids
    assert_idle(small)


def test_auto_kv_budget_holds_every_sequence_the_engine_runs_and_a_fixed_one_caps_it(monkeypatch) -> None:
    """``--kv-cache-memory auto`` sizes the cache from the load (``--max-num-seqs`` plus the
    prefix headroom), capped at a share of the memory available; a size caps it as before."""
    from rill.engine import sizing

    monkeypatch.setattr(sizing, "available_memory", lambda: 16 * 2**30)
    auto = EngineConfig(max_num_seqs=32)
    row = 23_040 * 4096  # SmolLM2's bf16 KV bytes per token x 4096 tokens
    assert sizing.cache_rows(auto, 23_040, 4096) == 32 + 16
    # A resident cache (llama.cpp's) keeps the fixed 2 GiB: 22 rows of 94 MB.
    assert sizing.cache_rows(auto, 23_040, 4096, lazy=False) == 2 * 2**30 // row
    monkeypatch.setattr(sizing, "available_memory", lambda: 2 * 2**30)
    assert sizing.cache_rows(auto, 23_040, 4096) == int(0.4 * 2 * 2**30) // row
    fixed = EngineConfig(max_num_seqs=32, kv_cache_memory="512MiB")
    assert sizing.cache_rows(fixed, 23_040, 4096) == 512 * 2**20 // row
    assert sizing.warm_up_tokens(8192, 135_000_000) == 2962
    assert sizing.warm_up_tokens(8192, 1_540_000_000) == 259
    assert sizing.warm_up_tokens(1024, 135_000_000) == 1024
