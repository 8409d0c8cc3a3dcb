"""Idle connections: how many file descriptors do N idle clients hold, and for how long?

    .venv/bin/python benchmarks/idle_connections.py [--connections 3000] [--model tiny|demo|DIR]
        [--source 127.0.0.2] [--wait 120] [-- extra rill serve flags]

Starts ``rill serve`` (HTTP only) as a child process, counts its open file descriptors
(``/proc/PID/fd``), then opens N connections from ``--source`` that never finish: a quarter
send nothing, a quarter half a request line, a quarter headers and part of a body, a quarter
a full ``/ws/chat`` WebSocket handshake and no message. Prints the server's descriptors with
the connections held, what each connection got (503 at once, 408, a WebSocket close, a silent
close), how long after opening the server had closed them (first, median, last), and the
descriptors once they are closed. Connections still open after ``--wait`` seconds are
reported as held. Flags after ``--`` go to ``rill serve`` (e.g. ``--first-message-timeout-s 5``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import Server, free_port, resolve_model

KINDS = ("bare", "request line", "unfinished body", "websocket")


def open_fds(pid: int) -> int:
    """Open file descriptors of ``pid``."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def opening(kind: str, port: int) -> bytes:
    """The bytes a connection of ``kind`` sends before going quiet."""
    host = f"127.0.0.1:{port}"
    if kind == "bare":
        return b""
    if kind == "request line":
        return f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n".encode()
    if kind == "unfinished body":
        return (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{"
        ).encode()
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET /ws/chat HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


def websocket_frames(data: bytes) -> tuple[int | None, list[bytes]]:
    """The close code (if a close frame is complete in ``data``) and the ping payloads before it."""
    pings: list[bytes] = []
    at = 0
    while at + 2 <= len(data):
        opcode, length = data[at] & 0x0F, data[at + 1] & 0x7F
        at += 2
        if length == 126:
            length, at = int.from_bytes(data[at : at + 2], "big"), at + 2
        elif length == 127:
            length, at = int.from_bytes(data[at : at + 8], "big"), at + 8
        if at + length > len(data):
            break
        payload, at = data[at : at + length], at + length
        if opcode == 0x8:
            return (int.from_bytes(payload[:2], "big") if len(payload) >= 2 else 1005), pings
        if opcode == 0x9:
            pings.append(payload)
    return None, pings


def masked(opcode: int, payload: bytes) -> bytes:
    """A client frame (clients must mask)."""
    mask = os.urandom(4)
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def hold(kind: str, port: int, source: str, wait_s: float, results: list) -> None:
    """Open one idle connection and record when and how the server ended it."""
    start = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))
    except OSError as exc:
        results.append((kind, f"connect failed: {exc.strerror or exc}", 0.0))
        return
    received = b""
    answered = 0
    try:
        data = opening(kind, port)
        if data:
            writer.write(data)
            await writer.drain()
        close_code: int | None = None
        async with asyncio.timeout(wait_s):
            while close_code is None and (chunk := await reader.read(65536)):
                received += chunk
                head, _, rest = received.partition(b"\r\n\r\n")
                if head.startswith(b"HTTP/1.1 101"):
                    close_code, pings = websocket_frames(rest)
                    for payload in pings[answered:]:  # like a real client: answer pings, send nothing else
                        writer.write(masked(0xA, payload))
                    answered = len(pings)
    except ConnectionError:
        pass
    except TimeoutError:
        results.append((kind, "still held", time.monotonic() - start))
        writer.close()
        return
    writer.close()
    if received.startswith(b"HTTP/1.1 101"):
        outcome = f"websocket close {close_code}" if close_code is not None else "websocket dropped"
    else:
        outcome = received[:12].decode("latin-1") or "closed silently"
    results.append((kind, outcome, time.monotonic() - start))


async def main(args: argparse.Namespace, serve_flags: list[str]) -> None:
    """Run the measurement (see the module docstring)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    model = resolve_model(args.model)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "rill",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--no-socket",
        "--grpc-port",
        "0",
        "--num-threads",
        "1",
        "--log-level",
        "warning",
        *serve_flags,
    ]
    with tempfile.TemporaryDirectory() as folder:
        server = Server("rill", cmd + ["--data-dir", folder], port, Path(folder) / "server.log", "/health")
        with server:
            server.wait_ready(300)
            assert server.proc is not None
            pid = server.proc.pid
            before = open_fds(pid)
            results: list = []
            tasks = [
                asyncio.create_task(hold(KINDS[i % len(KINDS)], port, args.source, args.wait, results))
                for i in range(args.connections)
            ]
            await asyncio.sleep(1.0)  # let every connection be accepted or refused
            held = open_fds(pid)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
                started = time.monotonic()
                reply = await http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4})
                normal_ms = (time.monotonic() - started) * 1000
            await asyncio.gather(*tasks)
            closed_at = time.monotonic()
            after = open_fds(pid)
            while after > before and time.monotonic() - closed_at < 30:  # sockets the server is still closing
                await asyncio.sleep(0.5)
                after = open_fds(pid)
            settled_s = time.monotonic() - closed_at
            gauges = httpx.get(f"http://127.0.0.1:{port}/metrics").text
            still_open = next(
                (line for line in gauges.splitlines() if line.startswith("rill_connections_open{")),
                "rill_connections_open (no gauge)",
            )
    print(
        f"server fds: {before} before, {held} with {args.connections} idle connections, {after} "
        f"{settled_s:.1f} s after the last was closed; {still_open}"
    )
    print(f"normal client meanwhile: HTTP {reply.status_code} in {normal_ms:.0f} ms")
    by_outcome: dict[tuple[str, str], list[float]] = {}
    for kind, outcome, seconds in results:
        by_outcome.setdefault((kind, outcome), []).append(seconds)
    for (kind, outcome), times in sorted(by_outcome.items()):
        print(
            f"  {kind:16} {outcome:26} {len(times):5}  closed after {min(times):6.2f} / "
            f"{statistics.median(times):6.2f} / {max(times):6.2f} s (first / median / last)"
        )


if __name__ == "__main__":
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=3000)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--source", default="127.0.0.2", help="source address of the idle connections")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds after which a connection counts as held")
    asyncio.run(main(parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv), extra))
