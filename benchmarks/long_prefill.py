"""Inter-token latency of running streams while a 4k-token prompt is prefilled.

Eight greedy streams decode on the ~100M-parameter random-init Llama (context raised to
8k); after a baseline of decode steps a 4,000-token prompt arrives. Printed: the streams'
inter-token latency (p50 / p90 / max) before and during that prefill, their ratio, and the
long prompt's time to first token, for rill's adaptive chunk cap and, in the same run, for a
plain step budget (the prefill chunk fills ``--max-num-batched-tokens``, vLLM's default
behaviour).

Usage: ``python benchmarks/long_prefill.py [--streams 8] [--long 4000]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from rill.config import EngineConfig
from rill.engine.builder import Engine, build_engine
from rill.engine.request import AbortCommand, AddCommand, Request
from rill.types import SamplingParams

CACHE = Path(os.environ.get("RILL_CACHE_DIR", Path.home() / ".cache" / "rill")) / "bench"


def long_context_model() -> Path:
    """The benchmark's ~100M Llama with an 8k context (written once)."""
    from rill.testing.checkpoints import make_checkpoint

    folder = CACHE / "llama-100m-8k"
    if not (folder / "config.json").exists():
        make_checkpoint(folder, arch="llama", preset="100m")
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = 8192  # default RoPE: nothing else depends on it
        (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def measure(engine: Engine, num_streams: int, long_len: int, is_adaptive: bool) -> dict[str, float]:
    """One trial; returns ITL figures (seconds) before/during the prefill and the long TTFT."""
    core = engine.core
    gen = torch.Generator().manual_seed(3)
    vocab = engine.model_info.vocab_size
    special = set(engine.tokenizer.special_token_ids)

    def ids(n: int) -> list[int]:
        return [t for t in torch.randint(0, vocab, (2 * n,), generator=gen).tolist() if t not in special][:n]

    def add(rid: str, prompt: list[int], max_tokens: int) -> None:
        core.apply(
            AddCommand(
                Request(
                    request_id=rid,
                    prompt_ids=prompt,
                    params=SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                    eos_token_ids=engine.eos_token_ids,
                    arrival_time=time.monotonic(),
                    seq_no=0,
                )
            )
        )

    streams = [f"s{i}" for i in range(num_streams)]
    for rid in streams:
        add(rid, ids(64), 4000)
    if not is_adaptive:
        core._update_costs = lambda plan, elapsed: None  # type: ignore[method-assign]
        core.scheduler.prefill_chunk_tokens = core.config.max_num_batched_tokens
    last: dict[str, float] = {}
    before: list[float] = []
    during: list[float] = []
    phase = "warm"
    steps = 0
    long_ttft = None
    t_long = 0.0
    while long_ttft is None:
        steps += 1
        if steps == 40:
            phase = "before"
        if steps == 80:
            add("long", ids(long_len), 1)
            t_long = time.perf_counter()
            phase = "during"
        outs = core.step()
        now = time.perf_counter()
        for out in outs:
            if out.request_id == "long" and out.token_ids:
                long_ttft = now - t_long
            elif out.token_ids:
                if out.request_id in last and phase in ("before", "during"):
                    (before if phase == "before" else during).append(now - last[out.request_id])
                last[out.request_id] = now
    for rid in streams:
        core.apply(AbortCommand(rid))
    while core.has_work():
        core.step()
    if not is_adaptive:
        del core._update_costs
    return {
        "before_p50": pct(before, 50),
        "before_p90": pct(before, 90),
        "before_max": max(before),
        "during_p50": pct(during, 50),
        "during_p90": pct(during, 90),
        "during_max": max(during),
        "long_ttft": long_ttft or float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    """Run both policies and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long", type=int, default=4000)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    folder = long_context_model()
    engine = build_engine(
        EngineConfig(
            model=str(folder),
            dtype=args.dtype,
            kv_cache_memory="4GiB",
            max_model_len=args.long + 256,
            max_num_seqs=args.streams + 2,
            max_num_batched_tokens=2048,
        )
    )
    print(
        f"model {folder} ({engine.model_info.dtype}), {args.streams} streams decoding, a {args.long}-token prompt arrives"
    )
    print(
        f"{'policy':<34} {'ITL before p50/p90/max (ms)':>30} {'ITL during p50/p90/max (ms)':>30} {'p90 ratio':>9} {'long TTFT s':>11}"
    )
    for name, adaptive in (("rill adaptive chunk cap", True), ("plain 2048-token step budget", False)):
        fig = measure(engine, args.streams, args.long, adaptive)
        ms = 1000
        print(
            f"{name:<34} {fig['before_p50'] * ms:>10.1f}/{fig['before_p90'] * ms:.1f}/{fig['before_max'] * ms:.1f}"
            f"{fig['during_p50'] * ms:>16.1f}/{fig['during_p90'] * ms:.1f}/{fig['during_max'] * ms:.1f}"
            f"{fig['during_p90'] / fig['before_p90']:>10.2f} {fig['long_ttft']:>11.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
