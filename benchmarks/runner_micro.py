"""Micro-benchmark of ``TorchModelRunner``: decode steps at B = 1, 8, 32 and one 32×128 prefill.

Builds (once, cached under ``--folder``) the engine-notes' model100m shape with random weights,
loads it in bf16 (or ``--dtype``) and times the runner alone: no sampling, no scheduler.
Decode contexts are ~256 tokens (the cached rows are filled by a prefill first; rows get
slightly different lengths, as in a real batch, so the length mask is exercised).

    .venv/bin/python benchmarks/runner_micro.py [--dtype bfloat16] [--steps 20] [--compare-hf]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from rill.engine.batch import RowWork
from rill.engine.runner import TorchModelRunner
from rill.models import load_model


def _time(fn, repeats: int) -> tuple[list[float], float]:
    """Wall seconds per call, and the process CPU seconds per call (robust on a shared host)."""
    times = []
    cpu_start = time.process_time()
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times, (time.process_time() - cpu_start) / repeats


def main() -> None:
    """Parse arguments, build or reuse the checkpoint, print one line per measurement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", default="/tmp/rill-bench/model100m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compare-hf", action="store_true", help="also time 32x128+128 greedy vs HF generate")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder = Path(args.folder)
    if not (folder / "config.json").exists():
        from rill.testing.checkpoints import make_checkpoint

        make_checkpoint(folder, "llama", preset="100m", seed=0)
    loaded = load_model(folder, dtype=args.dtype)
    runner = TorchModelRunner(loaded, num_rows=40, max_len=args.context + 2 * args.steps + 8)
    vocab = loaded.config.vocab_size
    generator = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(8, vocab, (n,), generator=generator).tolist()

    prefill = [RowWork(row=i, token_ids=prompt(128), start=0) for i in range(32)]
    runner.forward(prefill[:2])  # warm-up
    times, cpu = _time(lambda: runner.forward(prefill), 2)
    print(f"prefill 32x128: {min(times) * 1e3:.0f} ms ({32 * 128 / min(times):.0f} tok/s), cpu {cpu * 1e3:.0f} ms")

    # Fill rows to ~context tokens (lengths differ by a few tokens per row).
    lengths = [args.context - (i % 5) for i in range(32)]
    for i in range(0, 32, 8):
        runner.forward([RowWork(row=r, token_ids=prompt(lengths[r]), start=0) for r in range(i, i + 8)])
    for batch_size in (1, 8, 32):
        rows = list(range(batch_size))
        step = [0]

        def decode() -> None:  # timed within this iteration, so the loop's rows and step are the current ones
            work = [RowWork(row=r, token_ids=[5], start=lengths[r] + step[0]) for r in rows]  # noqa: B023
            runner.forward(work).argmax(-1).tolist()
            step[0] += 1  # noqa: B023

        decode()
        step[0] = 0
        times, cpu = _time(decode, args.steps)
        median = statistics.median(times)
        print(
            f"decode B={batch_size:2d}: median {median * 1e3:6.1f} ms/step, min {min(times) * 1e3:6.1f}"
            f" -> {batch_size / median:6.0f} tok/s; cpu {cpu * 1e3:6.1f} ms/step"
        )
    if args.compare_hf:
        compare_generate(folder, args.dtype)


def compare_generate(
    folder: Path, dtype: str, num_requests: int = 32, num_prompt: int = 128, num_new: int = 128
) -> None:
    """Greedy 32x128 -> +128 through the runner (argmax only) against transformers' padded-batch
    ``generate``; prints tokens per second (prefill included) for both."""
    from transformers import AutoModelForCausalLM

    loaded = load_model(folder, dtype=dtype)
    prompts = torch.randint(
        8, loaded.config.vocab_size, (num_requests, num_prompt), generator=torch.Generator().manual_seed(1)
    )
    runner = TorchModelRunner(loaded, num_rows=num_requests, max_len=num_prompt + num_new)
    start, cpu_start = time.perf_counter(), time.process_time()
    logits = runner.forward([RowWork(row=i, token_ids=p.tolist(), start=0) for i, p in enumerate(prompts)])
    for step in range(num_new - 1):
        tokens = logits.argmax(-1).tolist()
        logits = runner.forward([RowWork(row=i, token_ids=[t], start=num_prompt + step) for i, t in enumerate(tokens)])
    ours = num_requests * num_new / (time.perf_counter() - start)
    ours_cpu = time.process_time() - cpu_start
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        hf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=False,
            max_new_tokens=num_new,
            eos_token_id=None,
            pad_token_id=0,
        )
    theirs = num_requests * num_new / (time.perf_counter() - start)
    theirs_cpu = time.process_time() - cpu_start
    print(
        f"generate {num_requests}x{num_prompt}+{num_new}: runner {ours:.0f} tok/s, transformers {theirs:.0f} tok/s"
        f" ({ours / theirs:.2f}x); cpu s: runner {ours_cpu:.1f}, transformers {theirs_cpu:.1f}"
    )


if __name__ == "__main__":
    main()
