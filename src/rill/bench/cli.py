"""``rill bench`` / ``python -m rill.bench``: flags → workload → one run per protocol → report.

    rill bench --protocol openai --port 8000 --concurrency 8 --num-requests 64
    rill bench --protocol all --request-rate 4 --num-requests 100 --output result.json

``--protocol`` takes a comma list or ``all`` (every protocol this build of rill has; one
whose listener cannot be reached is skipped with a message). Prints each run's figures and
writes one JSON file with every summary (and, with ``--save-records``, every request).
Exit code: 0 when every protocol run had at least one successful request, 1 otherwise,
2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from rill.bench.drivers import DRIVERS, BenchError, Options, Target, server_protocol
from rill.bench.runner import measure
from rill.bench.stats import format_report
from rill.bench.workload import jsonl_prompts, synthetic_prompts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``rill bench``."""
    target = parser.add_argument_group("target (loopback only)")
    target.add_argument(
        "--protocol", default="openai", help=f"comma list of {', '.join(DRIVERS)}, or 'all' (default: openai)"
    )
    target.add_argument("--host", default="127.0.0.1", help="HTTP/WebSocket host (default: 127.0.0.1)")
    target.add_argument("--port", type=int, default=8000, help="HTTP/WebSocket port (default: 8000)")
    target.add_argument("--socket", default="/tmp/rill.sock", help="Unix socket of the uds protocol")
    target.add_argument("--grpc-address", default="127.0.0.1:50051", help="host:port of the Evergreen gRPC service")
    target.add_argument("--api-key", default=None, help="sent as a Bearer token")
    target.add_argument("--model", default=None, help="OpenAI 'model' field (default: the first of /v1/models)")
    target.add_argument("--openai-endpoint", choices=("completions", "chat"), default="completions")
    load = parser.add_argument_group("load")
    load.add_argument("--num-requests", type=int, default=64, help="requests per protocol (default: 64)")
    load.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="most requests in flight; 0 = unbounded (open loop only) (default: 8)",
    )
    load.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="open loop: Poisson arrivals at this many requests/s (default: closed loop)",
    )
    load.add_argument("--prompt-len", type=int, default=64, help="words per synthetic prompt (default: 64)")
    load.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per request (default: 64)")
    load.add_argument("--prompts-file", default=None, help='JSONL with {"prompt": ..., "max_tokens": ...} per line')
    load.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    load.add_argument("--no-ignore-eos", action="store_true", help="let eos end generations early")
    load.add_argument("--warmup", type=int, default=1, help="unmeasured requests first (default: 1)")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--request-timeout-s", type=float, default=300.0, help="per-request limit (default: 300)")
    load.add_argument("--max-duration-s", type=float, default=600.0, help="whole-run limit per protocol (default: 600)")
    out = parser.add_argument_group("output")
    out.add_argument("--output", default=None, help="JSON result file (default: rill-bench-<time>.json)")
    out.add_argument("--save-records", action="store_true", help="also write every request's record")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def register(subparsers: Any) -> None:
    """Add ``rill bench`` to the ``rill`` command line."""
    parser = subparsers.add_parser(
        "bench", help="load-test a running server over any of its protocols", description=__doc__.split("\n\n")[0]
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def protocols_of(spec: str) -> list[str]:
    """Protocol names from ``--protocol`` (``all``: those this build of rill has)."""
    if spec == "all":
        return [name for name in DRIVERS if _exists(server_protocol(name))]
    names = [part.strip() for part in spec.split(",") if part.strip()]
    unknown = [n for n in names if n not in DRIVERS]
    if unknown:
        raise BenchError(
            "unknown_protocol", f"unknown protocol(s) {', '.join(unknown)}; choose from {', '.join(DRIVERS)}"
        )
    return names


def _exists(package: str) -> bool:
    return importlib.util.find_spec(f"rill.protocols.{package}") is not None


def run(args: argparse.Namespace) -> int:
    """Run ``rill bench`` with parsed flags; returns the exit code."""
    try:
        names = protocols_of(args.protocol)
        requests = (
            jsonl_prompts(args.prompts_file, args.num_requests, args.max_tokens)
            if args.prompts_file
            else synthetic_prompts(args.num_requests, args.prompt_len, args.max_tokens, args.seed)
        )
    except BenchError as exc:
        print(f"rill bench: {exc.message}", file=sys.stderr)
        return 2
    concurrency = args.concurrency or None
    if concurrency is None and args.request_rate is None:
        print("rill bench: --concurrency 0 (unbounded) needs --request-rate", file=sys.stderr)
        return 2
    target = Target(
        host=args.host,
        port=args.port,
        socket=args.socket,
        grpc_address=args.grpc_address,
        api_key=args.api_key,
        model=args.model,
    )
    options = Options(
        temperature=args.temperature, ignore_eos=not args.no_ignore_eos, openai_endpoint=args.openai_endpoint
    )
    results, skipped, exit_code = [], {}, 0
    for name in names:
        if not _exists(server_protocol(name)):
            print(
                f"rill bench: skipping {name}: this build of rill has no {server_protocol(name)} protocol",
                file=sys.stderr,
            )
            skipped[name] = "protocol not in this build"
            continue
        try:
            summary, records = asyncio.run(
                measure(
                    name,
                    target,
                    options,
                    requests,
                    concurrency=concurrency,
                    rate_per_s=args.request_rate,
                    num_warmup=args.warmup,
                    seed=args.seed,
                    request_timeout_s=args.request_timeout_s,
                    max_duration_s=args.max_duration_s,
                    progress=not args.no_progress and sys.stderr.isatty(),
                )
            )
        except BenchError as exc:
            print(f"rill bench: skipping {name}: cannot reach the server ({exc})", file=sys.stderr)
            skipped[name] = str(exc)
            exit_code = 1
            continue
        print(format_report(summary), end="\n\n", flush=True)
        entry = msgspec.to_builtins(summary)
        if args.save_records:
            entry["records"] = msgspec.to_builtins(records)
        results.append(entry)
        if summary.num_ok == 0:
            exit_code = 1
    path = Path(args.output or f"rill-bench-{datetime.datetime.now():%Y%m%d-%H%M%S}.json")
    document = {
        "created": datetime.datetime.now(datetime.UTC).isoformat(),
        "command": sys.argv,
        "workload": {
            "num_requests": args.num_requests,
            "prompt_len_words": args.prompt_len,
            "max_tokens": args.max_tokens,
            "prompts_file": args.prompts_file,
            "temperature": args.temperature,
            "ignore_eos": not args.no_ignore_eos,
        },
        "results": results,
        "skipped": skipped,
    }
    path.write_text(json.dumps(document, indent=2, allow_nan=True) + "\n")
    print(f"results written to {path}")
    return exit_code


def main(argv: list[str] | None = None) -> int:
    """``python -m rill.bench``."""
    parser = argparse.ArgumentParser(prog="python -m rill.bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
