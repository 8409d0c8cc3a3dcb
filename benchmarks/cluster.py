"""What engine replicas on Ray Serve cost and give: single-process rill against ``--replicas``.

    .venv/bin/python benchmarks/cluster.py [--model smollm2] [--levels 1,8,32]
        [--max-tokens 64] [--prompt-len 48] [--rounds 1] [--quick]

One run, every server in turn on the same machine (each stopped before the next starts), the
OpenAI API in a closed loop (``rill.bench``), greedy, ``ignore_eos``, ``--waves`` times the
concurrency requests per level (default 8, so that the run's start and its ramp-down, when
fewer streams than the concurrency are left, weigh little: with 2 waves, two replicas made
1.49x one at c=32 in one run, and 1.63x with 8 in the next):

1. Throughput and TTFT at each concurrency for
   ``single``  one process, the engine on 2 threads (the default server);
   ``r1``      ``--replicas 1``, the replica's engine on 2 threads: what the Ray hop costs;
   ``r1-1t``   ``--replicas 1 --num-threads 1``: one 1-thread replica;
   ``r2-1t``   ``--replicas 2 --num-threads 1``: two 1-thread replicas (what scaling out gives).
   Goals: ``r1`` keeps at least 90 % of ``single``'s tokens/s at the highest level and adds at
   most 20 ms to TTFT p50; ``r2-1t`` reaches at least 1.6x ``r1-1t`` at the highest level.
2. Prefix-cache hit rate on a shared-system-prompt load (``--system-prompts`` long prefixes,
   each followed by different questions, in a shuffled order) on ``--replicas 2``, routed by
   prefix affinity and round-robin: prompt tokens found in the replicas' prefix caches over
   prompt tokens looked up (from ``/metrics``, summed over replicas). Each replica's prefix
   cache is bounded (``--prefix-cache-memory``, default about half the system prompts' KV),
   as a busy server's is: where prompts go then decides what stays cached.

3. With ``--bare-engines``, first: the most ``r2-1t`` could make of ``r1-1t`` here. The engine
   core alone, stepped in a process of its own on one thread (no server, no load generator, no
   Ray), holding the highest level's requests in a closed loop (the same prompts and answer
   length), against two such processes holding half as many each, stepping at the same time,
   for ``--bare-window-s`` seconds after a warm-up; alternating, ``--rounds`` times.

``--rounds N`` runs part 1 N times, the servers' order rotating each round, prints every
round's rows and each goal's ratio per round, and judges the goals on the median of those
ratios: this machine's own speed moves by a fifth or more within the hour, more than the
effects measured, so a ratio is only read between servers run minutes apart.

``--spread-answers`` gives part 1's answers random lengths from half to 1.5 times
``--max-tokens`` (the same mean): with answers all alike, a closed loop's streams finish and
start again in step, so each replica takes its prompts in waves of prompt-only steps; spread,
new prompts arrive while other streams decode, as a server's traffic does.

``--quick`` checks the script works (one level, few tokens): its figures mean nothing. On a
2-core machine the two 1-thread replicas and the server process share the cores: compare rows
of one run, never across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import Server, free_port, resolve_model

from rill.bench.drivers import Options, Target
from rill.bench.runner import measure
from rill.bench.stats import Summary
from rill.bench.workload import WORDS, BenchRequest, synthetic_prompts

CONFIGS = {
    "single": [],
    "r1": ["--replicas", "1"],
    "r1-1t": ["--replicas", "1", "--num-threads", "1"],
    "r2-1t": ["--replicas", "2", "--num-threads", "1"],
}


def bare_engine(model: str, concurrency: int, args: argparse.Namespace) -> None:
    """A child of ``bare_engines``: one 1-thread engine core holding ``concurrency`` requests
    (a finished one replaced at once), stepped after a warm-up for the window the parent
    starts with a line on stdin; prints its tokens/s and CPU seconds per second as JSON."""
    from engine import ClosedLoop  # benchmarks/engine.py: it imports torch, which only this child needs
    from rill.config import EngineConfig
    from rill.engine.builder import build_engine
    from rill.types import SamplingParams

    engine = build_engine(EngineConfig(model=model, num_threads=1, max_num_seqs=max(concurrency, 1)))
    prompts = iter(synthetic_prompts(10**5, args.prompt_len, args.max_tokens, args.seed + concurrency))
    loop = ClosedLoop(engine, prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0))
    for _ in range(concurrency):
        loop.add()
    loop.run(args.bare_warmup_s)  # past the first wave's prefill, into the steady mix
    print("ready", flush=True)
    sys.stdin.readline()
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = loop.run(args.bare_window_s)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    print(json.dumps({"tokens_per_s": tokens / wall, "cpu": cpu / wall}), flush=True)


def bare_engines(model: Path, top: int, args: argparse.Namespace) -> list[tuple[float, float]]:
    """Part 3: per round, one 1-thread engine at ``top`` requests, then two at ``top // 2`` at
    once: (one's tokens/s, the two's summed); each round's figures are printed."""

    def start(concurrency: int) -> subprocess.Popen[str]:
        cmd = [sys.executable, __file__, "--bare-child", str(concurrency), "--model", str(model)]
        cmd += ["--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens), "--seed", str(args.seed)]
        cmd += ["--bare-window-s", str(args.bare_window_s), "--bare-warmup-s", str(args.bare_warmup_s)]
        return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def together(concurrencies: list[int]) -> list[dict]:
        children = [start(c) for c in concurrencies]
        try:
            for child in children:  # each loaded and warm before any is measured
                assert child.stdout is not None
                while (line := child.stdout.readline()) and line.strip() != "ready":
                    pass
                if not line:
                    raise RuntimeError("a bare engine ended before it was ready")
            for child in children:
                assert child.stdin is not None
                child.stdin.write("go\n")
                child.stdin.flush()
            return [json.loads(child.stdout.readline()) for child in children]  # type: ignore[union-attr]
        finally:
            for child in children:
                child.kill()
                child.wait()

    out = []
    for index in range(args.rounds):
        [one] = together([top])
        two = together([top // 2, top - top // 2])
        out.append((one["tokens_per_s"], sum(t["tokens_per_s"] for t in two)))
        each = " + ".join(f"{t['tokens_per_s']:.1f}" for t in two)
        cpus = ", ".join(f"{t['cpu']:.2f}" for t in [one, *two])
        print(
            f"  round {index + 1}: one engine at c={top} {one['tokens_per_s']:.1f} tok/s; two at c={top // 2} "
            f"{each} = {out[-1][1]:.1f} tok/s ({out[-1][1] / out[-1][0]:.2f}x); CPU seconds per second {cpus}",
            flush=True,
        )
    return out


def server(name: str, model: Path, flags: list[str], log_dir: Path) -> Server:
    """``rill serve`` on ``model`` with only HTTP listening, plus ``flags``."""
    port = free_port()
    cmd = [sys.executable, "-m", "rill", "serve", "--model", str(model), "--port", str(port)]
    cmd += ["--no-socket", "--grpc-port", "0", "--max-queue", "4096", "--log-level", "warning", *flags]
    return Server(name, cmd, port, log_dir / f"{name}.log", "/health")


async def levels_of(port: int, levels: list[int], args: argparse.Namespace) -> dict[int, Summary]:
    """Every concurrency level against one running server; a seed per level (no prompt repeats)."""
    results: dict[int, Summary] = {}
    for level in levels:
        requests = synthetic_prompts(max(args.waves * level, 8), args.prompt_len, args.max_tokens, args.seed + level)
        if args.spread_answers:
            rng = random.Random(args.seed + level)
            low, high = (args.max_tokens + 1) // 2, args.max_tokens * 3 // 2
            requests = [msgspec.structs.replace(r, max_tokens=rng.randint(low, high)) for r in requests]
        summary, _ = await measure(
            "openai",
            Target(port=port),
            Options(temperature=0.0, ignore_eos=True),
            requests,
            concurrency=level,
            num_warmup=1,
            max_duration_s=args.max_duration_s,
        )
        results[level] = summary
        print(
            f"    c={level:<3} {summary.output_tokens_per_s:8.1f} tok/s  TTFT p50 {summary.ttft.p50_ms:7.0f} ms"
            f"  p99 {summary.ttft.p99_ms:7.0f} ms  errors {summary.num_errors}",
            flush=True,
        )
    return results


def prefix_counters(port: int) -> tuple[float, float]:
    """Prompt tokens found in the prefix caches and looked up, summed over the replicas."""
    hits = queries = 0.0
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        if line.startswith("rill_prefix_cache_hits_total{"):
            hits = float(line.rsplit(" ", 1)[1])
        elif line.startswith("rill_prefix_cache_queries_total{"):
            queries = float(line.rsplit(" ", 1)[1])
    return hits, queries


def shared_prefix_load(args: argparse.Namespace) -> list[BenchRequest]:
    """``--system-prompts`` long prefixes, each with ``--per-prompt`` different questions, shuffled."""
    rng = random.Random(args.seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(args.system_len)) for _ in range(args.system_prompts)]
    requests = [
        f"{system}\nQuestion: {' '.join(rng.choice(WORDS) for _ in range(8))}\nAnswer:"
        for system in systems
        for _ in range(args.per_prompt)
    ]
    rng.shuffle(requests)
    return [BenchRequest(index=i, prompt=p, max_tokens=args.prefix_max_tokens) for i, p in enumerate(requests)]


async def hit_rate(port: int, args: argparse.Namespace) -> tuple[float, Summary]:
    """The shared-prefix load on a running cluster: its hit rate (the stats are read every
    second: wait for them to settle) and its figures."""
    before = prefix_counters(port)
    summary, _ = await measure(
        "openai",
        Target(port=port),
        Options(temperature=0.0, ignore_eos=True),
        shared_prefix_load(args),
        concurrency=args.prefix_concurrency,
        num_warmup=0,
        max_duration_s=args.max_duration_s,
    )
    await asyncio.sleep(2.5)  # two reads of every replica's gauges: the counters include the last request
    after = prefix_counters(port)
    hits, queries = after[0] - before[0], after[1] - before[1]
    return (hits / queries if queries else float("nan")), summary


def verdict(ok: bool) -> str:
    """The word a goal's line ends with."""
    return "met" if ok else "NOT met"


def goal_lines(rounds: list[dict[str, dict[int, Summary]]], levels: list[int]) -> list[str]:
    """The goals' lines: each round's ratio (servers of one round ran minutes apart) and, over
    several rounds, their median, which the verdict reads."""
    top, low = levels[-1], (1 if 1 in levels else levels[-1])

    def line(what: str, values: list[float], unit: str, goal: str, ok: Callable[[float], bool]) -> str:
        med = statistics.median(values)
        shown = ", ".join(unit.format(v) for v in values)
        each = f" (rounds: {shown}; median)" if len(values) > 1 else ""
        return f"{what} {unit.format(med)}{each} (goal {goal}: {verdict(ok(med))})"

    lines = []
    if all({"single", "r1"} <= r.keys() for r in rounds):
        kept = [r["r1"][top].output_tokens_per_s / r["single"][top].output_tokens_per_s for r in rounds]
        added = [r["r1"][low].ttft.p50_ms - r["single"][low].ttft.p50_ms for r in rounds]
        lines.append(
            line(
                f"--replicas 1 keeps, of single-process tokens/s at c={top}:",
                kept,
                "{:.0%}",
                ">= 90 %",
                lambda v: v >= 0.9,
            )
        )
        lines.append(
            line(f"--replicas 1 adds to TTFT p50 at c={low}:", added, "{:.0f} ms", "<= 20 ms", lambda v: v <= 20)
        )
    if all({"r1-1t", "r2-1t"} <= r.keys() for r in rounds):
        gain = [r["r2-1t"][top].output_tokens_per_s / r["r1-1t"][top].output_tokens_per_s for r in rounds]
        lines.append(line(f"two 1-thread replicas, of one at c={top}:", gain, "{:.2f}x", ">= 1.6x", lambda v: v >= 1.6))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=48, help="words per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--waves", type=int, default=8, help="requests per level: this many times the concurrency")
    parser.add_argument("--max-duration-s", type=float, default=600.0)
    parser.add_argument("--system-prompts", type=int, default=12)
    parser.add_argument("--system-len", type=int, default=150, help="words per system prompt")
    parser.add_argument("--per-prompt", type=int, default=8, help="questions per system prompt")
    parser.add_argument("--prefix-concurrency", type=int, default=8)
    parser.add_argument("--prefix-max-tokens", type=int, default=8)
    parser.add_argument(
        "--prefix-cache-memory",
        default="48MiB",
        help="each replica's prefix cache in part 2: about half the system prompts' KV on SmolLM2",
    )
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument(
        "--spread-answers",
        action="store_true",
        help="part 1's answers of random lengths from half to 1.5x --max-tokens (else all alike)",
    )
    parser.add_argument("--log-dir", type=Path, default=Path("benchmarks/.cluster-logs"))
    parser.add_argument("--no-prefix", action="store_true", help="skip part 2 (the prefix-cache hit rate)")
    parser.add_argument(
        "--rounds", type=int, default=1, help="part 1 this many times, the servers' order rotating; goals on the median"
    )
    parser.add_argument(
        "--bare-engines",
        action="store_true",
        help="first, part 3: two bare 1-thread engines at half the highest level against one at all of it",
    )
    parser.add_argument("--bare-window-s", type=float, default=20.0)
    parser.add_argument("--bare-warmup-s", type=float, default=5.0)
    parser.add_argument("--bare-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.bare_child is not None:
        bare_engine(args.model, args.bare_child, args)
        return 0
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.quick:
        args.levels, args.max_tokens, args.system_prompts, args.per_prompt = "2", 8, 3, 2
        args.bare_window_s, args.bare_warmup_s = 1.0, 0.5
    levels = [int(x) for x in args.levels.split(",")]
    model = resolve_model(args.model)
    print(f"model {model}; levels {levels}; {args.max_tokens} tokens per request, prompts of {args.prompt_len} words")

    if args.bare_engines:
        print(f"\n## Bare engines (no server, no load generator, no Ray), c={levels[-1]}\n", flush=True)
        bare = bare_engines(model, levels[-1], args)
        gains = [two / one for one, two in bare]
        print(f"two bare 1-thread engines, of one: {statistics.median(gains):.2f}x (median of {len(gains)})\n")

    names = [name for name in args.configs.split(",") if name]
    rounds: list[dict[str, dict[int, Summary]]] = []
    for index in range(args.rounds if names else 0):  # --configs "": part 1 skipped
        # The order rotates, so that the machine's own drift (its memory speed moved 20-30 %
        # within an hour here) favours no server: each round compares neighbours in time.
        order = names[index % len(names) :] + names[: index % len(names)]
        if args.rounds > 1:
            print(f"  round {index + 1} of {args.rounds}: {', '.join(order)}", flush=True)
        results: dict[str, dict[int, Summary]] = {}
        for name in order:
            print(f"  {name}: rill serve {' '.join(CONFIGS[name])}", flush=True)
            started = time.monotonic()
            with server(name, model, CONFIGS[name], args.log_dir) as srv:
                srv.wait_ready(600)
                print(f"    ready in {time.monotonic() - started:.1f} s", flush=True)
                results[name] = asyncio.run(levels_of(srv.port, levels, args))
        rounds.append({name: results[name] for name in names})

    if names:
        print_rounds(rounds, levels)
    if args.no_prefix:
        return 0
    return prefix_part(model, args)


def print_rounds(rounds: list[dict[str, dict[int, Summary]]], levels: list[int]) -> None:
    """Part 1's table and its goal lines."""
    print("\n## Throughput and TTFT (OpenAI API, closed loop, greedy)\n")
    print("| round | server | c | tokens/s | TTFT p50 ms | TTFT p99 ms | errors |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for index, results in enumerate(rounds):
        for name, by_level in results.items():
            for level, s in by_level.items():
                print(
                    f"| {index + 1} | {name} | {level} | {s.output_tokens_per_s:.1f} | {s.ttft.p50_ms:.0f} "
                    f"| {s.ttft.p99_ms:.0f} | {s.num_errors} |"
                )
    print()
    for line in goal_lines(rounds, levels):
        print(line)


def prefix_part(model: Path, args: argparse.Namespace) -> int:
    """Part 2: the prefix-cache hit rate with and without affinity routing."""
    print("\n## Prefix-cache hit rate, shared system prompts, --replicas 2 --num-threads 1\n")
    print(
        f"{args.system_prompts} system prompts of {args.system_len} words x {args.per_prompt} questions, "
        f"shuffled, c={args.prefix_concurrency}, {args.prefix_max_tokens} tokens each, "
        f"--prefix-cache-memory {args.prefix_cache_memory} per replica\n"
    )
    print("| routing | hit rate | tokens/s | TTFT p50 ms |")
    print("| --- | --- | --- | --- |")
    for routing in ("prefix", "round-robin"):
        flags = ["--replicas", "2", "--num-threads", "1", "--routing", routing]
        flags += ["--prefix-cache-memory", args.prefix_cache_memory]
        with server(f"prefix-{routing}", model, flags, args.log_dir) as srv:
            srv.wait_ready(600)
            rate, summary = asyncio.run(hit_rate(srv.port, args))
        print(f"| {routing} | {rate:.1%} | {summary.output_tokens_per_s:.1f} | {summary.ttft.p50_ms:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
