"""GGUF input: files written by the ``gguf`` package's writer from random-init checkpoints load
and equal their source (exactly in F32, within the quantization's error otherwise), give the
same greedy tokens as the Hugging Face folder, and refuse what rill cannot read by name.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from rill_model_helpers import Sequence, random_prompts, run_greedy

from rill.engine.runner import TorchModelRunner
from rill.errors import ModelLoadError
from rill.models import load_model
from rill.models.gguf_loader import find_gguf, read_gguf
from rill.models.tokenizer import Tokenizer
from rill.testing.checkpoints import generate_text
from rill.testing.gguf_files import gguf_name, source_tensors, write_gguf


def _mixed_quant(name: str, tensor: torch.Tensor) -> str:
    # Every 2-D weight quantized: MLP matrices Q4_0, attention and embeddings Q8_0.
    return "Q4_0" if ".mlp." in name else "Q8_0"


CASES_WRITTEN = ("llama", "qwen3", "llama-tied", "gemma3-pattern")


@pytest.fixture(scope="module")
def gguf_files(checkpoint, tmp_path_factory) -> dict[str, Path]:
    """Per case: the F32 and the Q8_0/Q4_0 files written from the same random-init folder."""
    out = tmp_path_factory.mktemp("gguf")
    files = {}
    for case in CASES_WRITTEN:
        files[case] = write_gguf(checkpoint(case), out / f"{case}-f32.gguf", "F32")
        files[case + "-q"] = write_gguf(checkpoint(case), out / f"{case}-q.gguf", _mixed_quant)
    return files


def _greedy(folder_or_file: Path, prompts: list[list[int]]) -> list[list[int]]:
    runner = TorchModelRunner(load_model(folder_or_file, dtype="float32"), num_rows=4, max_len=128)
    sequences = [Sequence(prompt, row) for row, prompt in enumerate(prompts)]
    run_greedy(runner, sequences)
    return [seq.tokens for seq in sequences]


@pytest.mark.parametrize("case", CASES_WRITTEN)
def test_f32_gguf_loads_the_exact_weights_and_decodes_like_the_folder(checkpoint, gguf_files, case: str) -> None:
    """Exact tensors after un-permuting Llama's q/k rows (and taking the 1 off Gemma's norms),
    so 64 greedy tokens equal the folder's."""
    folder = checkpoint(case)
    loaded = load_model(gguf_files[case], dtype="float32")
    ours = loaded.model.to_hf_state_dict()
    source = source_tensors(folder)
    for name, tensor in source.items():
        if case.startswith("gemma3") and name.endswith("norm.weight"):
            assert torch.allclose(ours[name], tensor, rtol=0, atol=1e-6), name  # (w + 1) - 1 rounds
        else:
            assert torch.equal(ours[name], tensor), name
    prompts = random_prompts([5, 17, 30], loaded.config.vocab_size)
    assert _greedy(gguf_files[case], prompts) == _greedy(folder, prompts)


@pytest.mark.parametrize("case", ["llama", "qwen3", "gemma3-pattern"])
def test_quantized_gguf_equals_its_source_within_the_quantization_error(checkpoint, gguf_files, case: str) -> None:
    """Q8_0 and Q4_0 weights equal the writer's own quantize → dequantize round trip exactly,
    and the source within the type's bound: half a step of each 32-value block's scale."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    from rill.models.llama import permute_rows

    ours = load_model(gguf_files[case + "-q"], dtype="float32").model.to_hf_state_dict()
    types = read_gguf(gguf_files[case + "-q"]).tensor_types()
    arch = {"llama": "llama", "qwen3": "qwen3", "gemma3-pattern": "gemma3"}[case]
    # Worst error per value: half a step for Q8_0 (scale = block max / 127); one step for Q4_0
    # (scale = block max / 8, and the block's largest value is clamped to 7 steps); plus the
    # float16 rounding of the scale (2^-11 relative), which moves the farthest level by up to
    # block max * 2^-11.
    steps = {"Q8_0": 0.5 / 127, "Q4_0": 1.0 / 8}
    checked = set()
    for name, tensor in source_tensors(checkpoint(case)).items():
        kind = types[gguf_name(name, arch)]
        if tensor.ndim == 1:
            assert kind == "F32" and torch.allclose(ours[name], tensor, rtol=0, atol=1e-6), name
            continue
        checked.add(kind)
        source, loaded = tensor, ours[name]
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            # Compared in the file's row order, where the 32-value blocks were cut.
            heads = 4 if name.endswith("q_proj.weight") else 2
            source, loaded = permute_rows(source, heads), permute_rows(loaded, heads)
        values = source.numpy()
        round_trip = gguf.quants.dequantize(gguf.quants.quantize(values, Q[kind]), Q[kind])
        assert np.array_equal(loaded.numpy(), round_trip), name
        block_max = np.abs(values).reshape(values.shape[0], -1, 32).max(axis=-1, keepdims=True)
        error = np.abs(values - loaded.numpy()).reshape(values.shape[0], -1, 32)
        assert (error <= block_max * (steps[kind] + 2**-11) * (1 + 1e-6)).all(), name
        assert error.max() > 0, f"{name}: a {kind} round trip that changes nothing is not quantized"
    assert checked == {"Q8_0", "Q4_0"}


def test_gguf_tokenizer_equals_the_folders_and_carries_the_chat_template(checkpoint, gguf_files) -> None:
    folder = checkpoint("llama")
    ours = load_model(gguf_files["llama"], dtype="float32").tokenizer
    reference = Tokenizer.from_folder(folder)
    texts = generate_text(60, seed=3).splitlines() + [
        "  two  spaces",
        "tabs\tand\nlines",
        "digits 12345 x9",
        "é ü 中文 🙂",
    ]
    for text in texts:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))
    messages = [{"role": "user", "content": "hi"}]
    assert ours.encode_chat(messages) == reference.encode_chat(messages)
    assert ours.eos_token_id == reference.eos_token_id and ours.bos_token_id == reference.bos_token_id


def test_a_folder_holding_one_gguf_file_loads_it(gguf_files, tmp_path) -> None:
    (tmp_path / "model.gguf").symlink_to(gguf_files["llama"])
    assert find_gguf(tmp_path) == tmp_path / "model.gguf"
    assert load_model(tmp_path, dtype="float32").config.architecture == "LlamaForCausalLM"
    (tmp_path / "other.gguf").symlink_to(gguf_files["qwen3"])
    with pytest.raises(ModelLoadError, match="several GGUF files"):
        load_model(tmp_path)


def test_an_unknown_quantization_type_is_refused_by_name(tmp_path) -> None:
    import gguf
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.constants import GGMLQuantizationType as Q

    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (
        ("block_count", 1),
        ("embedding_length", 32),
        ("feed_forward_length", 64),
        ("attention.head_count", 2),
        ("context_length", 64),
    ):
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    block, size = GGML_QUANT_SIZES[Q.IQ4_NL]
    writer.add_tensor("token_embd.weight", np.zeros((16, 32 // block * size), dtype=np.uint8), raw_dtype=Q.IQ4_NL)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"token_embd.weight has quantization type IQ4_NL.*supported: F32"):
        load_model(path)


def test_an_unknown_gguf_architecture_is_refused_by_name(tmp_path) -> None:
    import gguf

    path = tmp_path / "rwkv.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv6")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="GGUF architecture 'rwkv6' is not supported; supported: llama"):
        load_model(path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_model(path)
