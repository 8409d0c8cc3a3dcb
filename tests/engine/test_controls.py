"""Control commands, stop conditions, deadlines and batch invariance over FakeRunner (no model)."""

from __future__ import annotations

import numpy as np

from rill.engine.request import AbortCommand, AddCommand, ModifyCommand, PauseCommand, RegenerateCommand, ResumeCommand
from rill.errors import RequestTimeout
from rill.types import RequestEvent, SamplingParams
from tests.engine.fake_core import (
    PROMPTS,
    Clock,
    Result,
    assert_idle,
    make_engine,
    make_request,
    run,
    solo,
    step,
    step_until_finished,
)


def steps_until(engine, results: dict[str, Result], rid: str, num_tokens: int) -> None:  # engine: an Engine
    """Step until ``rid`` has ``num_tokens`` tokens (bounded)."""
    for _ in range(500):
        if len(results.get(rid, Result()).token_ids) >= num_tokens:
            return
        step(engine, results)
    raise AssertionError(f"{rid} never reached {num_tokens} tokens")


def test_pause_produces_nothing_and_resume_continues_the_same_stream() -> None:
    engine = make_engine()
    core = engine.core
    request = make_request(engine, "p", PROMPTS[0], temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)
    reference = solo(request)
    results: dict[str, Result] = {}
    core.apply(AddCommand(request))
    steps_until(engine, results, "p", 5)
    core.apply(PauseCommand("p"))
    fed = engine.runner.num_tokens_fed
    for _ in range(5):
        step(engine, results)
    assert len(results["p"].token_ids) == 5 and engine.runner.num_tokens_fed == fed
    assert results["p"].events.count(RequestEvent.PAUSED) == 1 and core.stats().num_paused == 1
    core.apply(ResumeCommand("p"))
    while core.has_work():
        step(engine, results)
    assert RequestEvent.RESUMED in results["p"].events
    assert results["p"].token_ids == reference.token_ids
    assert_idle(engine)


def test_a_paused_request_gives_its_row_to_a_newcomer_and_recomputes_on_resume() -> None:
    engine = make_engine(num_rows=1, max_num_seqs=1)
    core = engine.core
    held = make_request(engine, "held", PROMPTS[1], temperature=0.0, max_tokens=10, ignore_eos=True)
    results: dict[str, Result] = {}
    core.apply(AddCommand(held))
    steps_until(engine, results, "held", 3)
    core.apply(PauseCommand("held"))
    newcomer = make_request(engine, "new", PROMPTS[2], temperature=0.0, max_tokens=4, ignore_eos=True)
    core.apply(AddCommand(newcomer))
    step_until_finished(engine, results, "new")
    core.apply(ResumeCommand("held"))
    while core.has_work():
        step(engine, results)
    assert results["new"].token_ids == solo(newcomer).token_ids
    assert results["held"].token_ids == solo(held).token_ids
    assert_idle(engine)


def test_modify_to_greedy_continues_with_the_argmax_of_the_same_history() -> None:
    engine = make_engine()
    core = engine.core
    request = make_request(engine, "m", PROMPTS[3], temperature=1.5, seed=9, max_tokens=12, ignore_eos=True)
    before = solo(request).token_ids
    results: dict[str, Result] = {}
    core.apply(AddCommand(request))
    steps_until(engine, results, "m", 4)
    new_params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    core.apply(ModifyCommand("m", new_params))
    while core.has_work():
        step(engine, results)
    tokens = results["m"].token_ids
    assert results["m"].events.count(RequestEvent.MODIFIED) == 1
    assert results["m"].modified == [new_params]  # the event carries the parameters now in force
    assert len(tokens) == 9 and results["m"].finish_reason == "length"  # the new max_tokens holds
    assert tokens[:4] == before[:4]
    for i in range(4, 9):
        history = request.prompt_ids + tokens[:i]
        assert tokens[i] == int(np.argmax(engine.runner.logits_after(history)))
    assert tokens != before[:9]  # greedy differs from what temperature 1.5 would have drawn
    assert_idle(engine)


def test_regenerate_restarts_from_the_prompt_and_reproduces_a_seeded_run() -> None:
    engine = make_engine()
    core = engine.core
    request = make_request(engine, "r", PROMPTS[4], temperature=1.0, seed=21, max_tokens=8, ignore_eos=True)
    results: dict[str, Result] = {}
    core.apply(AddCommand(request))
    steps_until(engine, results, "r", 5)
    first = list(results["r"].token_ids)
    fed = engine.runner.num_tokens_fed
    core.apply(RegenerateCommand("r"))
    results["r"] = Result()
    while core.has_work():
        step(engine, results)
    assert RequestEvent.REGENERATING in results["r"].events
    assert results["r"].token_ids == solo(request).token_ids
    assert results["r"].token_ids[:5] == first
    # The prompt's KV stayed: only the last prompt token and the new tokens were fed again.
    assert engine.runner.num_tokens_fed - fed == 1 + 7
    assert_idle(engine)


def test_abort_of_a_waiting_a_running_and_a_paused_request() -> None:
    engine = make_engine(max_num_seqs=1)
    core = engine.core
    results: dict[str, Result] = {}
    for rid in ("run", "paused", "wait"):
        core.apply(
            AddCommand(make_request(engine, rid, PROMPTS[0] + rid, temperature=0.0, max_tokens=50, ignore_eos=True))
        )
    step(engine, results)
    core.apply(PauseCommand("run"))
    step(engine, results)  # "paused" runs now; "run" is paused
    core.apply(PauseCommand("paused"))
    for rid in ("run", "paused", "wait"):
        core.apply(AbortCommand(rid))
    step(engine, results)
    assert {rid: res.finish_reason for rid, res in results.items()} == {
        "run": "cancelled",
        "paused": "cancelled",
        "wait": "cancelled",
    }
    assert not core.has_work()
    assert_idle(engine)


def test_stop_strings_and_stop_token_ids_end_the_request() -> None:
    engine = make_engine()
    request = make_request(engine, "s", PROMPTS[0], temperature=0.0, max_tokens=40, ignore_eos=True)
    text = solo(request).text
    stop = text[6:8]
    assert text.find(stop) == 6
    by_string = run(
        engine, [make_request(engine, "s1", PROMPTS[0], temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])]
    )["s1"]
    assert (by_string.text, by_string.finish_reason, by_string.stop_reason) == (text[:6], "stop", stop)
    token = solo(request).token_ids[3]
    by_token = run(
        engine,
        [
            make_request(
                engine, "s2", PROMPTS[0], temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[token]
            )
        ],
    )["s2"]
    assert by_token.finish_reason == "stop" and by_token.stop_reason == token
    assert by_token.token_ids == solo(request).token_ids[: by_token.token_ids.__len__()]
    assert token not in by_token.token_ids
    assert_idle(engine)


def test_eos_ends_a_request_unless_ignored_and_not_before_min_tokens() -> None:
    engine = make_engine()
    eos = engine.tokenizer.eos_token_id
    prompt = engine.tokenizer.encode(PROMPTS[2])
    engine.runner.script = lambda tokens: eos if len(tokens) >= len(prompt) + 2 else None
    ended = run(engine, [make_request(engine, "e", prompt, temperature=0.0, max_tokens=10)])["e"]
    assert ended.finish_reason == "stop" and len(ended.token_ids) == 2 and ended.usage.completion_tokens == 3
    late = run(engine, [make_request(engine, "m", prompt, temperature=0.0, max_tokens=10, min_tokens=5)])["m"]
    assert late.finish_reason == "stop" and len(late.token_ids) == 5
    ignored = run(engine, [make_request(engine, "i", prompt, temperature=0.0, max_tokens=6, ignore_eos=True)])["i"]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 6
    assert_idle(engine)


def test_a_deadline_ends_the_request_with_a_timeout_and_frees_its_row() -> None:
    clock = Clock()
    engine = make_engine(clock=clock)
    core = engine.core
    results: dict[str, Result] = {}
    core.apply(
        AddCommand(
            make_request(
                engine, "d", PROMPTS[0], deadline=clock.now + 5, temperature=0.0, max_tokens=100, ignore_eos=True
            )
        )
    )
    core.apply(AddCommand(make_request(engine, "free", PROMPTS[1], temperature=0.0, max_tokens=6, ignore_eos=True)))
    for _ in range(3):
        step(engine, results)
    assert results["d"].finish_reason is None
    clock.now += 5
    step(engine, results)
    assert results["d"].finish_reason == "error" and isinstance(results["d"].error, RequestTimeout)
    assert len(results["d"].token_ids) == 3
    while core.has_work():
        step(engine, results)
    assert results["free"].finish_reason == "length"
    assert_idle(engine)


def test_a_failing_step_fails_its_requests_and_the_engine_carries_on() -> None:
    engine = make_engine()

    def script(tokens: object) -> None:
        raise RuntimeError("the fake model failed")

    engine.runner.script = script
    failed = run(engine, [make_request(engine, "f", PROMPTS[0], max_tokens=4)])["f"]
    assert failed.finish_reason == "error" and "failed" in str(failed.error)
    engine.runner.script = None
    ok = run(engine, [make_request(engine, "ok", PROMPTS[0], temperature=0.0, max_tokens=4)])["ok"]
    assert ok.finish_reason == "length"
    assert_idle(engine)


MIXED = [
    dict(temperature=0.0),
    dict(temperature=0.8, seed=11),
    dict(temperature=1.2, top_k=5, seed=12),
    dict(temperature=0.7, top_p=0.9, seed=13),
    dict(temperature=1.0, min_p=0.05, seed=14),
    dict(temperature=0.9, repetition_penalty=1.3, seed=15),
    dict(temperature=0.6, presence_penalty=0.8, frequency_penalty=0.5, seed=16),
    dict(temperature=0.0, logprobs=2),
]


def test_a_request_gets_the_same_tokens_alone_and_in_a_mixed_batch() -> None:
    engine = make_engine(num_rows=24, max_num_seqs=24)
    requests = [
        make_request(
            engine,
            f"c{i}",
            PROMPTS[i % len(PROMPTS)] + f" {i}",
            max_tokens=6 + i % 5,
            ignore_eos=True,
            **MIXED[i % len(MIXED)],
        )
        for i in range(16)
    ]
    together = run(engine, requests)
    for request in requests:
        alone = solo(request)
        assert together[request.request_id].token_ids == alone.token_ids, request.params
        assert together[request.request_id].text == alone.text
        assert "".join(together[request.request_id].token_texts) == alone.text
    assert_idle(engine)
