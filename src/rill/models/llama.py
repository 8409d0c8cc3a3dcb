"""One decoder-only transformer for the Llama family: Llama (incl. Llama 3 RoPE), Mistral,
Qwen2 (q/k/v bias) and Qwen3 (q/k RMSNorm).

Weights are stored fused: ``qkv`` (q, k, v projections stacked) and ``gate_up`` (gate and up
projections stacked), so each block runs three large matmuls plus the output and down
projections. ``WEIGHTS`` (``rill.models.weights``) converts from/to the Hugging Face tensor
names; ``rill.models.llama_config`` parses ``config.json``.

Two entry points:

* ``model(input_ids [B, T]) -> logits [B, T, V]``: cache-free causal forward; autograd works
  (used for training and as a reference).
* ``model.forward_step(batch, kv_caches) -> float32 logits [M, V]``: one engine step over a
  contiguous per-row KV cache (see ``rill.models.attention``).

``FAMILY`` registers it in ``rill.models.registry``, with how its GGUF files (``llama``,
``qwen2``, ``qwen3``) map onto Hugging Face names.

Imports torch and ``rill.models`` only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import rill.models.packed as packed
import rill.models.qkernel as qkernel
import rill.models.quant as quant
from rill.errors import ModelLoadError
from rill.models.attention import StepBatch, cached_attention, prefill_attention, window_mask, write_kv
from rill.models.config import ModelConfig
from rill.models.gguf_loader import metadata_value, rename_tensor, shape_of
from rill.models.llama_config import parse_llama_config
from rill.models.registry import ModelFamily
from rill.models.rope import apply_rope, cos_sin_table, inverse_frequencies
from rill.models.weights import WeightNames


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and scaled in the input dtype (as transformers)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise over the last dimension."""
        return self.weight * _rms(x, self.eps)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # Unweighted RMS norm (torch accumulates in float32 for bf16 input), rounded to x's dtype
    # before the weight multiplies: the order transformers uses, bit for bit in bf16 too.
    return F.rms_norm(x, (x.shape[-1],), eps=eps)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block with fused projections."""

    def __init__(self, config: ModelConfig, window: int | None) -> None:
        super().__init__()
        hd = config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.window = window
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        qkv_size = (config.num_heads + 2 * config.num_kv_heads) * hd
        self.qkv = nn.Linear(config.hidden_size, qkv_size, bias=config.has_qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, config.hidden_size, bias=config.has_o_bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps) if config.has_qk_norm else None
        self.k_norm = RMSNorm(hd, config.rms_norm_eps) if config.has_qk_norm else None
        self.post_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm + fused QKV + q/k norm + RoPE on ``x [..., hidden]``.

        Returns ``q [..., heads, hd]``, ``k`` and ``v [..., kv_heads, hd]``; ``cos/sin`` broadcast
        as ``[..., 1, hd]``.
        """
        return self._split(packed.normed_linear(x, self.input_norm, self.qkv.weight, self.qkv.bias), cos, sin)

    def _split(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_qk = self.num_heads + self.num_kv_heads
        qk = qkv[..., : num_qk * self.head_dim].unflatten(-1, (num_qk, self.head_dim))
        v = qkv[..., num_qk * self.head_dim :].unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None:
            # One norm over q and k heads together, then each gets its own weight.
            weight = torch.cat(
                (self.q_norm.weight.expand(self.num_heads, -1), self.k_norm.weight.expand(self.num_kv_heads, -1))  # type: ignore[union-attr]
            )
            qk = weight * _rms(qk, self.q_norm.eps)
        qk = apply_rope(qk, cos, sin)
        return qk[..., : self.num_heads, :], qk[..., self.num_heads :, :], v

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """Post-attention norm + SwiGLU MLP (without the residual)."""
        gate_up = packed.normed_linear(x, self.post_norm, self.gate_up.weight, self.gate_up.bias)
        return packed.swiglu_linear(gate_up, self.down.weight, self.down.bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Cache-free block on ``x [B, T, hidden]``; ``mask`` [T, T] bool or None for plain causal."""
        q, k, v = self.project(x, cos, sin)  # [B, T, heads, hd]
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, heads, T, hd]
        x = x + self.o_proj(attn.transpose(1, 2).flatten(2))
        return x + self.mlp(x)

    def forward_step(
        self, x: torch.Tensor, batch: StepBatch, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        """Cached block on packed tokens ``x [N, hidden]`` (see ``rill.models.attention``).

        With quantized projections the decode rows' RoPE, cache writes and attention are one
        kernel call (``qkernel.decode_attention``), and so are the chunks of a step that may
        go token by token (``StepBatch.by_token``: speculative drafts, or small prompt chunks
        beside decode rows), exactly as decode steps compute them; other prompt chunks, and
        every model whose projections are dense (bit-for-bit with transformers), take the
        torch path.
        """
        if self.q_norm is None and isinstance(self.qkv, quant.QuantizedLinear) and (batch.num_decode or batch.by_token):
            qkv = packed.normed_linear(x, self.input_norm, self.qkv.weight, self.qkv.bias)
            whole = batch.all_by_token
            decode = qkv.shape[0] if whole else batch.num_decode
            attn = qkernel.decode_attention(
                qkv[:decode],
                batch.cos[:decode],
                batch.sin[:decode],
                batch.positions[:decode],
                k_cache,
                v_cache,
                self.num_heads,
                self.window,
                cache_rows=batch.write_rows if batch.prefill is not None and whole else None,
            )
            if attn is not None:
                if not whole:
                    q, k, v = self._split(qkv[decode:], batch.cos[decode:], batch.sin[decode:])
                    write_kv(k_cache, v_cache, k, v, batch, first=decode)
                    attn = torch.cat((attn, prefill_attention(q, k_cache, v_cache, batch.prefill, self.window)))
                x = x + self.o_proj(attn)
                return x + self.mlp(x)
            q, k, v = self._split(qkv, batch.cos, batch.sin)
        else:
            q, k, v = self.project(x, batch.cos, batch.sin)  # type: ignore[arg-type]  # [N, heads, hd]
        write_kv(k_cache, v_cache, k, v, batch)
        x = x + self.o_proj(cached_attention(q, k_cache, v_cache, batch, self.window))
        return x + self.mlp(x)


class LlamaModel(nn.Module):
    """Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3) with fused projections.

    Args:
        config: the parsed configuration; ``config.dtype``/``device`` are not applied here
            (call ``.to()``); the loader does.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        windows = config.sliding_windows or (None,) * config.num_layers
        self.layers = nn.ModuleList(DecoderLayer(config, windows[i]) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
        # Plain attributes, not buffers: derived data that must not enter state_dict.
        self._rope_cos = torch.empty(0, device="cpu")
        self._rope_sin = torch.empty(0, device="cpu")
        # Every layer in the decode kernel's terms, built at the first decode step (False: it does not apply).
        self._decode_layers: qkernel.DecodeLayers | bool | None = None

    @property
    def windows(self) -> set[int | None]:
        """The distinct attention windows of the layers (None = full attention)."""
        return {layer.window for layer in self.layers}  # type: ignore[misc]

    def lm_weight(self) -> torch.Tensor:
        """The LM head matrix ``[vocab, hidden]`` (the embedding when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope_rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``cos, sin [*positions.shape, 1, hd]`` in ``dtype`` for integer ``positions``.

        Positions must be below the table size set by ``ensure_rope`` (no device sync here).
        """
        cos = self._rope_cos.index_select(0, positions.flatten()).view(*positions.shape, 1, -1)
        sin = self._rope_sin.index_select(0, positions.flatten()).view(*positions.shape, 1, -1)
        return cos.to(dtype), sin.to(dtype)

    def ensure_rope(self, length: int) -> None:
        """Make the float32 cos/sin table cover positions ``[0, length)`` (grows by doubling)."""
        device = self.embed_tokens.weight.device
        if self._rope_cos.shape[0] >= length and self._rope_cos.device == device:
            return
        size = max(length, 2 * self._rope_cos.shape[0], 256)
        self._rope_cos, self._rope_sin = cos_sin_table(self.inv_freq.to(device), size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward: ``input_ids [B, T]`` → logits ``[B, T, vocab]`` in the model dtype."""
        num_tokens = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        self.ensure_rope(num_tokens)
        positions = torch.arange(num_tokens, device=input_ids.device)
        cos, sin = self.rope_rows(positions, x.dtype)  # [T, 1, hd]
        masks = {window: window_mask(num_tokens, window, x.device) for window in self.windows}
        for layer in self.layers:
            x = layer(x, cos, sin, masks[layer.window])  # type: ignore[index]
        return packed.linear(self.norm(x), self.lm_weight())

    def forward_step(self, batch: StepBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One cached step; returns float32 logits ``[M, vocab]`` for ``batch.logits_index``.

        ``kv_caches[i]`` is layer ``i``'s ``(keys, values)``, each ``[rows, kv_heads, max_len, hd]``;
        the caller has called ``ensure_rope(max_len)``.
        """
        x = self.embed_tokens(batch.input_ids)  # [N, hidden]
        batch.cos, batch.sin = self.rope_rows(batch.positions, x.dtype)
        if not self._step_in_one_call(x, batch, kv_caches):
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                x = layer.forward_step(x, batch, k_cache, v_cache)  # type: ignore[operator]
        if batch.logits_index is not None:
            if not batch.logits_index.numel():
                return x.new_empty((0, self.config.vocab_size), dtype=torch.float32)
            x = x.index_select(0, batch.logits_index)
        return packed.normed_linear(x, self.norm, self.lm_weight()).float()

    def _step_in_one_call(
        self, x: torch.Tensor, batch: StepBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> bool:
        """Run every layer on ``x`` in one kernel call (``qkernel.DecodeLayers``), in place, when
        the step's tokens may all go token by token (decode tokens, speculative drafts, small
        prompt chunks beside decode rows: ``StepBatch.by_token``) and every layer's products
        are the kernel's; False (nothing done) otherwise. Bit for bit what ``forward_step`` of
        each layer gives: the Python between the layers' calls was an eighth of a 1.5B model's
        decode step and more than half of a 135M one's."""
        if not batch.all_by_token:
            return False
        layers = self._decode_layers
        if layers is None:
            layers = self._decode_layers = self._build_decode_layers() or False
        if not isinstance(layers, qkernel.DecodeLayers):
            return False
        return layers.run(
            x,
            batch.cos,  # type: ignore[arg-type]
            batch.sin,  # type: ignore[arg-type]
            batch.positions,
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            self.config.num_heads,
            self.config.rms_norm_eps,
            cache_rows=None if batch.prefill is None else batch.write_rows,
        )

    def _build_decode_layers(self) -> qkernel.DecodeLayers | None:
        weights: list[qkernel.LayerWeights] = []
        for layer in self.layers:
            if layer.q_norm is not None or {layer.input_norm.eps, layer.post_norm.eps} != {self.config.rms_norm_eps}:
                return None
            products = (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            if not all(isinstance(p, quant.QuantizedLinear) for p in products):
                return None
            qkv, o, gate_up, down = ((p.weight, p.bias) for p in products)
            weights.append(
                qkernel.LayerWeights(
                    qkv, o, gate_up, down, layer.input_norm.weight, layer.post_norm.weight, layer.window
                )
            )
        return qkernel.DecodeLayers.build(weights)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> LlamaModel:
        # .to(), .half() and the like may give the weights new storage: the kernel's pointers go.
        self._decode_layers = None
        return super()._apply(fn, *args, **kwargs)

    def to_hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Return the weights under Hugging Face names (projections unfused), sharing no storage."""
        return WEIGHTS.to_hf(self.state_dict(), self.config)


WEIGHTS = WeightNames(
    layer={  # our name -> Hugging Face's, inside one layer (q/k/v, gate/up: weights.FUSED)
        "input_norm.weight": "input_layernorm.weight",
        "post_norm.weight": "post_attention_layernorm.weight",
        "o_proj.weight": "self_attn.o_proj.weight",
        "o_proj.bias": "self_attn.o_proj.bias",
        "q_norm.weight": "self_attn.q_norm.weight",
        "k_norm.weight": "self_attn.k_norm.weight",
        "down.weight": "mlp.down_proj.weight",
    }
)
"""The Llama family's weight names (``rill.models.weights``)."""


def init_weights(model: LlamaModel, initializer_range: float, seed: int | None = None) -> None:
    """Random init as transformers does: normal(0, range) for matrices, zero biases, unit norms."""
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = torch.empty(param.shape, dtype=torch.float32).normal_(
                    0.0, initializer_range, generator=generator
                )
                param.copy_(values)


# ------------------------------------------------------------------------------------ GGUF

_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_GGUF_LAYER_NAMES = {  # llama.cpp's name inside blk.N → Hugging Face's inside model.layers.N
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def gguf_config(metadata: dict[str, Any], shapes: dict[str, tuple[int, ...]], source: str) -> dict[str, Any]:
    """The ``config.json`` dict of a ``llama``/``qwen2``/``qwen3`` GGUF file (Mistral files say ``llama``)."""
    arch = str(metadata["general.architecture"])
    if "rope_freqs.weight" in shapes:
        raise ModelLoadError(
            f"{source}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 style) are not supported"
        )
    value = functools.partial(metadata_value, metadata, source=source)
    hidden = int(value(f"{arch}.embedding_length"))
    heads = int(value(f"{arch}.attention.head_count"))
    vocab_rows = shape_of(shapes, "token_embd.weight", source)[0]
    config: dict[str, Any] = {
        "architectures": [_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(value(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(value(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(metadata.get(f"{arch}.attention.key_length") or hidden // heads),
        "max_position_embeddings": int(metadata.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(value(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(metadata.get(f"{arch}.vocab_size", vocab_rows)),
        "tie_word_embeddings": "output.weight" not in shapes,
        "hidden_act": "silu",
        "attention_bias": "blk.0.attn_q.bias" in shapes and arch != "qwen2",
    }
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {
            "rope_type": scaling,
            "factor": float(metadata.get(f"{arch}.rope.scaling.factor", 1.0)),
        }
    return config


def gguf_tensor_name(name: str) -> str | None:
    """llama.cpp's tensor name → the Hugging Face name (None when unknown)."""
    return rename_tensor(name, _GGUF_LAYER_NAMES)


def gguf_fix_tensor(hf_name: str, tensor: torch.Tensor, hf_config: dict[str, Any]) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (Llama architecture only; Qwen files keep HF order)."""
    if hf_config["model_type"] != "llama" or not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return tensor
    heads = hf_config["num_attention_heads"] if hf_name.endswith("q_proj.weight") else hf_config["num_key_value_heads"]
    return unpermute_rows(tensor, heads)


def unpermute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter stores each head's rows interleaved (pairs ``(i, i + hd/2)`` next to
    each other, for its rotate-adjacent RoPE); put them back in rotate-half order."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def permute_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of ``unpermute_rows``: what llama.cpp's converter writes (used to write test files)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


FAMILY = ModelFamily(
    name="llama",
    model_types={
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
    },
    gguf_architectures=tuple(_GGUF_ARCHITECTURES),
    parse_config=parse_llama_config,
    build=LlamaModel,
    expected_hf_names=WEIGHTS.expected_hf_names,
    from_hf=WEIGHTS.from_hf,
    to_hf=WEIGHTS.to_hf,
    init_weights=lambda model, initializer_range, seed: init_weights(model, initializer_range, seed),
    gguf_config=gguf_config,
    gguf_tensor_name=gguf_tensor_name,
    gguf_fix_tensor=gguf_fix_tensor,
)
"""The Llama family in the model registry."""
