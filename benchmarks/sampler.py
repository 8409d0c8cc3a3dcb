"""Benchmark of rill.engine.sampler.Sampler against a naive torch sampler (full sort + multinomial).

Run: ``.venv/bin/python benchmarks/sampler.py [--vocab 16384 32000] [--batch 1 8 32 64] [--threads N]``

Scenarios, each with one set of logits per step (8 pre-generated, reused round-robin):
  greedy        every row temperature 0
  greedy+lp5    every row greedy with logprobs=5
  mixed-peaky   every row different: temperature 0.3-1.3, top_k 0/20/50, top_p 0.8-1.0,
                min_p 0/0.05, penalties on every 4th row, seeds on odd rows; logits randn*3
  mixed-flat    the same settings on near-uniform logits (randn*0.02, like a random-init model)
  allowed       mixed-peaky plus allowed_token_ids: 100 ids per row (different per row)

Times are per ``sample`` call in milliseconds: wall-clock minimum and median, and the median CPU
time of the process (the steadiest figure when other processes load the shared CPU; rill's path
is single-threaded, so its CPU time is its compute time). The ratio is naive CPU / rill CPU. The
naive sampler runs torch with ``--threads`` intra-op threads (default 1: with 2 threads, its CPU
time counts both threads and its wall time collapses whenever another process holds a core).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import msgspec
import numpy as np
import torch

from rill.engine.sampler import Sampler
from rill.types import SamplingParams


def mixed_params(i: int) -> SamplingParams:
    """Row i's settings: every row of a batch of up to 100 differs (temperature 0.3 + 0.37*i mod 1)."""
    return SamplingParams(
        temperature=round(0.3 + (0.37 * i) % 1.0, 4),
        top_k=(0, 20, 50)[i % 3],
        top_p=(1.0, 0.8, 0.9, 0.95, 0.85)[i % 5],
        min_p=(0.0, 0.05)[(i // 3) % 2],
        repetition_penalty=1.1 if i % 4 == 0 else 1.0,
        presence_penalty=0.3 if i % 8 == 0 else 0.0,
        frequency_penalty=0.2 if i % 8 == 4 else 0.0,
        seed=1000 + i if i % 2 else None,
    )


def allowed_params(i: int) -> SamplingParams:
    """``mixed_params(i)`` restricted to 100 token ids (a different set per row, inside 16k)."""
    ids = np.random.default_rng(i).choice(16384, 100, replace=False).tolist()
    return msgspec.structs.replace(mixed_params(i), allowed_token_ids=sorted(ids))


SCENARIOS = {
    "greedy": (lambda i: SamplingParams(temperature=0.0), 3.0),
    "greedy+lp5": (lambda i: SamplingParams(temperature=0.0, logprobs=5), 3.0),
    "mixed-peaky": (mixed_params, 3.0),
    "mixed-flat": (mixed_params, 0.02),
    "allowed": (allowed_params, 3.0),
}


class NaiveSampler:
    """HF-style reference cost: dense penalties, full-vocab sort for top-k/top-p/min-p, multinomial."""

    def __init__(self, vocab: int, params: list[SamplingParams], prompts: list[list[int]]) -> None:
        n = len(params)
        col = lambda name: torch.tensor([float(getattr(p, name)) for p in params])[:, None]  # noqa: E731
        self.temperature, self.top_p, self.min_p = col("temperature"), col("top_p"), col("min_p")
        self.rep, self.presence, self.frequency = (
            col("repetition_penalty"),
            col("presence_penalty"),
            col("frequency_penalty"),
        )
        self.top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])[:, None]
        self.is_greedy = torch.tensor([p.temperature < 1e-5 for p in params])
        self.has_penalties = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params)
        self.logprobs = max((p.logprobs or 0) for p in params)
        self.counts = torch.zeros(n, vocab)
        self.prompt_mask = torch.zeros(n, vocab, dtype=torch.bool)
        for i, prompt in enumerate(prompts):
            self.prompt_mask[i, prompt] = True
        self.allowed: torch.Tensor | None = None  # [n, vocab] bool, when any row has allowed_token_ids
        if any(p.allowed_token_ids is not None for p in params):
            self.allowed = torch.ones(n, vocab, dtype=torch.bool)
            for i, p in enumerate(params):
                if p.allowed_token_ids is not None:
                    self.allowed[i] = False
                    self.allowed[i, p.allowed_token_ids] = True
        self.generator = torch.Generator().manual_seed(0)

    def sample(self, logits: torch.Tensor) -> list[int]:
        """One step over all rows."""
        x = logits
        if self.has_penalties:
            seen = self.counts > 0
            x = torch.where(seen | self.prompt_mask, torch.where(x > 0, x / self.rep, x * self.rep), x)
            x = x - self.presence * seen - self.frequency * self.counts
        if self.allowed is not None:
            x = x.masked_fill(~self.allowed, -torch.inf)
        greedy = x.argmax(-1)
        if self.logprobs:
            torch.log_softmax(logits, -1).topk(self.logprobs)
        if not self.is_greedy.all():
            x = x / self.temperature.clamp(min=1e-5)
            values, order = x.sort(-1, descending=True)
            positions = torch.arange(x.shape[1])[None]
            values = values.masked_fill(positions >= self.top_k, -torch.inf)
            probs = values.softmax(-1)
            values = values.masked_fill(probs.cumsum(-1) - probs >= self.top_p, -torch.inf)
            values = values.masked_fill(probs < self.min_p * probs[:, :1], -torch.inf)
            picked = order.gather(1, torch.multinomial(values.softmax(-1), 1, generator=self.generator))[:, 0]
            greedy = torch.where(self.is_greedy, greedy, picked)
        self.counts[torch.arange(len(x)), greedy] += 1
        return greedy.tolist()


def timed(fn, repeats: int) -> tuple[float, float, float]:
    """(wall min, wall median, CPU median) milliseconds of ``fn(step)`` over ``repeats`` calls."""
    for step in range(3):
        fn(step)
    walls, cpus = [], []
    for step in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn(step)
        walls.append((time.perf_counter() - t0) * 1e3)
        cpus.append((time.process_time() - c0) * 1e3)
    return min(walls), statistics.median(walls), statistics.median(cpus)


def run(vocab: int, batch: int, scenario: str, repeats: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Times of rill and the naive sampler for one configuration."""
    make_params, scale = SCENARIOS[scenario]
    gen = torch.Generator().manual_seed(batch * 7 + vocab)
    logits = [torch.randn(batch, vocab, generator=gen) * scale for _ in range(8)]
    params = [make_params(i) for i in range(batch)]
    prompts = [torch.randint(0, vocab, (64,), generator=gen).tolist() for _ in range(batch)]
    sampler = Sampler(vocab, max(batch, 64))
    for key, (p, prompt) in enumerate(zip(params, prompts)):
        sampler.add(key, p, prompt, {0})
    keys = list(range(batch))
    ours = timed(lambda step: sampler.sample(logits[step % 8], keys), repeats)
    naive = NaiveSampler(vocab, params, prompts)
    theirs = timed(lambda step: naive.sample(logits[step % 8]), max(3, repeats // 4))
    return ours, theirs


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[16384, 32000])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--scenario", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the naive sampler")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}, "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(
        f"{'vocab':>6} {'B':>3} {'scenario':<12} | {'rill min':>8} {'med':>7} {'cpu':>7} | "
        f"{'naive min':>9} {'med':>8} {'cpu':>8} | {'cpu ratio':>9}"
    )
    for vocab in args.vocab:
        for scenario in args.scenario:
            for batch in args.batch:
                (o_min, o_med, o_cpu), (n_min, n_med, n_cpu) = run(vocab, batch, scenario, args.repeats)
                print(
                    f"{vocab:>6} {batch:>3} {scenario:<12} | {o_min:>8.3f} {o_med:>7.3f} {o_cpu:>7.3f} | "
                    f"{n_min:>9.2f} {n_med:>8.2f} {n_cpu:>8.2f} | {n_cpu / o_cpu:>8.1f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
