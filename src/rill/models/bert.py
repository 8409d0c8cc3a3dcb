"""BERT encoders (``BertModel``, ``model_type`` ``bert``): the text tower of sentence-embedding
models such as all-MiniLM-L6-v2.

How an encoder differs from the decoders beside it (``rill.models.llama``):

* attention is bidirectional: every token sees every other token of its input, and only the
  padding of a batch is masked out (no causal mask, no KV cache, one forward per input);
* positions are learned absolute embeddings, added to the word and token-type embeddings and
  normalised (LayerNorm) before the first layer;
* each layer is post-norm: ``x = LayerNorm(x + attention(x))``, ``x = LayerNorm(x + FFN(x))``,
  with biases everywhere and GELU in the FFN.

What comes out is one hidden state per token; ``rill.models.embedder`` pools them into one
vector per input. ``parse_bert_config`` reads ``config.json``; ``from_hf`` maps a checkpoint's
tensors (``BertModel`` names, or ``bert.``-prefixed ones from a task model) onto ``BertEncoder``,
with q/k/v stacked in one ``qkv`` matrix. ``FAMILY`` registers the family in
``rill.models.registry`` (``ENCODER_MODULES``).

Imports torch and ``rill.errors`` / ``rill.models.registry`` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rill.errors import ModelLoadError
from rill.models.registry import EncoderFamily

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
"""``hidden_act`` values this module runs (``gelu`` is the exact, erf-based GELU)."""


@dataclass(frozen=True)
class BertConfig:
    """The sizes and settings of one BERT encoder, read from ``config.json``.

    Attributes:
        vocab_size: rows of the word embedding.
        hidden_size: width of every hidden state (the token embeddings' size).
        num_layers: encoder layers.
        num_heads: attention heads per layer (``hidden_size`` must divide by it).
        intermediate_size: width of the FFN's inner layer.
        max_position_embeddings: rows of the position embedding: the longest input it can read.
        type_vocab_size: rows of the token-type embedding (segment A/B).
        layer_norm_eps: epsilon of every LayerNorm.
        hidden_act: the FFN's activation (a key of ``_ACTIVATIONS``).
        pad_token_id: the padding token's id.
        hf_config: the ``config.json`` dict as read (for what others look up, e.g. Matryoshka).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    hf_config: Mapping[str, Any]

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads


def parse_bert_config(hf: Mapping[str, Any], source: str) -> BertConfig:
    """``config.json`` of a BERT encoder → ``BertConfig``.

    Raises:
        ModelLoadError: a missing size, heads that do not divide the width, an activation or a
            position embedding type this module does not run; the message names ``source``.
    """
    try:
        sizes = {
            "vocab_size": int(hf["vocab_size"]),
            "hidden_size": int(hf["hidden_size"]),
            "num_layers": int(hf["num_hidden_layers"]),
            "num_heads": int(hf["num_attention_heads"]),
            "intermediate_size": int(hf["intermediate_size"]),
        }
    except KeyError as exc:
        raise ModelLoadError(f"{source}: required field {exc.args[0]!r} is missing") from exc
    if sizes["hidden_size"] % sizes["num_heads"]:
        raise ModelLoadError(
            f"{source}: hidden_size {sizes['hidden_size']} is not a multiple of num_attention_heads {sizes['num_heads']}"
        )
    act = str(hf.get("hidden_act", "gelu"))
    if act not in _ACTIVATIONS:
        raise ModelLoadError(f"{source}: hidden_act '{act}' is not supported (only {', '.join(_ACTIVATIONS)})")
    position_type = hf.get("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise ModelLoadError(f"{source}: position_embedding_type '{position_type}' is not supported (only absolute)")
    return BertConfig(
        **sizes,
        max_position_embeddings=int(hf.get("max_position_embeddings", 512)),
        type_vocab_size=int(hf.get("type_vocab_size", 2)),
        layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        hidden_act=act,
        pad_token_id=int(hf.get("pad_token_id") or 0),
        hf_config=dict(hf),
    )


class BertLayer(nn.Module):
    """One post-norm encoder layer: self-attention over the unpadded tokens, then the FFN."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.up = nn.Linear(h, config.intermediate_size)
        self.down = nn.Linear(config.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``x`` ``[B, T, H]``; ``keep`` ``[B, 1, 1, T]`` bool, True for the keys to attend to."""
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        # q, k, v: [B, heads, T, head_dim]; no causal mask: every token sees its whole input.
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = self.attn_norm(x + self.attn_out(attended.transpose(1, 2).reshape(b, t, h)))
        return self.ffn_norm(x + self.down(self.act(self.up(x))))


class BertEncoder(nn.Module):
    """The embeddings and the layers of a BERT model, without its pooler or task head."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.tokens = nn.Embedding(config.vocab_size, h)
        self.positions = nn.Embedding(config.max_position_embeddings, h)
        self.token_types = nn.Embedding(config.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, T]`` (right-padded) and their mask ``[B, T]`` (1 for real tokens) →
        hidden states ``[B, T, hidden]``. Every input is one segment (token type 0), as a
        sentence-embedding model reads it."""
        t = input_ids.shape[1]
        positions = torch.arange(t, device=input_ids.device)
        x = self.tokens(input_ids) + self.positions(positions)[None] + self.token_types.weight[0]
        x = self.embed_norm(x)
        keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, T]: broadcast over heads and queries
        for layer in self.layers:
            x = layer(x, keep)
        return x


_GLOBAL = {
    "tokens.weight": "embeddings.word_embeddings.weight",
    "positions.weight": "embeddings.position_embeddings.weight",
    "token_types.weight": "embeddings.token_type_embeddings.weight",
    "embed_norm.weight": "embeddings.LayerNorm.weight",
    "embed_norm.bias": "embeddings.LayerNorm.bias",
}
"""Our tensors outside the layers → ``BertModel``'s."""

_LAYER = {
    "attn_out.weight": "attention.output.dense.weight",
    "attn_out.bias": "attention.output.dense.bias",
    "attn_norm.weight": "attention.output.LayerNorm.weight",
    "attn_norm.bias": "attention.output.LayerNorm.bias",
    "up.weight": "intermediate.dense.weight",
    "up.bias": "intermediate.dense.bias",
    "down.weight": "output.dense.weight",
    "down.bias": "output.dense.bias",
    "ffn_norm.weight": "output.LayerNorm.weight",
    "ffn_norm.bias": "output.LayerNorm.bias",
}
"""Our tensor inside ``layers.N`` → ``BertModel``'s inside ``encoder.layer.N`` (q/k/v: ``_QKV``)."""

_QKV = {
    "qkv.weight": ("attention.self.query.weight", "attention.self.key.weight", "attention.self.value.weight"),
    "qkv.bias": ("attention.self.query.bias", "attention.self.key.bias", "attention.self.value.bias"),
}
"""Our stacked q/k/v tensors → the ``BertModel`` tensors stacked in them, in row order."""


def expected_hf_names(config: BertConfig) -> list[str]:
    """The ``BertModel`` tensor names a checkpoint of ``config`` must contain."""
    names = list(_GLOBAL.values())
    for i in range(config.num_layers):
        names += [f"encoder.layer.{i}.{theirs}" for theirs in _LAYER.values()]
        names += [f"encoder.layer.{i}.{part}" for parts in _QKV.values() for part in parts]
    return names


def _hf_name(name: str) -> str:
    """A checkpoint's tensor name as ``BertModel`` spells it: without the ``bert.`` prefix of a
    task model (``BertForMaskedLM``) and with ``weight``/``bias`` for the TF-era LayerNorm
    ``gamma``/``beta``."""
    name = name.removeprefix("bert.")
    if "LayerNorm." in name:
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    return name


def from_hf(tensors: Mapping[str, torch.Tensor], config: BertConfig) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors → ``BertEncoder``'s state dict (q/k/v stacked); the pooler, task
    heads and buffers (``position_ids``) are ignored.

    Raises:
        ModelLoadError: a tensor the encoder needs is missing (the first few are named).
    """
    named = {_hf_name(name): tensor for name, tensor in tensors.items()}
    missing = [name for name in expected_hf_names(config) if name not in named]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"the weights are missing tensors: {shown}")
    state = {ours: named[theirs] for ours, theirs in _GLOBAL.items()}
    for i in range(config.num_layers):
        prefix = f"encoder.layer.{i}."
        state.update((f"layers.{i}.{ours}", named[prefix + theirs]) for ours, theirs in _LAYER.items())
        state.update(
            (f"layers.{i}.{ours}", torch.cat([named[prefix + part] for part in parts])) for ours, parts in _QKV.items()
        )
    return state


FAMILY = EncoderFamily(
    name="bert",
    model_types={"BertModel": "bert"},
    parse_config=parse_bert_config,
    build=BertEncoder,
    from_hf=from_hf,
)
"""The BERT family in ``rill.models.registry`` (``ENCODER_MODULES``)."""
