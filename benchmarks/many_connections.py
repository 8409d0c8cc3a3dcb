"""Many connections: 1,000 concurrent streaming requests, mixed protocols, one rill server.

    .venv/bin/python benchmarks/many_connections.py [--connections 1000] [--max-tokens 16]
        [--model tiny|demo|DIR] [--protocols openai,generate-ws,batch-ws,uds,chat-ws,evergreen]

Starts ``rill serve`` as a child process with every listener (HTTP, a Unix socket in a
temporary folder, gRPC on a free port) and queues big enough for the load (``--max-queue``
and ``--chat-max-queue`` above the connection count, and the connection limits, since
every client is 127.0.0.1), raises this process's open-file
limit (the child inherits it), sends one warm-up request per protocol, then opens all
connections at once, split evenly over the protocols, each streaming one generation
(greedy, eos ignored where the protocol can say so). Prints errors (by protocol and type),
TTFT p50/p99, throughput, and the server's resident memory before the load and at its peak
(Linux ``VmHWM``). Evergreen requests are gRPC sessions multiplexed over one HTTP/2
connection (that is how gRPC clients connect); every other request has its own connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import PeerUnavailable, Server, free_port, resolve_model

from rill.bench.drivers import DRIVERS, Options, Target
from rill.bench.runner import measure
from rill.bench.stats import RequestRecord, Summary, format_report, summarize
from rill.bench.workload import synthetic_prompts


def raise_fd_limit(needed: int) -> int:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit (or ``needed``); returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(needed, soft)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rss_bytes(pid: int) -> tuple[int | None, int | None]:
    """Current and peak resident memory of ``pid`` (``VmRSS``, ``VmHWM``)."""
    now = peak = None
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                now = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return now, peak


async def run_mixed(
    protocols: list[str], target: Target, args: argparse.Namespace
) -> tuple[dict[str, Summary], list[RequestRecord], float]:
    """Warm each protocol up, then start every connection at once; per-protocol summaries and all records."""
    options = Options(temperature=0.0, ignore_eos=True)
    for name in protocols:  # one unmeasured request each (connects, compiles nothing twice)
        await measure(name, target, options, synthetic_prompts(1, 8, 4, seed=99), concurrency=1, num_warmup=0)
    shares = {
        name: args.connections // len(protocols) + (1 if i < args.connections % len(protocols) else 0)
        for i, name in enumerate(protocols)
    }
    began = time.perf_counter()

    async def one(name: str) -> tuple[Summary, list[RequestRecord]]:
        requests = synthetic_prompts(
            shares[name], args.prompt_len, args.max_tokens, seed=1 + protocols.index(name)
        )  # no shared prompts
        return await measure(
            name,
            target,
            options,
            requests,
            concurrency=shares[name],
            num_warmup=0,
            request_timeout_s=args.max_duration_s,
            max_duration_s=args.max_duration_s,
        )

    outcomes = await asyncio.gather(*(one(name) for name in protocols))
    wall_s = time.perf_counter() - began
    summaries = {name: summary for name, (summary, _) in zip(protocols, outcomes)}
    records = [record for _, recs in outcomes for record in recs]
    return summaries, records, wall_s


def main(argv: list[str] | None = None) -> int:
    """Run the many-connections benchmark; exit 0 only with zero errors."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=1000)
    parser.add_argument("--protocols", default=",".join(DRIVERS))
    parser.add_argument("--model", default="tiny", help="tiny (default), demo, 100m or a model folder")
    parser.add_argument("--prompt-len", type=int, default=16, help="words per prompt (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per request (default: 16)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server (default: 1)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="engine batch size (default: 64)")
    parser.add_argument("--max-duration-s", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args(argv)
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    limit = raise_fd_limit(4 * args.connections + 256)
    if limit < 2 * args.connections + 64:
        print(f"the open-file limit is {limit}: too low for {args.connections} connections", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rill-many-") as tmp:
        port, grpc_port = free_port(), free_port()
        target = Target(port=port, socket=f"{tmp}/rill.sock", grpc_address=f"127.0.0.1:{grpc_port}")
        queue = str(max(2 * args.connections, 1024))
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
            str(args.threads),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-queue",
            queue,
            "--chat-max-queue",
            queue,
            "--chat-max-active",
            str(args.max_num_seqs),
            # every connection comes from 127.0.0.1: the per-client bound must hold them all
            "--max-connections",
            queue,
            "--max-connections-per-client",
            queue,
            "--socket",
            target.socket,
            "--grpc-port",
            str(grpc_port),
            "--log-level",
            "warning",
        ]
        log = args.out / "many_connections.server.log"
        try:
            with Server("rill", cmd, port, log, "/health") as server:
                server.wait_ready(300)
                assert server.proc is not None
                rss_idle, _ = rss_bytes(server.proc.pid)
                print(
                    f"server pid {server.proc.pid} ready ({model_dir.name}); open-file limit {limit}; "
                    f"{args.connections} connections over {', '.join(protocols)}",
                    flush=True,
                )
                summaries, records, wall_s = asyncio.run(run_mixed(protocols, target, args))
                rss_after, rss_peak = rss_bytes(server.proc.pid)
        except PeerUnavailable as exc:
            print(f"the server did not start: {exc}", file=sys.stderr)
            return 1
    total = summarize(
        records, protocol="mixed", target=f"127.0.0.1:{port}", wall_s=wall_s, concurrency=args.connections
    )
    for name, summary in summaries.items():
        print(
            f"{name:<12} {summary.num_ok:>5} ok {summary.num_errors:>4} errors {summary.errors_by_type or ''}  "
            f"TTFT p50 {summary.ttft.p50_ms:8.0f} ms  p99 {summary.ttft.p99_ms:8.0f} ms"
        )
    samples: dict[tuple[str, str], str] = {}
    for record in records:
        if record.error is not None:
            samples.setdefault((record.protocol, record.error), record.error_message or "")
    for (name, kind), message in samples.items():
        print(f"  e.g. {name} {kind}: {message}")
    print()
    print(format_report(total))
    mib = 1024 * 1024
    print(
        f"server memory: {rss_idle / mib:.0f} MiB idle (after warm-up), peak {rss_peak / mib:.0f} MiB, "
        f"{rss_after / mib:.0f} MiB after the run"
        if rss_idle and rss_peak and rss_after
        else "server memory: unknown"
    )
    document = {
        "connections": args.connections,
        "protocols": protocols,
        "model": str(model_dir),
        "max_tokens": args.max_tokens,
        "server_rss_idle_bytes": rss_idle,
        "server_rss_peak_bytes": rss_peak,
        "server_rss_after_bytes": rss_after,
        "total": msgspec.to_builtins(total),
        "by_protocol": {n: msgspec.to_builtins(s) for n, s in summaries.items()},
        "error_samples": [{"protocol": n, "kind": k, "message": m} for (n, k), m in samples.items()],
    }
    path = args.out / "many_connections.json"
    path.write_text(msgspec.json.format(msgspec.json.encode(document)).decode() + "\n")
    print(f"figures written to {path}")
    return 0 if total.num_errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
