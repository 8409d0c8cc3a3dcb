"""The Llama family's ``config.json`` parser: Llama, Mistral (sliding window), Qwen2 (q/k/v
bias) and Qwen3 (q/k RMSNorm).

``rill.models.registry.parse_config`` calls ``parse_llama_config`` with the architecture it
resolved from the file; ``rill.models.llama`` registers it in its ``FAMILY``.

Imports ``rill.models.config`` and ``rill.errors`` only.
"""

from __future__ import annotations

from typing import Any

from rill.errors import ModelLoadError
from rill.models.config import ModelConfig, eos_ids, first_id, generation_defaults, required_sizes, rope_settings


def parse_llama_config(
    architecture: str, hf: dict[str, Any], generation: dict[str, Any] | None, source: str
) -> ModelConfig:
    """``config.json`` (and ``generation_config.json``) of a Llama-family ``architecture`` → ``ModelConfig``.

    Raises:
        ModelLoadError: an activation other than SiLU, an MLP bias, an unsupported RoPE type
            or a missing field; the message names ``source``.
    """
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{source}: hidden_act '{act}' is not supported (only silu)")
    if hf.get("mlp_bias"):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported")
    sizes = required_sizes(hf, source)
    head_dim = int(hf.get("head_dim") or sizes["hidden_size"] // sizes["num_heads"])
    rope_theta, rope_scaling = rope_settings(hf, source)
    generation = generation or {}
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    has_attention_bias = bool(hf.get("attention_bias", False)) and architecture != "MistralForCausalLM"
    return ModelConfig(
        architecture=architecture,
        **sizes,  # type: ignore[arg-type]
        head_dim=head_dim,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        # generate() stops on generation_config's ids when that file names them, else config's.
        eos_token_ids=eos_ids(generation.get("eos_token_id", hf.get("eos_token_id"))),
        generation_defaults=generation_defaults(generation),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        has_qkv_bias=is_qwen2 or has_attention_bias,
        has_o_bias=has_attention_bias and not is_qwen2,
        has_qk_norm=architecture == "Qwen3ForCausalLM",
        sliding_windows=_sliding_windows(hf, architecture, sizes["num_layers"]),
        bos_token_id=first_id(hf.get("bos_token_id")),
        pad_token_id=first_id(hf.get("pad_token_id")),
        hf_config=dict(hf),
    )


def _sliding_windows(hf: dict[str, Any], architecture: str, num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not hf.get("use_sliding_window", False):
        window = None
    if window is None:
        return (None,) * num_layers
    layer_types = hf.get("layer_types")
    if layer_types is None and architecture != "MistralForCausalLM":
        start = int(hf.get("max_window_layers", 0))
        layer_types = ["sliding_attention" if i >= start else "full_attention" for i in range(num_layers)]
    if layer_types is None:
        return (int(window),) * num_layers
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
