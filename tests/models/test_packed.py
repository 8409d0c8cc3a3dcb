"""Weights packed for oneDNN (bf16 on CPU) give exactly ``F.linear``'s results, in every entry point."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rill.engine.batch import RowWork
from rill.engine.runner import TorchModelRunner
from rill.models import load_model, packed
from rill.models.quant import weight_bytes

needs_packing = pytest.mark.skipif(
    not packed.can_pack(torch.empty(2, 2, dtype=torch.bfloat16)), reason="this CPU's oneDNN has no bf16 kernels"
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 32])
def test_packed_linear_is_bit_identical_to_f_linear(rows: int) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 64, generator=generator).bfloat16()
    bias = torch.randn(96, generator=generator).bfloat16()
    x = torch.randn(rows, 64, generator=generator).bfloat16()
    expected = F.linear(x, weight, bias)
    assert packed.pack_weight(weight) == 96 * 64 * 2
    assert packed.pack_weight(weight) == 0  # idempotent
    with torch.inference_mode():
        assert torch.equal(packed.linear(x, weight, bias), expected)


needs_float32_packing = pytest.mark.skipif(not packed.can_pack(torch.empty(2, 2)), reason="no oneDNN in this torch")


@needs_float32_packing
def test_packed_float32_gives_every_row_the_same_bits_at_any_batch_size() -> None:
    """MKL's sgemm (plain ``F.linear``) takes another kernel for one row than for several here,
    so a row's result changed in its last bits with its batch; the packed kernel's does not."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3072, 576, generator=generator)
    x = torch.randn(600, 576, generator=generator)
    expected = F.linear(x, weight)
    assert packed.pack_weight(weight) == 3072 * 576 * 4
    with torch.inference_mode():
        alone = packed.linear(x[:1], weight)
        for rows in (2, 3, 31, 32, 33, 512, 600):
            got = packed.linear(x[:rows], weight)
            assert torch.equal(got[:1], alone), rows
            torch.testing.assert_close(got, expected[:rows], atol=1e-3, rtol=1e-4)


def test_weights_of_other_dtypes_are_left_alone() -> None:
    weight = torch.randn(8, 4, dtype=torch.float16)
    assert packed.pack_weight(weight) == 0
    x = torch.ones(2, 4, dtype=torch.float16)
    assert torch.equal(packed.linear(x, weight), F.linear(x, weight))


@needs_packing
def test_autograd_falls_back_to_f_linear() -> None:
    weight = torch.randn(8, 4, dtype=torch.bfloat16, requires_grad=True)
    packed.pack_weight(weight)
    packed.linear(torch.ones(2, 4, dtype=torch.bfloat16), weight).float().sum().backward()
    assert weight.grad is not None and weight.grad.shape == (8, 4)


@needs_packing
@pytest.mark.parametrize("case", ["llama-tied", "qwen2", "gemma3"])
def test_a_packed_runner_gives_the_same_logits_as_plain_weights(checkpoint: Callable[[str], Path], case: str) -> None:
    folder = checkpoint(case)
    plain = load_model(folder, dtype="bfloat16")
    expected_full = plain.model(torch.tensor([[5, 9, 13, 2]]))
    plain_runner = TorchModelRunner(plain, num_rows=3, max_len=32, pack_weights=False)
    packed_loaded = load_model(folder, dtype="bfloat16")
    dense_bytes = weight_bytes(packed_loaded.model)
    packed_runner = TorchModelRunner(packed_loaded, num_rows=3, max_len=32)
    # Packing replaces: the projections' originals are freed; only a tied head keeps two forms.
    linears = [m.weight for m in packed_loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(w.numel() == 0 and packed.packed_copy(w) is not None for w in linears)
    tied = packed_loaded.model.lm_head is None
    assert (packed_runner.packed_weight_bytes > 0) == tied
    embedding = packed_loaded.model.embed_tokens.weight
    second_form = embedding.numel() * embedding.element_size() if tied else 0
    assert weight_bytes(packed_loaded.model) <= 1.1 * dense_bytes + second_form

    def steps(runner: TorchModelRunner) -> list[torch.Tensor]:
        out = [
            runner.forward(
                [RowWork(row=0, start=0, token_ids=[5, 9, 13, 2]), RowWork(row=1, start=0, token_ids=[7, 3])]
            )
        ]
        out.append(
            runner.forward(
                [
                    RowWork(row=0, start=4, token_ids=[11]),
                    RowWork(row=1, start=2, token_ids=[4]),
                    RowWork(row=2, start=0, token_ids=[6, 6, 8]),
                ]
            )
        )
        return out

    for got, expected in zip(steps(packed_runner), steps(plain_runner)):
        assert torch.equal(got, expected)
    with torch.inference_mode():
        assert torch.equal(packed_loaded.model(torch.tensor([[5, 9, 13, 2]])), expected_full)
