"""Attention over a contiguous per-row KV cache for one engine step.

A step packs every token of every scheduled row into one flat batch of ``N`` tokens: first the
decode tokens (one per row; their rows are physical rows ``0..B-1`` in that order, so their
keys are a *view* ``cache[:B, :, :L]``), then the prefill chunks (several tokens each, any
physical row). Linear layers run on the packed ``[N, hidden]`` tensor; only attention splits
into the two groups.

GQA is computed without repeating keys: the ``g`` query heads that share one KV head are
folded into the query-length dimension, so SDPA sees ``num_kv_heads`` heads and a query
length of ``g`` (decode) or ``T * g`` (prefill).

The runner builds a ``StepBatch`` once per step; layers only index into it. A model with
quantized projections may do its decode rows in one C call instead
(``rill.models.qkernel.decode_attention``: RoPE, cache write and attention), then
``write_kv(..., first=B)`` and ``prefill_attention`` for the step's prefill chunks; or, when
the batch says its chunks may go token by token (``StepBatch.by_token``), every token of the
step in that one call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

BY_TOKEN_PREFILL_TOKENS = 128
"""Most prompt tokens a step with decode rows may hold for its chunks to attend token by token
as the decode rows do (``StepBatch.by_token``). Under load nearly every step carries a small
chunk of a newly arrived prompt beside the running streams; in the decode kernel that chunk
costs what its tokens cost, where the layer-by-layer path adds a fixed cost per step (a 135M
model's steps took two thirds longer). Past this a step is mostly prompt, where that fixed
cost weighs little and the padded attention takes the prompt in blocks rather than a token
at a time."""


@dataclass(slots=True)
class PrefillLayout:
    """How the prefill chunks of a step are laid out for one padded attention call.

    Attributes:
        num_chunks: P, the number of prefill chunks.
        max_chunk_len: T, tokens in the longest chunk (others are right-padded to it).
        key_len: keys each chunk attends over (max of ``start + len``).
        row_slice: ``(first, last + 1)`` physical rows when the chunks' rows are consecutive
            and in order (then keys are a view), else None.
        rows: physical rows ``[P]`` (used to gather keys when ``row_slice`` is None).
        pad_index: ``[P * T]`` indices into the packed prefill tokens (padding points at a
            chunk's last token), or None when no padding is needed.
        unpad_index: ``[N_p]`` indices into the padded ``P * T`` layout, or None.
        masks: per sliding window (None = full attention), a bool mask ``[P, 1, T * g, key_len]``
            (True = attend); folded query index ``t * g + j`` is chunk token ``t``.
    """

    num_chunks: int
    max_chunk_len: int
    key_len: int
    row_slice: tuple[int, int] | None
    rows: torch.Tensor
    pad_index: torch.Tensor | None
    unpad_index: torch.Tensor | None
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class StepBatch:
    """Packed inputs of one cached step (built by the runner, read by every layer).

    Attributes:
        input_ids: ``[N]`` token ids, decode tokens first, then each prefill chunk in turn.
        positions: ``[N]`` absolute position of each token in its row.
        write_rows: ``[N]`` physical KV row each token's keys/values are written to.
        num_decode: B, decode tokens at the front of the batch (rows ``0..B-1``).
        decode_len: keys the decode rows attend over (max of their lengths after this step).
        decode_masks: per sliding window, a bool mask ``[B, 1, 1, decode_len]`` or None when
            every decode row has exactly ``decode_len`` keys and no window applies.
        prefill: layout of the prefill chunks, or None when the step has none.
        logits_index: ``[M]`` packed positions whose logits are wanted (may be empty), or
            None for every token in packed order.
        cos, sin: ``[N, 1, head_dim]`` RoPE rows in the activation dtype (set by the model).
        by_token: the prefill chunks may attend token by token as decode rows do (each token
            over its row's cache up to its own position, every key of the step written
            first), so that a model with a decode kernel may run the whole step through it:
            when every chunk is a speculative draft (``RowWork.draft``), or when the step
            has decode rows and its prompt chunks hold at most ``BY_TOKEN_PREFILL_TOKENS``.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    write_rows: torch.Tensor
    num_decode: int
    decode_len: int
    decode_masks: dict[int | None, torch.Tensor | None]
    prefill: PrefillLayout | None
    logits_index: torch.Tensor | None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    by_token: bool = False

    @property
    def all_by_token(self) -> bool:
        """Every token of the step may attend from its own position as a decode row does: the
        step is decode rows only, or its chunks may go token by token (``by_token``)."""
        return (self.prefill is None and self.num_decode > 0) or self.by_token


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch, first: int = 0
) -> None:
    """Store keys/values ``[N - first, kv_heads, head_dim]`` of the step's tokens ``first..N-1``
    at (row, position) in the caches."""
    rows, positions = batch.write_rows[first:], batch.positions[first:]
    k_cache[rows, :, positions] = k
    v_cache[rows, :, positions] = v


def cached_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: StepBatch,
    window: int | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attend the step's queries ``[N, heads, head_dim]`` over the caches; return ``[N, heads * head_dim]``.

    The step's own keys must already be written (``write_kv``). ``scale`` multiplies q·k
    (default ``head_dim ** -0.5``).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    num_decode = batch.num_decode
    outputs = []
    if num_decode:
        length = batch.decode_len
        q_d = q[:num_decode].view(num_decode, num_kv_heads, group, head_dim)
        keys, values = k_cache[:num_decode, :, :length], v_cache[:num_decode, :, :length]
        mask = batch.decode_masks[window]
        if q.dtype == torch.float32 or q.device.type != "cpu" or num_decode < BMM_MIN_ROWS:
            out_d = F.scaled_dot_product_attention(
                q_d, keys, values, attn_mask=mask, scale=scale
            )  # [B, kv_heads, g, hd]
        else:
            out_d = _decode_attention_bmm(q_d, keys, values, mask, scale)
        outputs.append(out_d.reshape(num_decode, num_heads * head_dim))
    if batch.prefill is not None:
        outputs.append(prefill_attention(q[num_decode:], k_cache, v_cache, batch.prefill, window, scale))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


BMM_MIN_ROWS = 4
"""Decode batches at least this large use ``_decode_attention_bmm`` on CPU in bf16/fp16."""


def _decode_attention_bmm(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    # NOTE: on CPU, SDPA's flash kernel has a high cost per (row, kv head) work item in bf16;
    # two batched matmuls over the strided cache view took 1.5 ms instead of 2.4 ms per layer
    # at B=32, 256 keys (100M model, one thread). Scores come out of the matmul in bf16 (as transformers' eager
    # attention does); scaling, masking and softmax run in float32.
    rows, num_kv_heads, group, head_dim = q.shape
    length = keys.shape[2]
    flat_keys = keys.reshape(rows * num_kv_heads, length, head_dim)  # a view: row stride = heads * head stride
    flat_values = values.reshape(rows * num_kv_heads, length, head_dim)
    scores = torch.bmm(flat_keys, q.reshape(rows * num_kv_heads, group, head_dim).transpose(1, 2))  # [BH, L, g]
    # One copy turns the scores to float32 and to [BH, g, L], so softmax runs on the last dim.
    scores = scores.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
    scores = scores.view(rows, num_kv_heads, group, length).mul_(head_dim**-0.5 if scale is None else scale)
    if mask is not None:
        scores.masked_fill_(mask.logical_not(), float("-inf"))  # mask: [B, 1, 1, L]
    probs = torch.softmax(scores, dim=-1).to(q.dtype).view(rows * num_kv_heads, group, length)
    return torch.bmm(probs, flat_values).view(rows, num_kv_heads, group, head_dim)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: PrefillLayout,
    window: int | None,
    scale: float | None = None,
) -> torch.Tensor:
    """Attend the prefill chunks' queries ``[N_p, heads, head_dim]`` (the step's tokens after
    its decode rows, keys already written) over the caches; return ``[N_p, heads * head_dim]``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    chunks, max_len, key_len = layout.num_chunks, layout.max_chunk_len, layout.key_len
    if layout.pad_index is not None:
        q = q.index_select(0, layout.pad_index)
    # [P*T, heads, hd] -> [P, kv_heads, T*g, hd]: query index t*g + j for head kv*g + j.
    q = q.view(chunks, max_len, num_kv_heads, group, head_dim).transpose(1, 2)
    q = q.reshape(chunks, num_kv_heads, max_len * group, head_dim)
    if layout.row_slice is not None:
        first, last = layout.row_slice
        keys, values = k_cache[first:last, :, :key_len], v_cache[first:last, :, :key_len]
    else:
        keys = k_cache[:, :, :key_len].index_select(0, layout.rows)
        values = v_cache[:, :, :key_len].index_select(0, layout.rows)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=layout.masks[window], scale=scale)
    out = out.view(chunks, num_kv_heads, max_len, group, head_dim).transpose(1, 2)
    out = out.reshape(chunks * max_len, num_heads * head_dim)
    if layout.unpad_index is not None:
        out = out.index_select(0, layout.unpad_index)
    return out


def window_mask(num_tokens: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """The ``[T, T]`` bool mask of a cache-free causal forward over ``num_tokens`` tokens
    attending to the last ``window`` keys, or None where plain causal attention (SDPA's
    ``is_causal``) already is that: no window, or one at least as long as the input."""
    if window is None or window >= num_tokens:
        return None
    q = torch.arange(num_tokens, device=device)[:, None]
    k = torch.arange(num_tokens, device=device)[None, :]
    return (k <= q) & (k > q - window)
