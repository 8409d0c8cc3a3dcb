"""Model configuration: ``ModelConfig`` and what every family's ``config.json`` parser shares.

``ModelConfig`` is the one set of facts the model code, the runner and the engine read. Each
family parses its own files (``rill.models.llama_config``, ``rill.models.gemma3_config``);
``rill.models.registry.parse_config`` picks the parser of a file's architecture. The helpers
here (required sizes, RoPE settings, special ids, generation defaults) are shared by the
parsers. Both spellings of RoPE settings are read: ``rope_theta`` + ``rope_scaling`` (older
files) and ``rope_parameters`` (what transformers 5.x ``save_pretrained`` writes).

Imports only the standard library, torch (for dtype names) and ``rill.errors``: nothing of
the registry or the families, which import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rill.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "dynamic")
"""RoPE variants implemented. ``dynamic`` equals ``default`` up to ``max_position_embeddings``,
which is why a dynamic-RoPE model's context is capped there (see ``ModelConfig.max_context_tokens``)."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Generation defaults copied from generation_config.json when present (sampling fields only).
_GENERATION_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "do_sample",
    "max_new_tokens",
    "max_length",
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the model, the runner and the engine need to know about a checkpoint.

    Attributes:
        architecture: the Hugging Face class name, e.g. ``"LlamaForCausalLM"``.
        hidden_size, num_layers, num_heads, num_kv_heads, head_dim, intermediate_size,
        vocab_size: the model's shape.
        max_position_embeddings: the trained context from ``config.json``.
        dtype: torch dtype name of the loaded weights (``"float32"``, ``"bfloat16"``).
        device: torch device string (``"cpu"``, ``"cuda:0"``).
        tie_word_embeddings: the LM head shares the input embedding matrix.
        eos_token_ids: every end-of-sequence id (config.json and generation_config.json).
        generation_defaults: sampling defaults from generation_config.json (may be empty).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: normalised RoPE parameters (``rope_type`` plus its fields).
        has_qkv_bias: q/k/v projections have a bias (Qwen2; Llama/Qwen3 ``attention_bias``).
        has_o_bias: the output projection has a bias (Llama/Qwen3 ``attention_bias``).
        has_qk_norm: RMSNorm over ``head_dim`` on queries and keys before RoPE (Qwen3).
        sliding_windows: per layer, the attention window in tokens or None for full attention.
        attention_scale: multiplies q·k (None: ``head_dim ** -0.5``); Gemma's
            ``query_pre_attn_scalar ** -0.5``.
        local_rope_theta: RoPE base of sliding-window layers when it differs (Gemma 3).
        final_logit_softcapping: ``cap * tanh(logits / cap)`` on the output when set (Gemma).
        bos_token_id, pad_token_id: special ids from config.json (may be None).
        hf_config: the raw ``config.json`` dict (for saving and for reference tests).
    """

    architecture: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str = "float32"
    device: str = "cpu"
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    has_qkv_bias: bool = False
    has_o_bias: bool = False
    has_qk_norm: bool = False
    sliding_windows: tuple[int | None, ...] = ()
    attention_scale: float | None = None
    local_rope_theta: float | None = None
    final_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The weights' dtype as a ``torch.dtype``."""
        return _DTYPES[self.dtype]

    @property
    def num_query_groups(self) -> int:
        """Query heads per KV head (1 for plain multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def max_context_tokens(self) -> int:
        """The longest context this implementation serves faithfully.

        ``max_position_embeddings``; for ``dynamic`` RoPE it is also a hard cap, since past it
        the frequencies would change with the sequence length.
        """
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """Bytes of keys plus values for one token over all layers in ``dtype`` (default: the model's)."""
        itemsize = torch.empty((), dtype=dtype or self.torch_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def with_runtime(self, dtype: str, device: str) -> ModelConfig:
        """Return a copy with the runtime dtype and device filled in."""
        values = {name: getattr(self, name) for name in self.__dataclass_fields__}
        return ModelConfig(**(values | {"dtype": dtype, "device": device}))


def dtype_name(dtype: str | torch.dtype) -> str:
    """Normalise ``"bfloat16"`` / ``torch.bfloat16`` / ``"bf16"`` to a dtype name; raise ValueError."""
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16"}
    name = aliases.get(dtype, dtype)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype '{dtype}'; use one of auto, {', '.join(_DTYPES)}")
    return name


def required_sizes(hf: dict[str, Any], source: str) -> dict[str, int]:
    """The sizes every decoder's ``config.json`` must give (hidden size, heads, layers,
    vocabulary, MLP width) and its key/value heads (default: as many as the heads), named as
    ``ModelConfig``'s fields.

    Raises:
        ModelLoadError: a required field is missing, or the key/value heads do not divide the heads.
    """
    try:
        hidden_size = int(hf["hidden_size"])
        num_heads = int(hf["num_attention_heads"])
        num_layers = int(hf["num_hidden_layers"])
        vocab_size = int(hf["vocab_size"])
        intermediate_size = int(hf["intermediate_size"])
    except KeyError as exc:
        raise ModelLoadError(f"{source}: required field {exc.args[0]!r} is missing") from exc
    num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
        )
    return dict(
        hidden_size=hidden_size,
        num_heads=num_heads,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
    )


def generation_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields of a ``generation_config.json`` dict that are set."""
    return {k: generation[k] for k in _GENERATION_KEYS if generation.get(k) is not None}


def rope_settings(hf: dict[str, Any], source: str) -> tuple[float, dict[str, Any]]:
    """``(rope_theta, normalised rope parameters)`` of a config dict; refuses unsupported types."""
    # transformers 5 writes "rope_parameters" (with rope_theta inside); older files have
    # top-level "rope_theta" and an optional "rope_scaling" whose type key may be "type".
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "rope_type" not in params and "type" in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    rope_theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: RoPE type '{rope_type}' is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor is not supported")
    needed = {
        "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
        "linear": ("factor",),
        "dynamic": ("factor",),
    }.get(rope_type, ())
    missing = [name for name in needed if name not in params]
    if missing:
        raise ModelLoadError(f"{source}: RoPE type '{rope_type}' needs {', '.join(missing)}")
    return rope_theta, params


def eos_ids(value: Any) -> tuple[int, ...]:
    """End-of-sequence ids from an int, a list or None (deduplicated, in order)."""
    ids: list[int] = []
    for token_id in value if isinstance(value, list) else [value]:
        if token_id is not None and int(token_id) not in ids:
            ids.append(int(token_id))
    return tuple(ids)


def first_id(value: Any) -> int | None:
    """A special id given as an int, a list (its first) or None."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)
