"""Quantized weights against the dequantized path on one GGUF: greedy answers and per-token logprobs.

    .venv/bin/python benchmarks/quant_quality.py --model qwen2.5-coder-1.5b --tokens 48
    .venv/bin/python benchmarks/quant_quality.py --model path/to/file.gguf --weights int8

Loads the file twice through rill's loader, ``--weights dense`` (every tensor dequantized to
``--dtype``) and ``--weights auto`` (or the mode given), and asks both the same 20 chat prompts
(``benchmarks/quality.py``'s questions, through the model's chat template), greedily, all
prompts in one batch on the runner. It prints per prompt whether the answers are equal and
where they part, then scores the dense answers under the quantized model (teacher-forced: the
same tokens, so every position compares): the mean and largest difference of the chosen
tokens' logprobs, how often the quantized model's top token is the dense model's, and the
mean KL divergence of the next-token distributions. Nothing here is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality import QUESTIONS  # benchmarks/ is not a package

from rill.engine.batch import RowWork
from rill.engine.runner import TorchModelRunner
from rill.models.loader import LoadedModel, load_model


def generate(loaded: LoadedModel, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Greedy continuations of every prompt, all prompts batched on one runner."""
    longest = max(map(len, prompts)) + num_tokens + 1
    runner = TorchModelRunner(loaded, num_rows=len(prompts), max_len=longest)
    eos = set(loaded.config.eos_token_ids) | set(loaded.tokenizer.eos_token_ids)
    logits = runner.forward([RowWork(row, prompt, 0) for row, prompt in enumerate(prompts)])
    answers: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    for _ in range(num_tokens):
        nexts = logits.argmax(dim=-1).tolist()
        for row, token in zip(live, nexts):
            answers[row].append(token)
        live = [row for row in live if answers[row][-1] not in eos]
        if not live:
            break
        logits = runner.forward(
            [RowWork(row, [answers[row][-1]], len(prompts[row]) + len(answers[row]) - 1) for row in live]
        )
    return answers


def score(loaded: LoadedModel, prompts: list[list[int]], answers: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: float32 log-softmax rows predicting each answer token (teacher-forced)."""
    longest = max(len(p) + len(a) for p, a in zip(prompts, answers)) + 1
    runner = TorchModelRunner(loaded, num_rows=1, max_len=longest)
    out = []
    for prompt, answer in zip(prompts, answers):
        tokens = prompt + answer
        logits = runner.forward([RowWork(0, tokens, 0, all_logits=True)])
        # Row i predicts token i + 1: the answer's tokens are predicted by rows len(prompt)-1 ...
        out.append(logits[len(prompt) - 1 : len(tokens) - 1].log_softmax(dim=-1))
    return out


def main(argv: list[str] | None = None) -> int:
    """Load both ways, generate, score, print."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a .gguf file or a catalog name (rill models)")
    parser.add_argument("--weights", default="auto", help="the quantized mode to compare with dense (default: auto)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=48, help="greedy tokens per answer (default: 48)")
    args = parser.parse_args(argv)
    from rill.models.catalog import resolve

    path = resolve(args.model) or Path(args.model)
    models = {mode: load_model(path, dtype=args.dtype, weights=mode) for mode in ("dense", args.weights)}
    quantized = models[args.weights]
    tokenizer = quantized.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    print(
        f"{path.name}: dense ({models['dense'].config.dtype}) against --weights {args.weights} "
        f"({quantized.weights}); {len(prompts)} chat prompts, {args.tokens} greedy tokens"
    )
    answers = {mode: generate(loaded, prompts, args.tokens) for mode, loaded in models.items()}
    equal = 0
    for question, dense, quant in zip(QUESTIONS, answers["dense"], answers[args.weights]):
        shared = next((i for i, (a, b) in enumerate(zip(dense, quant)) if a != b), min(len(dense), len(quant)))
        same = dense == quant
        equal += same
        where = "equal" if same else f"part at token {shared}"
        print(f"  {where:>18}  {question[:50]!r}: {tokenizer.decode(quant)[:70]!r}")
    dense_scores = score(models["dense"], prompts, answers["dense"])
    quant_scores = score(quantized, prompts, answers["dense"])
    deltas, tops, kls = [], [], []
    for dense_lp, quant_lp, answer in zip(dense_scores, quant_scores, answers["dense"]):
        chosen = torch.tensor(answer)
        rows = torch.arange(len(answer))
        deltas.append((quant_lp[rows, chosen] - dense_lp[rows, chosen]).abs())
        tops.append(quant_lp.argmax(dim=-1) == dense_lp.argmax(dim=-1))
        kls.append((dense_lp.exp() * (dense_lp - quant_lp)).sum(dim=-1))
    delta, top, kl = torch.cat(deltas), torch.cat(tops).float(), torch.cat(kls)
    print(f"greedy answers equal: {equal}/{len(prompts)}")
    print(
        f"dense answers scored by the quantized model ({delta.numel()} tokens): |delta logprob| mean "
        f"{delta.mean():.4f}, p99 {delta.quantile(0.99):.4f}, max {delta.max():.4f}; same top token "
        f"{100 * top.mean():.1f} %; KL mean {kl.mean():.5f}, max {kl.max():.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
