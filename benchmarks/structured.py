"""Cost of constrained decoding: 32 requests with 32 different JSON schemas vs unconstrained.

    .venv/bin/python benchmarks/structured.py [--model 100m|tiny|demo|DIR] [--concurrency 8,32]
        [--requests 32] [--threads 1]

``rill serve`` runs the checkpoint in a child process. For each concurrency N, two closed-loop
runs of ``--requests`` completions through ``/v1/completions`` with at most N in flight:

- constrained: request i carries ``response_format`` ``json_schema`` with its own schema (its
  own property names and string lengths, so no two share a compiled grammar) whose every
  valid output is long (fixed-length strings), temperature 1, seeded;
- unconstrained: the same prompts, seeds and, per request, exactly the number of tokens the
  constrained run produced (``max_tokens`` with ``ignore_eos``).

Printed per N: wall time, generated tokens, tokens/s of each run and the cost ratio
(constrained time per token / unconstrained time per token; 1.15 means 15 % more). Every
constrained output is checked against its schema (``jsonschema``). The first constrained run
pays each schema's compile (at admission, off the engine step); later rounds find every
grammar in the cache.

On a shared machine one pair of runs can be skewed by load that comes or goes between them,
so ``--rounds R`` runs R pairs, alternating which run goes first, and prints each pair's
ratio, then the ratio of the summed times and the load average (1 min) before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import Server, free_port, resolve_model


def schema(i: int) -> dict:
    """Request i's schema: three fixed-length strings and a bounded integer, named after i."""
    length = 12 + i % 7
    props = {f"f{i}_{j}": {"type": "string", "minLength": length, "maxLength": length} for j in range(3)}
    props[f"n{i}"] = {"type": "integer", "minimum": 0, "maximum": 9}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


async def one(client: httpx.AsyncClient, i: int, constrained: bool, max_tokens: int) -> tuple[int, str]:
    body: dict = {"prompt": f"Record number {i}:", "max_tokens": max_tokens, "seed": i, "temperature": 1.0}
    if constrained:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": f"s{i}", "schema": schema(i), "strict": True},
        }
    else:
        body["ignore_eos"] = True
    reply = await client.post("/v1/completions", json=body)
    reply.raise_for_status()
    data = reply.json()
    return data["usage"]["completion_tokens"], data["choices"][0]["text"]


async def run(
    port: int, n: int, concurrency: int, constrained: bool, lengths: list[int]
) -> tuple[float, list[int], list[str]]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:

        async def guarded(i: int) -> tuple[int, str]:
            async with gate:
                return await one(client, i, constrained, lengths[i])

        t0 = time.perf_counter()
        results = await asyncio.gather(*[guarded(i) for i in range(n)])
        elapsed = time.perf_counter() - t0
    return elapsed, [r[0] for r in results], [r[1] for r in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="100m")
    parser.add_argument("--concurrency", default="8,32")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, help="pairs of runs per N, alternating which goes first")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "rill-structured")
    args = parser.parse_args()
    import jsonschema

    levels = [int(c) for c in args.concurrency.split(",")]
    model_dir = resolve_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "rill",
        "serve",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--num-threads",
        str(args.threads),
        "--max-num-seqs",
        str(max(levels)),
        "--max-model-len",
        "1024",
        "--kv-cache-memory",
        "1GiB",
        "--no-socket",
        "--grpc-port",
        "0",
        "--log-level",
        "warning",
    ]
    print(f"model {model_dir}, {args.requests} requests, {args.threads} torch thread(s)", flush=True)
    with Server("rill", cmd, port, args.out / "server.log", "/health") as server:
        server.wait_ready(300)
        asyncio.run(run(port, 2, 2, False, [8, 8]))  # warm-up: first forward, allocator
        print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
        print(
            f"{'N':>3} {'round':>5} {'constrained s':>14} {'tokens':>7} {'tok/s':>7} {'free s':>7} {'tokens':>7} "
            f"{'tok/s':>7} {'ratio':>6}",
            flush=True,
        )
        for n in levels:
            lengths: list[int] = [400] * args.requests
            times = {True: 0.0, False: 0.0}
            for r in range(args.rounds):
                # Round 0 runs constrained first: the unconstrained run needs its lengths.
                order = (True, False) if r % 2 == 0 else (False, True)
                done: dict[bool, tuple[float, list[int]]] = {}
                for constrained in order:
                    elapsed, tokens, texts = asyncio.run(run(port, args.requests, n, constrained, lengths))
                    if constrained:
                        for i, text in enumerate(texts):
                            jsonschema.validate(json.loads(text), schema(i))
                        if r == 0:
                            lengths = tokens
                    done[constrained] = (elapsed, tokens)
                (c_time, c_tokens), (u_time, u_tokens) = done[True], done[False]
                assert u_tokens == c_tokens, "the unconstrained run makes as many tokens"
                times[True] += c_time
                times[False] += u_time
                ratio = (c_time / sum(c_tokens)) / (u_time / sum(u_tokens))
                print(
                    f"{n:>3} {r:>5} {c_time:>14.2f} {sum(c_tokens):>7} {sum(c_tokens) / c_time:>7.1f} "
                    f"{u_time:>7.2f} {sum(u_tokens):>7} {sum(u_tokens) / u_time:>7.1f} {ratio:>6.3f}",
                    flush=True,
                )
            print(f"{n:>3} all rounds: cost ratio {times[True] / times[False]:.3f}", flush=True)
        print(f"load average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
