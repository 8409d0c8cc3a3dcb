"""Quantized weights: GGUF blocks become exact int4 or bounded int8 values, every kernel
multiplies like the dequantized matrix, a GGUF served with ``--weights auto`` answers like its
dense twin, and a quantized model holds one copy of each weight."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from rill_model_helpers import Sequence, random_prompts, run_greedy

from rill.engine import runner as runner_module
from rill.engine.batch import RowWork
from rill.engine.runner import TorchModelRunner
from rill.errors import ModelLoadError
from rill.models import load_model, qkernel, quant, quant_cache, quant_values
from rill.models.attention import BY_TOKEN_PREFILL_TOKENS
from rill.models.gguf_loader import read_gguf
from rill.testing.gguf_files import write_gguf

_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw GGUF blocks of ``kind`` for a ``[rows, cols]`` matrix: quantized from random values
    where the ``gguf`` package can quantize, else random bytes with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    if kind not in _BLOCK_BYTES:
        values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return quants.quantize(values, GGMLQuantizationType[kind])
    raw = rng.integers(0, 256, (rows * cols // 256, _BLOCK_BYTES[kind]), dtype=np.uint8)
    scales = (rng.random((raw.shape[0], 2)) * 0.004 + 0.0005).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        raw[:, 208:210] = scales[:, 0:2]  # d is the block's last field
    else:
        raw[:, 0:4] = scales  # d, dmin
    return raw.reshape(rows, -1)


def _dequantized(raw: np.ndarray, kind: str) -> torch.Tensor:
    return torch.from_numpy(np.array(quants.dequantize(raw, GGMLQuantizationType[kind]), dtype=np.float32))


@pytest.mark.parametrize("kind", quant_values.INT4_TYPES)
def test_q4_blocks_become_the_same_values_as_int4(kind: str) -> None:
    """Q4_0, Q4_1 and Q4_K are 4-bit values with a scale and offset per 32: kept exactly."""
    rows, cols = 24, 512
    raw = _blocks(kind, rows, cols, seed=1)
    values = quant_values.gguf_int4(raw, kind, (rows, cols))
    reference = _dequantized(raw, kind)
    assert values.q.dtype == torch.uint8 and int(values.q.max()) <= 15
    assert values.scale.shape == (rows, cols // quant_values.GROUP_SIZE)
    torch.testing.assert_close(values.dequantize(), reference, rtol=1e-6, atol=1e-7)
    assert reference.abs().max() > 0


def test_q6_k_blocks_become_the_same_values_as_int6() -> None:
    """Q6_K is kept as it is: 6-bit values, an int8 scale per 16 and an fp16 scale per 256,
    dequantizing to exactly what ``gguf`` gives; without rill's kernel it packs as int8."""
    rows, cols = 20, 512
    raw = _blocks("Q6_K", rows, cols, seed=4)
    values = quant_values.gguf_int6(raw, (rows, cols))
    assert values.q.dtype == torch.uint8 and int(values.q.max()) <= 63 and int(values.q.max()) > 15
    assert values.sub.shape == (rows, cols // 16) and values.d.shape == (rows, cols // 256)
    reference = _dequantized(raw, "Q6_K")
    assert torch.equal(values.dequantize(), reference) and reference.abs().max() > 0
    fused = quant_values.cat([values, values])  # gate/up of one kind stay that kind
    assert isinstance(fused, quant_values.Int6Values) and torch.equal(fused.dequantize()[rows:], reference)
    mixed = quant_values.cat([quant_values.gguf_int4(_blocks("Q4_K", 16, cols, seed=5), "Q4_K", (16, cols)), values])
    assert isinstance(mixed, quant_values.Int8Values)  # q/k of Q4_K beside a Q6_K v: all int8
    assert isinstance(quant.pack(values, torch.float32, "cpu"), (quant.Int8Weight, qkernel.BlockedWeight))


@pytest.mark.skipif(
    not qkernel.available(), reason=f"the VNNI kernel does not run here: {qkernel.unavailable_reason()}"
)
@pytest.mark.parametrize("rows", (1, 4, 7))
def test_the_vnni_kernel_keeps_q4_k_scales_as_the_file_does(rows: int) -> None:
    """Q4_K values keep their 6-bit scales and mins in rill's kernel (4.625 bits a weight where
    fp16 scales and offsets take 5) and multiply like the dequantized matrix and like the same
    values with fp16 scales (which round ``d * sc``); a row alone equals it in a batch."""
    values = quant_values.gguf_int4(_blocks("Q4_K", 40, 768, seed=rows), "Q4_K", (40, 768))
    compact = qkernel.BlockedWeight(values, torch.bfloat16)
    plain = qkernel.BlockedWeight(quant_values.Int4Values(values.q, values.scale, values.offset), torch.bfloat16)
    assert (compact.bits, plain.bits, compact.kind) == (5, 4, "int4")
    stored = sum(b.numel() * b.element_size() for b in compact.buffers())
    assert stored <= 48 * 768 * 4.625 / 8 < sum(b.numel() * b.element_size() for b in plain.buffers())
    x = torch.randn(rows, 768, generator=torch.Generator().manual_seed(rows))
    expected = x @ values.dequantize().t()
    got = compact.linear(x)
    assert float((got - expected).norm() / expected.norm()) < 0.01
    assert float((got - plain.linear(x)).norm() / expected.norm()) < 0.002
    assert torch.equal(compact.linear(x), torch.cat([compact.linear(x[i : i + 1]) for i in range(rows)]))


@pytest.mark.skipif(
    not qkernel.available(), reason=f"the VNNI kernel does not run here: {qkernel.unavailable_reason()}"
)
@pytest.mark.parametrize("rows", (1, 2, 4, 5, 9))
def test_the_vnni_kernel_multiplies_six_bit_weights_like_their_dequantized_matrix(rows: int) -> None:
    """6-bit weights in rill's kernel: within 1 % of the product with the dequantized matrix
    at any batch (the activations are rounded to int8 per 32), 0.82 bytes a weight, and each
    row the same alone as in a batch. N = 40 leaves a partial block of 16 output rows."""
    values = quant_values.gguf_int6(_blocks("Q6_K", 40, 768, seed=rows), (40, 768))
    weight = qkernel.BlockedWeight(values, torch.bfloat16)
    assert weight.kind == "int6" and weight.bits == 6
    stored = sum(b.numel() * b.element_size() for b in weight.buffers())
    assert stored <= 48 * 768 * (6.5625 / 8)  # 48 rows: three whole blocks of 16
    x = torch.randn(rows, 768)
    got = weight.linear(x.bfloat16()).float()
    expected = x @ values.dequantize().t()
    assert float((got - expected).norm() / expected.norm()) < 0.01
    alone = torch.cat([weight.linear(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(weight.linear(x), alone)
    with pytest.raises(ValueError, match="256"):
        qkernel.BlockedWeight(
            quant_values.Int6Values(values.q[:, :96], values.sub[:, :6], values.d[:, :1]), torch.bfloat16
        )


@pytest.mark.parametrize("kind", ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"))
def test_other_types_become_int8_within_half_a_step(kind: str) -> None:
    """int8 with a scale per 32 inputs: every value within half its group's step, and the
    error a small fraction of the type's own spread."""
    rows, cols = 16, 512
    reference = _dequantized(_blocks(kind, rows, cols, seed=2), kind)
    values = quant_values.to_int8(reference)
    groups = reference.reshape(rows, -1, quant_values.GROUP_SIZE)
    step = groups.abs().amax(dim=2, keepdim=True) / 127.0
    error = (values.dequantize().reshape(groups.shape) - groups).abs()
    assert bool((error <= step / 2 * (1 + 1e-5) + 1e-7).all())  # a value can sit exactly on a half step
    assert error.max() > 0 or kind == "Q8_0"


def test_int4_from_float_keeps_values_on_a_16_level_grid() -> None:
    weight = torch.randn(8, 64)
    values = quant_values.to_int4(weight)
    groups = weight.reshape(8, 2, 32)
    step = (groups.amax(dim=2) - groups.amin(dim=2)) / 15
    error = (values.dequantize() - weight).reshape(8, 2, 32).abs()
    assert bool((error <= step[..., None] / 2 + 1e-6).all())
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_values.to_int4(torch.randn(4, 40))


def _kernels() -> list[str]:
    return ["torch", "vnni"] if qkernel.available() else ["torch"]


@pytest.mark.parametrize("backend", _kernels())
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("rows", (1, 2, 3, 5, 9))
def test_kernels_multiply_like_the_dequantized_matrix(backend: str, bits: int, rows: int) -> None:
    """Every kernel, any batch: ``x @ w.T`` within 2 % of the product with the dequantized
    weights (the VNNI kernel rounds activations to int8 per 32; torch's rounds scales to bf16).
    N = 40 leaves a partial block of 16 output rows in rill's kernel."""
    torch.manual_seed(rows)
    # torch's int4 packing needs whole blocks of 16 output rows; rill's kernel takes any.
    num_out = 48 if (backend, bits) == ("torch", 4) else 40
    weight = torch.randn(num_out, 256)
    values = quant_values.to_int4(weight) if bits == 4 else quant_values.to_int8(weight)
    dtype = torch.bfloat16 if backend == "vnni" or bits == 8 else torch.float32
    if backend == "vnni":
        packed: quant.QuantWeight = qkernel.BlockedWeight(values, dtype)
    elif bits == 4:
        packed = quant.Int4Weight(values, dtype)  # type: ignore[arg-type]
    else:
        packed = quant.Int8Weight(values, dtype)  # type: ignore[arg-type]
    x = torch.randn(rows, 256).to(dtype)
    got = packed.linear(x).float()
    expected = x.float() @ values.dequantize().t()
    assert got.shape == (rows, num_out) and got.dtype == torch.float32
    assert packed.linear(x[:0]).shape == (0, num_out)  # an empty batch is an empty product
    assert float((got - expected).norm() / expected.norm()) < 0.02


@pytest.mark.skipif(
    not qkernel.available(), reason=f"the VNNI kernel does not run here: {qkernel.unavailable_reason()}"
)
def test_the_vnni_kernel_gives_each_row_the_same_result_at_any_batch_size() -> None:
    """Activations are rounded per row and the weights read the same way for any batch, so a
    row's output does not depend on what it is batched with."""
    weight = qkernel.BlockedWeight(quant_values.to_int4(torch.randn(48, 128)), torch.bfloat16)
    x = torch.randn(7, 128)
    alone = torch.cat([weight.linear(x[i : i + 1].float()) for i in range(7)])
    assert torch.equal(weight.linear(x.float()), alone)


@pytest.mark.skipif(
    not qkernel.available(), reason=f"the VNNI kernel does not run here: {qkernel.unavailable_reason()}"
)
@pytest.mark.parametrize("bits", (4, 8))
def test_products_handed_out_to_free_threads_give_the_same_result(bits: int) -> None:
    """With ``share_cores`` (an engine replica) a product of 8 rows or more hands its weight
    blocks out in chunks; every block is computed once and as before, so the result is the
    same bit for bit (635 weight rows: 40 blocks of 16, the last one partial)."""
    torch.manual_seed(3)
    matrix = torch.randn(16 * 40 - 5, 256)
    values = quant_values.to_int4(matrix) if bits == 4 else quant_values.to_int8(matrix)
    weight = qkernel.BlockedWeight(values, torch.bfloat16)
    x = torch.randn(13, 256).to(torch.bfloat16)
    fixed = [weight.linear(x[:rows]) for rows in (4, 8, 13)]
    try:
        qkernel.share_cores(True)
        shared = [weight.linear(x[:rows]) for rows in (4, 8, 13)]
    finally:
        qkernel.share_cores(False)
    for a, b in zip(fixed, shared):
        assert torch.equal(a, b)
    expected = x.float() @ values.dequantize().t()  # and it is the product, not two equal wrong answers
    assert float((shared[2].float() - expected).norm() / expected.norm()) < 0.02


@pytest.mark.skipif(
    not qkernel.available(), reason=f"the VNNI kernel does not run here: {qkernel.unavailable_reason()}"
)
@pytest.mark.parametrize("bits", (4, 8))
@pytest.mark.parametrize("rows", (1, 3, 6))
def test_the_vnni_kernel_applies_a_norm_or_a_swiglu_as_the_unfused_steps_do(bits: int, rows: int) -> None:
    """``linear_rms`` is ``RMSNorm`` then the product and ``linear_swiglu`` is ``silu(gate) * up``
    then the product: in float32 the same within rounding of the activations' sums; in bf16
    within the two roundings to bf16 that the unfused path makes and the fused one skips."""
    torch.manual_seed(bits * 10 + rows)
    values = quant_values.to_int4(torch.randn(40, 96)) if bits == 4 else quant_values.to_int8(torch.randn(40, 96))
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        weight = qkernel.BlockedWeight(values, dtype)
        x = (3 * torch.randn(rows, 96)).to(dtype)
        norm = (torch.rand(96) + 0.5).to(dtype)
        fused = weight.linear_rms(x, norm, 1e-6).float()
        unfused = weight.linear(norm * torch.nn.functional.rms_norm(x, (96,), eps=1e-6)).float()
        assert fused.shape == (rows, 40)
        assert float((fused - unfused).norm() / unfused.norm()) < tolerance
        gate_up = (3 * torch.randn(rows, 192)).to(dtype)
        gate, up = gate_up.chunk(2, dim=-1)
        fused = weight.linear_swiglu(gate_up).float()
        unfused = weight.linear(torch.nn.functional.silu(gate) * up).float()
        assert float((fused - unfused).norm() / unfused.norm()) < tolerance
    # Large negative and positive gates: SiLU's exponential saturates to 0 and to the identity.
    weight = qkernel.BlockedWeight(values, torch.float32)
    gate_up = torch.cat((torch.tensor([[-200.0, -90.0, 90.0, 200.0]]).repeat(rows, 24), torch.ones(rows, 96)), dim=1)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = weight.linear(torch.nn.functional.silu(gate) * up)
    assert torch.isfinite(weight.linear_swiglu(gate_up)).all()
    assert torch.allclose(weight.linear_swiglu(gate_up), expected, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_torch_kernels_take_a_norm_or_a_swiglu_as_the_dense_model_computes_them(dtype: torch.dtype) -> None:
    """Where the weight's kernel cannot fuse them (torch's int8 and int4 kernels), ``normed_linear``
    and ``swiglu_linear`` give bit for bit what the norm module or ``silu(gate) * up`` and then
    the product give."""
    from rill.models import packed
    from rill.models.llama import RMSNorm

    torch.manual_seed(3)
    norm = RMSNorm(96, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    x, gate_up = (3 * torch.randn(5, 96)).to(dtype), (3 * torch.randn(5, 192)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    bias = torch.randn(32).to(dtype)
    for weight in (
        quant.Int8Weight(quant_values.to_int8(torch.randn(32, 96)), dtype),
        quant.Int4Weight(quant_values.to_int4(torch.randn(32, 96)), dtype),
    ):
        with torch.inference_mode():
            assert torch.equal(packed.normed_linear(x, norm, weight, bias), weight.linear(norm(x)) + bias)
            assert torch.equal(
                packed.swiglu_linear(gate_up, weight), weight.linear(torch.nn.functional.silu(gate) * up)
            )


def _mixed(name: str, tensor: torch.Tensor) -> str:
    # Q4_0 MLPs (int4), Q8_0 attention and embeddings (int8): both kinds, fused q/k/v too.
    return "Q4_0" if ".mlp." in name else "Q8_0"


@pytest.fixture(scope="module")
def quantized_files(checkpoint, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("quant-gguf")
    return {case: write_gguf(checkpoint(case), out / f"{case}.gguf", _mixed) for case in ("llama", "qwen2-tied")}


@pytest.mark.parametrize("case", ("llama", "qwen2-tied"))
def test_a_gguf_keeps_its_quantized_matrices_and_only_them(quantized_files, case: str) -> None:
    checkpoint = read_gguf(quantized_files[case])
    tensors = checkpoint.tensors(torch.bfloat16, weights="auto")
    kinds = {name: type(value).__name__ for name, value in tensors.items()}
    assert kinds["model.layers.0.mlp.up_proj.weight"] == "Int4Values"
    assert kinds["model.layers.0.self_attn.q_proj.weight"] == "Int8Values"
    assert kinds["model.norm.weight"] == "Tensor"
    loaded = load_model(quantized_files[case], dtype="bfloat16", weights="auto")
    assert loaded.weights == "int4+int8"
    linear = [m for m in loaded.model.modules() if isinstance(m, torch.nn.Linear)]
    assert not linear, "every projection is quantized"


@pytest.mark.parametrize("case", ("llama", "qwen2-tied"))
def test_quantized_weights_answer_like_the_dense_twin(quantized_files, case: str) -> None:
    """The same GGUF served quantized (``auto``) and dequantized (``dense``), teacher-forced on
    the same 20 prompts: the top token agrees at 90 % of the 480 positions or more (random-init
    models have near-ties everywhere, so not all), each position's logits stay within a few
    percent of the dense ones, and a greedy answer starts with the dense answer's token."""
    file = quantized_files[case]
    prompts = random_prompts([24] * 20, vocab_size=200, seed=5)
    logits = {}
    for weights in ("dense", "auto"):
        runner = TorchModelRunner(load_model(file, dtype="bfloat16", weights=weights), num_rows=1, max_len=64)
        logits[weights] = [runner.forward([RowWork(0, p, 0, all_logits=True)]).float() for p in prompts]
    agree = total = 0
    for dense, quantized in zip(logits["dense"], logits["auto"]):
        agree += int((dense.argmax(-1) == quantized.argmax(-1)).sum())
        total += dense.shape[0]
        assert float((quantized - dense).abs().max()) < 0.1 * float(dense.abs().max())
    assert agree / total >= 0.9
    # Greedy generation through the runner's decode path (cached steps, batch of 3).
    outputs = {}
    for weights in ("dense", "auto"):
        runner = TorchModelRunner(load_model(file, dtype="bfloat16", weights=weights), num_rows=4, max_len=64)
        sequences = [Sequence(p, row, num_new=8) for row, p in enumerate(prompts[:3])]
        run_greedy(runner, sequences)
        outputs[weights] = [s.tokens for s in sequences]
    firsts = [(a[0], b[0]) for a, b in zip(outputs["dense"], outputs["auto"])]
    assert sum(a == b for a, b in firsts) >= 2, firsts


def test_quantized_weights_take_half_the_dense_memory_or_less_and_are_the_only_copy(quantized_files) -> None:
    file = quantized_files["llama"]
    dense = load_model(file, dtype="bfloat16", weights="dense")
    quantized = load_model(file, dtype="bfloat16", weights="auto")
    dense_bytes, quant_bytes = quant.weight_bytes(dense.model), quant.weight_bytes(quantized.model)
    values = 0
    for module in quantized.model.modules():
        if isinstance(module, quant.QuantWeight):
            rows, cols = module.shape
            values += rows * cols * (0.5 if module.kind == "int4" else 1.0)  # bytes of the values alone
    # Norms and biases stay dense (parameters); quantized weights are buffers.
    rest = sum(p.numel() * p.element_size() for p in quantized.model.parameters())
    runner = TorchModelRunner(quantized, num_rows=2, max_len=32)
    assert runner.packed_weight_bytes == 0  # nothing left for oneDNN to pack beside them
    assert quant.weight_bytes(quantized.model) == quant_bytes
    # Scales and offsets (fp16 per 32 values) add at most a quarter to the values.
    assert values + rest <= quant_bytes <= 1.3 * values + rest
    assert quant_bytes < 0.55 * dense_bytes


@pytest.mark.skipif(not qkernel.available(), reason="rill's kernel does not run on this CPU")
def test_a_tied_lm_head_multiplies_the_files_own_values_in_the_kernel(quantized_files) -> None:
    """A model whose LM head is its embedding (Q8_0 here) gets the head as a packed weight of
    its own, the file's values in the kernel's layout (the embedding keeps its int8 rows for
    lookups); its products are the file's dequantized matrix's, to the kernel's rounding of
    the activations. A model with a head of its own gets no second one."""
    file = quantized_files["qwen2-tied"]
    model = load_model(file, dtype="bfloat16", weights="auto").model
    head = model.lm_weight()
    assert isinstance(head, qkernel.BlockedWeight) and head.kind == "int8", head
    assert isinstance(model.embed_tokens, quant.QuantizedEmbedding)
    values = load_model(file, dtype="float32", weights="dense").model.embed_tokens.weight
    x = torch.randn(6, values.shape[1], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    expected = x.float() @ values.T
    got = head.linear(x).float()
    assert float((got - expected).abs().max()) < 0.02 * float(expected.abs().max())
    untied = load_model(quantized_files["llama"], dtype="bfloat16", weights="auto").model
    heads = [m for m in untied.modules() if isinstance(m, quant.QuantizedLinear) and m is untied.lm_head]
    assert len(heads) == 1 and untied.lm_weight() is untied.lm_head.weight


def test_weights_modes_are_checked_and_a_folder_quantizes_at_load(checkpoint) -> None:
    folder = checkpoint("qwen2")
    with pytest.raises(ModelLoadError, match="--weights"):
        load_model(folder, weights="int3")
    assert load_model(folder, weights="auto").weights == "dense"
    loaded = load_model(folder, dtype="bfloat16", weights="int4")
    assert "int4" in loaded.weights
    runner = TorchModelRunner(loaded, num_rows=2, max_len=32)
    sequences = [Sequence([3, 5, 7, 9], 0, num_new=4)]
    run_greedy(runner, sequences)
    assert len(sequences[0].tokens) == 4


def test_a_quantized_gguf_is_cached_and_the_cache_gives_the_same_model(quantized_files) -> None:
    """The first load writes the packed model and the file's metadata to the cache; the second
    reads them (no GGUF parsing) and computes the same logits; a damaged entry is ignored."""
    file = quantized_files["qwen2-tied"]
    dtype = torch.bfloat16
    folder = quant_cache.entry_folder(file, "auto", dtype, "cpu")
    ids = torch.tensor([[5, 9, 13, 2, 7]])
    first = load_model(file, dtype="bfloat16", weights="auto")
    assert (folder / "weights.safetensors").is_file()
    with torch.inference_mode():
        expected = first.model(ids)
    second = load_model(file, dtype="bfloat16", weights="auto")
    assert second.tokenizer.encode("hello", add_special_tokens=False) == first.tokenizer.encode(
        "hello", add_special_tokens=False
    )
    assert second.weights == first.weights and second.config.num_layers == first.config.num_layers
    with torch.inference_mode():
        assert torch.equal(second.model(ids), expected)
    (folder / "weights.safetensors").write_bytes(b"damaged")
    third = load_model(file, dtype="bfloat16", weights="auto")
    with torch.inference_mode():
        assert torch.equal(third.model(ids), expected)
    assert (folder / "weights.safetensors").stat().st_size > 1000  # rebuilt


def _reference_decode(qkv, cos, sin, positions, k_cache, v_cache, num_heads, window):
    """The torch path's RoPE and cache writes, then attention in float32."""
    from rill.models.rope import apply_rope

    batch, kv_heads, head_dim = qkv.shape[0], k_cache.shape[1], k_cache.shape[3]
    qk = apply_rope(qkv[:, : (num_heads + kv_heads) * head_dim].view(batch, -1, head_dim), cos, sin)
    values = qkv[:, (num_heads + kv_heads) * head_dim :].view(batch, kv_heads, head_dim)
    out = []
    for b, p in enumerate(positions.tolist()):
        k_cache[b, :, p], v_cache[b, :, p] = qk[b, num_heads:], values[b]
        lo = max(0, p - window + 1) if window else 0
        q = qk[b, :num_heads].float().view(kv_heads, num_heads // kv_heads, head_dim)
        scores = torch.einsum("kgd,kld->kgl", q, k_cache[b, :, lo : p + 1].float()) * head_dim**-0.5
        out.append(torch.einsum("kgl,kld->kgd", scores.softmax(-1), v_cache[b, :, lo : p + 1].float()).flatten())
    return torch.stack(out)


@pytest.mark.skipif(
    not qkernel.available(), reason=f"the VNNI kernel does not run here: {qkernel.unavailable_reason()}"
)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize(
    "shape", ((1, 12, 2, 128, None), (3, 9, 3, 64, None), (2, 4, 2, 64, 5), (2, 4, 4, 32, 1), (3, 10, 2, 96, None))
)
def test_the_decode_attention_kernel_writes_the_cache_as_torch_does_and_attends_each_row(dtype, shape) -> None:
    """RoPE'd keys and the values land in the caches bit for bit as the torch path writes them
    (RoPE rounded as torch rounds it), nothing else in the caches changes, and each row's
    output is attention over its own keys up to its position (its window's worth), within
    the output's rounding to the dtype."""
    batch, heads, kv_heads, head_dim, window = shape
    generator = torch.Generator().manual_seed(sum(x or 0 for x in shape))
    rows, max_len = 4, 40
    k_cache = torch.randn(rows, kv_heads, max_len, head_dim, generator=generator).to(dtype)
    v_cache = torch.randn(rows, kv_heads, max_len, head_dim, generator=generator).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    positions = torch.tensor([17, 39, 0][:batch])
    angles = torch.rand(batch, 1, head_dim // 2, generator=generator) * 6
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    got = qkernel.decode_attention(qkv, cos, sin, positions, k_cache, v_cache, heads, window)
    expected = _reference_decode(qkv, cos, sin, positions, expected_k, expected_v, heads, window)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert got is not None and got.shape == (batch, heads * head_dim) and got.dtype == dtype
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert float((got.float() - expected).abs().max()) < tolerance


@pytest.mark.skipif(
    not qkernel.available(), reason=f"the VNNI kernel does not run here: {qkernel.unavailable_reason()}"
)
def test_the_decode_attention_kernel_declines_what_it_cannot_do() -> None:
    """A head size that is not a multiple of 32, another dtype or a cache view: None, and the
    caches are untouched (the torch path then does the work)."""
    cache = torch.zeros(2, 2, 8, 16)
    qkv = torch.ones(1, 6 * 16)
    cos, sin = torch.ones(1, 1, 16), torch.zeros(1, 1, 16)
    assert qkernel.decode_attention(qkv, cos, sin, torch.tensor([3]), cache, cache.clone(), 2, None) is None
    assert not cache.any()
    half = torch.zeros(2, 2, 8, 32, dtype=torch.float16)
    assert (
        qkernel.decode_attention(
            torch.ones(1, 6 * 32, dtype=torch.float16), cos, sin, torch.tensor([3]), half, half.clone(), 2, None
        )
        is None
    )
    view = torch.zeros(2, 2, 16, 32)[:, :, :8]
    assert (
        qkernel.decode_attention(torch.ones(1, 6 * 32), cos, sin, torch.tensor([3]), view, view.clone(), 2, None)
        is None
    )


@pytest.mark.skipif(
    not qkernel.available(), reason=f"the VNNI kernel does not run here: {qkernel.unavailable_reason()}"
)
@pytest.mark.parametrize("arch,extra", (("qwen2", {}), ("mistral", {"sliding_window": 6})))
def test_a_quantized_model_decodes_through_the_attention_kernel_like_the_torch_path(
    tmp_path, monkeypatch, arch: str, extra: dict
) -> None:
    """Head size 32, so decode rows go through ``qkernel.decode_attention`` (counted); mixed steps
    (a prompt arriving while others decode, chunked) too. The same run with the kernel turned
    away (the torch path) gives logits within bf16 rounding and the same greedy tokens nearly
    everywhere (random-init models have near-ties)."""
    from rill.models import llama
    from rill.testing.checkpoints import make_checkpoint

    folder = make_checkpoint(tmp_path / arch, arch=arch, head_dim=32, num_heads=4, num_kv_heads=2, **extra)
    # A GGUF file keeps no sliding window: the windowed model is quantized from its folder at load.
    file, weights = (folder, "int4") if extra else (write_gguf(folder, tmp_path / f"{arch}.gguf", _mixed), "auto")
    assert load_model(file, dtype="bfloat16", weights=weights).model.layers[0].window == extra.get("sliding_window")
    prompts = random_prompts([12, 9, 15], vocab_size=200, seed=3)
    calls = {"kernel": 0}
    kernel = qkernel.decode_attention
    # Layer by layer (the one-call step has its own test), so every step asks decode_attention.
    monkeypatch.setattr(llama.LlamaModel, "_step_in_one_call", lambda *a: False)

    def counted(*args, **kwargs):
        calls["kernel"] += 1
        return kernel(*args, **kwargs)

    outputs = {}
    for mode in ("kernel", "torch"):
        monkeypatch.setattr(qkernel, "decode_attention", counted if mode == "kernel" else lambda *a, **k: None)
        runner = TorchModelRunner(load_model(file, dtype="bfloat16", weights=weights), num_rows=4, max_len=64)
        sequences = [Sequence(p, row, num_new=12, arrival=2 * row, chunk=5) for row, p in enumerate(prompts)]
        run_greedy(runner, sequences)
        outputs[mode] = sequences
    assert calls["kernel"] > 0
    agree = total = 0
    for fused, plain in zip(outputs["kernel"], outputs["torch"]):
        first = next((i for i, (a, b) in enumerate(zip(fused.tokens, plain.tokens)) if a != b), len(fused.tokens))
        agree, total = agree + first, total + len(fused.tokens)
        for a, b in zip(fused.logprobs[: first + 1], plain.logprobs[: first + 1]):
            assert float((a - b).abs().max()) < 0.05 * float(b.abs().max())
    assert agree / total >= 0.8


def _q4_k_m(name: str, tensor: torch.Tensor) -> str:
    # As Q4_K_M files are: Q6_K down projections and LM head, Q4_K elsewhere.
    return "Q6_K" if name.endswith(("down_proj.weight", "lm_head.weight")) else "Q4_K"


@pytest.mark.parametrize("arch", ("qwen2", "llama"))
def test_a_q4_k_m_gguf_serves_its_own_k_quant_scales_and_six_bit_weights_like_its_dense_twin(tmp_path, arch) -> None:
    """Q6_K down projections and LM head stay 6-bit, Q4_K projections keep the file's 6-bit
    scales (with the kernel; int8 and fp16 scales without; llama's q/k row permutation moves
    them too), and the model answers like the same file dequantized: top token at 90 % of
    teacher-forced positions or more, logits within a few percent."""
    from rill.testing.checkpoints import make_checkpoint

    folder = make_checkpoint(
        tmp_path / "q6", arch=arch, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2
    )
    file = write_gguf(folder, tmp_path / "q6.gguf", _q4_k_m)
    tensors = read_gguf(file).tensors(torch.bfloat16, weights="auto")
    assert isinstance(tensors["model.layers.0.mlp.down_proj.weight"], quant_values.Int6Values)
    q_proj = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q_proj, quant_values.Int4Values) and q_proj.k is not None
    assert torch.equal((q_proj.k.d.repeat_interleave(8, 1) * q_proj.k.sc.float()), q_proj.scale)
    quantized = load_model(file, dtype="bfloat16", weights="auto")
    assert quantized.weights == ("int4+int6" if qkernel.available() else "int4+int8")
    prompts = random_prompts([24] * 10, vocab_size=200, seed=8)
    logits = {}
    for weights, loaded in (("dense", load_model(file, dtype="bfloat16", weights="dense")), ("auto", quantized)):
        runner = TorchModelRunner(loaded, num_rows=1, max_len=64)
        logits[weights] = [runner.forward([RowWork(0, p, 0, all_logits=True)]).float() for p in prompts]
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(logits["dense"], logits["auto"]))
    assert agree / (10 * 24) >= 0.9
    for dense, quant_logits in zip(logits["dense"], logits["auto"]):
        assert float((quant_logits - dense).abs().max()) < 0.1 * float(dense.abs().max())
    # The second load comes from the packed-model cache: the same weights, the same logits.
    again = TorchModelRunner(load_model(file, dtype="bfloat16", weights="auto"), num_rows=1, max_len=64)
    assert torch.equal(again.forward([RowWork(0, prompts[0], 0, all_logits=True)]).float(), logits["auto"][0])


def _one_call_schedule(vocab: int) -> list[list[RowWork]]:
    """Steps over three rows: prompts arriving in chunks beside decoding rows (mixed steps),
    steps of decode rows only, and steps of speculative drafts only, past a 6-token window."""
    ids = random_prompts([12, 9, 15], vocab_size=vocab, seed=5)
    decode = lambda row, at, token: RowWork(row, [token], at)  # noqa: E731
    return [
        [RowWork(0, ids[0], 0), RowWork(1, ids[1][:5], 0, need_logits=False)],
        [decode(0, 12, 3), RowWork(1, ids[1][5:], 5)],
        [decode(0, 13, 4), decode(1, 9, 5)],
        [decode(0, 14, 6), decode(1, 10, 7), RowWork(2, ids[2], 0)],
        [decode(0, 15, 8), decode(1, 11, 9), decode(2, 15, 10)],
        [
            RowWork(0, [11, 12, 13, 14], 16, all_logits=True, draft=True),
            RowWork(2, [15, 16], 16, all_logits=True, draft=True),
        ],
        [decode(1, 12, 17)],
        [RowWork(1, [18, 19, 20], 13, all_logits=True, draft=True)],
        [decode(0, 20, 21), decode(1, 16, 22), decode(2, 18, 23)],
    ]


@pytest.mark.skipif(
    not qkernel.available(), reason=f"the VNNI kernel does not run here: {qkernel.unavailable_reason()}"
)
@pytest.mark.parametrize(
    "arch,extra,types",
    (
        ("qwen2", {}, _mixed),  # q/k/v biases, int8 attention and int4 MLP
        # A GGUF file keeps no sliding window: this one is quantized from its folder at load.
        ("mistral", {"sliding_window": 6}, None),
        ("llama", {"hidden_size": 256, "intermediate_size": 512, "num_heads": 8}, _q4_k_m),  # 5- and 6-bit
    ),
)
def test_a_decode_step_runs_every_layer_in_one_kernel_call_bit_for_bit(
    tmp_path, monkeypatch, arch, extra, types
) -> None:
    """Steps of decode rows, of speculative drafts, or of prompt chunks beside decode rows run
    every layer in one call of ``kernels/layers.c`` (counted); a step of prompt chunks alone,
    or whose prompt chunks beside decode rows hold more than ``BY_TOKEN_PREFILL_TOKENS``,
    takes the layers one by one. The same steps with the one-call path turned away give
    identical logits at every step: the kernel rounds each intermediate where the Python path
    does."""
    from rill.models import llama
    from rill.testing.checkpoints import make_checkpoint

    folder = make_checkpoint(tmp_path / arch, arch=arch, head_dim=32, num_kv_heads=2, **{"num_heads": 4, **extra})
    file = folder if types is None else write_gguf(folder, tmp_path / f"{arch}.gguf", types)
    weights = "int4" if types is None else "auto"
    assert [layer.window for layer in load_model(file, dtype="bfloat16", weights=weights).model.layers] == [
        extra.get("sliding_window")
    ] * 2
    one_call = llama.LlamaModel._step_in_one_call
    calls = {"one call": 0}

    def counted(self, *args):
        done = one_call(self, *args)
        calls["one call"] += done
        return done

    def run(mode: str, bound: int) -> list[torch.Tensor]:
        calls["one call"] = 0
        monkeypatch.setattr(runner_module, "BY_TOKEN_PREFILL_TOKENS", bound)
        monkeypatch.setattr(llama.LlamaModel, "_step_in_one_call", counted if mode == "one call" else lambda *a: False)
        runner = TorchModelRunner(load_model(file, dtype="bfloat16", weights=weights), num_rows=3, max_len=64)
        return [runner.forward(step) for step in _one_call_schedule(200)]

    # With a bound of 10, the 15-token prompt beside two decode rows goes to the padded attention.
    for bound, one_call_steps in ((BY_TOKEN_PREFILL_TOKENS, 8), (10, 7)):  # 8: all but the first step
        plain = run("layers", bound)
        fused = run("one call", bound)
        assert calls["one call"] == one_call_steps
        for a, b in zip(fused, plain, strict=True):
            assert torch.equal(a, b)


@pytest.mark.skipif(
    not qkernel.available(), reason=f"the VNNI kernel does not run here: {qkernel.unavailable_reason()}"
)
def test_the_one_call_step_declines_float32_models_and_dense_weights(quantized_files, checkpoint) -> None:
    """Only bfloat16 models whose products are all the kernel's take the one-call step."""
    for loaded in (
        load_model(quantized_files["llama"], dtype="float32", weights="auto"),
        load_model(checkpoint("llama"), dtype="bfloat16", weights="dense"),
    ):
        runner = TorchModelRunner(loaded, num_rows=1, max_len=32)
        runner.forward([RowWork(0, [1, 2, 3], 0)])
        runner.forward([RowWork(0, [4], 3)])
        assert loaded.model._decode_layers is False
    loaded = load_model(quantized_files["llama"], dtype="bfloat16", weights="auto")
    runner = TorchModelRunner(loaded, num_rows=1, max_len=32)
    runner.forward([RowWork(0, [1, 2, 3], 0)])
    runner.forward([RowWork(0, [4], 3)])
    assert isinstance(loaded.model._decode_layers, qkernel.DecodeLayers)
    loaded.model.to(torch.bfloat16)  # new storage may come with it: the kernel's pointers are dropped
    assert loaded.model._decode_layers is None
