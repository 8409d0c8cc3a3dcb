"""The scheduler over FakeRunner: token budget, chunked prefill, priorities, preemption."""

from __future__ import annotations

from rill.engine.request import AddCommand
from rill.types import RequestEvent
from tests.engine.fake_core import PROMPTS, Result, assert_idle, make_engine, make_request, record_work, run, solo


def test_no_step_exceeds_the_token_budget_and_chunked_prompts_give_the_same_tokens() -> None:
    engine = make_engine(max_num_batched_tokens=24)
    steps = record_work(engine)
    requests = [
        make_request(engine, f"r{i}", PROMPTS[i], temperature=0.8, seed=i, max_tokens=6, ignore_eos=True)
        for i in range(4)
    ]
    results = run(engine, requests)
    assert max(sum(len(w.token_ids) for w in work) for work in steps) <= 24
    assert any(len(w.token_ids) > 1 and not w.need_logits for work in steps for w in work)  # some prompt was chunked
    # Every prompt token was fed once (no reuse among different prompts) plus one per output but the last.
    assert sum(len(w.token_ids) for work in steps for w in work) == sum(len(r.prompt_ids) + 5 for r in requests)
    for request in requests:
        assert results[request.request_id].token_ids == solo(request).token_ids
        assert results[request.request_id].finish_reason == "length"
    assert_idle(engine)


def test_running_streams_get_a_token_every_step_while_a_long_prompt_is_chunked() -> None:
    engine = make_engine(max_num_batched_tokens=512, max_len=512)
    engine.core.scheduler.prefill_chunk_tokens = 16
    engine.core._update_costs = lambda plan, elapsed_s: None  # type: ignore[method-assign]  # a fixed cap, not timed
    steps = record_work(engine)
    short = make_request(engine, "short", PROMPTS[4], temperature=0.0, max_tokens=40, ignore_eos=True)
    long = make_request(engine, "long", " ".join(PROMPTS[:4]), temperature=0.0, max_tokens=2, ignore_eos=True)
    counts: list[int] = []

    def on_step(num: int, results: dict[str, Result]) -> None:
        if num == 2:
            engine.core.apply(AddCommand(long))
        counts.append(len(results["short"].token_ids))

    results = run(engine, [short], on_step=on_step)
    short_row = steps[0][0].row
    chunks = [w for work in steps for w in work if w.row != short_row and len(w.token_ids) > 1]
    assert len(long.prompt_ids) > 150
    # The long prompt went in chunks of the cap, one per step, next to the short stream's decode...
    assert [len(w.token_ids) for w in chunks[:-1]] == [16] * (len(chunks) - 1) and len(chunks) >= 12
    assert all(len(work) == 2 for work in steps if any(w in work for w in chunks))
    # ...which got exactly one token every step meanwhile.
    assert counts[: len(chunks) + 2] == list(range(1, len(chunks) + 3))
    assert results["long"].token_ids == solo(long, max_len=512).token_ids
    assert results["short"].token_ids == solo(short, max_len=512).token_ids
    assert_idle(engine)


def test_admission_follows_priority_then_arrival() -> None:
    engine = make_engine(max_num_seqs=1)
    specs = [("a", 5), ("b", 0), ("c", 3), ("d", 0), ("e", 5)]
    requests = [
        make_request(engine, rid, PROMPTS[i], priority=p, temperature=0.0, max_tokens=2, ignore_eos=True)
        for i, (rid, p) in enumerate(specs)
    ]
    order: list[str] = []

    def on_step(num: int, results: dict[str, Result]) -> None:
        for rid, res in results.items():
            if RequestEvent.SCHEDULED in res.events and rid not in order:
                order.append(rid)

    run(engine, requests, on_step=on_step)
    assert order == ["b", "d", "c", "a", "e"]
    assert_idle(engine)


def test_never_more_running_than_max_num_seqs() -> None:
    engine = make_engine(max_num_seqs=3)
    steps = record_work(engine)
    requests = [
        make_request(engine, f"r{i}", PROMPTS[i], temperature=0.0, max_tokens=4, ignore_eos=True) for i in range(6)
    ]
    run(engine, requests)
    assert max(len(work) for work in steps) == 3
    assert_idle(engine)


def test_kv_pressure_preempts_the_least_urgent_and_it_resumes_with_the_same_tokens() -> None:
    engine = make_engine(num_rows=2, max_num_seqs=2)
    low = [
        make_request(engine, f"low{i}", PROMPTS[i], priority=5, temperature=0.9, seed=i, max_tokens=20, ignore_eos=True)
        for i in range(2)
    ]
    urgent = make_request(engine, "urgent", PROMPTS[3], priority=0, temperature=0.0, max_tokens=5, ignore_eos=True)
    finished: list[str] = []

    def on_step(num: int, results: dict[str, Result]) -> None:
        if num == 4:
            engine.core.apply(AddCommand(urgent))
        finished.extend(rid for rid, res in results.items() if res.finish_reason and rid not in finished)

    results = run(engine, low, on_step=on_step)
    assert finished[0] == "urgent"
    preempted = [r for r in low if RequestEvent.PREEMPTED in results[r.request_id].events]
    assert [r.request_id for r in preempted] == ["low1"]  # the later of two equally urgent ones
    assert engine.core.stats().num_preemptions_total == 1
    for request in low:  # recomputed from scratch, the preempted stream carries on as if nothing happened
        assert results[request.request_id].token_ids == solo(request).token_ids
        assert len(results[request.request_id].token_ids) == 20
    assert_idle(engine)


def test_an_equally_urgent_request_waits_instead_of_preempting() -> None:
    engine = make_engine(num_rows=1, max_num_seqs=1)
    first = make_request(engine, "first", PROMPTS[0], temperature=0.0, max_tokens=6, ignore_eos=True)
    second = make_request(engine, "second", PROMPTS[1], temperature=0.0, max_tokens=6, ignore_eos=True)
    results = run(engine, [first, second])
    assert engine.core.stats().num_preemptions_total == 0
    assert RequestEvent.PREEMPTED not in results["first"].events
    assert results["first"].finish_reason == results["second"].finish_reason == "length"
    assert_idle(engine)
