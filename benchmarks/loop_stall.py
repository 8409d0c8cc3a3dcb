"""Event-loop stall: how long ``/health`` waits while a huge prompt is admitted.

    .venv/bin/python benchmarks/loop_stall.py [--model tiny|demo|DIR] [--prompt-mb 3]
        [--list-size 200000] [--period-ms 5] [--serve-arg=--max-prompt-chars=4000000 ...]

Starts ``rill serve`` as a child process (HTTP only), then for each scenario pings
``GET /health`` every ``--period-ms`` ms on one keep-alive connection while one other
connection sends the big request, and prints the slowest ``/health`` answers seen while the
big request was in flight (max, p99, p50, in ms) and how the big request ended.

Scenarios: a ``--prompt-mb`` MB prompt on ``/v1/completions``, the same text as one chat
message on ``/v1/chat/completions``, and a prompt list of ``--list-size`` short strings on
``/v1/completions``. Every prompt is longer than the context, so each big request ends in
an error once it has been tokenized (or sooner, if a size limit refuses it before): what is
measured is the admission work, not generation. ``--serve-arg`` passes extra flags to
``rill serve`` (e.g. raise ``--max-prompt-chars`` to see the cost of tokenizing it all).

``--fast-path`` instead measures, in this process with the model's tokenizer, what the
admission's fast path trades: encoding a short prompt inline on the event loop against a
round trip through the tokenizer pool (``rill.frontend.admission.FAST_PATH_MAX_SIZE``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import Server, free_port, resolve_model

WORDS = "the quick brown fox jumps over a lazy dog while seven small owls watch from an old tree".split()


def big_text(num_bytes: int) -> str:
    """About ``num_bytes`` of English-like ASCII text (varied, so BPE merges stay realistic)."""
    out: list[str] = []
    size = 0
    i = 0
    while size < num_bytes:
        word = WORDS[(i * 7 + i // 13) % len(WORDS)]
        out.append(word)
        size += len(word) + 1
        i += 1
    return " ".join(out)[:num_bytes]


async def probe(client: httpx.AsyncClient, period_s: float, stop: asyncio.Event, latencies: list[float]) -> None:
    """GET /health every ``period_s`` until ``stop``; record each answer's latency in ms."""
    while not stop.is_set():
        began = time.perf_counter()
        response = await client.get("/health")
        latencies.append((time.perf_counter() - began) * 1000)
        assert response.status_code == 200, response.text
        await asyncio.sleep(period_s)


async def scenario(base: str, path: str, body: dict[str, Any], period_s: float) -> dict[str, Any]:
    """Send ``body`` to ``path`` while probing /health; the stall figures and the outcome."""
    latencies: list[float] = []
    stop = asyncio.Event()
    async with (
        httpx.AsyncClient(base_url=base, timeout=600) as prober,
        httpx.AsyncClient(base_url=base, timeout=600) as sender,
    ):
        await prober.get("/health")  # connect first: the handshake is not a stall
        task = asyncio.create_task(probe(prober, period_s, stop, latencies))
        await asyncio.sleep(20 * period_s)  # a baseline of quiet pings
        quiet = len(latencies)
        began = time.perf_counter()
        response = await sender.post(path, json=body)
        elapsed_ms = (time.perf_counter() - began) * 1000
        stop.set()
        await task
    during = sorted(latencies[quiet:]) or [0.0]
    return {
        "status": response.status_code,
        "answer": response.text[:120].replace("\n", " "),
        "request_ms": elapsed_ms,
        "pings": len(during),
        "max_ms": during[-1],
        "p99_ms": during[min(len(during) - 1, int(len(during) * 0.99))],
        "p50_ms": statistics.median(during),
        "quiet_max_ms": max(latencies[:quiet] or [0.0]),
    }


async def run(base: str, args: argparse.Namespace) -> None:
    """Run every scenario in turn and print one line each."""
    text = big_text(int(args.prompt_mb * 1_000_000))
    scenarios = {
        f"completions, {args.prompt_mb:g} MB prompt": ("/v1/completions", {"prompt": text, "max_tokens": 1}),
        f"chat, {args.prompt_mb:g} MB message": (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": text}], "max_tokens": 1},
        ),
        f"completions, {args.list_size} prompts": (
            "/v1/completions",
            {"prompt": [f"p{i} fox" for i in range(args.list_size)], "max_tokens": 1},
        ),
    }
    print(
        f"{'scenario':36} {'status':>6} {'request ms':>10} {'pings':>6} {'max ms':>8} {'p99 ms':>8} {'p50 ms':>7} {'quiet max':>9}"
    )
    for name, (path, body) in scenarios.items():
        r = await scenario(base, path, body, args.period_ms / 1000)
        print(
            f"{name:36} {r['status']:>6} {r['request_ms']:>10.0f} {r['pings']:>6} {r['max_ms']:>8.1f} "
            f"{r['p99_ms']:>8.1f} {r['p50_ms']:>7.1f} {r['quiet_max_ms']:>9.1f}   {r['answer']}"
        )


async def fast_path_figures(model_dir: Path, repeats: int = 2000) -> None:
    """Print inline-encode and pool-round-trip costs (µs) for prompts of a few sizes."""
    from rill.frontend.admission import PromptAdmission, prompt_token_ids
    from rill.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(model_dir)
    admission = PromptAdmission(max_prompt_chars=10**9, num_threads=2)
    loop = asyncio.get_running_loop()
    text = big_text(4096)

    async def pool_trip(prompt: str) -> None:
        await loop.run_in_executor(admission._pool, prompt_token_ids, tokenizer, [prompt], 10**9, 10**9)

    await pool_trip("warm up")
    began = time.perf_counter()
    for _ in range(repeats):
        await loop.run_in_executor(admission._pool, int)
    print(f"empty pool round trip: {(time.perf_counter() - began) / repeats * 1e6:.0f} µs")
    print(f"{'chars':>6} {'inline µs':>10} {'pool trip µs':>13}")
    for size in (16, 64, 128, 256, 512, 1024, 4096):
        prompt = text[:size]
        began = time.perf_counter()
        for _ in range(repeats):
            tokenizer.encode(prompt)
        inline = (time.perf_counter() - began) / repeats * 1e6
        began = time.perf_counter()
        for _ in range(repeats):
            await pool_trip(prompt)
        trip = (time.perf_counter() - began) / repeats * 1e6
        print(f"{size:>6} {inline:>10.0f} {trip:>13.0f}")
    admission.close()


def main(argv: list[str] | None = None) -> None:
    """Parse flags, start the server, run the scenarios."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny (random-init, cached), demo, or a model folder")
    parser.add_argument("--prompt-mb", type=float, default=3.0, help="size of the big prompt in MB")
    parser.add_argument("--list-size", type=int, default=200_000, help="strings in the big prompt list")
    parser.add_argument("--period-ms", type=float, default=5.0, help="gap between /health pings")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra flag for rill serve (repeatable)")
    parser.add_argument("--log", type=Path, default=Path("/tmp/rill-loop-stall.log"), help="server log file")
    parser.add_argument("--fast-path", action="store_true", help="measure the admission fast path instead (no server)")
    args = parser.parse_args(argv)
    model_dir = resolve_model(args.model)
    if args.fast_path:
        asyncio.run(fast_path_figures(model_dir))
        return
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "rill",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--num-threads",
        "1",
        "--no-socket",
        "--grpc-port",
        "0",
        "--log-level",
        "warning",
        "--max-body-bytes",
        str(64 * 1024 * 1024),
        *args.serve_arg,
    ]
    with Server("rill", cmd, port, args.log, "/health") as server:
        server.wait_ready(300)
        asyncio.run(run(f"http://127.0.0.1:{port}", args))


if __name__ == "__main__":
    main()
