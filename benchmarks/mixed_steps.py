"""Steps that carry a prompt chunk beside decode rows: token by token in the decode kernel against
the layer path, the same engine, the same run.

    .venv/bin/python benchmarks/mixed_steps.py [--models smollm2] [--concurrency 16,32]
        [--rounds 2] [--window-s 15] [--warmup-s 5]

Under load a new prompt arrives while other streams decode: its chunks ride in steps beside
their rows (``Scheduler``'s protected chunk). Up to ``BY_TOKEN_PREFILL_TOKENS`` prompt tokens
such a step runs every layer in one call of the decode kernel (``StepBatch.by_token``);
with the bound at 0 it takes the layers one by one, as every step with a prompt chunk did
before. Here one 1-thread engine core (no server) holds the concurrency's requests in a
closed loop, a finished one replaced at once, 48-word prompts and 64-token answers (eos
ignored, greedy); the first requests' answers are of random lengths so that arrivals spread
over the steps as a server's do (requests that all start at once stay in step: every prompt
then arrives in a step of prompts alone, which neither path changes). Per model, concurrency
and path, alternating ``--rounds`` times: tokens/s, steps/s, the share of steps with a prompt
chunk beside decode rows, and the mean time of those steps and of decode-only steps.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import rill.engine.runner as runner_module
from engine import ClosedLoop  # benchmarks/engine.py
from rill.bench.workload import synthetic_prompts
from rill.config import EngineConfig
from rill.engine.builder import build_engine
from rill.models.attention import BY_TOKEN_PREFILL_TOKENS
from rill.types import SamplingParams

PATHS = {"layers": 0, "one call": BY_TOKEN_PREFILL_TOKENS}
"""Each path by the bound it runs with (0: no prompt chunk goes token by token)."""


def measure(model: str, concurrency: int, bound: int, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One engine on ``model`` in the closed loop with the bound at ``bound``; its figures over the window."""
    runner_module.BY_TOKEN_PREFILL_TOKENS = bound
    engine = build_engine(EngineConfig(model=model, num_threads=1, max_num_seqs=concurrency))
    scheduler = engine.core.scheduler
    prompts = iter(synthetic_prompts(10**5, 48, 64, seed))
    loop = ClosedLoop(engine, prompts, SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0))
    rng = random.Random(seed)
    for _ in range(concurrency):  # answers of random lengths first: arrivals spread over the steps
        loop.add(SamplingParams(max_tokens=rng.randint(1, 64), ignore_eos=True, temperature=0.0))
    plans: list[tuple[int, int]] = []  # (decode tokens, prompt tokens) of each step
    schedule = scheduler.schedule

    def counted():  # type: ignore[no-untyped-def]
        plan = schedule()
        plans.append((plan.num_decode_tokens, plan.num_prefill_tokens))
        return plan

    scheduler.schedule = counted  # type: ignore[method-assign]

    loop.run(args.warmup_s)
    plans.clear()
    loop.step_s.clear()
    start = time.perf_counter()
    tokens = loop.run(args.window_s)
    wall = time.perf_counter() - start
    times = loop.step_s
    mixed = [t for (decode, prompt), t in zip(plans, times, strict=True) if decode and prompt]
    plain = [t for (decode, prompt), t in zip(plans, times, strict=True) if decode and not prompt]
    return {
        "tokens_per_s": tokens / wall,
        "steps_per_s": len(times) / wall,
        "mixed_share": len(mixed) / max(len(times), 1),
        "mixed_ms": statistics.mean(mixed) * 1e3 if mixed else 0.0,
        "decode_ms": statistics.mean(plain) * 1e3 if plain else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    """Run every model, concurrency and path; print a table and each path's ratio per round."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2", help="comma list of model names or folders")
    parser.add_argument("--concurrency", default="16,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    args = parser.parse_args(argv)
    print(
        "| model | c | round | path | tokens/s | steps/s | steps with a prompt chunk | their time | decode-only step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios: dict[tuple[str, int], list[float]] = {}
    for model in args.models.split(","):
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for round_ in range(1, args.rounds + 1):
                order = list(PATHS) if round_ % 2 else list(reversed(PATHS))
                figures = {}
                for path in order:
                    f = figures[path] = measure(model, concurrency, PATHS[path], args, seed=round_)
                    gc.collect()  # the next engine's model and KV cache take this one's place
                    print(
                        f"| {model} | {concurrency} | {round_} | {path} | {f['tokens_per_s']:.1f} | "
                        f"{f['steps_per_s']:.1f} | {f['mixed_share'] * 100:.0f} % | {f['mixed_ms']:.1f} ms | "
                        f"{f['decode_ms']:.1f} ms |",
                        flush=True,
                    )
                ratio = figures["one call"]["tokens_per_s"] / figures["layers"]["tokens_per_s"]
                ratios.setdefault((model, concurrency), []).append(ratio)
    print()
    for (model, concurrency), values in ratios.items():
        rounds = ", ".join(f"{v:.2f}x" for v in values)
        print(f"{model} c={concurrency}: one call / layers {statistics.median(values):.2f}x (rounds: {rounds})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
