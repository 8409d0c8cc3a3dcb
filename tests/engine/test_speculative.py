"""Speculative decoding (prompt lookup) in the engine: exact output, live controls, KV rollback.

Most tests run the real ``EngineCore`` over ``FakeRunner`` twice, with speculation and without,
and compare. The fake model is made to copy its own context most of the time (``copy_script``),
as a model quoting code does, so drafts are both accepted and rejected; every test that claims
"the same with speculation" also checks that drafts were accepted, so it cannot pass by never
speculating. The last tests run a tiny quantized checkpoint through the real runner.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rill.config import EngineConfig
from rill.engine.batch import RowWork
from rill.engine.builder import Engine, assemble_engine, build_engine
from rill.engine.request import (
    AbortCommand,
    AddCommand,
    ModifyCommand,
    PauseCommand,
    RegenerateCommand,
    Request,
    ResumeCommand,
)
from rill.engine.speculative import SpeculativeConfig, Speculator, Track, step_cost
from rill.errors import ConfigError
from rill.testing.fake_runner import FakeRunner, fake_tokenizer, history_hash
from rill.types import ResponseFormat, SamplingParams
from tests.engine.fake_core import Result, assert_idle, make_request, run, step

PROMPTS = [
    "the cat sat on the mat and the cat sat on the hat",
    "one two three four one two three four one two",
    "abcabcabcabc",
    "a big dog ran to the park and the big dog ran home",
]


def copy_script(period: int = 7, free_every: int = 4):
    """Force the token ``period`` positions back, except at one history in ``free_every``
    (chosen by a hash of the history), where the fake model's own random logits decide: long
    runs that prompt lookup predicts, broken by tokens it cannot."""

    def script(tokens):
        if len(tokens) < period or history_hash(tokens) % free_every == 0:
            return None
        return tokens[-period]

    return script


def make_engine(
    speculative: str = "ngram",
    k: int = 4,
    max_batch: int = 4,
    num_rows: int = 16,
    max_len: int = 256,
    runner: FakeRunner | None = None,
    script: Any = "copy",
    adaptive: bool = True,
) -> Engine:
    """An engine over a fresh ``FakeRunner`` (its context-copying script unless told otherwise).

    ``adaptive=False``: every request drafts as many tokens as it may, whatever the batch (the
    adaptive policy, tuned to a real model's costs, drafts little in batches).
    """
    config = EngineConfig(
        model="fake",
        max_num_seqs=16,
        max_num_batched_tokens=512,
        speculative=speculative,
        num_speculative_tokens=k,
        speculative_max_batch=max_batch,
    )
    runner = runner or FakeRunner(num_rows=num_rows, max_len=max_len)
    runner.script = copy_script() if script == "copy" else script
    engine = assemble_engine(
        config, runner, fake_tokenizer(), name="fake", architecture="FakeForCausalLM", warm_grammars=False
    )
    if not adaptive:
        force_drafts(engine)
    return engine


def force_drafts(engine: Engine) -> None:
    """Turn the adaptive draft length off: every speculating request drafts its limit."""
    speculator = engine.core.speculator
    speculator.config = dataclasses.replace(speculator.config, adaptive=False)


def accepted(engine: Engine) -> int:
    """Draft tokens accepted so far."""
    return engine.core.stats().spec_accepted_tokens_total


def both(prompt: str, **params: Any) -> tuple[Result, Result, Engine]:
    """The request run without speculation and with it (fresh engines); and the speculating engine."""
    plain, spec = make_engine("off"), make_engine()
    a = run(plain, [make_request(plain, "r", prompt, **params)])["r"]
    b = run(spec, [make_request(spec, "r", prompt, **params)])["r"]
    assert_idle(plain)
    assert_idle(spec)
    return a, b, spec


# -- the policy --------------------------------------------------------------------------------


def test_the_draft_length_grows_with_the_acceptance_rate() -> None:
    speculator = Speculator(SpeculativeConfig(method="ngram", num_tokens=8))
    lengths = [speculator.allocate([Track(trials=100.0, accepted=10.0 * r)], [8], 1)[0] for r in range(11)]
    assert lengths[0] == 0  # nothing is ever accepted: do not pay for drafts
    assert lengths == sorted(lengths)
    assert lengths[-1] == 8  # everything is accepted: the longest draft
    assert all(step_cost(k + 1) > step_cost(k) for k in range(20))


def test_drafts_are_handed_out_while_they_pay() -> None:
    speculator = Speculator(SpeculativeConfig(method="ngram", num_tokens=8))

    def states(*rates: float):
        return [Track(trials=100.0, accepted=100.0 * rate) for rate in rates]

    assert speculator.allocate(states(0.9), [8], 1)[0] >= 4  # alone and likely: a long draft
    assert speculator.allocate(states(0.05), [8], 1) == [0]  # alone and unlikely: none
    assert speculator.allocate(states(0.9), [2], 1) == [2]  # never past the request's limit
    assert speculator.allocate(states(*[0.5] * 8), [4] * 8, 8) == [0] * 8  # a big batch: not at 50 %
    big = speculator.allocate(states(*[0.95] * 4, *[0.3] * 4), [4] * 8, 8)
    assert sum(big[:4]) > 0 and big[4:] == [0] * 4  # ... only drafts that are nearly sure
    assert sum(speculator.allocate(states(*[0.7] * 2), [4, 4], 2)) > 0


def test_bad_speculation_settings_are_refused() -> None:
    for bad in (
        dict(method="eagle"),
        dict(method="ngram", num_tokens=0),
        dict(method="ngram", num_tokens=17),
        dict(method="ngram", max_batch=0),
        dict(method="ngram", min_n=3, max_n=2),
    ):
        with pytest.raises(ValueError):
            SpeculativeConfig(**bad)
    with pytest.raises(ConfigError):
        make_engine(k=0)


def test_a_request_may_opt_out_or_cap_its_draft() -> None:
    p = SamplingParams()
    assert p.speculative_tokens(4) == 4
    assert SamplingParams(speculative=False).speculative_tokens(4) == 0
    assert SamplingParams(speculative=2).speculative_tokens(4) == 2
    assert SamplingParams(speculative=9).speculative_tokens(4) == 4
    for bad in ("yes", -1, 17, 2.5):
        with pytest.raises(Exception, match="speculative"):
            SamplingParams(speculative=bad).validate()


# -- exact output -------------------------------------------------------------------------------

PARAMS = [
    dict(temperature=0.0),
    dict(temperature=0.0, logprobs=3),
    dict(temperature=0.0, repetition_penalty=1.3),
    dict(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4),
    dict(temperature=0.0, logit_bias={ord("e") + 3: 2.0}),
    dict(temperature=0.0, stop=["the mat", "four one"]),
    dict(temperature=0.0, max_tokens=7),
    dict(temperature=0.0, min_tokens=30, max_tokens=40),
    dict(temperature=0.8, seed=7),
    dict(temperature=1.0, top_k=5, top_p=0.9, seed=8),
    dict(temperature=0.7, min_p=0.1, repetition_penalty=1.1, seed=9, logprobs=2),
]


@pytest.mark.parametrize("params", PARAMS, ids=[str(p) for p in PARAMS])
def test_output_is_the_same_with_and_without_speculation(params: dict) -> None:
    """Greedy: token for token; seeded sampling: the same text (each position's draw is the one a
    plain step makes). Logprobs, stop strings, penalties, biases, max_tokens, min_tokens hold."""
    params = {"max_tokens": 60, **params}
    total = 0
    for prompt in PROMPTS:
        a, b, spec = both(prompt, **params)
        assert b.token_ids == a.token_ids, prompt
        assert b.text == a.text
        assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason)
        assert b.usage == a.usage
        assert [(lp.token_id, lp.logprob, lp.top) for lp in b.logprobs] == [
            (lp.token_id, lp.logprob, lp.top) for lp in a.logprobs
        ]
        total += accepted(spec)
    assert total > 0, "no draft was ever accepted: the comparison proves nothing"


def test_stop_token_ids_and_allowed_token_ids_hold_on_accepted_tokens() -> None:
    tok = fake_tokenizer()
    letters = [tok.encode(c)[-1] for c in "the cat sa"]  # [-1]: after the BOS
    for params in (dict(stop_token_ids=[tok.encode("h")[-1]]), dict(allowed_token_ids=sorted(set(letters)))):
        total = 0
        for prompt in PROMPTS:
            a, b, spec = both(prompt, temperature=0.0, max_tokens=50, **params)
            assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason
            if "allowed_token_ids" in params:
                assert set(b.token_ids) <= set(params["allowed_token_ids"])
            total += accepted(spec)
        assert total > 0


def test_a_grammar_holds_on_accepted_tokens() -> None:
    fmt = ResponseFormat(type="regex", regex="(the cat )+(sat|ran)")
    results = []
    for speculative in ("off", "ngram"):
        engine = make_engine(speculative)
        engine.grammars.warm()
        request = make_request(engine, "g", "the cat the cat the cat", temperature=0.0, max_tokens=60)
        request.matcher = engine.grammars.matcher(fmt)
        results.append((run(engine, [request])["g"], engine))
    (a, _), (b, spec) = results
    assert b.text == a.text and b.finish_reason == a.finish_reason == "stop"
    assert b.text.endswith(("sat", "ran")) and b.text.startswith("the cat ")
    assert accepted(spec) > 0


def test_a_batch_of_speculating_requests_each_equals_its_plain_run() -> None:
    spec, plain = make_engine(adaptive=False), make_engine("off")
    specs = [
        (f"r{i}", PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), dict(PARAMS[i % len(PARAMS)], max_tokens=40))
        for i in range(4)
    ]
    together = run(spec, [make_request(spec, rid, p, **kw) for rid, p, kw in specs])
    alone = run(plain, [make_request(plain, rid, p, **kw) for rid, p, kw in specs])
    for rid, _, _ in specs:
        assert together[rid].token_ids == alone[rid].token_ids
    assert accepted(spec) > 0
    assert_idle(spec)


def test_a_batch_larger_than_max_batch_does_not_speculate() -> None:
    spec = make_engine(max_batch=2, adaptive=False)
    requests = [
        make_request(
            spec, f"r{i}", PROMPTS[i % 4] + f" {i}", temperature=0.0, max_tokens=10 if i < 3 else 50, ignore_eos=True
        )
        for i in range(5)
    ]
    drafted = []

    def on_step(_: int, __: dict) -> None:
        drafted.append((spec.core.scheduler.num_running, spec.core.stats().spec_draft_tokens_total))

    run(spec, requests, on_step=on_step)
    # While more than two requests decode, no draft is verified.
    for (running, before), (_, after) in zip(drafted, drafted[1:]):
        if running > 2:
            assert after == before
    assert drafted[-1][1] > 0  # the last two, alone, speculated
    assert_idle(spec)


def test_a_draft_never_runs_past_the_context() -> None:
    plain, spec = make_engine("off", max_len=48), make_engine(max_len=48)
    prompt = "abcdabcdab"
    a = run(plain, [make_request(plain, "r", prompt, temperature=0.0, max_tokens=200, ignore_eos=True)])["r"]
    b = run(spec, [make_request(spec, "r", prompt, temperature=0.0, max_tokens=200, ignore_eos=True)])["r"]
    assert b.token_ids == a.token_ids and b.finish_reason == a.finish_reason == "length"
    assert len(fake_tokenizer().encode(prompt)) + len(b.token_ids) == 48
    assert accepted(spec) > 0


# -- the distribution ------------------------------------------------------------------------------


class ConstantRunner(FakeRunner):
    """Every position's distribution is the same: ``WEIGHTS`` over four letters."""

    WEIGHTS = (0.4, 0.3, 0.2, 0.1)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.letters = [fake_tokenizer().encode(c)[-1] for c in "abcd"]  # [-1]: after the BOS
        self._constant = np.full(self.vocab_size, -1e4, dtype=np.float32)
        self._constant[self.letters] = np.log(np.array(self.WEIGHTS, dtype=np.float32))

    def logits_after(self, tokens, digest=None) -> np.ndarray:
        return self._constant.copy()


def test_sampled_tokens_follow_the_model_distribution_under_speculation() -> None:
    """Chi-square over 400 seeded requests of eight tokens each: single tokens and consecutive
    pairs (where an accepted draft would show as a bias towards repeating the context) match
    the model's distribution. The prompt repeats "ab" so prompt lookup always drafts."""
    runner = ConstantRunner(num_rows=16, max_len=64)
    engine = make_engine(runner=runner, script=None)
    letters, weights = runner.letters, ConstantRunner.WEIGHTS
    singles, pairs = Counter(), Counter()
    for seed in range(400):
        r = run(
            engine, [make_request(engine, "s", "abababab", temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)]
        )["s"]
        ids = [letters.index(t) for t in r.token_ids]
        singles.update(ids)
        pairs.update(zip(ids, ids[1:]))
    assert accepted(engine) > 300, "drafts were hardly accepted: the test would not see a biased verifier"

    def chi2(counts: Counter, expected: dict) -> float:
        n = sum(counts.values())
        return sum((counts.get(cell, 0) - n * p) ** 2 / (n * p) for cell, p in expected.items())

    # Critical values at p = 0.001: 16.27 for 3 degrees of freedom, 37.70 for 15.
    assert chi2(singles, dict(enumerate(weights))) < 16.27
    assert chi2(pairs, {(i, j): weights[i] * weights[j] for i in range(4) for j in range(4)}) < 37.70
    assert_idle(engine)


def test_a_verifier_that_accepts_every_draft_would_fail_the_chi_square() -> None:
    """The statistic above can fail: the same counts from sequences that always follow the
    "ab" pattern (what a verifier that trusts its drafts emits) are far out."""
    pairs = Counter({(0, 1): 1400, (1, 0): 1400})
    weights = ConstantRunner.WEIGHTS
    n = sum(pairs.values())
    stat = sum(
        (pairs.get((i, j), 0) - n * weights[i] * weights[j]) ** 2 / (n * weights[i] * weights[j])
        for i in range(4)
        for j in range(4)
    )
    assert stat > 37.70


# -- live control and KV ------------------------------------------------------------------------


def test_each_step_rolls_rejected_drafts_back() -> None:
    """After every step each running request holds KV for exactly its tokens but the last
    (rejected draft positions are not counted), and the engine ends idle."""
    engine = make_engine(adaptive=False)
    requests = [
        make_request(engine, f"r{i}", p, temperature=0.0, max_tokens=50, ignore_eos=True)
        for i, p in enumerate(PROMPTS[:3])
    ]

    def on_step(_: int, __: dict) -> None:
        live = [r for r in engine.core.scheduler.running if r.is_prefill_reported]
        for r in live:
            assert r.num_computed == r.num_tokens - 1
        assert engine.core.stats().kv_used_tokens == sum(r.num_computed for r in engine.core.scheduler.running)

    run(engine, requests, on_step=on_step)
    assert accepted(engine) > 0
    assert engine.core.stats().spec_draft_tokens_total > accepted(engine)  # some were rejected
    assert_idle(engine)


def steps_until(engine: Engine, results: dict, request_id: str, num_tokens: int) -> None:
    """Step until ``request_id`` has at least ``num_tokens`` tokens."""
    for _ in range(500):
        if len(results[request_id].token_ids) >= num_tokens:
            return
        step(engine, results)
    raise AssertionError("the request did not get there")


def test_pause_resume_regenerate_and_abort_mid_speculation() -> None:
    prompt = PROMPTS[1]
    reference = run(
        make_engine("off"),
        [make_request(make_engine("off"), "r", prompt, temperature=0.0, max_tokens=60, ignore_eos=True)],
    )["r"]
    engine = make_engine()
    results = {"r": Result()}
    engine.core.apply(AddCommand(make_request(engine, "r", prompt, temperature=0.0, max_tokens=60, ignore_eos=True)))
    steps_until(engine, results, "r", 10)
    assert accepted(engine) > 0
    engine.core.apply(PauseCommand("r"))
    held = len(results["r"].token_ids)
    for _ in range(3):
        step(engine, results)
    assert len(results["r"].token_ids) == held  # paused: nothing, drafts included
    engine.core.apply(ResumeCommand("r"))
    steps_until(engine, results, "r", 25)
    engine.core.apply(RegenerateCommand("r"))
    results["r"] = Result()  # what the client sees from the regenerate on
    while engine.core.has_work():
        step(engine, results)
    assert results["r"].token_ids == reference.token_ids
    assert_idle(engine)
    # Abort in the middle of a speculating stream frees its row at once.
    results = {"a": Result()}
    engine.core.apply(AddCommand(make_request(engine, "a", prompt, temperature=0.0, max_tokens=60, ignore_eos=True)))
    steps_until(engine, results, "a", 12)
    engine.core.apply(AbortCommand("a"))
    step(engine, results)
    assert results["a"].finish_reason == "cancelled"
    assert_idle(engine)


def test_modify_applies_from_the_next_verified_token() -> None:
    """Sampling at first, then greedy: the tokens after the modify are the greedy continuation of
    what was generated before it; a modify to speculative false stops the drafts."""
    prompt = PROMPTS[0]
    engine = make_engine()
    results = {"m": Result()}
    request = make_request(engine, "m", prompt, temperature=1.0, seed=3, max_tokens=60, ignore_eos=True)
    engine.core.apply(AddCommand(request))
    steps_until(engine, results, "m", 15)
    prefix = list(results["m"].token_ids)
    greedy = request.params.updated({"temperature": 0.0})
    engine.core.apply(ModifyCommand("m", greedy))
    steps_until(engine, results, "m", 40)
    drafted = engine.core.stats().spec_draft_tokens_total
    engine.core.apply(ModifyCommand("m", greedy.updated({"speculative": False})))
    while engine.core.has_work():
        step(engine, results)
    assert engine.core.stats().spec_draft_tokens_total == drafted
    plain = make_engine("off")
    ids = fake_tokenizer().encode(prompt) + prefix
    rest = run(plain, [make_request(plain, "c", ids, temperature=0.0, max_tokens=60 - len(prefix), ignore_eos=True)])[
        "c"
    ]
    assert results["m"].token_ids[len(prefix) :] == rest.token_ids
    assert_idle(engine)


def test_beam_search_and_opted_out_requests_never_speculate() -> None:
    engine = make_engine()
    run(
        engine,
        [
            make_request(engine, "b", PROMPTS[1], num_beams=3, max_tokens=20),
            make_request(engine, "o", PROMPTS[1], temperature=0.0, max_tokens=40, speculative=False),
        ],
    )
    assert engine.core.stats().spec_draft_tokens_total == 0
    assert_idle(engine)


# -- a real model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quant_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with head size 32: with int8 weights its decode rows (and drafts) go through
    the decode-attention kernel."""
    from rill.testing.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("spec") / "llama-hd32", arch="llama", head_dim=32)


def _kernel_available() -> bool:
    from rill.models import qkernel

    return qkernel._load() is not None


@pytest.mark.skipif(not _kernel_available(), reason="the quantized kernels are not built on this CPU")
def test_a_draft_chunk_computes_what_decoding_it_token_by_token_computes(quant_model_dir: Path) -> None:
    engine = build_engine(
        EngineConfig(
            model=str(quant_model_dir),
            dtype="bfloat16",
            weights="int8",
            kv_cache_memory="16MiB",
            max_model_len=128,
            max_num_seqs=4,
        )
    )
    runner = engine.runner
    prompt = list(range(5, 40))
    runner.forward([RowWork(0, prompt, 0), RowWork(1, prompt, 0)])
    draft = runner.forward([RowWork(0, [7, 8, 9, 10], len(prompt), all_logits=True, draft=True)])
    one_by_one = torch.cat([runner.forward([RowWork(1, [t], len(prompt) + i)]) for i, t in enumerate([7, 8, 9, 10])])
    assert torch.equal(draft, one_by_one)


@pytest.mark.skipif(not _kernel_available(), reason="the quantized kernels are not built on this CPU")
def test_a_quantized_model_answers_the_same_with_and_without_speculation(quant_model_dir: Path) -> None:
    outputs = {}
    for speculative in ("off", "ngram"):
        engine = build_engine(
            EngineConfig(
                model=str(quant_model_dir),
                dtype="bfloat16",
                weights="int8",
                kv_cache_memory="16MiB",
                max_model_len=256,
                max_num_seqs=4,
                speculative=speculative,
            )
        )
        if engine.core.speculator is not None:
            force_drafts(engine)  # four requests decode together: the adaptive policy would hardly draft
        tok = engine.tokenizer
        requests = [
            Request(
                request_id=f"q{i}",
                prompt_ids=tok.encode(p),
                params=SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                eos_token_ids=engine.eos_token_ids,
                arrival_time=time.monotonic(),
                seq_no=0,
            )
            for i, p in enumerate(PROMPTS)
        ]
        outputs[speculative] = (run(engine, requests), engine.core.stats())
        assert_idle(engine)
    (plain, _), (spec, stats) = outputs["off"], outputs["ngram"]
    for rid in plain:
        assert spec[rid].token_ids == plain[rid].token_ids
    assert stats.spec_accepted_tokens_total > 0
    assert not math.isnan(stats.step_ms_ewma)


# -- a draft model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_pair(tmp_path_factory: pytest.TempPathFactory, quant_model_dir: Path) -> tuple[Path, Path]:
    """The tiny target and a one-layer draft with the same tokenizer (random: it rarely agrees)."""
    from rill.testing.checkpoints import make_checkpoint

    return quant_model_dir, make_checkpoint(
        tmp_path_factory.mktemp("spec") / "draft", arch="llama", head_dim=32, num_layers=1, seed=5
    )


def _answers(
    model: Path, draft: Path | None, weights: str = "int8", draft_weights: str = "same"
) -> tuple[dict[str, Result], Any]:
    # Dense drafts are verified through the prefill path, whose rounding differs from a decode
    # step's in the last bits: in bfloat16 that flips a near-tie now and then, in float32 not here.
    dtype = "bfloat16" if weights == "int8" else "float32"
    engine = build_engine(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            weights=weights,
            kv_cache_memory="16MiB",
            max_model_len=256,
            max_num_seqs=4,
            speculative_max_batch=4,
            draft_model=str(draft) if draft else None,
            draft_weights=draft_weights,
        )
    )
    if engine.core.speculator is not None:
        force_drafts(engine)
    tok = engine.tokenizer
    params = [dict(temperature=0.0), dict(temperature=0.9, seed=4), dict(temperature=0.0, repetition_penalty=1.2)]
    requests = [
        Request(
            request_id=f"d{i}",
            prompt_ids=tok.encode(p),
            params=SamplingParams(max_tokens=48, ignore_eos=True, **params[i % 3]),
            eos_token_ids=engine.eos_token_ids,
            arrival_time=time.monotonic(),
            seq_no=0,
        )
        for i, p in enumerate(PROMPTS)
    ]
    results = run(engine, requests)
    assert_idle(engine)
    return results, engine.core.stats()


@pytest.mark.parametrize("weights", ["int8", "dense"])
def test_a_draft_model_leaves_the_output_unchanged(draft_pair: tuple[Path, Path], weights: str) -> None:
    """With a draft that disagrees (a random one-layer model) and one that agrees (the target
    itself), every answer is the one decoding without a draft gives (with int8 weights drafts
    are verified through the decode kernel, bit for bit; dense, through the prefill path, in
    float32)."""
    target, random_draft = draft_pair
    plain, _ = _answers(target, None, weights)
    rates = []
    for draft in (random_draft, target):
        spec, stats = _answers(target, draft, weights)
        for rid in plain:
            assert spec[rid].token_ids == plain[rid].token_ids, (draft, rid)
        assert stats.spec_draft_tokens_total > 0
        rates.append(stats.spec_accepted_tokens_total / stats.spec_draft_tokens_total)
    assert rates[1] > 0.25 and rates[1] > 2 * rates[0]  # the target agrees with itself far more often


def test_the_draft_model_is_held_in_int4_on_the_cpu_by_default(draft_pair: tuple[Path, Path]) -> None:
    """``--draft-weights auto``: the draft's matrices are int4 (a draft step costs about half
    of one in the file's own precision), and the answers are still the plain ones."""
    from rill.models.quant import QuantWeight

    target, _ = draft_pair
    plain, _ = _answers(target, None)
    spec, stats = _answers(target, target, draft_weights="auto")
    assert {rid: r.token_ids for rid, r in spec.items()} == {rid: r.token_ids for rid, r in plain.items()}
    assert stats.spec_draft_tokens_total > 0
    engine = build_engine(
        EngineConfig(
            model=str(target), weights="int8", kv_cache_memory="16MiB", max_model_len=128, draft_model=str(target)
        )
    )
    assert engine.core.speculator is not None and engine.core.speculator.draft_model is not None
    kinds = {m.kind for m in engine.core.speculator.draft_model.runner.model.modules() if isinstance(m, QuantWeight)}
    target_kinds = {m.kind for m in engine.core.runner.model.modules() if isinstance(m, QuantWeight)}
    assert "int4" in kinds and "int4" not in target_kinds  # (embeddings stay int8 rows)


@pytest.mark.parametrize(
    ("draft_weights", "device", "held"),
    [
        ("auto", "cpu", "int4"),
        ("auto", "cpu:0", "int4"),
        ("auto", "cuda", "int8"),
        ("auto", "cuda:1", "int8"),
        ("same", "cpu", "int8"),
        ("dense", "cpu", "dense"),
    ],
)
def test_draft_weights_resolve(draft_weights: str, device: str, held: str) -> None:
    """``auto`` means int4 only on the CPU (int4 runs nowhere else); ``same`` follows --weights."""
    from rill.engine.builder import draft_weights as resolve

    config = EngineConfig(model="m", device=device, weights="int8", draft_weights=draft_weights)
    assert resolve(config) == held


def test_a_draft_model_needs_the_same_tokenizer(tmp_path: Path, quant_model_dir: Path) -> None:
    from rill.errors import ModelLoadError
    from rill.testing.checkpoints import make_checkpoint

    other = make_checkpoint(tmp_path / "other", arch="llama", head_dim=32, num_layers=1, vocab_size=900)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        build_engine(
            EngineConfig(model=str(quant_model_dir), kv_cache_memory="16MiB", max_model_len=128, draft_model=str(other))
        )
    for flags in (dict(speculative="draft"), dict(speculative="ngram", draft_model=str(quant_model_dir))):
        with pytest.raises(ConfigError):
            build_engine(EngineConfig(model=str(quant_model_dir), kv_cache_memory="16MiB", max_model_len=128, **flags))
