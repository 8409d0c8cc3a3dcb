"""``rill.models.weights``: one set of Hugging Face ↔ rill weight-name conversions for every family."""

from __future__ import annotations

import pytest
import torch

from rill.models import parse_config
from rill.models.registry import family_for_config

LLAMA = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 100,
    "intermediate_size": 96,
}
GEMMA = {
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
    "vocab_size": 100,
    "intermediate_size": 96,
    "head_dim": 32,
    "sliding_window": 8,
    "tie_word_embeddings": False,
}


@pytest.mark.parametrize(
    "hf", [LLAMA, GEMMA, LLAMA | {"architectures": ["Qwen3ForCausalLM"]}], ids=["qwen2", "gemma3", "qwen3"]
)
def test_each_family_maps_its_model_to_hugging_face_names_and_back(hf: dict) -> None:
    config = parse_config(hf)
    family = family_for_config(hf)
    model = family.build(config)
    family.init_weights(model, 0.02, 0)
    hf_tensors = model.to_hf_state_dict()
    # The model's own tensors are exactly those a checkpoint of its config must hold...
    assert sorted(hf_tensors) == sorted(family.expected_hf_names(config))
    # ...and mapping them back gives the model's state dict, tensor for tensor.
    state = family.from_hf(hf_tensors, config)
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in model.state_dict().items())
    assert all(torch.equal(family.to_hf(state, config)[name], tensor) for name, tensor in hf_tensors.items())


def test_optional_tensors_follow_the_config_and_missing_ones_are_all_named() -> None:
    qwen2, qwen3 = parse_config(LLAMA), parse_config(LLAMA | {"architectures": ["Qwen3ForCausalLM"]})
    family = family_for_config(LLAMA)
    names2, names3 = set(family.expected_hf_names(qwen2)), set(family.expected_hf_names(qwen3))
    assert "model.layers.1.self_attn.q_proj.bias" in names2 - names3  # Qwen2: q/k/v bias
    assert "model.layers.1.self_attn.k_norm.weight" in names3 - names2  # Qwen3: q/k norms
    gemma = parse_config(GEMMA)
    tensors = family_for_config(GEMMA).build(gemma).to_hf_state_dict()
    del tensors["model.layers.0.pre_feedforward_layernorm.weight"], tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError) as raised:
        family_for_config(GEMMA).from_hf(tensors, gemma)
    assert raised.value.args[0] == [
        "model.layers.0.pre_feedforward_layernorm.weight",
        "model.layers.1.mlp.up_proj.weight",
    ]
