"""Benchmark: N concurrent ``/generate`` sockets versus the engine alone at the same concurrency.

    .venv/bin/python benchmarks/generate_ws.py [--model DIR] [--concurrency 64] [--max-tokens 64]

Phase 1 (engine): N requests straight through ``InprocClient.generate``; phase 2 (protocol):
the same N requests as ``/generate`` WebSocket clients against a server on loopback, with
the load generator in a separate process (so it does not share this event loop). Both use
greedy sampling with ``ignore_eos`` so every request makes exactly ``--max-tokens`` tokens.
Prints tokens/s, time to first token and inter-token latency (mean, p50, p99) for both, and
the protocol's overhead as ratios (medians of ``--repeats`` alternating runs, since a shared
machine's load drifts). Without ``--model`` a small random-init checkpoint is
written to a temporary folder (``rill.testing.checkpoints``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any


def _summary(ttft_s: list[float], itl_s: list[float], num_tokens: int, wall_s: float) -> dict[str, float]:
    def pct(values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "tokens_per_s": num_tokens / wall_s if wall_s > 0 else float("nan"),
        "ttft_mean_ms": 1000 * statistics.fmean(ttft_s) if ttft_s else float("nan"),
        "ttft_p50_ms": 1000 * pct(ttft_s, 0.5),
        "ttft_p99_ms": 1000 * pct(ttft_s, 0.99),
        "itl_mean_ms": 1000 * statistics.fmean(itl_s) if itl_s else float("nan"),
        "itl_p50_ms": 1000 * pct(itl_s, 0.5),
        "itl_p99_ms": 1000 * pct(itl_s, 0.99),
        "num_tokens": float(num_tokens),
        "wall_s": wall_s,
    }


# --------------------------------------------------------------------------- load generator (child process)


async def _one_socket(url: str, prompt: str, max_tokens: int, start: asyncio.Event) -> tuple[float, list[float], int]:
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None) as ws:
        await start.wait()
        sent_at = time.perf_counter()
        await ws.send(
            json.dumps(
                {
                    "type": "config",
                    "prompt": prompt,
                    "parameters": {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                }
            )
        )
        ttft, gaps, num_tokens, last = float("nan"), [], 0, None
        while True:
            msg = json.loads(await ws.recv())
            now = time.perf_counter()
            if msg["type"] == "token":
                num_tokens += 1
                if last is None:
                    ttft = now - sent_at
                else:
                    gaps.append(now - last)
                last = now
            elif msg["type"] in ("completion", "error"):
                if msg["type"] == "error":
                    raise RuntimeError(f"server error: {msg}")
                return ttft, gaps, num_tokens


async def _load(url: str, concurrency: int, prompt: str, max_tokens: int) -> dict[str, float]:
    start = asyncio.Event()
    tasks = [asyncio.create_task(_one_socket(url, prompt, max_tokens, start)) for _ in range(concurrency)]
    await asyncio.sleep(0.5)  # let every socket connect before the clock starts (setup, not a measurement)
    began = time.perf_counter()
    start.set()
    results = await asyncio.gather(*tasks)
    wall_s = time.perf_counter() - began
    return _summary([r[0] for r in results], [g for r in results for g in r[1]], sum(r[2] for r in results), wall_s)


# --------------------------------------------------------------------------- engine-only phase


async def _engine_phase(client: Any, concurrency: int, prompt: str, max_tokens: int) -> dict[str, float]:
    from rill.types import GenerateRequest, SamplingParams

    async def one() -> tuple[float, list[float], int]:
        sent_at = time.perf_counter()
        stream = await client.generate(
            GenerateRequest(
                prompt=prompt,
                protocol="bench",
                sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            )
        )
        ttft, gaps, num_tokens, last = float("nan"), [], 0, None
        async with stream:
            async for out in stream:
                now = time.perf_counter()
                n = len(out.token_ids)
                if n == 0:
                    continue
                if last is None:
                    ttft = now - sent_at
                    gaps.extend([0.0] * (n - 1))
                else:
                    gaps.extend([(now - last) / n] * n)  # a coalesced delta: spread its gap
                num_tokens += n
                last = now
        return ttft, gaps, num_tokens

    began = time.perf_counter()
    results = await asyncio.gather(*[one() for _ in range(concurrency)])
    wall_s = time.perf_counter() - began
    return _summary([r[0] for r in results], [g for r in results for g in r[1]], sum(r[2] for r in results), wall_s)


async def _start_server(client: Any) -> tuple[Any, asyncio.Task, str]:
    import uvicorn

    from rill.config import ServerConfig
    from rill.server import build_app, make_deps

    deps = make_deps(ServerConfig(), client)
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(deps), host="127.0.0.1", port=0, log_level="warning", lifespan="off", ws_max_size=16 * 1024 * 1024
        )
    )
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, task, f"ws://127.0.0.1:{port}/generate"


async def _protocol_phase(url: str, concurrency: int, prompt: str, max_tokens: int) -> dict[str, float]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--load-only",
        url,
        "--concurrency",
        str(concurrency),
        "--max-tokens",
        str(max_tokens),
        "--prompt",
        prompt,
        stdout=subprocess.PIPE,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit("the load generator failed")
    return json.loads(out)


def _print(engine: dict[str, float], proto: dict[str, float], concurrency: int, max_tokens: int) -> None:
    print(f"\n{concurrency} concurrent requests x {max_tokens} tokens (greedy, ignore_eos)\n")
    print(f"{'figure':<16}{'engine':>12}{'/generate':>12}{'ratio':>9}")
    for key, label in (
        ("tokens_per_s", "tokens/s"),
        ("ttft_mean_ms", "TTFT mean ms"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p99_ms", "TTFT p99 ms"),
        ("itl_mean_ms", "ITL mean ms"),
        ("itl_p50_ms", "ITL p50 ms"),
        ("itl_p99_ms", "ITL p99 ms"),
        ("server_cpu_ms_per_token", "CPU ms/token"),
    ):
        ratio = proto[key] / engine[key] if engine[key] else float("nan")
        print(f"{label:<16}{engine[key]:>12.2f}{proto[key]:>12.2f}{ratio:>9.3f}")
    print("\nratio = /generate ÷ engine (tokens/s below 1, latencies above 1 are the protocol's overhead);")
    print("CPU ms/token = this process's CPU time per generated token (engine + server, not the load generator)")


async def _with_cpu(phase: Any) -> dict[str, float]:
    """Run a phase and add this process's CPU time per token (engine thread + event loop; the
    load generator runs elsewhere). Unlike wall-clock figures it barely moves when other
    processes load the machine."""
    cpu_start = time.process_time()
    result = await phase
    result["server_cpu_ms_per_token"] = 1000 * (time.process_time() - cpu_start) / max(1.0, result["num_tokens"])
    return result


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


async def _main(args: argparse.Namespace) -> None:
    from rill.config import EngineConfig
    from rill.frontend.inproc import InprocClient

    model = args.model
    if model is None:
        from rill.testing.checkpoints import make_checkpoint

        model = str(make_checkpoint(tempfile.mkdtemp(prefix="rill-bench-")))
    client = InprocClient.start(EngineConfig(model=model, max_num_seqs=max(64, args.concurrency)))
    await client.wait_ready()
    server, task, url = await _start_server(client)
    engine_runs: list[dict[str, float]] = []
    proto_runs: list[dict[str, float]] = []
    try:
        await _engine_phase(client, min(4, args.concurrency), args.prompt, 4)  # warm-up, not reported
        for i in range(args.repeats):  # alternate, so drifting machine load hits both sides alike
            engine_runs.append(await _with_cpu(_engine_phase(client, args.concurrency, args.prompt, args.max_tokens)))
            proto_runs.append(await _with_cpu(_protocol_phase(url, args.concurrency, args.prompt, args.max_tokens)))
            print(
                f"run {i + 1}/{args.repeats}: engine {engine_runs[-1]['tokens_per_s']:.1f} tokens/s, "
                f"/generate {proto_runs[-1]['tokens_per_s']:.1f} tokens/s",
                file=sys.stderr,
            )
    finally:
        server.should_exit = True
        await task
        await client.shutdown()
    print(f"\nmedian of {args.repeats} alternating runs")
    _print(_median(engine_runs), _median(proto_runs), args.concurrency, args.max_tokens)


def main() -> None:
    """Parse flags and run (or, with ``--load-only URL``, act as the load generator)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: a small random-init checkpoint)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each phase (medians reported)")
    parser.add_argument("--prompt", default="Once upon a time there was a little robot who wanted to paint")
    parser.add_argument("--load-only", default=None, metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load_only:
        print(json.dumps(asyncio.run(_load(args.load_only, args.concurrency, args.prompt, args.max_tokens))))
        return
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
