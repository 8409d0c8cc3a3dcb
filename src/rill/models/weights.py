"""Hugging Face ↔ rill weight names, for every family: one table per family, one set of functions.

Every family's model stores the q/k/v projections stacked in one ``qkv`` matrix and the gate
and up projections in one ``gate_up`` (``FUSED``), its layers as ``layers.N.<name>`` where a
Hugging Face checkpoint has ``model.layers.N.<its name>``, and the embedding, final norm and
LM head alike (``GLOBAL``). What differs between families is only the per-layer renaming (a
Gemma block has four norms, a Llama block two): a family module gives that table to
``WeightNames`` and registers its methods (``expected_hf_names``, ``from_hf``, ``to_hf``) in
its ``ModelFamily``.

Which optional tensors a checkpoint holds is the config's to say (``present``): the q/k/v
and output biases, and the q/k norms.

Imports torch and ``rill.models.config`` / ``rill.models.quant_values`` (quantized parts are
concatenated by ``quant_values.cat``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

import rill.models.quant_values as quant_values
from rill.models.config import ModelConfig

FUSED: Mapping[str, tuple[str, ...]] = {
    "qkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "gate_up.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
"""Our fused tensor inside a layer → the Hugging Face tensors stacked in it, in row order."""

GLOBAL: Mapping[str, str] = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
"""Our tensors outside the layers → Hugging Face's (the LM head, when not tied, keeps its name)."""

LM_HEAD = "lm_head.weight"


def present(config: ModelConfig, name: str) -> bool:
    """Whether a model of ``config`` has the per-layer tensor ``name`` (ours): the optional
    biases and q/k norms follow the config, every other tensor is always there."""
    if name == "qkv.bias":
        return config.has_qkv_bias
    if name == "o_proj.bias":
        return config.has_o_bias
    if name in ("q_norm.weight", "k_norm.weight"):
        return config.has_qk_norm
    return True


def fused_sizes(config: ModelConfig, name: str) -> list[int]:
    """The rows of each part of the fused tensor ``name`` (``FUSED``), in order."""
    if name == "gate_up.weight":
        return [config.intermediate_size] * 2
    hd = config.head_dim
    return [config.num_heads * hd, config.num_kv_heads * hd, config.num_kv_heads * hd]


@dataclass(frozen=True)
class WeightNames:
    """One family's weight names and the conversions built on them.

    Attributes:
        layer: our tensor inside a layer → the Hugging Face tensor inside ``model.layers.N``,
            for every tensor that is not fused (``FUSED``).
    """

    layer: Mapping[str, str]

    def expected_hf_names(self, config: ModelConfig) -> list[str]:
        """The Hugging Face tensor names a checkpoint of ``config`` must contain."""
        names = list(GLOBAL.values()) + ([] if config.tie_word_embeddings else [LM_HEAD])
        for i in range(config.num_layers):
            names += [f"model.layers.{i}.{theirs}" for ours, theirs in self.layer.items() if present(config, ours)]
            names += [
                f"model.layers.{i}.{part}" for ours, parts in FUSED.items() if present(config, ours) for part in parts
            ]
        return names

    def from_hf(self, tensors: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """Hugging Face tensors → this family's state dict, q/k/v and gate/up concatenated
        (quantized parts by ``quant_values.cat``).

        Missing names raise ``KeyError`` listing them; extra names (e.g. rotary buffers) are ignored.
        """
        missing = [name for name in self.expected_hf_names(config) if name not in tensors]
        if missing:
            raise KeyError(missing)
        out = {ours: tensors[theirs] for ours, theirs in GLOBAL.items()}
        if not config.tie_word_embeddings:
            out[LM_HEAD] = tensors[LM_HEAD]
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            out.update(
                (f"layers.{i}.{ours}", tensors[prefix + theirs])
                for ours, theirs in self.layer.items()
                if present(config, ours)
            )
            out.update(
                (f"layers.{i}.{ours}", quant_values.cat([tensors[prefix + part] for part in parts]))  # type: ignore[misc]
                for ours, parts in FUSED.items()
                if present(config, ours)
            )
        return out

    def to_hf(self, state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """Inverse of ``from_hf``: a state dict → Hugging Face names (fused tensors split),
        sharing no storage with ``state``."""
        out = {theirs: state[ours] for ours, theirs in GLOBAL.items()}
        if not config.tie_word_embeddings:
            out[LM_HEAD] = state[LM_HEAD]
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            out.update(
                (prefix + theirs, state[f"layers.{i}.{ours}"])
                for ours, theirs in self.layer.items()
                if f"layers.{i}.{ours}" in state
            )
            for ours, parts in FUSED.items():
                if f"layers.{i}.{ours}" in state:
                    pieces = state[f"layers.{i}.{ours}"].split(fused_sizes(config, ours))
                    out.update((prefix + part, piece) for part, piece in zip(parts, pieces))
        return {name: tensor.detach().clone().contiguous() for name, tensor in out.items()}
