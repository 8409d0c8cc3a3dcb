"""Tests for rill.engine.sampler_kernels: thresholds against a sort-based reference, draws, top-N."""

from __future__ import annotations

import numpy as np
import pytest

from rill.engine.sampler_kernels import apply_penalties, inverse_cdf, keep_thresholds, top_n


def _reference_keep(p: np.ndarray, top_k: int, top_p: float, min_p: float) -> set[int]:
    order = np.argsort(-p, kind="stable")
    keep = set(order[:top_k].tolist()) if top_k else set(range(len(p)))
    q = np.where([i in keep for i in range(len(p))], p, 0.0)
    if top_p < 1.0:
        q_sorted = np.sort(q)[::-1] / q.sum()
        cut = np.searchsorted(np.cumsum(q_sorted), top_p)  # first index reaching top_p
        keep &= {i for i in range(len(p)) if q[i] / q.sum() >= q_sorted[min(cut, len(p) - 1)]}
    return {i for i in keep if p[i] >= min_p * p.max()}


@pytest.mark.parametrize("num_candidates", [1, 8, 1024])
def test_keep_thresholds_match_a_sort_based_reference(num_candidates):
    rng = np.random.default_rng(4)
    f, width = 60, 256
    w = np.exp(rng.standard_normal((f, width)) * rng.uniform(0.1, 3, (f, 1))).astype(np.float32)
    w /= w.max(axis=1, keepdims=True)
    top_k = rng.choice([0, 1, 5, 40], f)
    top_p = rng.choice([1.0, 0.5, 0.9, 0.99], f).astype(np.float32)
    min_p = rng.choice([0.0, 0.05, 0.3], f).astype(np.float32)
    thr = keep_thresholds(w, top_k, top_p, min_p, num_candidates)
    for r in range(f):
        got = set(np.nonzero(w[r] >= thr[r])[0].tolist())
        assert got == _reference_keep(w[r].astype(np.float64), top_k[r], float(top_p[r]), float(min_p[r])), r


def test_mostly_zero_rows_get_the_reference_cuts():
    # Rows of an allowed_token_ids list or a grammar mask: most weights are exactly 0 (such a
    # batch takes the full-sort path, as a partition is slow on ties); the cuts are unchanged.
    rng = np.random.default_rng(7)
    f, width = 40, 2048
    w = np.exp(rng.standard_normal((f, width)) * 2).astype(np.float32)
    w[:30] *= rng.random((30, width)) < 0.05  # 30 rows keep ~100 of 2048 tokens
    w /= w.max(axis=1, keepdims=True)
    top_k = rng.choice([0, 1, 5], f)
    top_p = rng.choice([1.0, 0.5, 0.9], f).astype(np.float32)
    min_p = rng.choice([0.0, 0.05], f).astype(np.float32)
    for rows in (np.arange(f), np.arange(30, f)):  # mostly zeros, and the dense rows alone
        thr = keep_thresholds(w[rows], top_k[rows], top_p[rows], min_p[rows], 128)
        for j, r in enumerate(rows):
            if top_k[r] or top_p[r] < 1.0 or min_p[r]:
                got = set(np.nonzero(w[r] >= thr[j])[0].tolist())
                assert got == _reference_keep(w[r].astype(np.float64), top_k[r], float(top_p[r]), float(min_p[r])), r


def test_inverse_cdf_edges_and_zero_weights():
    w = np.zeros((3, 256), np.float32)
    w[:, [5, 130, 200]] = [1.0, 2.0, 1.0]
    u = np.array([0.0, 0.5, np.nextafter(1.0, 0.0)])
    assert inverse_cdf(w, u).tolist() == [5, 130, 200]
    rng = np.random.default_rng(5)
    w = (rng.random((4, 256)) < 0.1).astype(np.float32)
    tokens = inverse_cdf(np.repeat(w, 500, 0), rng.random(2000))
    assert np.all(np.repeat(w, 500, 0)[np.arange(2000), tokens] > 0)


def test_candidate_and_full_sort_cuts_are_identical():
    # Bit-identical thresholds whatever the candidate-set size: the batch-invariance guarantee.
    rng = np.random.default_rng(6)
    w = np.exp(rng.standard_normal((200, 1024)).astype(np.float32) * 2)
    w = (w / w.max(axis=1, keepdims=True)).astype(np.float32)
    w[:50] = np.round(w[:50] * 8) / 8  # many exact ties
    top_k = rng.choice([0, 3, 30, 200], 200)
    top_p = rng.choice([0.3, 0.8, 0.95], 200).astype(np.float32)
    min_p = np.zeros(200, np.float32)
    reference = keep_thresholds(w, top_k, top_p, min_p, 1024)
    for num_candidates in (1, 128, 300):
        np.testing.assert_array_equal(keep_thresholds(w, top_k, top_p, min_p, num_candidates), reference)


def test_top_n_orders_by_value_then_id():
    x = np.array([[0.0, 2.0, 1.0, 2.0, -1.0, 2.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]], np.float32)
    ids, values = top_n(x, 3)
    assert ids.tolist() == [[1, 3, 5], [0, 1, 2]]
    assert values.tolist() == [[2.0, 2.0, 2.0], [5.0, 4.0, 3.0]]
    x[0, 0] = np.nan  # NaN logits must not crash
    assert top_n(x, 2)[0].shape == (2, 2)


def test_apply_penalties_leaves_unseen_tokens_and_off_rows_alone():
    x = np.array([[1.0, -1.0, 2.0], [9.0, 9.0, 9.0], [1.0, -1.0, 2.0]], np.float32)
    counts = np.array([[0, 1, 0], [2, 0, 0]], np.float32)
    prompt = np.array([[True, False, False], [False, False, False]])
    apply_penalties(
        x,
        np.array([0, 2]),
        counts,
        prompt,
        np.array([2.0, 1.0], np.float32),
        np.array([0.0, 0.5], np.float32),
        np.array([0.0, 1.0], np.float32),
    )
    np.testing.assert_array_equal(x, [[0.5, -2.0, 2.0], [9.0, 9.0, 9.0], [1.0 - 0.5 - 2.0, -1.0, 2.0]])


@pytest.mark.parametrize("k", [2, 12, 13, 40])
def test_top_n_matches_a_stable_sort(k):
    rng = np.random.default_rng(7)
    x = np.round(rng.standard_normal((9, 300)) * 4).astype(np.float32)  # many ties
    order = np.argsort(-x, axis=1, kind="stable")[:, :k]
    ids, values = top_n(x, k, scratch=np.empty_like(x))
    np.testing.assert_array_equal(ids, order)
    np.testing.assert_array_equal(values, np.take_along_axis(x, order, axis=1))


def test_top_n_with_too_few_finite_logits_lists_distinct_ids():
    x = np.full((2, 6), -np.inf, np.float32)
    x[0, 4] = 0.0
    x[1, [1, 3]] = [1.0, 2.0]
    for k in (4, 20 // 4 + 1, 6):  # both the argmax path and the fallback
        ids = top_n(x, k)[0]
        assert ids[0, 0] == 4 and ids[1, :2].tolist() == [3, 1]
        assert all(len(set(row)) == k for row in ids.tolist())
