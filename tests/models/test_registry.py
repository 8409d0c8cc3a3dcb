"""The model registry: architectures map to families, unknown ones are refused by name, and the
Gemma 3 family parses both spellings of its settings and refuses what it does not compute."""

from __future__ import annotations

import pytest

from rill.errors import ModelLoadError
from rill.models import SUPPORTED_ARCHITECTURES, parse_config
from rill.models.registry import family_for_architecture, family_for_gguf, supported_gguf_architectures

GEMMA = {
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 6,
    "vocab_size": 100,
    "intermediate_size": 128,
    "head_dim": 32,
    "sliding_window": 8,
}


def test_every_architecture_has_one_family_and_gguf_names_map_to_them() -> None:
    assert set(SUPPORTED_ARCHITECTURES) == {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
    }
    assert family_for_architecture("Gemma3ForCausalLM").name == "gemma3"
    assert family_for_architecture("Qwen2ForCausalLM").name == "llama"
    assert {family_for_gguf(a, "x").name for a in supported_gguf_architectures()} == {"llama", "gemma3"}
    with pytest.raises(ModelLoadError, match="GGUF architecture 'mamba' is not supported"):
        family_for_gguf("mamba", "x")


def test_gemma3_old_spelling_layer_pattern_and_rope_bases() -> None:
    config = parse_config(
        GEMMA
        | {
            "rope_theta": 5e5,
            "rope_local_base_freq": 2e4,
            "sliding_window_pattern": 3,
            "query_pre_attn_scalar": 16,
            "final_logit_softcapping": 30.0,
        }
    )
    assert config.sliding_windows == (8, 8, None, 8, 8, None)
    assert (config.rope_theta, config.local_rope_theta) == (5e5, 2e4)
    assert config.attention_scale == 16**-0.5 and config.final_logit_softcapping == 30.0
    assert config.tie_word_embeddings and config.has_qk_norm


def test_gemma3_new_spelling() -> None:
    config = parse_config(
        GEMMA
        | {
            "layer_types": ["full_attention"] + ["sliding_attention"] * 5,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        }
    )
    assert config.sliding_windows == (None,) + (8,) * 5
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0} and config.local_rope_theta == 1e4
    assert config.attention_scale == 256**-0.5  # transformers' default query_pre_attn_scalar


@pytest.mark.parametrize(
    "extra, reason",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"hidden_activation": "relu"}, "hidden_activation 'relu'"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default"},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            "sliding-window layers",
        ),
    ],
)
def test_gemma3_settings_it_cannot_compute_are_refused(extra: dict, reason: str) -> None:
    with pytest.raises(ModelLoadError, match=reason):
        parse_config(GEMMA | extra)
