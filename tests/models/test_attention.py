"""The bf16 decode attention (two batched matmuls over a strided cache view) agrees with SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rill.models.attention import _decode_attention_bmm


@pytest.mark.parametrize("is_masked", [False, True])
def test_bmm_decode_attention_matches_sdpa(is_masked: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    rows, kv_heads, group, head_dim, length, max_len = 6, 2, 3, 32, 40, 64
    cache = torch.randn(8, kv_heads, max_len, head_dim, generator=generator)
    values = torch.randn(8, kv_heads, max_len, head_dim, generator=generator)
    q = torch.randn(rows, kv_heads, group, head_dim, generator=generator)
    lengths = torch.tensor([40, 33, 1, 17, 40, 25])
    mask = (torch.arange(length)[None, :] < lengths[:, None])[:, None, None, :] if is_masked else None
    keys, vals = cache[:rows, :, :length], values[:rows, :, :length]
    expected = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
    got = _decode_attention_bmm(q.bfloat16(), keys.bfloat16(), vals.bfloat16(), mask)
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    assert (got.float() - expected).abs().max() < 3e-2
