"""Gemma 3 text models (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``; GGUF ``gemma3``).

How a Gemma 3 block differs from a Llama one:

* local and global layers: most layers attend over a sliding window and rotate with their own
  RoPE base (``rope_parameters["sliding_attention"]``, 10k); every few layers (``layer_types``)
  attends to everything with the global base (1M, possibly scaled);
* four RMSNorms per block (before and after attention, before and after the MLP) plus RMSNorm
  over ``head_dim`` on queries and keys; every Gemma norm scales by ``1 + weight`` and rounds to
  the activation dtype after scaling;
* GELU (tanh approximation) gating in the MLP;
* embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the activation dtype first);
* attention scaled by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
* optional final logit soft-capping ``cap * tanh(logits / cap)``.

Weights are stored fused like ``rill.models.llama`` (``qkv``, ``gate_up``; ``WEIGHTS``, see
``rill.models.weights``); ``rill.models.gemma3_config`` parses ``config.json``. ``FAMILY``
registers the family in ``rill.models.registry``, with how GGUF files map onto it (llama.cpp
stores the norm weights as ``1 + weight``).

Imports torch and ``rill.models`` only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import rill.models.packed as packed
from rill.models.attention import StepBatch, cached_attention, window_mask, write_kv
from rill.models.config import ModelConfig
from rill.models.gemma3_config import LOCAL_ROPE_THETA, SLIDING_WINDOW_PATTERN, parse_gemma3_config
from rill.models.gguf_loader import metadata_value, rename_tensor, shape_of
from rill.models.registry import ModelFamily
from rill.models.rope import apply_rope, cos_sin_table, inverse_frequencies
from rill.models.weights import WeightNames

ARCHITECTURE = "Gemma3ForCausalLM"


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``, computed in float32 and rounded after scaling (as Gemma)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Layer(nn.Module):
    """One Gemma 3 block (fused q/k/v and gate/up projections)."""

    def __init__(self, config: ModelConfig, window: int | None) -> None:
        super().__init__()
        hd, eps = config.head_dim, config.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.window = window
        self.scale = config.attention_scale
        self.input_norm = GemmaRMSNorm(config.hidden_size, eps)
        self.qkv = nn.Linear(
            config.hidden_size, (config.num_heads + 2 * config.num_kv_heads) * hd, bias=config.has_qkv_bias
        )
        self.q_norm = GemmaRMSNorm(hd, eps)
        self.k_norm = GemmaRMSNorm(hd, eps)
        self.o_proj = nn.Linear(config.num_heads * hd, config.hidden_size, bias=config.has_o_bias)
        self.post_attn_norm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_mlp_norm = GemmaRMSNorm(config.hidden_size, eps)
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.post_mlp_norm = GemmaRMSNorm(config.hidden_size, eps)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm + QKV + q/k norm + RoPE: ``q [..., heads, hd]``, ``k``/``v [..., kv_heads, hd]``."""
        qkv = self.qkv(self.input_norm(x))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q = qkv[..., :q_size].unflatten(-1, (self.num_heads, self.head_dim))
        k = qkv[..., q_size : q_size + kv_size].unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = qkv[..., q_size + kv_size :].unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin), v

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """Pre-norm, GELU-tanh gated MLP, post-norm (without the residual)."""
        gate, up = self.gate_up(self.pre_mlp_norm(x)).chunk(2, dim=-1)
        return self.post_mlp_norm(self.down(F.gelu(gate, approximate="tanh") * up))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Cache-free block on ``x [B, T, hidden]``; ``mask`` [T, T] bool or None for plain causal."""
        q, k, v = self.project(x, cos, sin)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        x = x + self.post_attn_norm(self.o_proj(attn.transpose(1, 2).flatten(2)))
        return x + self.mlp(x)

    def forward_step(
        self,
        x: torch.Tensor,
        batch: StepBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """Cached block on packed tokens ``x [N, hidden]`` (see ``rill.models.attention``)."""
        q, k, v = self.project(x, cos, sin)
        write_kv(k_cache, v_cache, k, v, batch)
        attn = cached_attention(q, k_cache, v_cache, batch, self.window, scale=self.scale)
        x = x + self.post_attn_norm(self.o_proj(attn))
        return x + self.mlp(x)


class Gemma3Model(nn.Module):
    """Gemma 3 text causal LM (the ``CausalLM`` protocol of ``rill.models.registry``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3Layer(config, window) for window in config.sliding_windows)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        # Global layers rotate with rope_theta (+ scaling); sliding-window layers with their own base.
        self.inv_freq = {
            False: inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling),
            True: inverse_frequencies(
                config.head_dim, config.local_rope_theta or config.rope_theta, {"rope_type": "default"}
            ),
        }
        self._tables: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
        self._table_len = 0

    @property
    def windows(self) -> set[int | None]:
        """The distinct attention windows of the layers (None = full attention)."""
        return {layer.window for layer in self.layers}  # type: ignore[misc]

    def lm_weight(self) -> torch.Tensor:
        """The LM head matrix ``[vocab, hidden]`` (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def ensure_rope(self, length: int) -> None:
        """Make both float32 cos/sin tables cover positions ``[0, length)`` (grows by doubling)."""
        device = self.embed_tokens.weight.device
        if self._table_len >= length and self._tables and self._tables[False][0].device == device:
            return
        size = max(length, 2 * self._table_len, 256)
        self._tables = {is_local: cos_sin_table(freq.to(device), size) for is_local, freq in self.inv_freq.items()}
        self._table_len = size

    def _rope_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        rows = {}
        for is_local, (cos, sin) in self._tables.items():
            c = cos.index_select(0, positions.flatten()).view(*positions.shape, 1, -1).to(dtype)
            s = sin.index_select(0, positions.flatten()).view(*positions.shape, 1, -1).to(dtype)
            rows[is_local] = (c, s)
        return rows

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # The scale is rounded to the activation dtype before multiplying (as the reference).
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = packed.linear(self.norm(x), self.lm_weight())
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward: ``input_ids [B, T]`` → logits ``[B, T, vocab]`` in the model dtype."""
        num_tokens = input_ids.shape[1]
        x = self._embed(input_ids)
        self.ensure_rope(num_tokens)
        rope = self._rope_rows(torch.arange(num_tokens, device=input_ids.device), x.dtype)
        masks = {window: window_mask(num_tokens, window, x.device) for window in self.windows}
        for layer in self.layers:
            cos, sin = rope[layer.window is not None]
            x = layer(x, cos, sin, masks[layer.window])  # type: ignore[index]
        return self._logits(x)

    def forward_step(self, batch: StepBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One cached step; returns float32 logits ``[M, vocab]`` for ``batch.logits_index``."""
        x = self._embed(batch.input_ids)
        rope = self._rope_rows(batch.positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            cos, sin = rope[layer.window is not None]
            x = layer.forward_step(x, batch, k_cache, v_cache, cos, sin)  # type: ignore[operator]
        if batch.logits_index is not None:
            if not batch.logits_index.numel():
                return x.new_empty((0, self.config.vocab_size), dtype=torch.float32)
            x = x.index_select(0, batch.logits_index)
        return self._logits(x).float()

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under Hugging Face names (projections unfused), sharing no storage."""
        return WEIGHTS.to_hf(self.state_dict(), self.config)


# ------------------------------------------------------------------------- weight names

WEIGHTS = WeightNames(
    layer={  # our name -> Hugging Face's, inside one layer (q/k/v, gate/up: weights.FUSED)
        "input_norm.weight": "input_layernorm.weight",
        "q_norm.weight": "self_attn.q_norm.weight",
        "k_norm.weight": "self_attn.k_norm.weight",
        "o_proj.weight": "self_attn.o_proj.weight",
        "o_proj.bias": "self_attn.o_proj.bias",
        "post_attn_norm.weight": "post_attention_layernorm.weight",
        "pre_mlp_norm.weight": "pre_feedforward_layernorm.weight",
        "post_mlp_norm.weight": "post_feedforward_layernorm.weight",
        "down.weight": "mlp.down_proj.weight",
    }
)
"""The Gemma 3 family's weight names (``rill.models.weights``)."""


def init_weights(model: Gemma3Model, initializer_range: float, seed: int | None = None) -> None:
    """Random init as transformers does: normal(0, range) matrices, zero biases, zero norms (scale 1)."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias")):
                param.zero_()
            else:
                param.copy_(torch.empty(param.shape).normal_(0.0, initializer_range, generator=generator))


# ------------------------------------------------------------------------------- GGUF

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gguf_config(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> dict[str, Any]:
    """The ``config.json`` dict of a ``gemma3`` GGUF file.

    The file does not store the layer pattern, the local RoPE base or ``query_pre_attn_scalar``:
    they are Gemma 3's fixed values (every 6th layer global, base 10k, ``head_dim``; the 62-layer
    27B model scales by ``hidden_size / heads``), as llama.cpp assumes.
    """
    value = functools.partial(metadata_value, metadata, source=source)
    num_layers = int(value("gemma3.block_count"))
    hidden = int(value("gemma3.embedding_length"))
    heads = int(value("gemma3.attention.head_count"))
    head_dim = int(metadata.get("gemma3.attention.key_length", 256))
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "gemma3_text",
        "hidden_size": hidden,
        "intermediate_size": int(value("gemma3.feed_forward_length")),
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get("gemma3.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(metadata.get("gemma3.context_length", 32768)),
        "rms_norm_eps": float(value("gemma3.attention.layer_norm_rms_epsilon")),
        "sliding_window": int(value("gemma3.attention.sliding_window")),
        "layer_types": [
            "sliding_attention" if (i + 1) % SLIDING_WINDOW_PATTERN else "full_attention" for i in range(num_layers)
        ],
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": float(metadata.get("gemma3.rope.freq_base", 1e6))},
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_ROPE_THETA},
        },
        "query_pre_attn_scalar": hidden // heads if num_layers == 62 else head_dim,
        "final_logit_softcapping": metadata.get("gemma3.final_logit_softcapping"),
        "vocab_size": shape_of(shapes, "token_embd.weight", source)[0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "hidden_activation": "gelu_pytorch_tanh",
    }
    scaling = metadata.get("gemma3.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_parameters"]["full_attention"] |= {
            "rope_type": scaling,
            "factor": float(metadata.get("gemma3.rope.scaling.factor", 1.0)),
        }
    return config


def gguf_fix_tensor(hf_name: str, tensor: torch.Tensor, hf_config: dict[str, Any]) -> torch.Tensor:
    """llama.cpp stores Gemma's norm weights as ``1 + weight`` (its norm multiplies directly)."""
    return tensor - 1.0 if hf_name.endswith("norm.weight") else tensor


FAMILY = ModelFamily(
    name="gemma3",
    model_types={ARCHITECTURE: "gemma3_text"},
    gguf_architectures=("gemma3",),
    parse_config=parse_gemma3_config,
    build=Gemma3Model,
    expected_hf_names=WEIGHTS.expected_hf_names,
    from_hf=WEIGHTS.from_hf,
    to_hf=WEIGHTS.to_hf,
    init_weights=lambda model, initializer_range, seed: init_weights(model, initializer_range, seed),
    gguf_config=gguf_config,
    gguf_tensor_name=lambda name: rename_tensor(name, _GGUF_LAYER_NAMES),
    gguf_fix_tensor=gguf_fix_tensor,
)
"""The Gemma 3 family in the model registry."""
