"""Engine benchmark: rill's engine against transformers on the same checkpoint, same run.

For each model (the demo model and a ~100M-parameter random-init Llama) and each
concurrency (1, 8, 32, 64), N requests with 128-token prompts arrive at once and each
generates 128 tokens (eos ignored). Printed per row: aggregate output tokens/s, time to
first token p50/p99 and inter-token latency p50/p99, for

* rill: the engine core stepped directly (no HTTP; the engine's own figures);
* rill with 32 different sampling settings at concurrency 32 (the sampler stays vectorised);
* transformers ``generate`` one request after another (sequential; its tokens/s does not
  depend on N, so it is measured on a few requests and its TTFT under N concurrent arrivals
  is the queueing it implies);
* transformers ``generate`` on one padded batch of the N prompts (left padding);

all in the same dtype, followed by the ratios rill / sequential and rill / padded batch.

Usage: ``python benchmarks/engine.py [--models demo,100m] [--concurrency 1,8,32,64]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from rill.bench.workload import BenchRequest
from rill.config import EngineConfig
from rill.engine.builder import Engine, build_engine
from rill.engine.request import AddCommand, Request
from rill.types import SamplingParams

CACHE = Path(os.environ.get("RILL_CACHE_DIR", Path.home() / ".cache" / "rill")) / "bench"


@dataclass
class Figures:
    """One measured configuration."""

    name: str
    concurrency: int
    num_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        """Aggregate output tokens per second."""
        return self.num_tokens / self.wall_s if self.wall_s else 0.0


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank), NaN for an empty list."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def model_folder(name: str) -> Path:
    """The demo model, the cached ~100M random-init Llama, or a given folder."""
    if name == "demo":
        from rill.demo import ensure_demo_model

        return ensure_demo_model(progress=True)
    if name == "100m":
        from rill.testing.checkpoints import make_checkpoint

        folder = CACHE / "llama-100m"
        if not (folder / "config.json").exists():
            print("writing the ~100M random-init Llama checkpoint (once) ...", flush=True)
            make_checkpoint(folder, arch="llama", preset="100m")
        return folder
    return Path(name)


def make_prompts(engine: Engine, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n distinct prompts of exactly ``length`` token ids (specials excluded)."""
    gen = torch.Generator().manual_seed(seed)
    special = set(engine.tokenizer.special_token_ids) | set(engine.eos_token_ids)
    vocab = engine.model_info.vocab_size
    prompts = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (length * 2,), generator=gen).tolist()
        prompts.append([t for t in ids if t not in special][:length])
    return prompts


MIXED = [
    dict(
        temperature=0.3 + 0.1 * (i % 10),
        top_k=(0, 20, 50)[i % 3],
        top_p=(1.0, 0.9, 0.8)[i % 3],
        min_p=(0.0, 0.05)[i % 2],
        repetition_penalty=(1.0, 1.1)[(i // 2) % 2],
        presence_penalty=(0.0, 0.3)[(i // 3) % 2],
        frequency_penalty=(0.0, 0.2)[(i // 4) % 2],
        seed=(None, i)[i % 2],
    )
    for i in range(64)
]


def submit(engine: Engine, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
    """Add one request to the engine core directly (no server), arriving now."""
    request = Request(
        request_id=request_id,
        prompt_ids=prompt_ids,
        params=params,
        eos_token_ids=engine.eos_token_ids,
        arrival_time=time.monotonic(),
        seq_no=0,
    )
    engine.core.apply(AddCommand(request))


class ClosedLoop:
    """The engine core holding requests in a closed loop: each finished one replaced at once by
    the next of ``prompts`` with ``params`` (``add`` starts one, with other parameters if given)."""

    def __init__(self, engine: Engine, prompts: Iterator[BenchRequest], params: SamplingParams) -> None:
        self.engine, self.prompts, self.params = engine, prompts, params
        self.step_s: list[float] = []
        """Each step's time (``run`` appends; clear it between windows)."""

    def add(self, params: SamplingParams | None = None) -> None:
        """Start the next prompt."""
        request = next(self.prompts)
        prompt_ids = self.engine.tokenizer.encode(request.prompt)
        submit(self.engine, f"b{request.index}", prompt_ids, params or self.params)

    def run(self, seconds: float) -> int:
        """Step for ``seconds``; the tokens made."""
        tokens, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            outputs = self.engine.core.step()
            self.step_s.append(time.perf_counter() - start)
            for output in outputs:
                tokens += len(output.token_ids)
                if output.finished:
                    self.add()
        return tokens


def run_rill(engine: Engine, prompts: list[list[int]], new_tokens: int, mixed: bool) -> Figures:
    """All requests arrive at t0; the core is stepped until every one finished."""
    core = engine.core
    name = "rill (32 different samplers)" if mixed else "rill"
    fig = Figures(name, len(prompts))
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **(MIXED[i] if mixed else {"temperature": 0.0}))
        submit(engine, f"b{i}", ids, params)
    while core.has_work():
        outputs = core.step()
        now = time.perf_counter()
        for out in outputs:
            if not out.token_ids:
                continue
            fig.num_tokens += len(out.token_ids)
            if out.request_id not in first:
                first[out.request_id] = now
                fig.ttft_s.append(now - t0)
            else:
                fig.itl_s.extend([(now - last[out.request_id]) / len(out.token_ids)] * len(out.token_ids))
            last[out.request_id] = now
    fig.wall_s = time.perf_counter() - t0
    return fig


def load_hf(folder: Path, dtype: str):
    """transformers' model for the same folder, in the same dtype."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    return model.eval()


def run_hf_sequential(model, prompts: list[list[int]], new_tokens: int, concurrency: int, pad_id: int) -> Figures:
    """One request after another; measured on up to 3 requests (rate does not depend on N)."""
    fig = Figures("transformers sequential", concurrency, note="measured on 3 requests")
    per_request: list[float] = []
    firsts: list[float] = []
    with torch.inference_mode():
        for ids in prompts[:3]:
            x = torch.tensor([ids])
            t0 = time.perf_counter()
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=1, do_sample=False, pad_token_id=pad_id)
            firsts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
            per_request.append(time.perf_counter() - t0)
    mean_request = statistics.mean(per_request)
    mean_first = statistics.mean(firsts)
    fig.num_tokens = new_tokens * concurrency
    fig.wall_s = mean_request * concurrency
    # Request i waits for the i requests before it: the TTFT that N simultaneous arrivals see.
    fig.ttft_s = [i * mean_request + mean_first for i in range(concurrency)]
    fig.itl_s = [(mean_request - mean_first) / max(new_tokens - 1, 1)] * concurrency
    return fig


def run_hf_padded(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> Figures:
    """One padded batch of all N prompts."""
    fig = Figures("transformers padded batch", len(prompts))
    x = torch.tensor(prompts)
    mask = torch.ones_like(x)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(x, attention_mask=mask, max_new_tokens=1, do_sample=False, pad_token_id=pad_id)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(
            x,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
        fig.wall_s = time.perf_counter() - t0
    fig.num_tokens = new_tokens * len(prompts)
    fig.ttft_s = [first] * len(prompts)
    fig.itl_s = [(fig.wall_s - first) / max(new_tokens - 1, 1)] * len(prompts)
    return fig


def median_figure(runs: list[Figures]) -> Figures:
    """The run with the median tokens/s (its own latencies), noting the spread."""
    ordered = sorted(runs, key=lambda f: f.tokens_per_s)
    fig = ordered[len(ordered) // 2]
    if len(runs) > 1:
        spread = f"median of {len(runs)}: " + "/".join(f"{f.tokens_per_s:.0f}" for f in ordered) + " tok/s"
        fig.note = f"{fig.note}; {spread}" if fig.note else spread
    return fig


def row(fig: Figures) -> str:
    """One table line."""
    ms = 1000.0
    return (
        f"{fig.name:<32} {fig.concurrency:>4} {fig.tokens_per_s:>9.1f} {pct(fig.ttft_s, 50) * ms:>10.0f} "
        f"{pct(fig.ttft_s, 99) * ms:>10.0f} {pct(fig.itl_s, 50) * ms:>9.1f} {pct(fig.itl_s, 99) * ms:>9.1f}  {fig.note}"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="demo,100m", help="comma list: demo, 100m or model folders")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--dtype", default="auto", help="auto, float32 or bfloat16 (the same for rill and transformers)"
    )
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each configuration this many times, interleaved, and report the median (machine noise)",
    )
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    header = (
        f"{'engine':<32} {'N':>4} {'tok/s':>9} {'TTFT p50':>10} {'TTFT p99':>10} {'ITL p50':>9} {'ITL p99':>9}  (ms)"
    )
    for model_name in args.models.split(","):
        folder = model_folder(model_name)
        engine = build_engine(
            EngineConfig(
                model=str(folder),
                dtype=args.dtype,
                kv_cache_memory="8GiB",
                max_model_len=args.prompt_len + args.new_tokens + 8,
                max_num_seqs=max(levels),
            )
        )
        dtype = engine.model_info.dtype
        params_m = (
            sum(p.numel() for p in engine.runner.model.parameters()) / 1e6
            if hasattr(engine.runner, "model")
            else float("nan")
        )
        print(f"\n## {model_name}: {folder} ({params_m:.1f}M parameters, {dtype}, {torch.get_num_threads()} threads)")
        hf = None if args.skip_transformers else load_hf(folder, dtype)
        pad_id = engine.tokenizer.pad_token_id or 0
        print(header)
        results: dict[tuple[str, int], Figures] = {}
        run_rill(engine, make_prompts(engine, 2, args.prompt_len, seed=999), 4, mixed=False)  # warm-up
        for n in levels:
            # Fresh prompts for every rill run: the prefix cache must not answer a prompt of
            # an earlier run (that would flatter rill against transformers).
            rounds: list[list[Figures]] = []
            for r in range(args.repeat):
                prompts = make_prompts(engine, n, args.prompt_len, seed=n + 10000 * r)
                figs = [run_rill(engine, prompts, args.new_tokens, mixed=False)]
                if n == 32:
                    figs.append(
                        run_rill(
                            engine,
                            make_prompts(engine, n, args.prompt_len, seed=1000 + n + 10000 * r),
                            args.new_tokens,
                            mixed=True,
                        )
                    )
                if hf is not None:
                    figs.append(run_hf_sequential(hf, prompts, args.new_tokens, n, pad_id))
                    figs.append(run_hf_padded(hf, prompts, args.new_tokens, pad_id))
                rounds.append(figs)
            figs = [median_figure([rnd[i] for rnd in rounds]) for i in range(len(rounds[0]))]
            for fig in figs:
                results[(fig.name, n)] = fig
                print(row(fig), flush=True)
            gc.collect()
        if hf is not None:
            print("\nratios (aggregate tokens/s):")
            for n in levels:
                r = results[("rill", n)].tokens_per_s
                seq = results[("transformers sequential", n)].tokens_per_s
                pad = results[("transformers padded batch", n)].tokens_per_s
                line = f"  N={n:<3} rill/sequential {r / seq:6.2f}x   rill/padded {r / pad:5.2f}x"
                if ("rill (32 different samplers)", n) in results:
                    m = results[("rill (32 different samplers)", n)].tokens_per_s
                    line += f"   mixed-samplers/sequential {m / seq:6.2f}x   mixed-samplers/padded {m / pad:5.2f}x"
                print(line)
        del engine, hf
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
