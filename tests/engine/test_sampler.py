"""Tests for rill.engine.sampler: semantics of every parameter, seeds, state, and the kernels."""

from __future__ import annotations

import math
import random
import warnings

import numpy as np
import pytest
import torch

from rill.engine.sampler import Sampler
from rill.types import SamplingParams

# A crafted 16-token distribution: probs 0.3, 0.25, 0.2, 0.1, 0.05, then 11 tokens sharing 0.1.
CRAFTED = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.1, 0.05] + [0.1 / 11] * 11))


def make(vocab: int = 16, rows: int = 64, **kw) -> Sampler:
    """A sampler; kw go to the constructor."""
    return Sampler(vocab, rows, **kw)


def draw_many(params: SamplingParams, logits: torch.Tensor, num_rows: int = 200, steps: int = 10) -> np.ndarray:
    """Tokens from ``num_rows`` seeded rows with the same params over ``steps`` steps."""
    s = make(logits.shape[-1], num_rows)
    for k in range(num_rows):
        s.add(k, SamplingParams(**{**_fields(params), "seed": k}), [], set())
    batch = logits.expand(num_rows, -1)
    return np.array([s.sample(batch, list(range(num_rows))).token_ids for _ in range(steps)]).ravel()


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__struct_fields__}


def one(s: Sampler, logits: torch.Tensor, key: int = 0) -> int:
    """Sample one row."""
    return s.sample(logits[None], [key]).token_ids[0]


# ----- greedy ---------------------------------------------------------------------------------


def test_greedy_is_argmax():
    torch.manual_seed(0)
    s = make(1000, 8)
    for k in range(8):
        s.add(k, SamplingParams(temperature=0.0), [], set())
    for _ in range(5):
        x = torch.randn(8, 1000)
        assert s.sample(x, list(range(8))).token_ids == x.argmax(-1).tolist()


def test_top_k_one_and_tiny_temperature_are_greedy():
    torch.manual_seed(1)
    s = make(500, 4)
    s.add(0, SamplingParams(top_k=1, temperature=1.5), [], set())
    s.add(1, SamplingParams(temperature=1e-3, seed=3), [], set())  # sampled, but the limit is argmax
    s.add(2, SamplingParams(temperature=1e-7), [], set())  # below GREEDY_TEMPERATURE
    for _ in range(20):
        x = torch.randn(3, 500)
        out = s.sample(x, [0, 1, 2]).token_ids
        assert out[0] == x[0].argmax().item() and out[2] == x[2].argmax().item()
        top2 = x[1].topk(2).values
        if top2[0] - top2[1] > 0.05:  # a gap of 0.05 is 50 nats at T=1e-3
            assert out[1] == x[1].argmax().item()


# ----- filters --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.6), {0, 1, 2}),  # 0.3 + 0.25 < 0.6 <= 0.75
        (SamplingParams(min_p=0.5), {0, 1, 2}),  # p >= 0.15
        (SamplingParams(top_k=3, top_p=0.5), {0, 1}),  # top-p on the renormalised top-3 (0.75)
        (SamplingParams(top_p=0.9, min_p=0.4), {0, 1, 2}),  # min-p (p >= 0.12) cuts tokens top-p keeps
        (SamplingParams(top_k=4, temperature=0.5), {0, 1, 2, 3}),
    ],
)
def test_filters_never_pick_excluded_tokens(params, allowed):
    tokens = draw_many(params, CRAFTED)
    assert set(tokens.tolist()) == allowed  # every allowed token shows up in 2000 draws


def test_filters_with_fallback_to_full_sort():
    # num_candidates=2 forces the top-p rows through the full-sort path.
    s = make(16, 100, num_candidates=2)
    for k in range(100):
        s.add(k, SamplingParams(top_p=0.6, seed=k), [], set())
    tokens = {t for _ in range(5) for t in s.sample(CRAFTED.expand(100, -1), list(range(100))).token_ids}
    assert tokens == {0, 1, 2}


def test_temperature_sampling_matches_softmax():
    torch.manual_seed(2)
    logits = torch.randn(40) * 1.5  # 40 tokens: padded to one 128-wide block
    temperature = 0.8
    tokens = draw_many(SamplingParams(temperature=temperature), logits, num_rows=250, steps=80)
    expected = torch.softmax(logits / temperature, -1).double().numpy() * len(tokens)
    observed = np.bincount(tokens, minlength=40)
    big = expected >= 5
    chi2 = (((observed - expected) ** 2 / expected)[big]).sum()
    dof = big.sum() - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)  # fixed seeds: deterministic


# ----- seeds ----------------------------------------------------------------------------------


def _seeded_params() -> list[SamplingParams]:
    return [
        SamplingParams(seed=11, temperature=0.9, top_p=0.9),
        SamplingParams(seed=12, temperature=1.2, top_k=20, top_p=0.8, repetition_penalty=1.3),
        SamplingParams(seed=13, temperature=0.7, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(seed=14, temperature=1.0, logit_bias={5: 3.0}),
    ]


def _step_logits(step: int, n: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, vocab, generator=g) * 3


def test_seeded_rows_identical_alone_and_in_a_mixed_batch():
    vocab, steps = 2048, 50
    seeded = _seeded_params()
    alone = []
    for p in seeded:
        s = make(vocab, 4, num_candidates=64)
        s.add(2, p, [1, 2, 3], {0})
        alone.append([one(s, _step_logits(t, 1, vocab)[0], key=2) for t in range(steps)])
    # In the batch the seeded rows sit among 28 unseeded rows with other settings (a larger
    # top_k changes the candidate set size; greedy and penalised rows change the plan).
    s = make(vocab, 64, num_candidates=300)
    keys = list(range(63, 31, -1))  # 32 keys, in an unusual order
    positions = [3, 10, 17, 31]
    for i, key in enumerate(keys):
        if i in positions:
            s.add(key, seeded[positions.index(i)], [1, 2, 3], {0})
        else:
            s.add(
                key,
                SamplingParams(
                    temperature=[0.0, 0.5, 1.3][i % 3],
                    top_k=[0, 400, 7][i % 3],
                    top_p=[1.0, 0.95][i % 2],
                    presence_penalty=0.2 * (i % 2),
                ),
                [4, 5],
                {0},
            )
    batch = [[] for _ in seeded]
    for t in range(steps):
        x = torch.randn(32, vocab) * 3
        for pos in positions:
            x[pos] = _step_logits(t, 1, vocab)[0]
        out = s.sample(x, keys).token_ids
        for j, pos in enumerate(positions):
            batch[j].append(out[pos])
    assert batch == alone


def test_reset_restarts_the_seeded_sequence():
    s = make(300, 2)
    s.add(1, SamplingParams(seed=5, top_p=0.95, frequency_penalty=0.4), [7, 8], {0})
    first = [one(s, _step_logits(t, 1, 300)[0], key=1) for t in range(20)]
    s.reset(1, [7, 8])
    again = [one(s, _step_logits(t, 1, 300)[0], key=1) for t in range(20)]
    assert again == first


# ----- logits processing ----------------------------------------------------------------------


def test_penalties_follow_the_formulas():
    s = make(8, 4)
    s.add(3, SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25), [1, 2], {7})
    for tok in (3, 3, 4):
        s.record(3, tok)
    raw = torch.tensor([1.0, 2.0, -2.0, 4.0, -1.0, 3.0, 0.5, -0.5])
    got = s._processed_logits(raw[None], [3])[0]
    want = raw.clone()
    for t in (1, 2, 3, 4):  # prompt + output: positive divided, negative multiplied
        want[t] = want[t] / 2.0 if want[t] > 0 else want[t] * 2.0
    want[3] -= 0.5 + 0.25 * 2  # output counts: 3 twice, 4 once
    want[4] -= 0.5 + 0.25 * 1
    np.testing.assert_array_equal(got, want.numpy())
    assert raw[3] == 4.0  # the caller's logits are not modified


def test_penalty_state_built_when_enabled_mid_stream():
    s = make(8, 2)
    s.add(0, SamplingParams(temperature=0.0), [6], set())
    for _ in range(3):
        one(s, torch.tensor([0.0, 0, 0, 5, 0, 0, 0, 0]))  # picks 3 three times
    s.update(0, SamplingParams(temperature=0.0, frequency_penalty=2.0, repetition_penalty=2.0))
    got = s._processed_logits(torch.ones(1, 8), [0])[0]
    np.testing.assert_allclose(got, [1, 1, 1, 0.5 - 6.0, 1, 1, 0.5, 1])


def test_logit_bias_forces_a_token():
    s = make(16, 2)
    s.add(0, SamplingParams(logit_bias={9: 100.0}, seed=1), [], set())
    s.add(1, SamplingParams(logit_bias={9: 100.0}, temperature=0.0), [], set())
    for _ in range(20):
        assert s.sample(CRAFTED.expand(2, -1), [0, 1]).token_ids == [9, 9]


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([0.0, 1.0, 9.0, 8.0, 2.0])  # eos 2 best, stop id 3 next
    s = make(5, 2)
    s.add(0, SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[3]), [], {2})
    assert [one(s, logits) for _ in range(4)] == [4, 4, 4, 2]


def test_ignore_eos_masks_eos_always():
    s = make(5, 2)
    s.add(0, SamplingParams(ignore_eos=True, seed=0, top_k=2), [], {2})
    logits = torch.tensor([0.0, 1.0, 9.0, 8.0, 2.0])
    assert 2 not in [one(s, logits) for _ in range(30)]


def test_allowed_token_ids_restrict_greedy_and_sampled_rows():
    # CRAFTED's best tokens are 0, 1, 2; among {3, 4, 9} the weights are 0.1, 0.05, 0.009.
    s = make(16, 2)
    s.add(0, SamplingParams(temperature=0.0, allowed_token_ids=[9, 4, 3]), [], set())
    assert one(s, CRAFTED) == 3
    np.testing.assert_array_equal(
        np.isfinite(s._processed_logits(CRAFTED[None], [0])[0]), np.isin(np.arange(16), [3, 4, 9])
    )
    counts = np.bincount(draw_many(SamplingParams(allowed_token_ids=[3, 4, 9]), CRAFTED), minlength=16)
    assert set(np.flatnonzero(counts).tolist()) == {3, 4, 9}
    assert counts[3] > counts[4] > counts[9]  # in proportion to the weights within the list
    s.update(0, SamplingParams(temperature=0.0))  # lifted mid-stream
    assert one(s, CRAFTED) == 0


def test_allowed_token_ids_win_over_the_min_tokens_ban():
    logits = torch.tensor([0.0, 1.0, 9.0, 8.0, 2.0])
    s = make(5, 2)
    s.add(0, SamplingParams(temperature=0.0, min_tokens=3, allowed_token_ids=[2]), [], {2})  # only eos allowed
    s.add(1, SamplingParams(seed=3, min_tokens=3, allowed_token_ids=[2, 4]), [], {2})
    assert [s.sample(logits.expand(2, -1), [0, 1]).token_ids for _ in range(3)] == [[2, 4]] * 3


def test_seeded_allowed_rows_are_the_same_alone_and_in_a_batch():
    vocab, allowed = 4096, list(range(0, 4096, 37))
    p = SamplingParams(seed=21, temperature=0.9, top_p=0.9, allowed_token_ids=allowed)
    alone_sampler = make(vocab, 2, num_candidates=64)
    alone_sampler.add(0, p, [], set())
    alone = [one(alone_sampler, _step_logits(t, 1, vocab)[0]) for t in range(20)]
    s = make(vocab, 8, num_candidates=64)
    for key in range(8):
        s.add(key, p if key == 5 else SamplingParams(seed=key, top_k=50 * key), [], set())
    batch = []
    for t in range(20):
        x = torch.randn(8, vocab) * 3
        x[5] = _step_logits(t, 1, vocab)[0]
        batch.append(s.sample(x, list(range(8))).token_ids[5])
    assert batch == alone and set(alone) <= set(allowed)


def test_all_banned_row_falls_back_to_raw_argmax():
    logits = torch.full((2, 6), -math.inf)
    logits[:, 4] = 0.0  # only eos is possible, and min_tokens bans it
    s = make(6, 2)
    s.add(0, SamplingParams(temperature=0.0, min_tokens=2), [], {4})
    s.add(1, SamplingParams(min_tokens=2, seed=1, top_p=0.5), [], {4})
    assert s.sample(logits, [0, 1]).token_ids == [4, 4]


# ----- logprobs -------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_top_n():
    torch.manual_seed(3)
    vocab = 3000
    s = make(vocab, 4)
    s.add(0, SamplingParams(logprobs=5, repetition_penalty=1.5, temperature=0.7, seed=0), list(range(50)), set())
    s.add(1, SamplingParams(logprobs=0, temperature=0.0, logit_bias={17: 50.0}), [], set())
    s.add(2, SamplingParams(), [], set())
    s.add(3, SamplingParams(logprobs=2, temperature=0.0), [], set())
    x = torch.randn(4, vocab) * 2
    out = s.sample(x, [0, 1, 2, 3])
    ref = torch.log_softmax(x.double(), -1)
    assert out.logprobs[2] is None
    for row, n in ((0, 5), (1, 0), (3, 2)):
        lp = out.logprobs[row]
        assert lp.token_id == out.token_ids[row]
        assert lp.logprob == pytest.approx(ref[row, lp.token_id].item(), abs=1e-5)
        others = ref[row].clone()
        others[lp.token_id] = -math.inf  # top lists the N most likely *other* tokens (rill.types)
        vals, ids = others.topk(n)
        assert [t.token_id for t in lp.top] == ids.tolist()
        np.testing.assert_allclose([t.logprob for t in lp.top], vals.numpy(), atol=1e-5)
    assert out.logprobs[3].top[0].token_id == ref[3].topk(2).indices[1]  # greedy: ranks 2 and 3
    assert out.token_ids[1] == 17  # the bias moved the choice, not the logprob
    assert out.logprobs[1].logprob == pytest.approx(ref[1, 17].item(), abs=1e-5)


# ----- state ----------------------------------------------------------------------------------


def test_update_takes_effect_on_the_next_call():
    s = make(16, 2)
    s.add(0, SamplingParams(seed=3), [], set())
    one(s, CRAFTED)
    s.update(0, SamplingParams(temperature=0.0, logit_bias={12: 10.0}))
    assert one(s, CRAFTED) == 12
    s.update(0, SamplingParams(temperature=0.0))
    assert one(s, CRAFTED) == 0
    # The outputs survived both updates: a presence penalty now pushes the greedy pick off 0.
    s.update(0, SamplingParams(temperature=0.0, presence_penalty=2.0))
    assert one(s, CRAFTED) != 0


def test_remove_then_add_clears_history():
    s = make(8, 2)
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    s.add(1, p, [], set())
    for _ in range(4):
        s.record(1, 5)
    s.remove(1)
    with pytest.raises(KeyError):
        s.sample(torch.zeros(1, 8), [1])
    s.add(1, p, [], set())
    np.testing.assert_array_equal(s._processed_logits(torch.zeros(1, 8), [1]), np.zeros((1, 8)))
    with pytest.raises(ValueError):
        s.add(1, p, [], set())


def test_update_with_a_new_seed_restarts_the_generator():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(9)) * 0.1
    fresh = make(300, 1)
    fresh.add(0, SamplingParams(seed=77), [], set())
    expected = [one(fresh, logits) for _ in range(10)]
    s = make(300, 1)
    s.add(0, SamplingParams(seed=1), [], set())
    one(s, logits)
    s.update(0, SamplingParams(seed=77))
    assert [one(s, logits) for _ in range(10)] == expected


def test_input_dtype_shape_and_immutability():
    s = make(64, 4)
    s.add(0, SamplingParams(repetition_penalty=1.5, logit_bias={3: 5.0}, seed=0), [1, 2, 3], set())
    x = torch.randn(1, 64)
    before = x.clone()
    s.sample(x, [0])
    assert torch.equal(x, before)  # processing works on a copy
    assert 0 <= s.sample(x.to(torch.bfloat16), [0]).token_ids[0] < 64
    with pytest.raises(ValueError):
        s.sample(torch.randn(2, 64), [0])


def test_random_extreme_settings_never_fail():
    rng = random.Random(0)
    for _ in range(60):
        vocab, n = rng.choice([5, 37, 300]), rng.randint(1, 8)
        s = make(vocab, 8, num_candidates=rng.choice([1, 1024]))
        keys = rng.sample(range(8), n)
        params = [
            SamplingParams(
                temperature=rng.choice([0.0, 1e-6, 1e-3, 1.0, 100.0]),
                top_k=rng.choice([0, -1, 1, 10, vocab + 5]),
                top_p=rng.choice([1.0, 0.5, 1e-6]),
                min_p=rng.choice([0.0, 0.1, 1.0]),
                repetition_penalty=rng.choice([1.0, 0.5, 10.0]),
                frequency_penalty=rng.choice([0.0, -2.0]),
                logit_bias=rng.choice([{}, {0: -100.0, 1: 100.0}]),
                seed=rng.choice([None, 7]),
                min_tokens=rng.choice([0, 3]),
                stop_token_ids=rng.choice([[], [1]]),
                ignore_eos=rng.choice([False, True]),
                logprobs=rng.choice([None, 0, 3]),
            )
            for _ in keys
        ]
        for key, p in zip(keys, params):
            s.add(key, p, [rng.randrange(vocab) for _ in range(5)], {rng.randrange(vocab)})
        for _ in range(4):
            x = torch.randn(n, vocab) * rng.choice([0.01, 10.0])
            x[0, rng.randrange(vocab)] = rng.choice([-math.inf, math.inf, math.nan, 0.0])
            if rng.random() < 0.3:
                x[-1] = -math.inf
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                out = s.sample(x, keys)
            assert all(0 <= t < vocab for t in out.token_ids)
            assert [lp is None for lp in out.logprobs] == [p.logprobs is None for p in params]
            for lp, p in zip(out.logprobs, params):
                if lp is not None:
                    assert len(lp.top) == min(p.logprobs, vocab - 1)
                    assert lp.token_id not in [t.token_id for t in lp.top]


def test_the_sampler_owns_its_keys() -> None:
    sampler = Sampler(vocab_size=8, max_rows=2)
    first = sampler.open(SamplingParams(temperature=0.0), [1], {0})
    second = sampler.open(SamplingParams(temperature=0.0), [1], {0})
    assert (first, second) == (0, 1)
    with pytest.raises(RuntimeError, match="no sampler key left"):
        sampler.open(SamplingParams(), [1], {0})
    sampler.remove(first)
    assert sampler.open(SamplingParams(), [2], {0}) == first  # a freed key is handed out again


def test_score_matches_log_softmax_in_bounded_memory() -> None:
    """Prompt logprobs of a long all-logits chunk (200 rows, 20 alternatives: the k > 12 path):
    each entry is torch's log-softmax, rank and top alternatives, and the scoring allocates less
    than one copy of the chunk's logits (rows are scored a block at a time; numpy's allocations
    are traced by tracemalloc)."""
    import tracemalloc

    vocab, rows, num_top = 8192, 200, 20
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    targets = torch.randint(0, vocab, (rows,), generator=gen).tolist()
    sampler = Sampler(vocab, 4)
    tracemalloc.start()
    try:
        got = sampler.score(logits, targets, num_top)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < logits.numel() * 4 // 2, (peak, logits.numel() * 4)
    assert all(a.size < rows * vocab for a in sampler._ws._arrays.values())  # the workspace kept between steps
    ref = torch.log_softmax(logits.double(), dim=-1)
    for j, entry in enumerate(got):
        row = ref[j]
        assert entry.token_id == targets[j]
        assert math.isclose(entry.logprob, row[targets[j]].item(), abs_tol=1e-4)
        assert entry.rank == 1 + int((logits[j] > logits[j][targets[j]]).sum())
        others = [t for t in torch.argsort(logits[j], descending=True, stable=True).tolist() if t != targets[j]][
            :num_top
        ]
        assert [alt.token_id for alt in entry.top] == others
        assert all(math.isclose(alt.logprob, row[alt.token_id].item(), abs_tol=1e-4) for alt in entry.top)
