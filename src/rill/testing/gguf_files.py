"""Write GGUF files from Hugging Face folders with the ``gguf`` package's writer (for tests).

``write_gguf(folder, out, quant)`` writes what llama.cpp's converter would for the small
random-init checkpoints of ``rill.testing.checkpoints`` (Llama family; Gemma 3): llama.cpp's
tensor names and metadata keys, the q/k row permutation of Llama models, Gemma's ``+1`` on norm
weights, and a ``gpt2`` (byte-level BPE) tokenizer taken from the folder's ``tokenizer.json``.
``quant`` picks the GGML type of each 2-D weight (1-D tensors stay F32).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}

_LLAMA_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GEMMA3_LAYER = _LLAMA_LAYER | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str, arch: str) -> str:
    """llama.cpp's name of a Hugging Face tensor name."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    return f"blk.{index}.{(_GEMMA3_LAYER if arch == 'gemma3' else _LLAMA_LAYER)[rest]}"


def source_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors as a Hugging Face checkpoint holds them (float32)."""
    from safetensors.torch import load_file

    return {name: tensor.float() for name, tensor in load_file(str(Path(folder) / "model.safetensors")).items()}


def write_gguf(folder: str | Path, out: str | Path, quant: Callable[[str, torch.Tensor], str] | str = "F32") -> Path:
    """Write the checkpoint in ``folder`` as the GGUF file ``out``; return ``out``.

    Args:
        quant: a GGML type name (``F32``, ``F16``, ``Q8_0``, ``Q4_0``...) for every 2-D weight,
            or ``(hf_name, tensor) -> type name``. ``Q4_K`` and ``Q6_K``, which the ``gguf``
            package cannot quantize to, go through ``quantize_q4_k`` / ``quantize_q6_k``
            (input widths a multiple of 256).
    """
    import gguf
    from gguf.constants import GGMLQuantizationType as Q

    from rill.models.llama import permute_rows

    folder, out = Path(folder), Path(out)
    config = json.loads((folder / "config.json").read_text())
    hf_arch = config["architectures"][0]
    arch = GGUF_ARCH[hf_arch]
    writer = gguf.GGUFWriter(str(out), arch)
    _write_metadata(writer, config, arch)
    _write_tokenizer(writer, folder)
    pick = quant if callable(quant) else (lambda name, tensor: quant)
    for name, tensor in source_tensors(folder).items():
        if arch == "llama" and name.endswith("q_proj.weight"):
            tensor = permute_rows(tensor, config["num_attention_heads"])
        elif arch == "llama" and name.endswith("k_proj.weight"):
            tensor = permute_rows(tensor, config["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor + 1.0
        values = tensor.numpy().astype(np.float32)
        kind = pick(name, tensor) if values.ndim == 2 else "F32"
        if kind == "F32":
            writer.add_tensor(gguf_name(name, arch), values)
        elif kind == "F16":
            writer.add_tensor(gguf_name(name, arch), values.astype(np.float16))
        elif kind == "Q6_K":  # the gguf package cannot quantize to the K types
            writer.add_tensor(gguf_name(name, arch), quantize_q6_k(values), raw_dtype=Q.Q6_K)
        elif kind == "Q4_K":
            writer.add_tensor(gguf_name(name, arch), quantize_q4_k(values), raw_dtype=Q.Q4_K)
        else:
            qtype = Q[kind]
            writer.add_tensor(gguf_name(name, arch), gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantize_q4_k(values: np.ndarray) -> np.ndarray:
    """Raw Q4_K blocks ``[rows, cols / 256 * 144]`` for a float32 ``[rows, cols]`` matrix (cols a
    multiple of 256): per 32 values a 6-bit scale and a 6-bit min of fp16 ``d`` and ``dmin`` per
    256, 4-bit values, packed as GGML packs them (``rill.models.quant_values.gguf_int4`` reads them)."""
    rows, cols = values.shape
    x = values.reshape(-1, 8, 32).astype(np.float32)  # [blocks, 8 sub-blocks, 32 values]
    low = np.minimum(x.min(axis=2), 0.0)  # Q4_K's offsets are -dmin * mn <= 0
    step = (x.max(axis=2) - low) / 15.0
    d = (step.max(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = (-low.min(axis=1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1.0)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-low / np.where(dmin > 0, dmin, 1.0)[:, None]), 0, 63).astype(np.uint8)
    scale = d[:, None] * sc
    q = np.round((x + (dmin[:, None] * mn)[..., None]) / np.where(scale > 0, scale, 1.0)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)  # value 64 c + 32 h + l
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    packed = np.empty((x.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    head = np.stack([d, dmin], axis=1).astype(np.float16).view(np.uint8)
    return np.concatenate([head, packed, qs], axis=1).reshape(rows, cols // 256 * 144)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """Raw Q6_K blocks ``[rows, cols / 256 * 210]`` for a float32 ``[rows, cols]`` matrix (cols a
    multiple of 256): per 16 values an int8 scale of an fp16 scale per 256, 6-bit values with
    32 as zero, packed as GGML packs them (``rill.models.quant_values.gguf_int6`` reads them back)."""
    rows, cols = values.shape
    x = values.reshape(-1, 16, 16).astype(np.float32)  # [blocks, 16 sub-blocks, 16 values]
    step = np.abs(x).max(axis=2) / 31.0  # each sub-block's step
    d = (step.max(axis=1) / 127.0).astype(np.float16).astype(np.float32)
    safe_d = np.where(d > 0, d, 1.0)
    sub = np.clip(np.round(step / safe_d[:, None]), -127, 127).astype(np.int8)
    scale = d[:, None] * sub.astype(np.float32)
    safe_scale = np.where(scale != 0, scale, 1.0)
    q = np.where(scale[..., None] != 0, np.round(x / safe_scale[..., None]), 0)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # value 128 h + 32 j + l
    ql = np.concatenate(
        [(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4), (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2
    )  # [blocks, half, 64]
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    blocks = np.concatenate(
        [
            ql.reshape(-1, 128),
            qh.reshape(-1, 64),
            sub.view(np.uint8),
            d.astype(np.float16).view(np.uint8).reshape(-1, 2),
        ],
        axis=1,
    )
    return blocks.reshape(rows, cols // 256 * 210)


def _write_metadata(writer, config: dict, arch: str) -> None:
    writer.add_uint32(f"{arch}.block_count", config["num_hidden_layers"])
    writer.add_uint32(f"{arch}.context_length", config["max_position_embeddings"])
    writer.add_uint32(f"{arch}.embedding_length", config["hidden_size"])
    writer.add_uint32(f"{arch}.feed_forward_length", config["intermediate_size"])
    writer.add_uint32(f"{arch}.attention.head_count", config["num_attention_heads"])
    writer.add_uint32(f"{arch}.attention.head_count_kv", config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    writer.add_uint32(f"{arch}.attention.value_length", head_dim)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    if arch == "gemma3":
        writer.add_float32(f"{arch}.rope.freq_base", rope.get("full_attention", {}).get("rope_theta", 1e6))
        writer.add_uint32(f"{arch}.attention.sliding_window", config["sliding_window"])
        if config.get("final_logit_softcapping") is not None:
            writer.add_float32(f"{arch}.final_logit_softcapping", config["final_logit_softcapping"])
    else:
        writer.add_float32(f"{arch}.rope.freq_base", rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_uint32(f"{arch}.vocab_size", config["vocab_size"])


def _write_tokenizer(writer, folder: Path) -> None:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = dict(tokenizer["model"]["vocab"])
    special = set()
    for added in tokenizer.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["content"])
    tokens = [token for token, _ in sorted(vocab.items(), key=lambda item: item[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "gpt-2")  # llama.cpp knows it by this name
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.token_type", [3 if t in special else 1 for t in tokens])
    writer.add_array("tokenizer.ggml.merges", merges)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    for key, name in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("pad_token", "padding_token_id"),
        ("unk_token", "unknown_token_id"),
    ):
        if isinstance(tokenizer_config.get(key), str) and tokenizer_config[key] in vocab:
            writer.add_uint32(f"tokenizer.ggml.{name}", vocab[tokenizer_config[key]])
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    if isinstance(tokenizer_config.get("chat_template"), str):
        writer.add_string("tokenizer.chat_template", tokenizer_config["chat_template"])
