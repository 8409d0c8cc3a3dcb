"""A request that raises inside the engine fails alone; the others of its step are untouched.

Issue 12 item 1: a beam request with ``length_penalty`` -1000 overflowed in the beam score and
the engine failed every request of that step. These tests drive ``EngineCore`` directly (so
the parameters are not validated first, as a bug would reach it) and check, for each stage
that works on one request (sampling, beam scoring, detokenizing, commands), that the bad
request ends with ``GenerationError``, that every other request gives exactly the tokens of
its run alone, and that no KV row is left behind.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rill.config import EngineConfig
from rill.engine.builder import Engine, build_engine
from rill.engine.request import AddCommand, ModifyCommand
from rill.errors import GenerationError
from rill.testing.faults import fail_sampling
from rill.types import SamplingParams
from tests.engine.test_core import MIXED, PROMPTS, Result, assert_idle, make_request, run

BAD_SEED = 424242  # marks the request whose sampling the injected fault breaks


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    """A float32 engine on the tiny model."""
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


def good_specs(n: int = 8, max_tokens: int = 24) -> list[tuple[str, str, dict]]:
    """``n`` requests of mixed sampling settings (greedy, seeded, penalties, logprobs) that run long."""
    specs = []
    for i in range(n):
        params = dict(MIXED[i % len(MIXED)], max_tokens=max_tokens, ignore_eos=True)
        if i % 3 == 0:
            params["logprobs"] = 2
        specs.append((f"good{i}", PROMPTS[i % len(PROMPTS)], params))
    return specs


def solo_runs(engine: Engine, specs: list[tuple[str, str, dict]]) -> dict[str, Result]:
    """Each request run alone: the reference the batched runs must equal."""
    return {rid: run(engine, [make_request(engine, rid, prompt, **params)])[rid] for rid, prompt, params in specs}


def assert_unharmed(together: dict[str, Result], solo: dict[str, Result], specs: list[tuple[str, str, dict]]) -> None:
    """Every good request finished normally with the tokens of its solo run."""
    for rid, _, params in specs:
        assert together[rid].error is None, (rid, together[rid].error)
        assert together[rid].finish_reason == "length", rid
        assert together[rid].token_ids == solo[rid].token_ids, rid
        assert len(together[rid].token_ids) == params["max_tokens"]
        assert together[rid].text == solo[rid].text


def assert_rows_consistent(engine: Engine) -> None:
    """No row is both free and cached, and none is listed free twice (a double free)."""
    kv = engine.core.kv
    assert len(set(kv.free_rows)) == len(kv.free_rows)
    assert not set(kv.free_rows) & set(kv.cached)
    assert len(kv.free_rows) + len(kv.cached) == kv.num_rows


@pytest.mark.parametrize("length_penalty", [-1000.0, 1000.0, float("inf")])
def test_beam_with_an_extreme_length_penalty_never_harms_the_other_requests(
    engine: Engine, length_penalty: float
) -> None:
    specs = good_specs()
    solo = solo_runs(engine, specs)
    bad = make_request(engine, "beam", PROMPTS[1], num_beams=4, max_tokens=16, length_penalty=length_penalty)
    together = run(engine, [make_request(engine, rid, prompt, **params) for rid, prompt, params in specs] + [bad])
    assert_unharmed(together, solo, specs)
    result = together["beam"]
    if result.finish_reason == "error":  # it may fail, but alone and with the typed error
        assert isinstance(result.error, GenerationError)
        assert "beam search" in str(result.error)
    assert_idle(engine)
    assert_rows_consistent(engine)


def test_minus_1000_length_penalty_is_the_reported_failure(engine: Engine) -> None:
    # The audit's exact case: it raised (OverflowError) and took the whole step down.
    specs = good_specs(n=3, max_tokens=40)
    bad = make_request(engine, "beam", PROMPTS[0], num_beams=4, max_tokens=30, length_penalty=-1000.0)
    together = run(engine, [make_request(engine, rid, prompt, **params) for rid, prompt, params in specs] + [bad])
    assert isinstance(together["beam"].error, GenerationError)
    assert all(together[rid].finish_reason == "length" for rid, _, _ in specs)
    assert_idle(engine)
    assert_rows_consistent(engine)


def test_valid_length_penalties_score_without_overflow(engine: Engine) -> None:
    # The bounds of SamplingParams.validate, on a long beam: both finish normally.
    for i, lp in enumerate((-10.0, 10.0)):
        params = SamplingParams(num_beams=4, max_tokens=40, length_penalty=lp).validate()
        request = make_request(
            engine, f"lp{i}", PROMPTS[2], **{f: getattr(params, f) for f in params.__struct_fields__}
        )
        result = run(engine, [request])[f"lp{i}"]
        assert result.error is None and result.finish_reason in ("length", "stop"), result
    assert_idle(engine)


def test_a_request_raising_inside_sampling_fails_alone(engine: Engine) -> None:
    specs = good_specs()
    solo = solo_runs(engine, specs)
    bad = make_request(engine, "bad", PROMPTS[4], temperature=0.9, seed=BAD_SEED, max_tokens=24, ignore_eos=True)
    with fail_sampling(engine.core.sampler, lambda p: p.seed == BAD_SEED):
        together = run(engine, [make_request(engine, rid, prompt, **params) for rid, prompt, params in specs] + [bad])
    assert_unharmed(together, solo, specs)
    assert together["bad"].finish_reason == "error"
    assert isinstance(together["bad"].error, GenerationError)
    assert "sampling" in str(together["bad"].error)
    assert "injected" not in str(together["bad"].error)  # the client never sees exception text
    assert together["bad"].token_ids == []
    assert_idle(engine)
    assert_rows_consistent(engine)


def test_a_request_whose_sampling_fails_mid_stream_stops_there(engine: Engine) -> None:
    # Fault from the 5th step on: the bad request keeps its first tokens, then fails alone.
    specs = good_specs(n=4)
    solo = solo_runs(engine, specs)
    core = engine.core
    bad = make_request(engine, "bad", PROMPTS[2], temperature=0.0, seed=BAD_SEED, max_tokens=24, ignore_eos=True)
    requests = [make_request(engine, rid, prompt, **params) for rid, prompt, params in specs] + [bad]
    armed = {"on": False}
    with fail_sampling(core.sampler, lambda p: armed["on"] and p.seed == BAD_SEED):
        together = run(engine, requests, on_step=lambda step, results: armed.update(on=step >= 4))
    assert_unharmed(together, solo, specs)
    assert isinstance(together["bad"].error, GenerationError)
    assert 0 < len(together["bad"].token_ids) < 24
    assert_idle(engine)


class ExplodingDetokenizer:
    """Stands in for a request's detokenizer whose decode raises (a tokenizer bug on one id)."""

    def push(self, token_id: int) -> str:
        """Raise as a broken decode would."""
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "test: invalid start byte")

    def flush(self) -> str:
        """Raise as a broken decode would."""
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "test: invalid start byte")

    def reset(self, prompt_ids: list[int]) -> None:
        """Nothing to reset."""

    @property
    def has_held_text(self) -> bool:
        """Nothing is ever held."""
        return False


def test_a_request_raising_while_detokenizing_fails_alone(engine: Engine) -> None:
    specs = good_specs()
    solo = solo_runs(engine, specs)
    core = engine.core
    bad = make_request(engine, "bad", PROMPTS[3], temperature=0.0, max_tokens=24, ignore_eos=True)
    core.apply(AddCommand(bad))
    bad.output.detokenizer = ExplodingDetokenizer()
    together = run(engine, [make_request(engine, rid, prompt, **params) for rid, prompt, params in specs])
    assert_unharmed(together, solo, specs)
    assert isinstance(together["bad"].error, GenerationError)
    assert_idle(engine)


def test_a_command_that_raises_fails_only_its_request(engine: Engine) -> None:
    # A modify whose parameters the sampler cannot apply (not validated: a str token id).
    specs = good_specs(n=4)
    solo = solo_runs(engine, specs)
    core = engine.core
    bad = make_request(engine, "bad", PROMPTS[0], temperature=0.8, seed=3, max_tokens=24, ignore_eos=True)
    sent = {"done": False}

    def modify_once(step: int, results: dict[str, Result]) -> None:
        if step == 3 and not sent["done"]:
            sent["done"] = True
            core.apply(ModifyCommand("bad", SamplingParams(temperature=0.5, logit_bias={"x": 1.0}, max_tokens=24)))  # type: ignore[dict-item]

    together = run(
        engine,
        [make_request(engine, rid, prompt, **params) for rid, prompt, params in specs] + [bad],
        on_step=modify_once,
    )
    assert sent["done"]
    assert_unharmed(together, solo, specs)
    assert isinstance(together["bad"].error, GenerationError)
    assert_idle(engine)


def test_the_sampler_redoes_a_failing_batch_row_by_row_with_the_same_draws() -> None:
    # Two samplers in the same state; the second has one row that raises. Every other row
    # (greedy, seeded, penalised, filtered, with logprobs) gets the same token and logprobs.
    import numpy as np
    import torch

    from rill.engine.sampler import Sampler

    vocab, steps = 300, 6
    settings = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, seed=1, logprobs=3),
        SamplingParams(temperature=1.1, top_k=20, seed=2),
        SamplingParams(temperature=0.7, top_p=0.8, min_p=0.02, seed=3),
        SamplingParams(temperature=0.9, repetition_penalty=1.4, presence_penalty=0.5, seed=4, logit_bias={5: 3.0}),
        SamplingParams(temperature=0.9, seed=BAD_SEED),
    ]
    clean, faulty = Sampler(vocab, 8), Sampler(vocab, 8)
    for sampler in (clean, faulty):
        for key, params in enumerate(settings):
            sampler.add(key, params, [1, 2, 3], {0})
    gen = torch.Generator().manual_seed(0)
    keys = list(range(len(settings)))
    with fail_sampling(faulty, lambda p: p.seed == BAD_SEED):
        for _ in range(steps):
            logits = torch.randn(len(keys), vocab, generator=gen) * 3
            want = clean.sample(logits, keys)
            got = faulty.sample(logits, keys)
            assert set(got.errors) == {len(settings) - 1}
            assert got.token_ids[:-1] == want.token_ids[:-1]
            assert got.logprobs[:-1] == want.logprobs[:-1]
            assert got.token_ids[-1] == -1 and got.logprobs[-1] is None
    # The penalty counts (what the outputs so far change in later steps) match for the clean
    # rows; the failed row counted nothing.
    np.testing.assert_array_equal(faulty._counts[keys[:-1]], clean._counts[keys[:-1]])
    assert not faulty._counts[keys[-1]].any()
    assert "_sample_rows" not in vars(faulty)  # the hook is gone after the block
