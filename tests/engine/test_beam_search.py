"""Beam search in the engine over FakeRunner: the best beam, streaming, KV rows (no model)."""

from __future__ import annotations

import numpy as np

from rill.engine.request import AbortCommand, AddCommand
from rill.testing.fake_runner import FakeRunner
from tests.engine.fake_core import PROMPTS, Result, assert_idle, make_engine, make_request, run, step


def reference_beams(
    runner: FakeRunner, prompt: list[int], num_beams: int, num_tokens: int
) -> list[tuple[float, list[int]]]:
    """Plain beam search over the runner's logits, every beam run to ``num_tokens``; best first."""
    beams: list[tuple[float, list[int]]] = [(0.0, [])]
    for _ in range(num_tokens):
        candidates = []
        for score, tokens in beams:
            logits = runner.logits_after(prompt + tokens).astype(np.float64)
            logprobs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
            candidates += [(score + float(lp), tokens + [token]) for token, lp in enumerate(logprobs)]
        beams = sorted(candidates, key=lambda c: -c[0])[:num_beams]
    return beams


def test_the_result_is_the_best_of_num_beams_beams_and_beats_greedy() -> None:
    engine = make_engine()
    request = make_request(engine, "b", PROMPTS[2], num_beams=3, max_tokens=6, ignore_eos=True)
    result = run(engine, [request])["b"]
    ranked = reference_beams(engine.runner, request.prompt_ids, 3, 6)
    assert result.token_ids == ranked[0][1] and result.finish_reason == "length"
    greedy = run(engine, [make_request(engine, "g", PROMPTS[2], temperature=0.0, max_tokens=6, ignore_eos=True)])["g"]
    greedy_score = reference_beams(engine.runner, request.prompt_ids, 1, 6)[0]
    assert greedy.token_ids == greedy_score[1]
    assert ranked[0][0] >= greedy_score[0]
    assert_idle(engine)


def test_beams_stream_only_agreed_tokens_that_join_to_the_final_text() -> None:
    engine = make_engine()
    core = engine.core
    results: dict[str, Result] = {}
    core.apply(AddCommand(make_request(engine, "b", PROMPTS[0], num_beams=4, max_tokens=10, ignore_eos=True)))
    seen_during: list[list[int]] = []
    while core.has_work():
        for out in step(engine, results):
            if not out.finished:
                seen_during.append(list(results["b"].token_ids))
    final = results["b"]
    assert len(final.token_ids) == 10 and final.text == engine.tokenizer.decode(final.token_ids)
    assert all(final.token_ids[: len(prefix)] == prefix for prefix in seen_during)  # nothing streamed is taken back
    assert_idle(engine)


def test_beams_hold_num_beams_rows_and_give_them_back_on_finish_and_abort() -> None:
    engine = make_engine(num_rows=8)
    core = engine.core
    results: dict[str, Result] = {}
    core.apply(AddCommand(make_request(engine, "b", PROMPTS[1], num_beams=4, max_tokens=8, ignore_eos=True)))
    step(engine, results)
    step(engine, results)
    assert core.kv.num_live_rows == 4
    assert len({beam.row for beam in core.requests["b"].beam.beams}) == 4
    while core.has_work():
        step(engine, results)
    assert results["b"].finish_reason == "length"
    assert_idle(engine)
    core.apply(AddCommand(make_request(engine, "c", PROMPTS[1], num_beams=3, max_tokens=50, ignore_eos=True)))
    for _ in range(4):
        step(engine, results)
    assert core.kv.num_live_rows == 3
    core.apply(AbortCommand("c"))
    step(engine, results)
    assert results["c"].finish_reason == "cancelled"
    assert_idle(engine)


def test_a_hypothesis_ending_in_eos_ends_the_search_with_stop() -> None:
    engine = make_engine()
    request = make_request(engine, "b", PROMPTS[3], num_beams=2, max_tokens=20, early_stopping=True)
    eos = engine.tokenizer.eos_token_id
    num_prompt = len(request.prompt_ids)
    engine.runner.script = lambda tokens: eos if len(tokens) >= num_prompt + 3 else None
    result = run(engine, [request])["b"]
    assert result.finish_reason == "stop"
    assert len(result.token_ids) == 3 and eos not in result.token_ids
    assert result.usage.completion_tokens == 4  # the eos counts in usage
    assert_idle(engine)


def test_beam_requests_beside_sampled_ones_leave_those_unchanged() -> None:
    engine = make_engine()
    beam = make_request(engine, "beam", PROMPTS[0], num_beams=3, max_tokens=8, ignore_eos=True)
    plain = [
        make_request(engine, f"p{i}", PROMPTS[i], temperature=0.9, seed=i, max_tokens=8, ignore_eos=True)
        for i in range(3)
    ]
    together = run(engine, [beam, *plain])
    for request in plain:
        fresh = make_engine()
        alone = run(
            fresh,
            [
                make_request(
                    fresh,
                    request.request_id,
                    request.prompt_ids,
                    temperature=0.9,
                    seed=int(request.params.seed or 0),
                    max_tokens=8,
                    ignore_eos=True,
                )
            ],
        )
        assert together[request.request_id].token_ids == alone[request.request_id].token_ids
    assert together["beam"].token_ids == reference_beams(engine.runner, beam.prompt_ids, 3, 8)[0][1]
    assert_idle(engine)


def test_a_beam_group_drives_its_rows_through_the_kv_managers_api() -> None:
    import pytest
    import torch

    from rill.engine.beam import BeamGroup, BeamSearch
    from rill.engine.kv_cache import EmptyRow, KVManager

    kv = KVManager(num_rows=5, max_len=64, bytes_per_token=1)
    copies: list[tuple[int, int, int]] = []
    prompt = [3, 4, 5]
    prompt_row = kv.acquire(EmptyRow(), prompt).row
    group = BeamGroup(
        BeamSearch(3, 1.0, False, frozenset(), max_tokens=4), kv, lambda src, dst, n: copies.append((src, dst, n))
    )
    assert len(group.spare_rows) == 2 and kv.num_live_rows == 3 and not group.is_decoding
    group.start(prompt_row, prompt, num_computed=3)
    # Token 7 is best by far, then 8, then 9: three beams, two of them copies of the prompt's row.
    logits = torch.full((1, 10), -9.0)
    logits[0, 7], logits[0, 8], logits[0, 9] = 3.0, 2.0, 1.0
    result = group.step(logits, max_len=64)
    assert result.best is None and result.agreed == []  # the beams disagree on their first token
    assert [b.tokens for b in group.beams] == [[7], [8], [9]] and group.beams[0].row == prompt_row
    assert sorted(dst for _, dst, _ in copies) == sorted(group.rows()[1:]) and all(
        src == prompt_row for src, _, _ in copies
    )
    assert all(kv.is_live(row) for row in group.rows()) and kv.num_live_rows == 3
    assert [w.token_ids for w in group.work()] == [[7], [8], [9]]
    group.release()
    assert kv.num_live_rows == 0 and group.rows() == []
    with pytest.raises(ValueError):
        kv.assign(prompt_row, EmptyRow())  # a row nobody holds cannot change owner
