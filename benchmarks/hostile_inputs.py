"""Hostile inputs of issues 12 (items 2, 3, 6, 7) and 31: what they cost a running server.

    .venv/bin/python benchmarks/hostile_inputs.py [--model tiny|demo|DIR] [--issue 12|31|all]
                                                  [--server-arg=--flag=value ...]

Starts ``rill serve`` as a child process (HTTP, gRPC, one ``--evergreen-file-root`` in a
temporary folder holding a 1 MB text file, a temporary ``--data-dir``) and, while a probe
asks ``/health`` every 10 ms, sends:

* Evergreen messages whose one leaf has 20 / 50 chunks referencing the 1 MB file;
* an Evergreen shared 1 MB node used twice (a 2 MB prompt, under the default
  ``--evergreen-max-prompt-bytes``) and 21 times (the audit's 21 MB);
* an Evergreen session with 1,000,000 empty fragments and one with 500 node ids of 390 KB;
* on ``/generate``: a 3.9 MB prompt (refused as too long) then 100 feedback messages, and a
  short accepted generation then 100 feedback messages of 65,536 characters.

For each it prints the outcome (status or error), the server's resident memory before and
after and its peak during the case (Linux ``VmRSS`` / ``VmHWM``, the peak reset before each
case), the data folder's growth on disk, and the longest ``/health`` answer (the event
loop's stall). Figures are noisy on a loaded machine.

Issue 31's cases (``--issue 31``): a scoring request (3,885-token prompt, ``echo``,
``logprobs`` and ``prompt_logprobs`` 20, ``n`` 2, ``best_of`` 4) beside a stream, against a
plain request of the same prompt (the stream's worst gap while its neighbour runs); 100
distinct 63 KB schemas sent as ``/generate`` ``modify`` (``/health`` p99); six Evergreen
sessions of 60 MB at once; 20 ``/generate`` clients that never read; two addresses holding
idle sockets while a third asks ``/health``; 100 feedback messages of 41 bytes on a 13 KB
prompt (disk); ``/detokenize`` of 585k ids; and, on a second server with
``--rate-limit-requests 3``, ten requests with spoofed ``X-Forwarded-For`` headers. The RSS
column "after" waits up to 10 s for memory to come back within 10 % of "before"; "kv cached"
is what the prefix cache keeps then (``rill_kv_cache_cached_bytes``, bounded by
``--prefix-cache-memory``), part of "after".

A flood sent over several messages may show ``INTERNAL: Internal error from Core``: the
server aborted with RESOURCE_EXHAUSTED, but grpc's asyncio client replaces that status by a
local one when it writes after the server ended the call (grpc/grpc#36066).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import Server, free_port, resolve_model

from rill.clients.evergreen import EvergreenClient, EvergreenError
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.messages import (
    Action,
    Chunk,
    ChunkMetadata,
    GenerateConfig,
    NamedParameter,
    NodeFragment,
    SessionMessage,
)

MB = 1_000_000
TEXT = ChunkMetadata(mimetype="text/plain")


def proc_status(pid: int, key: str) -> int:
    """A ``/proc/PID/status`` size field in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder``."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


class HealthProbe:
    """Asks ``/health`` every 10 ms; ``worst_ms`` is the slowest answer since ``reset``,
    ``p99_ms`` the 99th percentile of the answers since then."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst_ms = 0.0
        self.samples_ms: list[float] = []
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            while True:
                start = time.perf_counter()
                with contextlib.suppress(httpx.HTTPError):
                    await http.get(self.url)
                elapsed_ms = (time.perf_counter() - start) * 1000
                self.worst_ms = max(self.worst_ms, elapsed_ms)
                self.samples_ms.append(elapsed_ms)
                await asyncio.sleep(0.01)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def reset(self) -> None:
        self.worst_ms = 0.0
        self.samples_ms = []

    @property
    def p99_ms(self) -> float:
        ordered = sorted(self.samples_ms)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def generate_action(input_id: str = "p", output_id: str = "r") -> Action:
    config = codec.encode_config(GenerateConfig(temperature=0.0, max_tokens=4))
    return Action(
        name="GENERATE",
        inputs=(NamedParameter(name="prompt", id=input_id),),
        outputs=(NamedParameter(name="response", id=output_id),),
        configs=(config,),
    )


async def evergreen(address: str, messages: list[SessionMessage]) -> str:
    """Run one session; its outcome as ``OK`` or ``STATUS: message``."""
    async with EvergreenClient(address) as client:
        session = client.open_session()
        try:
            with contextlib.suppress(asyncio.InvalidStateError):  # the server ended the call: read why
                for message in messages:
                    await session.send(message)
                await session.end_input()
            while await session.receive() is not None:
                pass
        except EvergreenError as exc:
            return f"{exc.status}: {exc.message[:90]}"
    return "OK"


def ref_messages(uri: str, num_refs: int) -> list[SessionMessage]:
    fragments = tuple(
        NodeFragment(
            id="p", seq=i, continued=i < num_refs - 1, chunk_fragment=Chunk(metadata=TEXT if i == 0 else None, ref=uri)
        )
        for i in range(num_refs)
    )
    return [SessionMessage(node_fragments=fragments, actions=(generate_action(),))]


def shared_node_messages(num_uses: int) -> list[SessionMessage]:
    leaf = NodeFragment(id="shared", chunk_fragment=Chunk(metadata=TEXT, data=b"word " * (MB // 5)))
    parent = NodeFragment(id="p", child_ids=("shared", *(f"u{i}" for i in range(num_uses - 1))))
    links = tuple(NodeFragment(id=f"u{i}", child_ids=("shared",)) for i in range(num_uses - 1))
    return [
        SessionMessage(node_fragments=(leaf,)),
        SessionMessage(node_fragments=(parent, *links), actions=(generate_action(),)),
    ]


def empty_fragment_messages(num_fragments: int, per_message: int = 50_000) -> list[SessionMessage]:
    return [
        SessionMessage(
            node_fragments=tuple(
                NodeFragment(id="n", seq=seq, continued=True)
                for seq in range(start, min(start + per_message, num_fragments))
            )
        )
        for start in range(0, num_fragments, per_message)
    ]


def long_id_messages(num_ids: int, id_bytes: int) -> list[SessionMessage]:
    return [
        SessionMessage(node_fragments=(NodeFragment(id=f"{i:06d}" + "x" * (id_bytes - 6), continued=True),))
        for i in range(num_ids)
    ]


async def feedback_case(ws_url: str, prompt: str, text: str | None, num_messages: int = 100) -> str:
    from websockets.asyncio.client import connect

    async with connect(ws_url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "config", "prompt": prompt, "parameters": {"max_tokens": 2}}))
        while (first := json.loads(await ws.recv()))["type"] not in ("completion", "error"):
            pass
        for _ in range(num_messages):
            await ws.send(json.dumps({"type": "feedback", "rating": 1, **({"text": text} if text else {})}))
        replies = [json.loads(await ws.recv()) for _ in range(num_messages)]
    stored = sum(r.get("operation") == "feedback_received" for r in replies)
    errors = sorted({r["error"] for r in replies if r["type"] == "error"})
    return f"generation: {first.get('error', first['type'])}; stored {stored}/{num_messages}; errors {errors}"


# -- issue 31: harm that per-request limits cannot see ---------------------------------------


async def served_model(http: httpx.AsyncClient, base: str) -> str:
    return (await http.get(f"{base}/v1/models")).json()["data"][0]["id"]


async def prompt_of(http: httpx.AsyncClient, base: str, num_tokens: int) -> str:
    """A plain-text prompt of about ``num_tokens`` tokens (counted by the server's ``/tokenize``)."""
    colours = ("red", "green", "blue", "amber", "violet", "grey", "white", "black")
    sentences = [f"Item {i} in row {i % 17} is {colours[i % 8]} and weighs {i * 7 % 101} grams." for i in range(2000)]
    low, high = 1, len(sentences)
    while low < high:  # the most sentences whose tokens stay within num_tokens
        mid = (low + high + 1) // 2
        count = (await http.post(f"{base}/tokenize", json={"prompt": " ".join(sentences[:mid])})).json()["count"]
        low, high = (mid, high) if count <= num_tokens else (low, mid - 1)
    return " ".join(sentences[:low])


async def stream_beside(
    http: httpx.AsyncClient, base: str, model: str, neighbour: dict[str, Any]
) -> tuple[float, int, str]:
    """Stream 400 tokens; once 5 have come, send ``neighbour`` to ``/v1/completions``.

    Returns the stream's worst inter-token gap (ms) while the neighbour ran, the tokens it
    got meanwhile, and the neighbour's outcome."""
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 400,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    times: list[float] = []
    window: list[float] = []
    task: asyncio.Task | None = None
    async with http.stream("POST", f"{base}/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            times.append(now)
            if len(times) == 5:
                sent_at = time.perf_counter()
                task = asyncio.create_task(http.post(f"{base}/v1/completions", json={"model": model, **neighbour}))
            if task is not None and (not task.done() or not window):
                window.append(now)
            if task is not None and task.done() and len(window) > 1 and window[-1] < now:
                break
    assert task is not None, "the stream ended before it had 5 tokens"
    reply = await task
    outcome = f"{reply.status_code}"
    if reply.status_code != 200:
        outcome += f" {reply.text[:80]}"
    gaps = [b - a for a, b in zip([sent_at, *window], window)]
    return max(gaps) * 1000, len(window), outcome


async def scoring_case(base: str) -> str:
    """The audit's scoring request beside a stream, against a plain request of the same prompt.

    One round of each first, reported apart: the first chunks of new lengths create their
    GEMM kernels (oneDNN primitives), which costs a stream a gap whatever the request."""
    async with httpx.AsyncClient(timeout=600) as http:
        model = await served_model(http, base)
        prompt = await prompt_of(http, base, 3885)
        # Each request its own first words, so that none finds its prompt in the prefix cache.
        plain = lambda i: {"prompt": f"Request {i}. {prompt}", "max_tokens": 4, "temperature": 0}  # noqa: E731
        scoring = lambda i: {  # noqa: E731
            "prompt": f"Request {i}. {prompt}",
            "max_tokens": 4,
            "echo": True,
            "logprobs": 20,
            "prompt_logprobs": 20,
            "n": 2,
            "best_of": 4,
            "temperature": 1.0,
        }
        numbers = itertools.count()
        warm = [
            (name, *await stream_beside(http, base, model, neighbour(next(numbers))))
            for name, neighbour in (("plain", plain), ("scoring", scoring))
        ]
        rows = []
        for _ in range(3):  # interleaved: the machine's speed drifts
            for name, neighbour in (("plain", plain), ("scoring", scoring)):
                rows.append((name, *await stream_beside(http, base, model, neighbour(next(numbers)))))
    worst = {name: max(r[1] for r in rows if r[0] == name) for name in ("plain", "scoring")}
    detail = "; ".join(f"{name} {gap:.0f} ms/{n} tok ({outcome})" for name, gap, n, outcome in rows)
    first = "; ".join(f"{name} {gap:.0f} ms" for name, gap, _, _ in warm)
    return (
        f"worst gap scoring/plain = {worst['scoring'] / worst['plain']:.2f}x (goal <= 1.5x): {detail}; "
        f"first of each on this server (new kernel shapes): {first}"
    )


def big_schema(index: int, num_bytes: int = 63_000) -> dict[str, Any]:
    """A distinct JSON schema of about ``num_bytes`` (many optional string properties)."""
    properties: dict[str, Any] = {}
    k = 0
    while len(json.dumps(properties)) < num_bytes:
        properties[f"s{index}_field_{k:05d}_padding"] = {"type": "string", "maxLength": 8}
        k += 1
    return {"type": "object", "properties": properties, "additionalProperties": False}


async def modify_schemas_case(ws_url: str, probe: HealthProbe, num_schemas: int = 100) -> str:
    """A running /generate generation sent ``num_schemas`` distinct 63 KB schemas as ``modify``,
    one after another (each waits for its answer; when a generation ends, a new connection
    starts another)."""
    from websockets.asyncio.client import connect

    schemas = [big_schema(i) for i in range(num_schemas)]
    kinds: dict[str, int] = {}
    messages: list[str] = []
    config = {"type": "config", "prompt": "Once upon a time", "parameters": {"max_tokens": 100000, "temperature": 0}}
    ws = None
    probe.reset()  # the schemas were built before: their cost is this process's, not the server's
    for schema in schemas:
        if ws is None:
            ws = await connect(ws_url, max_size=None)
            await ws.send(json.dumps(config))
            while json.loads(await ws.recv())["type"] != "init":
                pass
        await ws.send(
            json.dumps(
                {
                    "type": "control",
                    "action": "modify",
                    "parameters": {
                        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
                    },
                }
            )
        )
        while True:
            msg = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if msg["type"] == "status" and msg.get("operation") == "modified":
                kinds["modified"] = kinds.get("modified", 0) + 1
                break
            if msg["type"] in ("error", "completion"):
                key = f"error:{msg.get('error')}" if msg["type"] == "error" else "ended first"
                kinds[key] = kinds.get(key, 0) + 1
                if kinds[key] == 1 and msg["type"] == "error":
                    messages.append(str(msg.get("message"))[:100])
                await ws.close()
                ws = None
                break
    p99 = probe.p99_ms
    if ws is not None:
        await ws.close()
    return f"/health p99 {p99:.0f} ms (goal < 50 ms); replies {dict(sorted(kinds.items()))} {messages}"


async def evergreen_budget_case(address: str, num_sessions: int = 6, session_bytes: int = 60 * MB) -> str:
    """``num_sessions`` sessions, each holding ``session_bytes`` of chunk data (under its own
    ``--evergreen-max-bytes``), open at once; then all close."""
    async with EvergreenClient(address) as client:
        sessions = [client.open_session() for _ in range(num_sessions)]
        outcomes: list[str] = ["OK"] * num_sessions
        piece = b"word " * (MB // 5)

        async def fill(index: int) -> None:
            try:
                with contextlib.suppress(asyncio.InvalidStateError):
                    for k in range(session_bytes // MB):
                        await sessions[index].send(
                            SessionMessage(
                                node_fragments=(
                                    NodeFragment(id=f"n{k}", chunk_fragment=Chunk(metadata=TEXT, data=piece)),
                                )
                            )
                        )
                # Its own action makes the server answer, so an early refusal is read here.
                await sessions[index].send(
                    SessionMessage(
                        node_fragments=(NodeFragment(id="q", chunk_fragment=Chunk(metadata=TEXT, data=b"Hello")),),
                        actions=(generate_action("q", "out"),),
                    )
                )
                message = await sessions[index].receive()
                if message is None:
                    outcomes[index] = "ended"
            except EvergreenError as exc:
                outcomes[index] = f"{exc.status}: {exc.message[:70]}"

        await asyncio.gather(*(fill(i) for i in range(num_sessions)))
        for session in sessions:
            session.cancel()
    counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    return f"{num_sessions} sessions of {session_bytes // MB} MB: {counts}"


async def slow_readers_case(ws_url: str, num_clients: int = 20, hold_s: float = 5.0) -> str:
    """``num_clients`` /generate clients start long generations and never read, then leave."""
    from websockets.asyncio.client import connect

    sockets = []
    for _ in range(num_clients):
        ws = await connect(ws_url, max_size=None, max_queue=1)
        await ws.send(
            json.dumps(
                {
                    "type": "config",
                    "prompt": "Once upon a time " * 50,
                    "parameters": {"max_tokens": 100000, "ignore_eos": True},
                }
            )
        )
        sockets.append(ws)
    await asyncio.sleep(hold_s)  # what piles up while nobody reads is the point of the case
    for ws in sockets:
        ws.transport.abort()
    return f"{num_clients} clients held {hold_s:g} s without reading, then dropped"


async def idle_sockets_case(port: int, per_address: int = 1100) -> str:
    """Two addresses open up to ``per_address`` idle sockets each; can a third still get /health?"""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    held: dict[str, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}
    for source in ("127.0.0.2", "127.0.0.3"):
        held[source] = []
        for _ in range(per_address):
            try:
                held[source].append(await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)))
            except OSError:
                break
    await asyncio.sleep(1.0)  # refused sockets get their 503 and close meanwhile
    alive = {}
    for source, pairs in held.items():
        alive[source] = sum(1 for reader, _ in pairs if not reader.at_eof() and not reader._buffer)  # type: ignore[attr-defined]
    transport = httpx.AsyncHTTPTransport(local_address="127.0.0.4")
    async with httpx.AsyncClient(transport=transport, timeout=30) as http:
        try:
            status = str((await http.get(f"http://127.0.0.1:{port}/health")).status_code)
        except httpx.HTTPError as exc:
            status = type(exc).__name__
    for pairs in held.values():
        for _, writer in pairs:
            writer.transport.abort()
    return f"idle sockets kept: {alive}; a third address's /health: {status}"


async def small_feedback_case(ws_url: str) -> str:
    """A 13 KB prompt's generation, then 16 feedback messages of 41 bytes (the most one
    generation may get by default)."""
    return await feedback_case(ws_url, "word " * 2600, "x" * 41, num_messages=16)


async def detokenize_case(base: str) -> str:
    async with httpx.AsyncClient(timeout=120) as http:
        reply = await http.post(f"{base}/detokenize", json={"tokens": [1] * 585_000})
    return f"{reply.status_code} {reply.text[:60]}"


async def forwarded_case(base: str) -> str:
    """Ten requests, each with its own spoofed X-Forwarded-For, under --rate-limit-requests 3."""
    statuses = []
    async with httpx.AsyncClient(timeout=120) as http:
        model = await served_model(http, base)
        for i in range(10):
            reply = await http.post(
                f"{base}/v1/completions",
                headers={"X-Forwarded-For": f"10.0.0.{i + 1}"},
                json={"model": model, "prompt": "Hi", "max_tokens": 1},
            )
            statuses.append(reply.status_code)
    return f"statuses {statuses} (admitted {statuses.count(200)} of 10; 3 expected)"


async def run31(args: argparse.Namespace, server: Server, root: Path, data_dir: Path) -> None:
    """Issue 31's scenarios against one server; each row: RSS before / after / peak, disk, /health."""
    pid = server.proc.pid  # type: ignore[union-attr]
    base = f"http://127.0.0.1:{server.port}"
    ws_url = f"ws://127.0.0.1:{server.port}/generate"
    address = f"127.0.0.1:{args.grpc_port}"
    probe = HealthProbe(f"{base}/health")
    probe.start()
    await asyncio.sleep(0.5)
    cases: list[tuple[str, Callable[[], Awaitable[str]]]] = [
        ("1 scoring request beside a stream", lambda: scoring_case(base)),
        ("2 100 distinct 63 KB schemas as /generate modify", lambda: modify_schemas_case(ws_url, probe)),
        ("4 evergreen: 6 sessions x 60 MB at once", lambda: evergreen_budget_case(address)),
        ("4 /generate: 20 clients that never read", lambda: slow_readers_case(ws_url)),
        ("5 two addresses' idle sockets, a third asks", lambda: idle_sockets_case(server.port)),
        ("6 13 KB prompt + 16 feedback of 41 bytes", lambda: small_feedback_case(ws_url)),
        ("8 /detokenize 585k ids", lambda: detokenize_case(base)),
        # A server in service has its prefix cache full: the first run above filled it from
        # empty (the KV it keeps is the "kv cached" column), this one shows what a scoring
        # request leaves behind once cached prefixes replace each other.
        ("1 again, the prefix cache full from the cases above", lambda: scoring_case(base)),
    ]
    if args.only:
        cases = [case for case in cases if case[0].split()[0] in args.only]
    await run_cases(cases, pid, data_dir, probe)
    await probe.stop()


async def settled_rss(pid: int, start: int, timeout_s: float = 10.0) -> int:
    """RSS once it is back within 10 % of ``start``, or after ``timeout_s`` (what it is then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rss = proc_status(pid, "VmRSS")
        if rss <= start * 1.1 or time.monotonic() > deadline:
            return rss
        await asyncio.sleep(0.25)


async def kv_cached_mib(metrics_url: str) -> float:
    """KV memory the server keeps for prefix reuse (``rill_kv_cache_cached_bytes``), in MiB."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(metrics_url)).text
    return (
        sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("rill_kv_cache_cached_bytes")
        )
        / 2**20
    )


async def run_cases(
    cases: list[tuple[str, Callable[[], Awaitable[str]]]], pid: int, data_dir: Path, probe: HealthProbe
) -> None:
    metrics_url = probe.url.replace("/health", "/metrics")
    print(
        f"{'case':<52} {'rss before':>10} {'after':>8} {'peak':>8} {'after/before':>12} {'kv cached':>9} "
        f"{'net':>6} {'disk +':>8} {'/health':>9}  outcome"
    )
    # "net": after/before without the growth of the prefix cache (KV kept for reuse, bounded by
    # --prefix-cache-memory): what the case left behind besides the cache.
    for name, case in cases:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before, disk_before = proc_status(pid, "VmRSS"), folder_bytes(data_dir)
        cached_before = await kv_cached_mib(metrics_url)
        probe.reset()
        try:
            outcome = await case()
        except Exception as exc:  # noqa: BLE001 - a benchmark row, not a crash: say what broke
            outcome = f"FAILED: {type(exc).__name__}: {exc}"[:200]
        worst = probe.worst_ms
        after, peak = await settled_rss(pid, before), proc_status(pid, "VmHWM")
        disk = folder_bytes(data_dir) - disk_before
        cached = await kv_cached_mib(metrics_url)
        print(
            f"{name:<52} {before / 2**20:>8.0f}Mi {after / 2**20:>6.0f}Mi {peak / 2**20:>6.0f}Mi "
            f"{after / before:>11.2f}x {cached:>7.0f}Mi "
            f"{(after - (cached - cached_before) * 2**20) / before:>5.2f}x "
            f"{disk / 2**20:>6.2f}Mi {worst:>7.0f}ms  {outcome}",
            flush=True,
        )


async def run(args: argparse.Namespace, server: Server, root: Path, data_dir: Path) -> None:
    pid = server.proc.pid  # type: ignore[union-attr]
    address = f"127.0.0.1:{args.grpc_port}"
    probe = HealthProbe(f"http://127.0.0.1:{server.port}/health")
    probe.start()
    await asyncio.sleep(0.5)
    uri = f"file://{root}/big.txt"

    async def idle() -> str:
        await asyncio.sleep(3)
        return "no request: the machine's own noise"

    cases: list[tuple[str, Callable[[], Awaitable[str]]]] = [
        ("idle, 3 s", idle),
        ("evergreen: 20 refs to a 1 MB file", lambda: evergreen(address, ref_messages(uri, 20))),
        ("evergreen: 50 refs to a 1 MB file", lambda: evergreen(address, ref_messages(uri, 50))),
        ("evergreen: 1 MB shared node x 2 uses", lambda: evergreen(address, shared_node_messages(2))),
        ("evergreen: 1 MB shared node x 21 uses", lambda: evergreen(address, shared_node_messages(21))),
        ("evergreen: 1,000,000 empty fragments", lambda: evergreen(address, empty_fragment_messages(1_000_000))),
        ("evergreen: 500 node ids of 390 KB", lambda: evergreen(address, long_id_messages(500, 390_000))),
        (
            "/generate: 3.9 MB prompt + 100 feedback",
            lambda: feedback_case(f"ws://127.0.0.1:{server.port}/generate", "x" * 3_900_000, None),
        ),
        (
            "/generate: short prompt + 100 feedback of 64 Ki chars",
            lambda: feedback_case(f"ws://127.0.0.1:{server.port}/generate", "Once upon a time", "é" * 65536),
        ),
    ]
    await run_cases(cases, pid, data_dir, probe)
    await probe.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default="tiny",
        help="tiny, demo or a model folder (the scoring case needs a "
        "context of 4,096 tokens: give a real model, e.g. SmolLM2)",
    )
    parser.add_argument("--issue", choices=("12", "31", "all"), default="all", help="which audit's cases to run")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only issue 31's cases of this item number (repeatable, e.g. --only 1 --only 7)",
    )
    parser.add_argument("--server-arg", action="append", default=[], help="extra rill serve flag (repeatable)")
    args = parser.parse_args(argv)
    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="rill-hostile-") as tmp:
        root, data_dir = Path(tmp) / "files", Path(tmp) / "data"
        root.mkdir()
        (root / "big.txt").write_bytes(b"word " * (MB // 5))

        def command(port: int, *extra: str) -> list[str]:
            return [
                sys.executable,
                "-m",
                "rill",
                "serve",
                "--model",
                str(model_dir),
                "--port",
                str(port),
                "--grpc-port",
                str(args.grpc_port),
                "--no-socket",
                "--num-threads",
                "1",
                "--log-level",
                "warning",
                "--evergreen-file-root",
                str(root),
                "--data-dir",
                str(data_dir),
                *extra,
                *args.server_arg,
            ]

        port, args.grpc_port = free_port(), free_port()
        with Server("rill", command(port), port, Path(tmp) / "server.log", "/health") as server:
            server.wait_ready(300)
            if args.issue in ("12", "all"):
                print("# issue 12's cases")
                asyncio.run(run(args, server, root, data_dir))
            if args.issue in ("31", "all"):
                print("# issue 31's cases")
                asyncio.run(run31(args, server, root, data_dir))
        if args.issue in ("31", "all") and (not args.only or "7" in args.only):
            # Its own server: a request-count limit would refuse the other cases' requests.
            port, args.grpc_port = free_port(), free_port()
            with Server(
                "rill", command(port, "--rate-limit-requests", "3"), port, Path(tmp) / "server2.log", "/health"
            ) as server:
                server.wait_ready(300)
                print(
                    f"{'7 spoofed X-Forwarded-For, --rate-limit-requests 3':<52} "
                    f"{asyncio.run(forwarded_case(f'http://127.0.0.1:{port}'))}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
