"""Pure numpy kernels of the sampler: penalties, top-k/top-p/min-p thresholds, inverse-CDF draw, top-N.

Stateless functions on float32 arrays, each vectorised over rows; ``rill.engine.sampler`` owns the
state and the calling order. Imports numpy only.

NOTE(sampler): numpy, not torch. On the 2-core dev box numpy's AVX-512 ``sort``/``partition`` are
10-15x faster than ``torch.sort``/``torch.topk``, and numpy stays single-threaded, whereas torch's
intra-op threads stall (1-8 ms per small op) whenever another process holds the second core.
Measured pitfalls avoided below: numpy's masked ops (``np.where``, ``copyto(where=)``) branch per
element (~5 ns on a random pattern), ``np.cumsum`` runs at ~3.5 ns per element (13 ns with a
dtype cast), 2-D ``np.nonzero`` is 10x slower than ``np.flatnonzero``, and ``einsum`` sums short
blocks 4x faster than ``.sum(axis=-1)``.

NOTE(sampler): top-k, top-p and min-p become one *value* threshold per row (keep weights >= thr;
tokens tied at a cut are all kept, as in HF's top-k), and the draw walks the kept weights in
token-id order. Results therefore depend neither on how a sort orders tied values nor on the
candidate-set size (which follows the batch's largest top_k), so a seeded row draws the same
tokens alone or in any batch. Prefix sums are taken over whole ``BLOCK``-wide blocks from the
start of the sorted values, so a candidate set and a full sort give bit-identical cuts.
"""

from __future__ import annotations

import numpy as np

BLOCK = 128  # block width of the two-level prefix sums; widths passed in are multiples of it


def apply_penalties(
    x: np.ndarray,
    rows: np.ndarray,
    counts: np.ndarray,
    prompt_mask: np.ndarray,
    rep: np.ndarray,
    presence: np.ndarray,
    frequency: np.ndarray,
) -> None:
    """Apply repetition, presence and frequency penalties to some rows of ``x``, in place.

    Args:
        x: C-contiguous float32 ``[n, vocab]`` logits; rows ``rows`` are modified.
        rows: ``[r]`` row indices into ``x``.
        counts: ``[r, vocab]`` output-token counts; prompt_mask: ``[r, vocab]`` prompt tokens.
        rep, presence, frequency: ``[r]`` per-row penalties (1, 0, 0 mean off).

    Repetition (HF): for tokens in prompt or output, positive logits are divided by ``rep``,
    negative ones multiplied. Then (OpenAI) ``x -= presence * (count > 0) + frequency * count``.
    """
    # Gather/scatter over the seen tokens only: numpy's masked ops (np.where, copyto with
    # where=) branch per element and cost ~5 ns each on a random sign pattern.
    flat, vocab = x.reshape(-1), x.shape[1]
    seen = counts > 0  # flatnonzero of a bool array is 20x faster than of a float one
    if (rep != 1.0).any():
        idx = np.flatnonzero(prompt_mask | seen)  # 2-D np.nonzero is 10x slower
        row, col = np.divmod(idx, vocab)
        at, r = rows[row] * vocab + col, rep[row]
        v = flat[at]
        flat[at] = np.where(v > 0, v / r, v * r)
    if (presence != 0.0).any() or (frequency != 0.0).any():
        idx = np.flatnonzero(seen)
        row, col = np.divmod(idx, vocab)
        flat[rows[row] * vocab + col] -= presence[row] + frequency[row] * counts.reshape(-1)[idx]


def keep_thresholds(
    w: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    num_candidates: int,
    scratch: np.ndarray | None = None,
) -> np.ndarray:
    """Per-row weight threshold implementing top-k, then top-p, then min-p.

    Args:
        w: ``[f, width]`` weights in [0, 1] (temperature-scaled ``exp(x - max)``), ``width`` a
            multiple of ``BLOCK``; zero columns are allowed (padding, banned tokens).
        top_k: ``[f]`` int (0 = off); top_p: ``[f]`` (1 = off); min_p: ``[f]`` (0 = off).
        num_candidates: size of the candidate set tried before a full sort.
        scratch: optional C-contiguous float32 ``[f, width]`` workspace, overwritten.
    Returns:
        float32 ``[f]``: keep the tokens with ``w >= thr``. top-p keeps the smallest set of most
        likely tokens whose mass (renormalised after top-k) reaches ``top_p``; min-p keeps tokens
        with weight >= ``min_p`` times the row maximum. Tokens tied at a cut are all kept.
        Rows with no filter get 0.

    Cuts come from the m largest weights (m = the largest top_k + 1, or ``num_candidates`` when a
    row has top-p without top-k) found with ``np.partition``, ~2.7x cheaper than a full sort.
    A top-p row whose candidates hold less than ``top_p`` of its mass (flat logits, e.g. a
    random-init model) is redone with a full sort of that row; rows that provably need more
    (``top_p * mass > num_candidates``, as each weight is <= 1) skip the attempt. Rows that are
    mostly zero weights are sorted in full at once (faster there than a partition).
    """
    has_k, has_p = top_k > 0, top_p < 1.0
    thr = min_p.astype(np.float32) * w.max(axis=1)  # final for min-p-only rows
    if not (has_k | has_p).any():
        return thr
    scratch = np.empty_like(w) if scratch is None else scratch
    total = np.einsum("fv->f", w).astype(np.float64)  # the row's mass
    # m candidates weigh at most m: top-p rows that need more mass skip straight to a full sort.
    full = has_p & ~has_k & (top_p * total > num_candidates)
    part = np.flatnonzero((has_k | has_p) & ~full)
    if len(part):
        thr[part], redo = _cut(w, part, top_k, top_p, min_p, total, num_candidates, scratch)
        full[part[redo]] = True
    if full.any():
        rows = np.flatnonzero(full)
        thr[rows] = _cut(w, rows, top_k, top_p, min_p, total, w.shape[1], scratch)[0]
    return thr


def _cut(
    w: np.ndarray,
    sel: np.ndarray,
    top_k: np.ndarray,
    top_p: np.ndarray,
    min_p: np.ndarray,
    total: np.ndarray,
    num_candidates: int,
    scratch: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    # keep_thresholds for rows ``sel`` from their m largest weights; also returns the rows whose
    # cut cannot be decided from them (top-p mass not reached, or top-k ties spilling past them).
    width = w.shape[1]
    top_k, top_p, min_p, total = top_k[sel], top_p[sel], min_p[sel], total[sel]
    f = len(sel)
    rows = np.arange(f)
    has_k, has_p = top_k > 0, top_p < 1.0
    m = max(int(top_k.max()) + 1 if has_k.any() else 1, num_candidates if (has_p & ~has_k).any() else 1)
    m = min(-(-m // BLOCK) * BLOCK, width)  # whole blocks, so prefix sums match a full sort's
    cand = np.take(w, sel, axis=0, out=scratch[:f], mode="clip")
    if m < width and 2 * np.count_nonzero(cand) < cand.size:
        # NOTE(sampler): mostly zeros (an allowed_token_ids list, a grammar mask): numpy's
        # partition slows ~12x on that many ties (4 ms for 32 x 16k), a full sort does not (0.3 ms).
        m = width
    if m == width:
        cand.sort(axis=1)
        desc = cand[:, ::-1]
    else:  # the m largest, sorted descending (values only: ties need no order)
        cand.partition(width - m, axis=1)
        desc = np.sort(cand[:, width - m :], axis=1)[:, ::-1]
    v_k = np.where(has_k, desc[rows, np.minimum(top_k, m) - 1], 0.0).astype(np.float32)
    thr = np.maximum(min_p.astype(np.float32) * desc[:, 0], v_k)
    if not has_p.any():
        return thr, np.zeros(f, dtype=bool)
    # Mass in descending order over the top-k set, against top_p times the top-k mass (or the
    # row's mass without top-k); the cut is the first token where it is reached.
    blocks, cum_b = _block_cumsum(desc * (desc >= v_k[:, None]))
    target = top_p * np.where(has_k, cum_b[:, -1], total)
    cut = _first_past(blocks, cum_b, target, strict=False)
    thr = np.where(has_p, np.maximum(thr, desc[rows, np.minimum(cut, m - 1)]), thr)
    redo = has_p & ((cut >= m) | (has_k & (desc[:, m - 1] >= v_k))) & (m < width)
    return thr, redo


def inverse_cdf(w: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Draw one token per row with probability proportional to ``w``, in token-id order.

    Two levels instead of a full-length cumsum (numpy's runs at ~3.5 ns per element): cumulative
    sums of ``BLOCK``-wide block sums pick the block, a cumsum inside that block the token.
    Zero-weight tokens are never chosen.

    Args:
        w: C-contiguous ``[s, width]`` float32 weights, ``width % BLOCK == 0``, each row > 0.
        u: ``[s]`` uniforms in [0, 1).
    Returns:
        int64 ``[s]`` token ids.
    """
    blocks, cum_b = _block_cumsum(w)
    total = cum_b[:, -1]
    # Never past the last non-empty block, nor inside a block past its last non-zero weight
    # (float rounding can leave u * total at or beyond the sums).
    last_block = (cum_b < total[:, None]).sum(axis=1)
    return _first_past(blocks, cum_b, u * total, strict=True, last_block=last_block)


def _block_cumsum(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # [s, n] -> blocks [s, n / BLOCK, BLOCK] and float64 cumulative block sums [s, n / BLOCK].
    s, n = w.shape
    blocks = w.reshape(s, n // BLOCK, BLOCK)
    sums = np.einsum("sbk->sb", blocks)  # 4x faster than .sum(axis=2) for 128-wide blocks
    return blocks, np.cumsum(sums.astype(np.float64), axis=1)


def _first_past(
    blocks: np.ndarray, cum_b: np.ndarray, target: np.ndarray, strict: bool, last_block: np.ndarray | None = None
) -> np.ndarray:
    # First index whose inclusive prefix sum passes target (> if strict, else >=), or n if none.
    # With last_block, the answer is clamped to a non-zero weight (sampling never fails).
    s, nb, width = blocks.shape
    rows = np.arange(s)
    before = np.less_equal if strict else np.less
    b = before(cum_b, target[:, None]).sum(axis=1)
    if last_block is not None:
        b = np.minimum(b, last_block)
    bb = np.minimum(b, nb - 1)
    base = np.where(bb > 0, cum_b[rows, bb - 1], 0.0)
    inner = blocks[rows, bb].astype(np.float64)
    cum_t = base[:, None] + np.cumsum(inner, axis=1)  # [s, BLOCK]
    t = before(cum_t, target[:, None]).sum(axis=1)
    if last_block is not None:
        t = np.minimum(t, width - 1 - np.argmax(inner[:, ::-1] > 0, axis=1))
    return np.where(b < nb, bb * width + t, nb * width)


def top_n(x: np.ndarray, k: int, scratch: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest entries of each row of C-contiguous ``x`` ``[l, v]``: ids and values
    ``[l, k]``, largest first, ties by lower id (2-3x faster than ``np.argpartition``).
    ``scratch``: optional float32 ``[l, v]`` workspace, overwritten."""
    l, v = x.shape
    if scratch is None:
        part = x.copy()
    else:
        part = scratch
        np.copyto(part, x)
    if k <= 12:  # k argmax passes (~0.03 ms each at 32 x 16k) beat one partition (~0.4 ms)
        rows, ids = np.arange(l), np.empty((l, k), dtype=np.int64)
        values = np.empty((l, k), dtype=x.dtype)
        for j in range(k):  # argmax takes the lowest id among ties
            ids[:, j] = part.argmax(axis=1)
            values[:, j] = part[rows, ids[:, j]]
            part[rows, ids[:, j]] = -np.inf
        if np.isfinite(values).all():  # else ids may repeat (too few finite logits): slow path
            return ids, values
    else:
        part.partition(v - k, axis=1)
        flat = np.flatnonzero(x >= part[:, v - k, None])  # k or more per row (ties at the k-th)
        row, col = np.divmod(flat, v)
        val = x.reshape(-1)[flat]
        order = np.lexsort((col, -val, row))
        row, col, val = row[order], col[order], val[order]
        keep = np.arange(len(row)) - np.searchsorted(row, np.arange(l))[row] < k
        if keep.sum() == l * k:  # else NaN logits made comparisons fail: slow path
            return col[keep].reshape(l, k), val[keep].reshape(l, k)
    ids = np.argsort(-x, axis=1, kind="stable")[:, :k]
    return ids, np.take_along_axis(x, ids, axis=1)
