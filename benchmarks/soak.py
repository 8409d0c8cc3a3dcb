"""A mixed soak: every protocol at once, with random disconnects, scoring requests, schemas and feedback.

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--clients 12] [--model tiny|demo|DIR]
                                        [--server-arg=--flag=value ...]

Starts ``rill serve`` as a child process (HTTP, gRPC, the Unix socket, a temporary
``--data-dir``) and runs ``--clients`` client loops for ``--minutes``. Each loop picks one of:

* ``/generate``: a stream, sometimes given a JSON schema by ``modify`` or dropped mid-way;
  after a finished one, a feedback message whose acknowledgement is remembered;
* OpenAI: a streamed completion (sometimes dropped mid-way), a scoring request (``echo``,
  ``logprobs``, ``prompt_logprobs``, ``best_of``) or a chat completion with a JSON schema;
* batch ``/ws``: two prompts, sometimes dropped mid-way;
* ``/ws/chat``: a short reply, sometimes dropped;
* Evergreen over gRPC: one generation, sometimes cancelled;
* the framed Unix socket: one request, sometimes closed mid-way.

Every 10 s it samples the server's RSS and ``/metrics``. At the end it waits (up to 60 s)
for the server to go quiet and prints: requests by protocol and outcome, running requests
and KV bytes in use, RSS over time (first and last minute), and whether every acknowledged
feedback record is in the store.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sqlite3
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import Server, free_port, resolve_model
from hostile_inputs import proc_status

from rill.clients.evergreen import EvergreenClient, EvergreenError
from rill.clients.uds import UdsClient, UdsConnectionError
from rill.protocols.evergreen.messages import GenerateConfig

PROMPTS = (
    "Once upon a time",
    "The little robot",
    "Write a list of fruits:",
    "In the morning the cat",
    "Here is a poem about the sea:",
)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


class Soak:
    """Client loops against one server, and what they saw."""

    def __init__(self, args: argparse.Namespace, port: int, grpc_port: int, socket: str, rng: random.Random) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}"
        self.grpc = f"127.0.0.1:{grpc_port}"
        self.socket = socket
        self.rng = rng
        self.model = ""
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.acknowledged: list[str] = []  # feedback texts the server acknowledged
        self.deadline = 0.0
        self.args = args

    def note(self, protocol: str, outcome: str) -> None:
        self.outcomes[(protocol, outcome)] += 1

    async def client_loop(self, http: httpx.AsyncClient) -> None:
        cases = (self.generate_ws, self.openai, self.batch_ws, self.chat_ws, self.evergreen, self.framed_uds)
        while time.monotonic() < self.deadline:
            case = self.rng.choice(cases)
            name = case.__name__
            try:
                await asyncio.wait_for(case(http), 120)
            except TimeoutError:
                self.note(name, "client timeout (120 s)")
            except Exception as exc:  # noqa: BLE001 - the soak counts what broke; it goes on
                self.note(name, f"client saw {type(exc).__name__}")

    def drop_after(self) -> int | None:
        """Tokens after which this client leaves (None: it stays to the end); a third drop."""
        return self.rng.randint(1, 12) if self.rng.random() < 0.33 else None

    async def generate_ws(self, http: httpx.AsyncClient) -> None:
        from websockets.asyncio.client import connect

        drop = self.drop_after()
        async with connect(f"{self.ws}/generate", max_size=None) as ws:
            await ws.send(
                json.dumps(
                    {
                        "type": "config",
                        "prompt": self.rng.choice(PROMPTS),
                        "parameters": {"max_tokens": self.rng.randint(8, 48), "temperature": 0.8},
                    }
                )
            )
            num_tokens, finished = 0, None
            while finished is None:
                msg = json.loads(await ws.recv())
                if msg["type"] == "error":
                    self.note("generate_ws", f"error {msg.get('error')}")
                    return
                if msg["type"] in ("token", "tokens", "text"):
                    num_tokens += 1
                    if num_tokens == 2 and self.rng.random() < 0.2:
                        await ws.send(
                            json.dumps(
                                {
                                    "type": "control",
                                    "action": "modify",
                                    "parameters": {
                                        "response_format": {
                                            "type": "json_schema",
                                            "json_schema": {"name": "p", "schema": SCHEMA},
                                        }
                                    },
                                }
                            )
                        )
                    if drop is not None and num_tokens >= drop:
                        ws.transport.abort()
                        self.note("generate_ws", "dropped")
                        return
                if msg["type"] == "completion":
                    finished = msg
            marker = f"soak-{self.rng.getrandbits(64):016x}"
            await ws.send(json.dumps({"type": "feedback", "rating": 1, "text": marker}))
            while True:
                reply = json.loads(await ws.recv())
                if reply["type"] == "error" and "modify" in str(reply.get("message")):
                    continue  # the generation ended before our modify arrived: its answer, not the feedback's
                if reply["type"] == "error":
                    self.note("generate_ws", f"feedback error {reply.get('error')}: {str(reply.get('message'))[:50]}")
                    return
                if reply.get("operation") == "feedback_received":
                    self.acknowledged.append(marker)
                    self.note("generate_ws", "ok + feedback")
                    return

    async def openai(self, http: httpx.AsyncClient) -> None:
        kind = self.rng.choice(("stream", "scoring", "schema"))
        if kind == "stream":
            drop = self.drop_after()
            body = {"model": self.model, "prompt": self.rng.choice(PROMPTS), "max_tokens": 32, "stream": True}
            async with http.stream("POST", f"{self.base}/v1/completions", json=body) as response:
                num = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        num += 1
                        if drop is not None and num >= drop:
                            self.note("openai", "stream dropped")
                            return  # leaving the block closes the connection
                self.note("openai", f"stream {response.status_code}")
            return
        if kind == "scoring":
            body = {
                "model": self.model,
                "prompt": " ".join(PROMPTS) * self.rng.randint(1, 6),
                "max_tokens": 2,
                "echo": True,
                "logprobs": 5,
                "prompt_logprobs": 5,
                "n": 2,
                "best_of": 3,
            }
            reply = await http.post(f"{self.base}/v1/completions", json=body)
        else:
            body = {
                "model": self.model,
                "messages": [{"role": "user", "content": "Give a name and an age."}],
                "max_tokens": 40,
                "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
            }
            reply = await http.post(f"{self.base}/v1/chat/completions", json=body)
        detail = "" if reply.status_code == 200 else f" {reply.json().get('error', {}).get('message', '')[:50]}"
        self.note("openai", f"{kind} {reply.status_code}{detail}")

    async def batch_ws(self, http: httpx.AsyncClient) -> None:
        from websockets.asyncio.client import connect

        drop = self.drop_after()
        prompts = [{"request_id": f"b{self.rng.getrandbits(48):x}", "prompt": p} for p in self.rng.sample(PROMPTS, 2)]
        async with connect(f"{self.ws}/ws", max_size=None) as ws:
            await ws.send(
                json.dumps(
                    {
                        "prompts": prompts,
                        "stream_response": True,
                        "generation_config": {"max_new_tokens": 24, "do_sample": True},
                    }
                )
            )
            done, num = 0, 0
            while done < len(prompts):
                events = json.loads(await ws.recv())
                for event in events if isinstance(events, list) else [events]:
                    kind = event.get("type")
                    num += kind == "PROGRESS"
                    if kind in ("COMPLETE", "ERROR"):
                        done += 1
                        if kind == "ERROR":
                            self.note("batch_ws", "error")
                if drop is not None and num >= drop:
                    ws.transport.abort()
                    self.note("batch_ws", "dropped")
                    return
        self.note("batch_ws", "ok")

    async def chat_ws(self, http: httpx.AsyncClient) -> None:
        from rill.clients.chat import ChatError, chat

        messages = [{"role": "user", "content": self.rng.choice(PROMPTS)}]
        task = asyncio.create_task(chat(f"{self.ws}/ws/chat", messages, generation={"max_new_tokens": 24}))
        if self.rng.random() < 0.33:
            await asyncio.sleep(self.rng.uniform(0.0, 0.5))  # a random moment to hang up at
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ChatError):
                await task
            self.note("chat_ws", "dropped")
            return
        try:
            await task
            self.note("chat_ws", "ok")
        except ChatError as exc:
            self.note("chat_ws", f"error {str(exc)[:40]}")

    async def evergreen(self, http: httpx.AsyncClient) -> None:
        drop = self.drop_after()
        async with EvergreenClient(self.grpc) as client:
            num = 0
            try:
                async for _ in client.generate(self.rng.choice(PROMPTS), config=GenerateConfig(max_tokens=24)):
                    num += 1
                    if drop is not None and num >= drop:
                        self.note("evergreen", "dropped")
                        return
            except EvergreenError as exc:
                self.note("evergreen", f"error {exc.status}")
                return
        self.note("evergreen", "ok")

    async def framed_uds(self, http: httpx.AsyncClient) -> None:
        drop = self.drop_after()

        def run() -> str:
            with UdsClient(self.socket) as client:
                num = 0
                try:
                    for event in client.generate(
                        {"id": f"u{self.rng.getrandbits(32):x}", "prompt": self.rng.choice(PROMPTS), "max_tokens": 24}
                    ):
                        num += event["event"] == "token"
                        if drop is not None and num >= drop:
                            return "dropped"
                        if event["event"] == "error":
                            return f"error {event.get('code')}"
                except UdsConnectionError:
                    return "connection error"
            return "ok"

        self.note("framed_uds", await asyncio.to_thread(run))


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples in Prometheus text."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def soak(args: argparse.Namespace, server: Server, port: int, grpc_port: int, socket: str, data_dir: Path) -> int:
    pid = server.proc.pid  # type: ignore[union-attr]
    runner = Soak(args, port, grpc_port, socket, random.Random(args.seed))
    samples: list[tuple[float, int, float, float, float]] = []  # (s, rss, running, kv used, kv cached)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as http:
        runner.model = (await http.get(f"{runner.base}/v1/models")).json()["data"][0]["id"]
        started = time.monotonic()
        runner.deadline = started + args.minutes * 60

        async def sample() -> None:
            while True:
                text = (await http.get(f"{runner.base}/metrics")).text
                samples.append(
                    (
                        time.monotonic() - started,
                        proc_status(pid, "VmRSS"),
                        metric(text, "rill_num_requests_running"),
                        metric(text, "rill_kv_cache_used_bytes"),
                        metric(text, "rill_kv_cache_cached_bytes"),
                    )
                )
                await asyncio.sleep(10)

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(runner.client_loop(http) for _ in range(args.clients)))
        sampler.cancel()
        quiet_deadline = time.monotonic() + 60
        while True:  # disconnected work is freed within a step; wait for stragglers' streams to end
            text = (await http.get(f"{runner.base}/metrics")).text
            running, kv = metric(text, "rill_num_requests_running"), metric(text, "rill_kv_cache_used_bytes")
            if (running == 0 and kv == 0) or time.monotonic() > quiet_deadline:
                break
            await asyncio.sleep(0.5)
    rss_end = proc_status(pid, "VmRSS")
    print(f"soak: {args.minutes:g} min, {args.clients} clients, seed {args.seed}")
    for (protocol, outcome), count in sorted(runner.outcomes.items()):
        print(f"  {protocol:<12} {outcome:<40} {count:>6}")
    minute = [s for s in samples if s[0] <= 60]
    last = [s for s in samples if s[0] >= samples[-1][0] - 60] if samples else []
    mean = lambda rows: sum(r[1] for r in rows) / max(1, len(rows)) / 2**20  # noqa: E731
    print(
        f"RSS: first minute {mean(minute):.0f} MiB, last minute {mean(last):.0f} MiB, "
        f"max {max((s[1] for s in samples), default=0) / 2**20:.0f} MiB, after quiet {rss_end / 2**20:.0f} MiB"
    )
    print("RSS every 10 s (MiB): " + " ".join(f"{s[1] / 2**20:.0f}" for s in samples))
    print("of which prefix cache (MiB): " + " ".join(f"{s[4] / 2**20:.0f}" for s in samples))
    print(f"after the soak: {running:.0f} running requests, {kv:.0f} KV bytes in use")
    with sqlite3.connect(data_dir / "feedback.sqlite3") as db:
        stored = {row[0] for row in db.execute("SELECT text FROM feedback")}
    missing = [m for m in runner.acknowledged if m not in stored]
    print(
        f"feedback: {len(runner.acknowledged)} acknowledged, {len(runner.acknowledged) - len(missing)} stored, "
        f"{len(missing)} missing"
    )
    return 0 if (running == 0 and kv == 0 and not missing) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny, demo or a model folder")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-arg", action="append", default=[], help="extra rill serve flag (repeatable)")
    args = parser.parse_args(argv)
    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="rill-soak-") as tmp:
        data_dir, socket = Path(tmp) / "data", str(Path(tmp) / "rill.sock")
        port, grpc_port = free_port(), free_port()
        cmd = [
            sys.executable,
            "-m",
            "rill",
            "serve",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--grpc-port",
            str(grpc_port),
            "--socket",
            socket,
            "--log-level",
            "warning",
            "--data-dir",
            str(data_dir),
            *args.server_arg,
        ]
        with Server("rill", cmd, port, Path(tmp) / "server.log", "/health") as server:
            server.wait_ready(300)
            code = asyncio.run(soak(args, server, port, grpc_port, socket, data_dir))
            log = (Path(tmp) / "server.log").read_text()
            tracebacks = log.count("Traceback")
            print(f"server log: {len(log.splitlines())} lines, {tracebacks} tracebacks")
            if tracebacks:
                print(log[-3000:])
                code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
