"""How big an engine's KV cache and warm-up are: tokens per sequence, rows the memory budget
holds, and the warm-up prefill's length.

Pure arithmetic over the configuration and the model's facts, plus one read of the memory
available now (``available_memory``). Imports ``rill.config`` (sizes) and ``rill.errors``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rill.config import EngineConfig, parse_size
from rill.errors import ModelLoadError

if TYPE_CHECKING:
    from rill.models.config import ModelConfig

log = logging.getLogger("rill.engine")

DEFAULT_MAX_CONTEXT = 4096
"""Tokens per sequence when neither ``--max-model-len`` nor a shorter model context says otherwise."""


WARM_UP_MACS = 4 * 10**11
"""Multiply-adds the warm-up's prefill may cost: about 2 s on a 2-core AVX-512 machine. The
first big step pays for first-touch memory and kernel set-up; a model whose full-budget
prefill takes minutes (Qwen2.5-1.5B: 8,190 tokens in 160 s) warms as well on fewer tokens."""


def warm_up_tokens(budget: int, num_parameters: int) -> int:
    """Tokens of the warm-up prefill: the step budget, capped so it costs about
    ``WARM_UP_MACS`` (at least 256 tokens)."""
    return min(budget, max(256, WARM_UP_MACS // max(1, num_parameters)))


def parameter_count(model: Any) -> int:
    """Weights of ``model`` (quantized ones by their shape)."""
    from rill.models.quant import QuantWeight

    dense = sum(p.numel() for p in model.parameters())
    quantized = sum(m.shape.numel() for m in model.modules() if isinstance(m, QuantWeight))
    return dense + quantized


def max_len(config: EngineConfig, mc: ModelConfig) -> int:
    """Tokens per sequence: ``--max-model-len``, else the model's context up to
    ``DEFAULT_MAX_CONTEXT``; never more than the model's context."""
    return min(config.max_model_len or min(mc.max_context_tokens, DEFAULT_MAX_CONTEXT), mc.max_context_tokens)


AUTO_KV_SHARE = 0.4
"""``--kv-cache-memory auto``: the most of the memory available at start the cache may take."""
AUTO_KV_RESIDENT_AT_START = "2GiB"
"""``auto`` where the cache is resident from the start (llama.cpp's, or off the CPU): the old default."""


def cache_rows(
    config: EngineConfig, kv_bytes_per_token: int, max_len: int, limit: int | None = None, lazy: bool = True
) -> int:
    """How many sequences of ``max_len`` tokens fit in ``--kv-cache-memory``: a few more than
    ``--max-num-seqs`` (room for cached prefixes and beams), at most ``limit``.

    ``auto`` sizes the cache from the load rather than a fixed budget: every row the engine can
    use (``--max-num-seqs`` plus the prefix-cache headroom), at most ``AUTO_KV_SHARE`` of the
    memory available now. The torch runner's CPU cache is an anonymous mapping that takes
    memory as rows are written (``rill.engine.runner.zeroed_cache``), so a large budget costs
    nothing until sequences fill it; a cache resident from the start (``lazy=False``) keeps the
    fixed ``AUTO_KV_RESIDENT_AT_START``.

    Raises:
        ModelLoadError: not even one sequence fits.
    """
    row_bytes = kv_bytes_per_token * max_len
    wanted = config.max_num_seqs + max(8, config.max_num_seqs // 2)
    if config.kv_cache_memory != "auto":
        budget = parse_size(config.kv_cache_memory, "kv_cache_memory")
    elif lazy:
        available = available_memory()
        budget = min(wanted * row_bytes, int(AUTO_KV_SHARE * available))
        log.info(
            "KV cache: --kv-cache-memory auto: %d rows of %d tokens want %.0f MiB, at most %.0f%% of the %.0f MiB "
            "available: %.0f MiB (memory is taken as rows are used)",
            wanted,
            max_len,
            wanted * row_bytes / 2**20,
            100 * AUTO_KV_SHARE,
            available / 2**20,
            budget / 2**20,
        )
    else:
        budget = parse_size(AUTO_KV_RESIDENT_AT_START, "kv_cache_memory")
    num_rows = min(budget // row_bytes, wanted)
    if limit is not None:
        num_rows = min(num_rows, limit)
    if num_rows < 1:
        raise ModelLoadError(
            f"--kv-cache-memory {config.kv_cache_memory} holds no sequence of {max_len} tokens "
            f"({row_bytes} bytes each); raise it or lower --max-model-len"
        )
    return int(num_rows)


def available_memory() -> int:
    """Bytes of memory available now (``MemAvailable``; 8 GiB where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 8 * 2**30
