"""Where the time goes: ``rill serve`` over HTTP against the engine alone, sampled with py-spy.

    .venv/bin/python benchmarks/profile_serve.py --model 100m --concurrency 1,8,32

For each concurrency, the same kind of work (``--prompt-tokens``-token prompts, all
different, ``--max-tokens`` new tokens, greedy, eos ignored, one wave of requests arriving at
once) runs twice, one after the other:

* **http**: ``rill serve`` in a child process, driven by ``rill.bench``'s OpenAI driver
  (streaming ``/v1/completions``) from this process;
* **engine**: the engine core stepped directly in a child process (``benchmarks/engine.py``'s
  ``run_rill``: no asyncio, no sockets).

Both runs use ``--runner`` (``torch``, or ``llamacpp`` on the model's GGUF as ``peers.py``
converts it) and ``--dtype`` (bfloat16 by default; float32 on a CPU without native bf16).

py-spy (the ``bench`` extra) samples the child at ``--rate`` Hz with ``--idle`` (every
thread every tick), and the per-thread CPU time is read from ``/proc`` before and after, so
OpenMP worker threads (invisible to py-spy) are counted too. Printed per run: tokens/s,
the engine thread's wall time split into forward, sampler, detokenizer, scheduler and core
bookkeeping, hand-off to the event loop and waiting for work; the event loop's busy share
split into HTTP/SSE encoding and writes, output routing and the rest; and CPU seconds per
thread group (engine thread, OpenMP workers, event loop, tokenizer pool, other) per second
of wall time. Then the ratio http / engine tokens/s per concurrency.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import Server, ensure_gguf, free_port
from peers import GGUF_TYPE_OF_DTYPE, exact_prompts, load_average, model_folder, rill_serve_cmd

from rill.bench.drivers import Options, Target
from rill.bench.runner import measure
from rill.bench.workload import BenchRequest

PY_SPY = Path(sys.executable).parent / "py-spy"

# Engine-thread categories, first match wins, tested on the stack from its innermost frame out.
ENGINE_RULES = (
    ("sampler", ("sampler.py", "sampler_kernels.py")),
    ("detokenizer", ("detokenizer.py",)),
    ("forward", ("runner.py", "models/", "torch/nn/")),
    ("hand-off", ("call_soon_threadsafe", "_write_to_self")),
    ("waiting for work", ("Queue.get ", "Condition.wait")),
    ("scheduler", ("scheduler.py", "kv_cache.py")),
    ("core bookkeeping", ("core.py", "request.py", "batch.py")),
)
LOOP_RULES = (
    ("idle (epoll)", ("EpollSelector.select",)),
    ("output routing", ("_dispatch", "stream.py")),
    (
        "HTTP/SSE encode + write",
        ("openai_http", "starlette", "uvicorn", "h11", "httptools", "sse", "transport", "selector_events.py"),
    ),
)


def classify(stack: str, rules: tuple[tuple[str, tuple[str, ...]], ...]) -> str:
    """The first rule whose marker appears in the stack (innermost frames first)."""
    frames = stack.split(";")[::-1]
    for frame in frames:
        for name, markers in rules:
            if any(m in frame for m in markers):
                return name
    return "other"


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[int, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / ticks
    return out


def parse_raw(path: Path) -> tuple[dict[str, Counter], dict[int, str]]:
    """py-spy's raw output → per thread name a Counter of stacks, and tid → thread name."""
    by_thread: dict[str, Counter] = {}
    names: dict[int, str] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        head, _, rest = stack.partition(": ")
        tid = int(head.split("(")[1].split(")")[0]) if "(" in head else 0
        name, _, frames = rest.partition(";")
        names[tid] = name
        by_thread.setdefault(name, Counter())[frames] += int(count)
    return by_thread, names


def group_of(name: str | None) -> str:
    if name is None:
        return "OpenMP workers (native)"
    if name == "rill-engine":
        return "engine thread"
    if name == "MainThread":
        return "main / event loop"
    if name.startswith("rill-tokenize"):
        return "tokenizer pool"
    return "other Python threads"


def breakdown(
    raw: Path,
    cpu_before: dict[int, float],
    cpu_after: dict[int, float],
    wall_s: float,
    engine_thread: str,
    loop_thread: str | None,
) -> dict:
    """Shares of the engine thread's wall time, the loop's busy time, and CPU per thread group."""
    by_thread, names = parse_raw(raw)
    engine = Counter()
    for stack, n in by_thread.get(engine_thread, Counter()).items():
        engine[classify(stack, ENGINE_RULES)] += n
    loop = Counter()
    if loop_thread:
        for stack, n in by_thread.get(loop_thread, Counter()).items():
            loop[classify(stack, LOOP_RULES)] += n
    cpu: Counter = Counter()
    for tid, after in cpu_after.items():
        cpu[group_of(names.get(tid))] += after - cpu_before.get(tid, 0.0)
    total_e = sum(engine.values()) or 1
    total_l = sum(loop.values()) or 1
    return {
        "engine_thread_pct": {k: 100 * v / total_e for k, v in engine.most_common()},
        "loop_pct": {k: 100 * v / total_l for k, v in loop.most_common()},
        "cpu_per_wall_s": {k: v / wall_s for k, v in cpu.most_common()},
    }


# --------------------------------------------------------------------------- the two kinds of run

ENGINE_CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from engine import run_rill
from rill.config import EngineConfig
from rill.engine.builder import build_engine
folder, new_tokens, max_seqs, runner, dtype = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
engine = build_engine(EngineConfig(model=folder, runner=runner, dtype=dtype, max_model_len=512, max_num_seqs=max_seqs))
tok = engine.tokenizer
run_rill(engine, [tok.encode("warm up the engine please", add_special_tokens=False)] * 2, 4, mixed=False)
print("READY", flush=True)
for line in sys.stdin:
    texts = json.loads(line)
    prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
    fig = run_rill(engine, prompts, new_tokens, mixed=False)
    print(json.dumps({"tokens_per_s": fig.tokens_per_s, "wall_s": fig.wall_s}), flush=True)
"""


def spy(pid: int, out: Path, rate: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(PY_SPY),
            "record",
            "-p",
            str(pid),
            "-f",
            "raw",
            "-o",
            str(out),
            "-r",
            str(rate),
            "--threads",
            "--idle",
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def stop_spy(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    proc.wait(60)


def run_http(model_dir: Path, levels: list[int], prompts: dict[int, list[str]], args: argparse.Namespace) -> dict:
    port = free_port()
    cmd = rill_serve_cmd(
        model_dir, port, max(levels), 512, "--dtype", args.dtype, "--runner", args.runner, *args.serve_args.split()
    )
    results = {}
    with Server("rill", cmd, port, args.out / "profile-serve.log", "/health") as server:
        server.wait_ready(300)
        pid = server.proc.pid
        target = Target(port=port)
        options = Options(temperature=0.0, ignore_eos=True)
        asyncio.run(
            measure(
                "openai",
                target,
                options,
                [BenchRequest(index=0, prompt="warm up", max_tokens=4)],
                concurrency=1,
                num_warmup=0,
            )
        )
        for level in levels:
            requests = [
                BenchRequest(index=i, prompt=p, max_tokens=args.max_tokens) for i, p in enumerate(prompts[level])
            ]
            raw = args.out / f"http-c{level}.txt"
            load = load_average()
            before = thread_cpu(pid)
            recorder = spy(pid, raw, args.rate)
            t0 = time.monotonic()
            summary, _ = asyncio.run(
                measure(
                    "openai",
                    target,
                    options,
                    requests,
                    concurrency=level,
                    num_warmup=0,
                    max_duration_s=1800,
                    request_timeout_s=1800,
                )
            )
            wall = time.monotonic() - t0
            after = thread_cpu(pid)
            stop_spy(recorder)
            results[level] = {
                "tokens_per_s": summary.output_tokens_per_s,
                "load": load,
                **breakdown(raw, before, after, wall, "rill-engine", "MainThread"),
            }
            print(f"http   c={level:<3} {summary.output_tokens_per_s:7.1f} tok/s  load {load}", flush=True)
    return results


def run_engine(model_dir: Path, levels: list[int], prompts: dict[int, list[str]], args: argparse.Namespace) -> dict:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            ENGINE_CHILD,
            str(Path(__file__).resolve().parent),
            str(model_dir),
            str(args.max_tokens),
            str(max(levels)),
            args.runner,
            args.dtype,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    results = {}
    try:
        assert child.stdout is not None and child.stdin is not None
        while (line := child.stdout.readline()) and not line.startswith("READY"):
            pass
        for level in levels:
            raw = args.out / f"engine-c{level}.txt"
            load = load_average()
            before = thread_cpu(child.pid)
            recorder = spy(child.pid, raw, args.rate)
            child.stdin.write(json.dumps(prompts[level]) + "\n")
            child.stdin.flush()
            fig = json.loads(child.stdout.readline())
            after = thread_cpu(child.pid)
            stop_spy(recorder)
            results[level] = {
                "tokens_per_s": fig["tokens_per_s"],
                "load": load,
                **breakdown(raw, before, after, fig["wall_s"], "MainThread", None),
            }
            print(f"engine c={level:<3} {fig['tokens_per_s']:7.1f} tok/s  load {load}", flush=True)
    finally:
        child.kill()
        child.wait()
    return results


def report(http: dict, engine: dict, levels: list[int]) -> str:
    lines = []
    for kind, res in (("http", http), ("engine", engine)):
        for level in levels:
            r = res.get(level)
            if not r:
                continue
            lines.append(f"{kind:<6} c={level:<3} {r['tokens_per_s']:7.1f} tok/s (load {r['load']})")
            lines.append(
                "   engine thread wall %: " + ", ".join(f"{k} {v:.1f}" for k, v in r["engine_thread_pct"].items())
            )
            if r["loop_pct"]:
                lines.append("   event loop wall %:    " + ", ".join(f"{k} {v:.1f}" for k, v in r["loop_pct"].items()))
            lines.append(
                "   CPU s per wall s:     " + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_per_wall_s"].items())
            )
    for level in levels:
        if level in http and level in engine:
            lines.append(
                f"http / engine tokens/s at c={level}: {http[level]['tokens_per_s'] / engine[level]['tokens_per_s']:.2f}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="100m", help="smollm2, 100m or a folder")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument("--dtype", choices=tuple(GGUF_TYPE_OF_DTYPE), default="bfloat16")
    parser.add_argument(
        "--runner",
        choices=("torch", "llamacpp"),
        default="torch",
        help="llamacpp: both runs serve the model's GGUF in --dtype (peers.py's conversion) with llama.cpp",
    )
    parser.add_argument("--serve-args", default="", help="extra flags for rill serve, one string")
    parser.add_argument("--only", choices=("http", "engine"), default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-results/profile"))
    args = parser.parse_args(argv)
    if not PY_SPY.exists():
        parser.error(f"py-spy is missing ({PY_SPY}): pip install -e '.[bench]'")
    args.out.mkdir(parents=True, exist_ok=True)
    levels = [int(x) for x in args.concurrency.split(",")]
    folder = model_folder(args.model)
    pool = exact_prompts(folder, 2 * sum(levels), args.prompt_tokens, seed=7)
    model_dir = ensure_gguf(folder, GGUF_TYPE_OF_DTYPE[args.dtype]) if args.runner == "llamacpp" else folder
    fresh = iter(pool)  # every run its own prompts: the prefix cache answers none of them
    prompts_http = {n: [next(fresh) for _ in range(n)] for n in levels}
    prompts_engine = {n: [next(fresh) for _ in range(n)] for n in levels}
    print(f"model {model_dir}, load average {load_average()}", flush=True)
    http = {} if args.only == "engine" else run_http(model_dir, levels, prompts_http, args)
    engine = {} if args.only == "http" else run_engine(model_dir, levels, prompts_engine, args)
    text = report(http, engine, levels)
    print(text)
    (args.out / "profile.json").write_text(json.dumps({"http": http, "engine": engine}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
