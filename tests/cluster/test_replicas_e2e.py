"""``rill serve --replicas 2`` on Ray's local instance: every protocol served, controls reach
the right generation, a batch continuation continues the same text, feedback lands in
PostgreSQL, and a replica killed with SIGKILL mid-stream costs only its own streams.

Tiny random-init model, one thread per replica. Random weights make gibberish: the tests
assert order, counts and equality between runs (greedy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
from websockets.asyncio.client import connect

from rill.clients.chat import chat
from rill.clients.evergreen import EvergreenClient
from rill.clients.generate import GenerateClient
from rill.clients.uds import UdsClient
from rill.engine.threads import proc_stat_fields
from tests.protocols.batch_ws.test_adapter import GREEDY, assert_continued, by_type, greedy_batch, run_batch
from tests.protocols.generate_ws.test_adapter import is_status, is_type, send, until

from .conftest import LONG_CONTEXT, ClusterServer, wait_for

LONG = LONG_CONTEXT - 32
"""Tokens of a generation that must still run when its control arrives: at a few milliseconds
a token that lasts seconds, against the milliseconds a control takes (400 once ran out first,
when calls went by value)."""

COMEBACK_TIMEOUT_S = 300
"""Bound on waiting for Ray to restart a killed replica (a bound, not a pass condition)."""


def generated_tokens(cluster: ClusterServer) -> dict[str, float]:
    return cluster.replica_values("rill_replica_generation_tokens_total")


async def completion_text(cluster: ClusterServer, prompt: str, max_tokens: int) -> str:
    async with openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none") as client:
        result = await client.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
        )
    return result.choices[0].text


async def test_every_protocol_is_served_and_work_spreads_over_both_replicas(cluster: ClusterServer) -> None:
    before = sum(generated_tokens(cluster).values())
    # The OpenAI API, streamed, several at once: the router spreads them.
    async with openai.AsyncOpenAI(base_url=f"{cluster.url}/v1", api_key="none") as client:

        async def one(i: int) -> str:
            stream = await client.chat.completions.create(
                model="tiny-llama",
                messages=[{"role": "user", "content": f"question {i}"}],
                max_tokens=24,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        texts = await asyncio.gather(*(one(i) for i in range(6)))
    assert all(texts)
    # /generate
    async with GenerateClient(f"{cluster.ws_url}/generate") as gen:
        msgs = [m async for m in gen.generate("Once upon a time", max_tokens=8, temperature=0, ignore_eos=True)]
    assert msgs[-1]["type"] == "completion" and msgs[-1]["usage"]["completion_tokens"] == 8
    # batch /ws
    async with connect(f"{cluster.ws_url}/ws") as ws:
        frames = await run_batch(
            ws,
            {
                "prompts": [{"request_id": "b1", "prompt": "The little robot"}],
                "generation_config": {**GREEDY, "max_new_tokens": 8},
            },
        )
    assert by_type(frames, "COMPLETE")["b1"]["new_tokens_count"] == 8
    # the Unix socket (framed JSON)
    events = await asyncio.to_thread(_uds_generate, str(cluster.socket))
    assert events[-1]["event"] == "eos" and any(e["event"] == "token" for e in events)
    # /ws/chat
    reply = await chat(
        f"{cluster.ws_url}/ws/chat",
        [{"role": "user", "content": "hello"}],
        generation={"max_new_tokens": 8, "temperature": 0},
    )
    assert reply.text
    # Evergreen over gRPC
    async with EvergreenClient(cluster.grpc_address) as evergreen:
        pieces = [p async for p in evergreen.generate("Once upon a time")]
    assert "".join(pieces)
    # Both replicas made tokens (the gauges are read every second: a bounded wait for them).
    made = wait_for(
        lambda: (lambda t: t if len(t) == 2 and sum(t.values()) > before else None)(generated_tokens(cluster)),
        30,
        "both replicas' counters",
    )
    assert all(count > 0 for count in made.values()), made
    # The front door runs on the replicas' machine: each hands its outputs over a local socket.
    linked = wait_for(
        lambda: (lambda v: v if len(v) == 2 else None)(cluster.replica_values("rill_replica_engine_linked_frontends")),
        30,
        "both replicas' linked front doors",
    )
    assert all(count >= 1 for count in linked.values()), linked


def test_replicas_run_at_the_servers_niceness(cluster: ClusterServer) -> None:
    # Ray starts its workers at niceness 15; an engine replica at 15 is preempted by the
    # server process and Ray's daemons at every token.
    pids = cluster.replica_pids()
    assert len(pids) == 2
    niceness: dict[tuple[int, str], int] = {}
    for pid in pids:
        tasks = Path(f"/proc/{pid}/task")
        for task in tasks.iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                niceness[pid, task.name] = int(proc_stat_fields(int(task.name), tasks)[16])  # field 19
    assert niceness and set(niceness.values()) == {os.getpriority(os.PRIO_PROCESS, 0)}, niceness


def _uds_generate(path: str) -> list[dict[str, Any]]:
    with UdsClient(path) as client:
        return list(client.generate({"id": "u1", "prompt": "Hello", "max_tokens": 8}))


async def paused_after_first_token(ws: Any, prompt: str) -> list[dict[str, Any]]:
    """Start a long greedy generation on ``ws`` and pause it at its first token: what it sent
    up to its ``paused`` status. Paused at once, it cannot reach its end before a later step."""
    await send(ws, type="config", prompt=prompt, parameters={"max_tokens": LONG, "temperature": 0, "ignore_eos": True})
    got = await until(ws, is_type("token"))
    await send(ws, type="control", action="pause")
    got += await until(ws, lambda m: is_status("paused")(m) or m["type"] in ("completion", "error"))
    assert is_status("paused")(got[-1]), f"the generation ended before its pause: {got[-1]}"
    return got


async def test_generate_controls_reach_the_right_generation(cluster: ClusterServer) -> None:
    url = f"{cluster.ws_url}/generate"
    async with connect(url) as a, connect(url) as b:
        # Pause A: A says paused and makes nothing more while B goes on.
        before_pause = await paused_after_first_token(a, "Once upon a time")
        await send(
            b,
            type="config",
            prompt="The little robot",
            parameters={"max_tokens": LONG, "temperature": 0, "ignore_eos": True},
        )
        got_b = []
        for _ in range(8):  # long enough for A to make tokens, were it not paused
            got_b += await until(b, is_type("token"))
        assert all(m["type"] != "completion" for m in got_b)
        # Modify B: B (not A) takes the new parameters.
        await send(b, type="control", action="modify", parameters={"temperature": 0.9})
        modified = await until(b, is_status("modified"))
        assert modified[-1]["parameters"]["temperature"] == 0.9
        # Regenerate B: B (not A) starts again from its prompt.
        await send(b, type="control", action="regenerate")
        await until(b, is_status("regenerating"))
        await until(b, is_type("init"))
        # Stop A while paused: A ends cancelled; B still runs to its own end.
        await send(a, type="control", action="stop")
        end_a = await until(a, is_type("completion"))
        assert end_a[-1]["finish_reason"] == "cancelled"
        # Nothing generated between pause and stop. The end may still deliver tokens made
        # before the pause whose text was held back (the first bytes of a character split over
        # tokens: at most three), in the generation's last output.
        made_before = sum(1 for m in before_pause if m["type"] == "token")
        held = [m for m in end_a if m["type"] == "token"]
        assert len(held) <= 3 and end_a[-1]["usage"]["completion_tokens"] == made_before + len(held)
        assert all(m["type"] == "token" for m in end_a[len(end_a) - len(held) - 1 : -1])  # right before the end
        end_b = await until(b, is_type("completion"))
        assert end_b[-1]["finish_reason"] == "length" and end_b[-1]["usage"]["completion_tokens"] == LONG


async def test_a_disconnect_frees_the_replicas_kv(cluster: ClusterServer) -> None:
    """A client that leaves mid-generation cancels it on its replica: every replica's KV in use
    and running count go back to zero (read from /metrics: a bounded wait)."""
    url = f"{cluster.ws_url}/generate"
    cancelled_before = cancelled(cluster)
    async with connect(url) as a, connect(url) as b:
        for ws in (a, b):
            # Paused, each keeps its KV and cannot run out before the socket closes.
            await paused_after_first_token(ws, "Once upon a time")
        busy = wait_for(
            lambda: (lambda kv: kv if sum(kv.values()) > 0 else None)(
                cluster.replica_values("rill_replica_kv_cache_used_bytes")
            ),
            30,
            "KV in use while both stream",
        )
        assert busy
    # Both sockets closed while paused: both cancelled, nothing runs, nothing holds KV.
    wait_for(lambda: cancelled(cluster) == cancelled_before + 2, 30, "both generations cancelled")
    wait_for(
        lambda: (
            sum(cluster.replica_values("rill_replica_kv_cache_used_bytes").values()) == 0
            and sum(cluster.replica_values("rill_replica_num_requests_running").values()) == 0
        ),
        30,
        "the replicas' KV freed",
    )
    assert cancelled(cluster) == cancelled_before + 2


def cancelled(cluster: ClusterServer) -> float:
    """Generations the front door saw end cancelled (its own counter: current, not polled)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in cluster.metrics().splitlines()
        if line.startswith("rill_requests_total{") and 'finish_reason="cancelled"' in line
    )


async def test_batch_continuation_continues_the_same_text(cluster: ClusterServer) -> None:
    prompts = {"c1": "Once upon a time", "c2": "The little robot"}
    async with connect(f"{cluster.ws_url}/ws") as ws:
        first = await greedy_batch(ws, prompts, 10)
        second = await greedy_batch(ws, dict.fromkeys(prompts, "ignored"), 10)
        single = await greedy_batch(ws, prompts, 20, prefix="ref-")
    assert_continued(prompts, first, second, single)


async def give_feedback(cluster: ClusterServer, rating: float, text: str) -> str:
    """Generate on /generate, send feedback on it; the store's database URL once acknowledged."""
    async with GenerateClient(f"{cluster.ws_url}/generate") as gen:
        _ = [m async for m in gen.generate("Once upon a time", max_tokens=4, temperature=0)]
        ack = await gen.feedback(rating, text)
    assert ack["type"] == "status" and cluster.database is not None
    return cluster.database


async def test_feedback_lands_in_postgresql(cluster: ClusterServer) -> None:
    database = await give_feedback(cluster, 0.75, "useful, from the cluster")
    records = [json.loads(line) for line in (await asyncio.to_thread(_export, database)).splitlines()]
    assert any(r.get("text") == "useful, from the cluster" and r.get("rating") == 0.75 for r in records), records


def _export(database: str) -> str:
    """``rill feedback export`` of ``database``: what the store holds, read apart from any server."""
    command = [sys.executable, "-m", "rill", "feedback", "export", "--database", database]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


async def test_replica_killed_mid_stream(cluster: ClusterServer) -> None:
    """SIGKILL one replica while each replica runs one greedy stream: that stream ends with the
    typed, retryable error; the other's text equals a solo run; Ray brings the replica back."""
    pids = cluster.replica_pids()
    assert len(pids) == 2, pids
    prompts = ("Once upon a time", "The little robot")
    url = f"{cluster.ws_url}/generate"
    async with connect(url) as a, connect(url) as b:
        heads: dict[Any, list[dict]] = {}
        for ws, prompt in ((a, prompts[0]), (b, prompts[1])):
            # One at a time: the second goes to the replica with nothing in flight. Each waits
            # paused, so both are still running when the kill lands, however fast they are.
            heads[ws] = await paused_after_first_token(ws, prompt)
        os.kill(pids[0], signal.SIGKILL)
        # The killed replica's stream ends with an error by itself; the other, still paused,
        # says nothing until it is resumed.
        reads = {asyncio.ensure_future(until(ws, lambda m: m["type"] in ("completion", "error"))): ws for ws in (a, b)}
        done, pending = await asyncio.wait(reads, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        if len(done) != 1:
            for read in pending:
                read.cancel()  # nobody will await them: no task left reading a closed socket
            raise AssertionError(f"{len(done)} streams ended within 60 s of the kill, not 1")
        [lost_read], [survivor_read] = done, pending
        ends = {reads[lost_read]: heads[reads[lost_read]] + lost_read.result()}
        survivor = reads[survivor_read]
        await send(survivor, type="control", action="resume")
        ends[survivor] = heads[survivor] + await asyncio.wait_for(survivor_read, 60)
    kinds = sorted(msgs[-1]["type"] for msgs in ends.values())
    assert kinds == ["completion", "error"], kinds
    [lost] = [msgs[-1] for msgs in ends.values() if msgs[-1]["type"] == "error"]
    assert lost["recoverable"] is True and "replica" in lost["message"], lost
    [(ws_ok, survived)] = [(ws, msgs) for ws, msgs in ends.items() if msgs[-1]["type"] == "completion"]
    prompt = prompts[0] if ws_ok is a else prompts[1]
    text = [m for m in survived if m["type"] == "token"][-1]["generated_text"]
    assert survived[-1]["usage"]["completion_tokens"] == LONG
    # The same request alone afterwards gives the same text.
    async with GenerateClient(url) as gen:
        again = [m async for m in gen.generate(prompt, max_tokens=LONG, temperature=0, ignore_eos=True)]
    assert [m for m in again if m["type"] == "token"][-1]["generated_text"] == text
    # Ray restarts the killed replica; it rejoins without a server restart and serves.
    wait_for(lambda: len(cluster.replica_pids()) == 2, COMEBACK_TIMEOUT_S, "the replica restarted")
    wait_for(lambda: len(generated_tokens(cluster)) == 2, COMEBACK_TIMEOUT_S, "both replicas in /metrics")
    assert httpx.get(f"{cluster.url}/health").status_code == 200
    assert await completion_text(cluster, "Hello again", 4)


async def test_acknowledged_feedback_survives_kill_of_the_server(cluster: ClusterServer) -> None:
    """Last in this module: it kills the server itself (SIGKILL), then reads the store."""
    database = await give_feedback(cluster, 0.25, "written just before the kill")
    cluster.proc.send_signal(signal.SIGKILL)
    cluster.proc.wait()
    exported = await asyncio.to_thread(_export, database)
    assert any(json.loads(line).get("text") == "written just before the kill" for line in exported.splitlines())
