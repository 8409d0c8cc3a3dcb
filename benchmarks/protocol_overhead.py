"""Protocol overhead: each front-end against the engine's own figures at the same concurrency.

    .venv/bin/python benchmarks/protocol_overhead.py [--model tiny|demo|100m|DIR] [--concurrency 1,8,32]
        [--max-tokens 32] [--prompt-len 32] [--threads 1] [--protocols ...]

Phase 1, the engine alone: the engine core is stepped directly in this process (no
asyncio, no sockets; ``benchmarks/engine.py``'s ``run_rill``) with N prompts arriving at
once, ``--waves`` times. Phase 2, each protocol: the same checkpoint and settings served by
``rill serve`` in a child process, N requests at once (closed loop at concurrency N, one
wave per ``--waves``) through ``rill bench``'s driver for that protocol. Prompts are the
same word lists (tokenized for the engine), outputs are greedy and of ``--max-tokens``
tokens (eos ignored where the protocol can say so). Every run uses its own prompts, so
the prefix cache never answers for a previous one.

Printed per concurrency: tokens/s, TTFT p50/p99 and mean time per output token (TPOT)
of the engine and of each protocol, and the ratios protocol / engine (tokens/s: < 1 is the
throughput the protocol costs; TTFT and TPOT: > 1 is the latency it adds, including the
load generator's own parsing, which runs on the same CPU). TPOT rather than the gap
between messages: when a client falls behind, several tokens' messages arrive in one read
and their gaps say nothing about the server.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import PeerUnavailable, Server, free_port, resolve_model

from rill.bench.drivers import DRIVERS, Options, Target, server_protocol
from rill.bench.runner import measure
from rill.bench.stats import Distribution, distribution
from rill.bench.workload import synthetic_prompts


class Row:
    """The figures one line of the table needs."""

    def __init__(self, tokens_per_s: float, ttft: Distribution, tpot_ms: float, num_errors: int = 0) -> None:
        self.tokens_per_s, self.ttft, self.tpot_ms, self.num_errors = tokens_per_s, ttft, tpot_ms, num_errors


def engine_rows(model_dir: Path, levels: list[int], args: argparse.Namespace) -> dict[int, Row]:
    """The engine core's own figures at each concurrency (in this process)."""
    import torch

    from engine import run_rill  # benchmarks/engine.py (the lead's engine benchmark)
    from rill.config import EngineConfig
    from rill.engine.builder import build_engine

    torch.set_num_threads(args.threads)
    engine = build_engine(
        EngineConfig(
            model=str(model_dir),
            dtype=args.dtype,
            kv_cache_memory="1GiB",
            max_model_len=args.context,
            max_num_seqs=max(levels),
            num_threads=args.threads,
        )
    )
    run_rill(
        engine,
        [engine.tokenizer.encode(r.prompt) for r in synthetic_prompts(2, args.prompt_len, 4, seed=999)],
        4,
        mixed=False,
    )  # warm-up
    rows: dict[int, Row] = {}
    for level in levels:
        num_tokens, wall_s, ttft_s, itl_s = 0, 0.0, [], []
        for wave in range(args.waves):
            prompts = synthetic_prompts(level, args.prompt_len, args.max_tokens, seed=10_000 + 100 * level + wave)
            fig = run_rill(engine, [engine.tokenizer.encode(p.prompt) for p in prompts], args.max_tokens, mixed=False)
            num_tokens += fig.num_tokens
            wall_s += fig.wall_s
            ttft_s += fig.ttft_s
            itl_s += fig.itl_s
        # Every request makes the same number of tokens, so the mean gap is the mean TPOT.
        rows[level] = Row(num_tokens / wall_s, distribution(ttft_s), distribution(itl_s).mean_ms)
        print(
            f"  engine       N={level:<3} {rows[level].tokens_per_s:8.1f} tok/s  TTFT p50 {rows[level].ttft.p50_ms:7.1f} ms",
            flush=True,
        )
    del engine
    gc.collect()
    return rows


async def protocol_rows(
    protocols: list[str], target: Target, levels: list[int], args: argparse.Namespace
) -> dict[str, dict[int, Row]]:
    """Each protocol's figures at each concurrency against the running server."""
    options = Options(temperature=0.0, ignore_eos=True)
    rows: dict[str, dict[int, Row]] = {}
    for p_index, name in enumerate(protocols):
        rows[name] = {}
        for level in levels:
            requests = synthetic_prompts(
                level * args.waves, args.prompt_len, args.max_tokens, seed=20_000 + 1000 * p_index + level
            )
            summary, _ = await measure(
                name,
                target,
                options,
                requests,
                concurrency=level,
                num_warmup=1,
                max_duration_s=args.max_duration_s,
                request_timeout_s=args.max_duration_s,
            )
            rows[name][level] = Row(summary.output_tokens_per_s, summary.ttft, summary.tpot.mean_ms, summary.num_errors)
            print(
                f"  {name:<12} N={level:<3} {summary.output_tokens_per_s:8.1f} tok/s  TTFT p50 "
                f"{summary.ttft.p50_ms:7.1f} ms  errors {summary.num_errors}",
                flush=True,
            )
    return rows


def _ratio(a: float, b: float) -> str:
    return f"{a / b:6.2f}x" if b and a == a and b == b else "     —"


def main(argv: list[str] | None = None) -> int:
    """Run both phases and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (default), demo, 100m or a model folder")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--protocols", default=",".join(DRIVERS))
    parser.add_argument("--prompt-len", type=int, default=32, help="words per prompt (default: 32)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--waves", type=int, default=2, help="rounds of N simultaneous requests per level")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--max-duration-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    model_dir = resolve_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    print(
        f"model {model_dir} ({args.dtype}, {args.threads} threads), {args.prompt_len}-word prompts, "
        f"{args.max_tokens} tokens, {args.waves} waves of N requests\n== engine alone",
        flush=True,
    )
    engine = engine_rows(model_dir, levels, args)
    with tempfile.TemporaryDirectory(prefix="rill-overhead-") as tmp:
        port, grpc_port = free_port(), free_port()
        target = Target(port=port, socket=f"{tmp}/rill.sock", grpc_address=f"127.0.0.1:{grpc_port}")
        cmd = [
            sys.executable,
            "-m",
            "rill",
            "serve",
            "--model",
            str(model_dir),
            "--dtype",
            args.dtype,
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--num-threads",
            str(args.threads),
            "--max-num-seqs",
            str(max(levels)),
            "--max-model-len",
            str(args.context),
            "--kv-cache-memory",
            "1GiB",
            "--chat-max-active",
            str(max(levels)),
            "--socket",
            target.socket,
            "--grpc-port",
            str(grpc_port),
            "--log-level",
            "warning",
        ]
        present = [p for p in protocols if importlib.util.find_spec(f"rill.protocols.{server_protocol(p)}")]
        for missing in set(protocols) - set(present):
            print(f"skipping {missing}: not in this build of rill")
        print("== protocols (rill serve in a child process)", flush=True)
        try:
            with Server("rill", cmd, port, args.out / "protocol_overhead.server.log", "/health") as server:
                server.wait_ready(300)
                rows = asyncio.run(protocol_rows(present, target, levels, args))
        except PeerUnavailable as exc:
            print(f"the server did not start: {exc}", file=sys.stderr)
            return 1
    print(
        f"\n{'front-end':<13}{'N':>4}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT':>9}"
        f"{'tok/s ratio':>13}{'TTFT p50 ratio':>16}{'TPOT ratio':>12}{'errors':>8}"
    )
    for level in levels:
        e = engine[level]
        print(
            f"{'engine':<13}{level:>4}{e.tokens_per_s:>9.1f}{e.ttft.p50_ms:>10.1f}{e.ttft.p99_ms:>10.1f}{e.tpot_ms:>9.2f}"
        )
        for name in present:
            r = rows[name][level]
            print(
                f"{name:<13}{level:>4}{r.tokens_per_s:>9.1f}{r.ttft.p50_ms:>10.1f}{r.ttft.p99_ms:>10.1f}"
                f"{r.tpot_ms:>9.2f}{_ratio(r.tokens_per_s, e.tokens_per_s):>13}"
                f"{_ratio(r.ttft.p50_ms, e.ttft.p50_ms):>16}{_ratio(r.tpot_ms, e.tpot_ms):>12}{r.num_errors:>8}"
            )
    print(
        "\nratios are protocol / engine at the same concurrency (tok/s < 1: throughput lost; TTFT, TPOT > 1: latency added)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
