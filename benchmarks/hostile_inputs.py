"""Hostile inputs of issue 12 (items 2, 3, 6, 7): what they cost a running server.

    .venv/bin/python benchmarks/hostile_inputs.py [--model tiny|demo|DIR] [--server-arg=--flag=value ...]

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

A flood sent over several messages may show ``INTERNAL: Internal error from Core``: the
server aborted with RESOURCE_EXHAUSTED, but grpc's asyncio client replaces that status by a
local one when it writes after the server ended the call (grpc/grpc#36066).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import Server, free_port, resolve_model  # noqa: E402

from rill.clients.evergreen import EvergreenClient, EvergreenError  # noqa: E402
from rill.protocols.evergreen.messages import (  # noqa: E402
    Action,
    Chunk,
    ChunkMetadata,
    GenerateConfig,
    NamedParameter,
    NodeFragment,
    SessionMessage,
)
from rill.protocols.evergreen import codec  # noqa: E402

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
    """Asks ``/health`` every 10 ms; ``worst_ms`` is the slowest answer since ``reset``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst_ms = 0.0
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            while True:
                start = time.perf_counter()
                with contextlib.suppress(httpx.HTTPError):
                    await http.get(self.url)
                self.worst_ms = max(self.worst_ms, (time.perf_counter() - start) * 1000)
                await asyncio.sleep(0.01)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def reset(self) -> None:
        self.worst_ms = 0.0

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def generate_action(input_id: str = "p", output_id: str = "r") -> Action:
    config = codec.encode_config(GenerateConfig(temperature=0.0, max_tokens=4))
    return Action(name="GENERATE", inputs=(NamedParameter(name="prompt", id=input_id),),
                  outputs=(NamedParameter(name="response", id=output_id),), configs=(config,))


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
    fragments = tuple(NodeFragment(id="p", seq=i, continued=i < num_refs - 1,
                                   chunk_fragment=Chunk(metadata=TEXT if i == 0 else None, ref=uri))
                      for i in range(num_refs))
    return [SessionMessage(node_fragments=fragments, actions=(generate_action(),))]


def shared_node_messages(num_uses: int) -> list[SessionMessage]:
    leaf = NodeFragment(id="shared", chunk_fragment=Chunk(metadata=TEXT, data=b"word " * (MB // 5)))
    parent = NodeFragment(id="p", child_ids=("shared", *(f"u{i}" for i in range(num_uses - 1))))
    links = tuple(NodeFragment(id=f"u{i}", child_ids=("shared",)) for i in range(num_uses - 1))
    return [SessionMessage(node_fragments=(leaf,)), SessionMessage(node_fragments=(parent, *links),
                                                                   actions=(generate_action(),))]


def empty_fragment_messages(num_fragments: int, per_message: int = 50_000) -> list[SessionMessage]:
    return [SessionMessage(node_fragments=tuple(NodeFragment(id="n", seq=seq, continued=True)
                                                for seq in range(start, min(start + per_message, num_fragments))))
            for start in range(0, num_fragments, per_message)]


def long_id_messages(num_ids: int, id_bytes: int) -> list[SessionMessage]:
    return [SessionMessage(node_fragments=(NodeFragment(id=f"{i:06d}" + "x" * (id_bytes - 6), continued=True),))
            for i in range(num_ids)]


async def feedback_case(ws_url: str, prompt: str, text: str | None) -> str:
    from websockets.asyncio.client import connect

    async with connect(ws_url, max_size=None) as ws:
        await ws.send(json.dumps({"type": "config", "prompt": prompt, "parameters": {"max_tokens": 2}}))
        while (first := json.loads(await ws.recv()))["type"] not in ("completion", "error"):
            pass
        for _ in range(100):
            await ws.send(json.dumps({"type": "feedback", "rating": 1, **({"text": text} if text else {})}))
        replies = [json.loads(await ws.recv()) for _ in range(100)]
    stored = sum(r.get("operation") == "feedback_received" for r in replies)
    errors = sorted({r["error"] for r in replies if r["type"] == "error"})
    return f"generation: {first.get('error', first['type'])}; stored {stored}/100; errors {errors}"


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
        ("/generate: 3.9 MB prompt + 100 feedback",
         lambda: feedback_case(f"ws://127.0.0.1:{server.port}/generate", "x" * 3_900_000, None)),
        ("/generate: short prompt + 100 feedback of 64 Ki chars",
         lambda: feedback_case(f"ws://127.0.0.1:{server.port}/generate", "Once upon a time", "é" * 65536)),
    ]
    print(f"{'case':<52} {'rss before':>10} {'after':>8} {'peak':>8} {'disk +':>8} {'/health':>9}  outcome")
    for name, case in cases:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before, disk_before = proc_status(pid, "VmRSS"), folder_bytes(data_dir)
        probe.reset()
        outcome = await case()
        await asyncio.sleep(0.2)  # a few more probes after the reply
        after, peak = proc_status(pid, "VmRSS"), proc_status(pid, "VmHWM")
        disk = folder_bytes(data_dir) - disk_before
        print(f"{name:<52} {before / 2**20:>8.0f}Mi {after / 2**20:>6.0f}Mi {peak / 2**20:>6.0f}Mi "
              f"{disk / 2**20:>6.2f}Mi {probe.worst_ms:>7.0f}ms  {outcome}", flush=True)
    await probe.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="tiny, demo or a model folder")
    parser.add_argument("--server-arg", action="append", default=[], help="extra rill serve flag (repeatable)")
    args = parser.parse_args(argv)
    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="rill-hostile-") as tmp:
        root, data_dir = Path(tmp) / "files", Path(tmp) / "data"
        root.mkdir()
        (root / "big.txt").write_bytes(b"word " * (MB // 5))
        port, args.grpc_port = free_port(), free_port()
        cmd = [sys.executable, "-m", "rill", "serve", "--model", str(model_dir), "--port", str(port),
               "--grpc-port", str(args.grpc_port), "--no-socket", "--num-threads", "1", "--log-level", "warning",
               "--evergreen-file-root", str(root), "--data-dir", str(data_dir), *args.server_arg]
        with Server("rill", cmd, port, Path(tmp) / "server.log", "/health") as server:
            server.wait_ready(300)
            asyncio.run(run(args, server, root, data_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
