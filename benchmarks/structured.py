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
constrained output is checked against its schema (``jsonschema``). The first run pays each
schema's compile (at admission, off the engine step); a second constrained pass (``--passes``)
would find every grammar in the cache. Figures on a shared machine are indicative only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import Server, free_port, resolve_model  # noqa: E402


def schema(i: int) -> dict:
    """Request i's schema: three fixed-length strings and a bounded integer, named after i."""
    length = 12 + i % 7
    props = {f"f{i}_{j}": {"type": "string", "minLength": length, "maxLength": length} for j in range(3)}
    props[f"n{i}"] = {"type": "integer", "minimum": 0, "maximum": 9}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


async def one(client: httpx.AsyncClient, i: int, constrained: bool, max_tokens: int) -> tuple[int, str]:
    body: dict = {"prompt": f"Record number {i}:", "max_tokens": max_tokens, "seed": i, "temperature": 1.0}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema(i),
                                                                           "strict": True}}
    else:
        body["ignore_eos"] = True
    reply = await client.post("/v1/completions", json=body)
    reply.raise_for_status()
    data = reply.json()
    return data["usage"]["completion_tokens"], data["choices"][0]["text"]


async def run(port: int, n: int, concurrency: int, constrained: bool, lengths: list[int]) -> tuple[float, list[int], list[str]]:
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
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "rill-structured")
    args = parser.parse_args()
    import jsonschema

    levels = [int(c) for c in args.concurrency.split(",")]
    model_dir = resolve_model(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [sys.executable, "-m", "rill", "serve", "--model", str(model_dir), "--dtype", "float32", "--port", str(port),
           "--host", "127.0.0.1", "--num-threads", str(args.threads), "--max-num-seqs", str(max(levels)),
           "--max-model-len", "1024", "--kv-cache-memory", "1GiB", "--no-socket", "--grpc-port", "0",
           "--log-level", "warning"]
    print(f"model {model_dir}, {args.requests} requests, {args.threads} torch thread(s)", flush=True)
    with Server("rill", cmd, port, args.out / "server.log", "/health") as server:
        server.wait_ready(300)
        asyncio.run(run(port, 2, 2, False, [8, 8]))  # warm-up: first forward, allocator
        print(f"{'N':>3} {'constrained s':>14} {'tokens':>7} {'tok/s':>7} {'free s':>7} {'tokens':>7} "
              f"{'tok/s':>7} {'ratio':>6}", flush=True)
        for n in levels:
            c_time, c_tokens, texts = asyncio.run(run(port, args.requests, n, True, [400] * args.requests))
            for i, text in enumerate(texts):
                jsonschema.validate(json.loads(text), schema(i))
            u_time, u_tokens, _ = asyncio.run(run(port, args.requests, n, False, c_tokens))
            assert u_tokens == c_tokens, "the unconstrained run makes as many tokens"
            ratio = (c_time / sum(c_tokens)) / (u_time / sum(u_tokens))
            print(f"{n:>3} {c_time:>14.2f} {sum(c_tokens):>7} {sum(c_tokens) / c_time:>7.1f} {u_time:>7.2f} "
                  f"{sum(u_tokens):>7} {sum(u_tokens) / u_time:>7.1f} {ratio:>6.3f}", flush=True)


if __name__ == "__main__":
    main()
