"""Memory a finished client held goes back to the OS: ``rill serve`` as a process of its own,
its resident set read from ``/proc`` before and after a burst of Evergreen sessions.

The sessions' chunks pass through gRPC's own threads. With glibc's default of an arena per
thread, each of those threads kept the top of its arena (the freed burst) resident after the
sessions closed, because ``malloc_trim`` shrinks only the main arena's top and the server's
malloc thresholds never let a thread arena shrink its own.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from rill.clients.evergreen import EvergreenClient, Session
from rill.protocols.evergreen.messages import GenerateConfig
from tests.conftest import free_port
from tests.helpers import rill_process
from tests.protocols.evergreen.helpers import generate, leaf, msg

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and uses glibc")

MIB = 2**20
PIECE = "word " * (MIB // 5)  # 1 MiB of text per fragment


def rss_bytes(pid: int) -> int:
    """The process's resident set size, from ``/proc/<pid>/status``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


async def fill_sessions(address: str, num_sessions: int, mib_each: int) -> list[str]:
    """Open ``num_sessions`` sessions at once, send each ``mib_each`` MiB of chunk data and a
    short generation, read its first answer, then cancel them all; each one's outcome."""
    action = generate("q", "out", config=GenerateConfig(temperature=0.0, max_tokens=2))
    async with EvergreenClient(address) as client:
        sessions = [client.open_session() for _ in range(num_sessions)]

        async def fill(session: Session) -> str:
            for k in range(mib_each):
                await session.send(msg(leaf(f"n{k}", text=PIECE)))
            await session.send(msg(leaf("q", "Hello"), action))
            return "answered" if await session.receive() is not None else "ended"

        outcomes = await asyncio.gather(*(fill(s) for s in sessions))
        for session in sessions:
            session.cancel()
    return list(outcomes)


def test_evergreen_burst_memory_is_returned(tiny_model_dir: Path) -> None:
    """Six sessions of 40 MiB at once (~240 MiB more while they are open): once they are gone,
    the server's RSS comes back within 64 MiB of where it was before them."""
    grpc_port = free_port()
    with rill_process(tiny_model_dir, "--grpc-port", str(grpc_port)) as (proc, _url):
        address = f"127.0.0.1:{grpc_port}"
        # One small session first: gRPC's channels, the codec and the engine's first step are
        # start-up costs, not what the burst leaves behind.
        assert asyncio.run(fill_sessions(address, 1, 1)) == ["answered"]
        before = rss_bytes(proc.pid)
        assert asyncio.run(fill_sessions(address, 6, 40)) == ["answered"] * 6
        # Memory comes back through a trim in a thread of the server's own, after the sessions'
        # leases are released: wait for it (a bound on a condition, not a timed pass).
        deadline = time.monotonic() + 30
        while (after := rss_bytes(proc.pid)) > before + 64 * MIB and time.monotonic() < deadline:
            time.sleep(0.2)
        assert after <= before + 64 * MIB, f"RSS {before / MIB:.0f} MiB before, {after / MIB:.0f} MiB after"
