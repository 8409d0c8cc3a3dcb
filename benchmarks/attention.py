"""One decode step of attention: rill's kernel (``qkernel.decode_attention``) against torch's.

    .venv/bin/python benchmarks/attention.py [--threads 1] [--contexts 128,1024,4096]
        [--batches 1,16] [--rounds 3]

Quantized models' decode rows attend through ``kernels/attention.c`` (RoPE, the cache write
and attention in one call); dense models' through torch (``rill.models.attention``: two
batched matmuls from 4 rows, SDPA below). Here both run on the same bf16 caches, every row
attending over ``context`` keys, for the head layouts of the catalog's models; the figure is
microseconds a call (one layer), the median of ``--rounds`` timings of ``--reps`` calls each,
the two alternating. The kernel's figure includes its RoPE and cache write, torch's does not.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rill.models import qkernel
from rill.models.attention import BMM_MIN_ROWS, _decode_attention_bmm

LAYOUTS = {
    "SmolLM2-135M (9 heads, 3 kv, 64)": (9, 3, 64),
    "Qwen2.5-0.5B (14 heads, 2 kv, 64)": (14, 2, 64),
    "Qwen2.5-1.5B (12 heads, 2 kv, 128)": (12, 2, 128),
}
"""Name -> (query heads, kv heads, head size)."""


def _timed(call, reps: int) -> float:  # type: ignore[no-untyped-def]
    """Microseconds a call over ``reps`` calls."""
    start = time.perf_counter()
    for _ in range(reps):
        call()
    return (time.perf_counter() - start) / reps * 1e6


def measure(heads: int, kv_heads: int, head_dim: int, batch: int, context: int, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """(kernel us, torch us) a call for one layout, batch and context."""
    generator = torch.Generator().manual_seed(context + batch)
    k_cache = torch.randn(batch, kv_heads, context, head_dim, generator=generator).bfloat16()
    v_cache = torch.randn(batch, kv_heads, context, head_dim, generator=generator).bfloat16()
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * head_dim, generator=generator).bfloat16()
    angles = torch.rand(batch, 1, head_dim // 2, generator=generator)
    cos, sin = torch.cat((angles, angles), -1).cos().bfloat16(), torch.cat((angles, angles), -1).sin().bfloat16()
    positions = torch.full((batch,), context - 1)
    q = qkv[:, : heads * head_dim].reshape(batch, kv_heads, heads // kv_heads, head_dim)

    def kernel() -> None:
        qkernel.decode_attention(qkv, cos, sin, positions, k_cache, v_cache, heads, None)

    def torch_path() -> None:
        if batch >= BMM_MIN_ROWS:
            _decode_attention_bmm(q, k_cache, v_cache, None)
        else:
            torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache)

    reps = max(5, args.reps * 128 // context)
    figures: dict[str, list[float]] = {"kernel": [], "torch": []}
    kernel()  # warm-up
    torch_path()
    for _ in range(args.rounds):
        figures["kernel"].append(_timed(kernel, reps))
        figures["torch"].append(_timed(torch_path, reps))
    return statistics.median(figures["kernel"]), statistics.median(figures["torch"])


def main(argv: list[str] | None = None) -> int:
    """Print one row per layout, batch and context."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="128,1024,4096")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=400, help="calls a timing at 128 keys (fewer at longer contexts)")
    args = parser.parse_args(argv)
    if not qkernel.available():
        print(f"the kernel does not run here: {qkernel.unavailable_reason()}")
        return 1
    torch.set_num_threads(args.threads)
    print(f"one layer's decode attention, bf16 caches, {args.threads} thread(s); microseconds a call")
    print(f"{'layout':36s} {'rows':>4s} {'keys':>6s} {'kernel':>9s} {'torch':>9s} {'torch/kernel':>12s}")
    for name, (heads, kv_heads, head_dim) in LAYOUTS.items():
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                kernel_us, torch_us = measure(heads, kv_heads, head_dim, batch, context, args)
                print(
                    f"{name:36s} {batch:4d} {context:6d} {kernel_us:9.1f} {torch_us:9.1f} {torch_us / kernel_us:11.2f}x",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
