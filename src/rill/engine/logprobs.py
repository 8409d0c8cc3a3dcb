"""Logprobs of the raw model distribution: of the tokens a step chose (``chosen_logprobs``) and
of given tokens (``score_block``: prompt logprobs), each with its most likely alternatives.

Vectorised over the rows: one log-sum-exp and one ``top_n`` per block of rows. Scratch arrays
come from the sampler's ``Workspace``. Imports numpy and ``rill.types``.
"""

from __future__ import annotations

import numpy as np

from rill.engine.sampler_kernels import top_n
from rill.engine.sampler_state import Slot, Workspace
from rill.types import TokenLogprob, TopLogprob


def score_block(raw: np.ndarray, token_ids: list[int], num_top: int, ws: Workspace) -> list[TokenLogprob]:
    """How likely ``token_ids[i]`` was under row ``i`` of ``raw`` (see ``Sampler.score``)."""
    num_rows, vocab = raw.shape
    targets = np.asarray(token_ids, np.int64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        peak = raw.max(axis=1)
        shifted = np.subtract(raw, peak[:, None], out=ws.get("w", (num_rows, vocab), np.float32))
        lse = peak + np.log(np.einsum("lv->l", np.exp(shifted, out=shifted)).astype(np.float64))
        given = raw[np.arange(num_rows), targets]
        chosen = (given - lse).tolist()
        ranks = (1 + np.count_nonzero(raw > given[:, None], axis=1)).tolist()
        top_ids: list[list[int]] = [[] for _ in range(num_rows)]
        top_lps: list[list[float]] = [[] for _ in range(num_rows)]
        if num_top > 0:  # one more than asked, so that N remain once the given token is left out
            ids, values = top_n(raw, min(num_top + 1, vocab), scratch=ws.get("scratch", (num_rows, vocab), np.float32))
            top_ids, top_lps = ids.tolist(), (values - lse[:, None]).tolist()
    out = []
    for j, tok in enumerate(targets.tolist()):
        top = [TopLogprob(t, lp) for t, lp in zip(top_ids[j], top_lps[j]) if t != tok][:num_top]
        out.append(TokenLogprob(token_id=tok, logprob=chosen[j], top=top, rank=ranks[j]))
    return out


def chosen_logprobs(
    raw: np.ndarray, tokens: np.ndarray, slots: list[Slot], rows: list[int], ws: Workspace
) -> list[TokenLogprob | None]:
    """Per row, the chosen token's logprob and its ``params.logprobs`` likeliest alternatives, for
    ``rows`` (those that asked); None for the others."""
    n = len(slots)
    out: list[TokenLogprob | None] = [None] * n
    if not rows:
        return out
    num_rows, vocab = len(rows), raw.shape[1]
    xr = raw if num_rows == n else np.take(raw, rows, axis=0, out=ws.get("x", (num_rows, vocab), np.float32))
    peak = xr.max(axis=1)
    shifted = np.subtract(xr, peak[:, None], out=ws.get("w", (num_rows, vocab), np.float32))
    lse = peak + np.log(np.einsum("lv->l", np.exp(shifted, out=shifted)).astype(np.float64))
    chosen = (xr[np.arange(num_rows), tokens[rows]] - lse).tolist()
    # One more than asked, so that N remain once the chosen token is left out.
    num_top = min(max(slots[i].params.logprobs for i in rows) + 1, vocab)  # type: ignore[operator,type-var]
    top_ids: list[list[int]] = [[] for _ in rows]
    top_lps: list[list[float]] = [[] for _ in rows]
    if num_top > 1:
        ids, values = top_n(xr, num_top, scratch=ws.get("scratch", (num_rows, vocab), np.float32))
        top_ids, top_lps = ids.tolist(), (values - lse[:, None]).tolist()
    for j, i in enumerate(rows):
        tok, k = int(tokens[i]), slots[i].params.logprobs
        top = [TopLogprob(t, lp) for t, lp in zip(top_ids[j], top_lps[j]) if t != tok][:k]
        out[i] = TokenLogprob(token_id=tok, logprob=chosen[j], top=top)
    return out
