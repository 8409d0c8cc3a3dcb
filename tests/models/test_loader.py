"""Loading checkpoints: sharded weights, dtypes, generation config, config spellings, saving,
and every error case with its message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rill.errors import ModelLoadError
from rill.models import (
    SUPPORTED_ARCHITECTURES,
    build_model,
    default_dtype,
    load_model,
    parse_config,
    save_checkpoint,
)
from rill.testing.checkpoints import make_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with sampling defaults in its generation config."""
    return make_checkpoint(
        tmp_path_factory.mktemp("llama"),
        "llama",
        generation_config={"do_sample": True, "temperature": 0.7, "top_p": 0.9},
    )


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def _ids(vocab_size: int) -> torch.Tensor:
    return torch.randint(8, vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))


def test_config_fields(llama_dir: Path) -> None:
    loaded = load_model(llama_dir, dtype="float32")
    config = loaded.config
    assert (config.architecture, config.hidden_size, config.num_layers) == ("LlamaForCausalLM", 64, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.dtype == "float32" and config.device == "cpu"
    assert config.eos_token_ids == (2, 7)  # the list from generation_config.json
    assert config.generation_defaults == {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
    assert config.vocab_size == loaded.model.embed_tokens.weight.shape[0]
    assert config.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4
    assert not loaded.model.training


def test_sharded_weights_load_like_single_file(tmp_path: Path, llama_dir: Path) -> None:
    sharded = make_checkpoint(tmp_path / "sharded", "llama", max_shard_size="60KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    loaded = load_model(sharded, "float32")
    ids = _ids(loaded.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(loaded.model(ids), load_model(llama_dir, "float32").model(ids))


def test_bfloat16_load(llama_dir: Path) -> None:
    loaded = load_model(llama_dir, dtype="bfloat16")
    assert loaded.config.dtype == "bfloat16"
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    ids = _ids(loaded.config.vocab_size)
    with torch.no_grad():
        bf16 = loaded.model(ids).float()
        fp32 = load_model(llama_dir, dtype="float32").model(ids)
    assert (bf16.argmax(-1) == fp32.argmax(-1)).float().mean() > 0.9


def test_bfloat16_checkpoint_loads_as_float32(tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path / "bf16", "qwen3", dtype="bfloat16")
    loaded = load_model(folder, dtype="float32")
    assert loaded.model.embed_tokens.weight.dtype == torch.float32


def test_auto_dtype_follows_the_cpu(llama_dir: Path) -> None:
    flags = Path("/proc/cpuinfo").read_text()
    expected = "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"
    assert default_dtype("cpu") == expected
    assert load_model(llama_dir).config.dtype == expected


def test_legacy_rope_keys_parse_like_rope_parameters() -> None:
    base = dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        vocab_size=100,
    )
    rope = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    new = parse_config(base | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **rope}})
    old = parse_config(base | {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **rope}})
    assert (
        (new.rope_theta, new.rope_scaling)
        == (old.rope_theta, old.rope_scaling)
        == (5e5, {"rope_type": "llama3", **rope})
    )


def test_sliding_window_settings() -> None:
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=100)
    assert (
        parse_config(base | {"architectures": ["MistralForCausalLM"], "sliding_window": None}).sliding_windows
        == (None,) * 3
    )
    assert (
        parse_config(base | {"architectures": ["MistralForCausalLM"], "sliding_window": 8}).sliding_windows == (8,) * 3
    )
    qwen2 = base | {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 8, "max_window_layers": 1}
    assert parse_config(qwen2).sliding_windows == (None,) * 3  # use_sliding_window defaults to false
    assert parse_config(qwen2 | {"use_sliding_window": True}).sliding_windows == (None, 8, 8)


def test_build_and_save_round_trip_through_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    config = dict(
        architectures=["Qwen2ForCausalLM"],
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        tie_word_embeddings=True,
        initializer_range=0.08,
    )
    model = build_model(config, seed=0)
    assert model.training and all(p.requires_grad for p in model.parameters())
    ids = _ids(64)
    model(ids).float().logsumexp(-1).mean().backward()  # the training path has gradients
    assert model.embed_tokens.weight.grad is not None
    folder = save_checkpoint(model, config, tmp_path / "saved", {"eos_token_id": [2, 3]})
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)(ids).logits
        assert (model(ids) - ref).abs().max() < 1e-5
    assert load_model(folder, "float32").config.eos_token_ids == (2, 3)


# ---- errors ---------------------------------------------------------------------------------


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(tmp_path: Path, llama_dir: Path) -> None:
    folder = _copy(llama_dir, tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json not found"):
        load_model(folder)


def test_missing_weights_names_the_files(tmp_path: Path, llama_dir: Path) -> None:
    folder = _copy(llama_dir, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors and model\.safetensors\.index\.json"):
        load_model(folder)


def test_missing_shard(tmp_path: Path) -> None:
    folder = make_checkpoint(tmp_path / "sharded", "llama", max_shard_size="60KB")
    next(folder.glob("model-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="lists shard .* which is missing"):
        load_model(folder)


def test_missing_tensor_is_named(tmp_path: Path, llama_dir: Path) -> None:
    folder = _copy(llama_dir, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(folder)


def test_shape_mismatch_is_named(tmp_path: Path, llama_dir: Path) -> None:
    folder = _copy(llama_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match=r"mlp\.down_proj\.weight has shape \(64, 128\), but config\.json implies \(64, 96\)"
    ):
        load_model(folder)


def test_unsupported_architecture_lists_supported(tmp_path: Path, llama_dir: Path) -> None:
    folder = _copy(llama_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="unsupported architecture GPT2LMHeadModel") as info:
        load_model(folder)
    assert all(name in str(info.value) for name in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_type(tmp_path: Path, llama_dir: Path) -> None:
    folder = _copy(llama_dir, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="RoPE type 'yarn' is not supported"):
        load_model(folder)


def test_bad_dtype(llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="unsupported dtype 'int8'"):
        load_model(llama_dir, dtype="int8")


def test_broken_config_json(tmp_path: Path, llama_dir: Path) -> None:
    folder = _copy(llama_dir, tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(folder)
