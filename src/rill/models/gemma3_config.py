"""The Gemma 3 family's ``config.json`` parser (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``).

``rill.models.registry.parse_config`` calls ``parse_gemma3_config`` with the architecture it
resolved from the file; ``rill.models.gemma3`` registers it in its ``FAMILY``, and its GGUF
reader fills in the constants below, which GGUF files do not store.

Imports ``rill.models.config`` and ``rill.errors`` only.
"""

from __future__ import annotations

from typing import Any

from rill.errors import ModelLoadError
from rill.models.config import ModelConfig, eos_ids, first_id, generation_defaults, required_sizes, rope_settings

SLIDING_WINDOW_PATTERN = 6
"""Every 6th layer is global unless ``layer_types`` says otherwise (as transformers and llama.cpp)."""
LOCAL_ROPE_THETA = 10000.0
"""The RoPE base of sliding-window layers when the file names none."""


def parse_gemma3_config(
    architecture: str, hf: dict[str, Any], generation: dict[str, Any] | None, source: str
) -> ModelConfig:
    """``config.json`` (and ``generation_config.json``) of ``Gemma3ForCausalLM`` → ``ModelConfig``.

    Raises:
        ModelLoadError: a setting this implementation does not compute (attention soft-capping,
            bidirectional attention, RoPE scaling on local layers, another activation).
    """
    act = hf.get("hidden_activation", hf.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{source}: hidden_activation '{act}' is not supported (only gelu_pytorch_tanh)")
    if hf.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{source}: attn_logit_softcapping is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention=true is not supported")
    sizes = required_sizes(hf, source)
    head_dim = int(hf.get("head_dim") or 256)
    global_rope, local_theta = _rope(hf, source)
    rope_theta, rope_scaling = rope_settings({"rope_parameters": global_rope}, source)
    generation = generation or {}
    return ModelConfig(
        architecture=architecture,
        **sizes,  # type: ignore[arg-type]
        head_dim=head_dim,
        max_position_embeddings=int(hf.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        eos_token_ids=eos_ids(generation.get("eos_token_id", hf.get("eos_token_id", 1))),
        generation_defaults=generation_defaults(generation),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        has_qkv_bias=bool(hf.get("attention_bias", False)),
        has_o_bias=bool(hf.get("attention_bias", False)),
        has_qk_norm=True,
        sliding_windows=_windows(hf, sizes["num_layers"]),
        attention_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        local_rope_theta=local_theta,
        final_logit_softcapping=None
        if hf.get("final_logit_softcapping") is None
        else float(hf["final_logit_softcapping"]),
        bos_token_id=first_id(hf.get("bos_token_id", 2)),
        pad_token_id=first_id(hf.get("pad_token_id", 0)),
        hf_config=dict(hf),
    )


def _rope(hf: dict[str, Any], source: str) -> tuple[dict[str, Any], float]:
    # transformers 5 writes rope_parameters per layer type; older files have rope_theta,
    # rope_local_base_freq and an optional rope_scaling (for the global layers).
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = dict(params.get("full_attention") or {"rope_type": "default"})
        local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    else:
        full = dict(hf.get("rope_scaling") or params or {"rope_type": "default"})
        full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", LOCAL_ROPE_THETA)}
    full.setdefault("rope_theta", 1_000_000.0)
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ModelLoadError(f"{source}: RoPE scaling on sliding-window layers is not supported")
    return full, float(local.get("rope_theta", LOCAL_ROPE_THETA))


def _windows(hf: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = int(hf.get("sliding_window_pattern", SLIDING_WINDOW_PATTERN))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if window is None:
        return (None,) * num_layers
    return tuple(int(window) if kind == "sliding_attention" else None for kind in layer_types)
