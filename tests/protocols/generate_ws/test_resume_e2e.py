"""``/generate`` resume against a real ``rill serve`` (tiny random-init model) on loopback.

A generation whose ``config`` says ``"resumable": true`` outlives its socket: a client that
drops at any point and sends ``resume`` on a new socket gets every message it missed, then the
rest live, and steers it from there. Random weights make gibberish; greedy decoding makes the
same gibberish every time, so an interrupted run is compared with an uninterrupted one.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import LiveServer, start_server
from tests.helpers import recv_json as recv

GRACE_S = 3.0
"""The server's ``--resume-grace-s``: short, so that a test can wait for an expiry; a resume
in these tests follows its drop at once (a reconnect on loopback), far inside it."""

PROMPTS = ["Once upon a time", "The three primary colors are", "In a quiet village", "def main():"]
NUM_TOKENS = 12  # per cycle of the drop/resume property: short, so 200 cycles stay fast
PAUSED_TOKENS = 200  # a cycle that pauses: long enough that the pause comes before the end
LONG = 600  # tokens: controls sent after the first token arrive long before such a run ends


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A server of its own: two API keys (two principals) and a short grace period."""
    live = start_server(
        tiny_model_dir,
        **{
            "resume.resume_grace_s": GRACE_S,
            # The 200 cycles keep each generation for the grace period after it: room for all.
            "resume.resume_max_streams": 1000,
            "resume.resume_max_streams_per_principal": 1000,
            "http.api_key": ["k1", "k2"],
            "http.data_dir": str(tmp_path_factory.mktemp("data")),
        },
    )
    yield live
    live.stop()


def on_server(server: LiveServer, work: Coroutine[Any, Any, Any]) -> Any:
    """Run ``work`` on the server's event loop (its registry lives there) and await it here."""
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, server.loop))


def open_ws(server: LiveServer, key: str = "k1") -> Any:
    return connect(f"{server.ws_url}/generate", additional_headers={"Authorization": f"Bearer {key}"})


async def send(ws: ClientConnection, **msg: Any) -> None:
    await ws.send(json.dumps(msg))


async def read_until(ws: ClientConnection, pred: Any) -> list[dict]:
    """Messages up to and including the first one matching ``pred``."""
    got = []
    while True:
        got.append(await recv(ws))
        if pred(got[-1]):
            return got


def is_end(msg: dict) -> bool:
    return msg["type"] in ("completion", "error")


def is_status(op: str) -> Any:
    return lambda msg: msg["type"] == "status" and msg["operation"] == op


def after_tokens(num_tokens: int) -> Any:
    """A predicate true at the ``num_tokens``-th token message (0: at once)."""
    count = [0]

    def pred(msg: dict) -> bool:
        count[0] += msg["type"] == "token"
        return count[0] >= num_tokens

    return pred


def tokens(msgs: list[dict]) -> str:
    return "".join(m["token"] for m in msgs if m["type"] == "token")


def drop(ws: ClientConnection, abruptly: bool) -> Any:
    """Lose the connection: a TCP reset (no close frame) or a clean close."""
    if abruptly:
        ws.transport.abort()
        return asyncio.sleep(0)
    return ws.close()


def config(prompt: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    params = {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    return {"type": "config", "prompt": prompt, "parameters": params, "resumable": True, **extra}


async def uninterrupted(server: LiveServer, prompt: str, max_tokens: int) -> list[dict]:
    async with open_ws(server) as ws:
        await send(ws, **config(prompt, max_tokens))
        msgs = await read_until(ws, is_end)
    assert msgs[-1]["type"] == "completion", msgs[-1]
    return msgs


async def forgotten(server: LiveServer, request_id: str) -> None:
    """Wait until the registry no longer keeps ``request_id`` (its grace period ended)."""
    await on_server(server, server.state["deps"].resumable.wait_forgotten(request_id))


async def test_every_message_of_a_resumable_generation_has_its_index(server: LiveServer) -> None:
    msgs = await uninterrupted(server, PROMPTS[0], 8)
    assert [m["index"] for m in msgs] == list(range(len(msgs)))
    assert msgs[0]["type"] == "init" and msgs[-1]["generated_text"] == tokens(msgs)
    async with open_ws(server) as ws:  # a spec client's generation carries none
        await send(ws, type="config", prompt=PROMPTS[0], parameters={"max_tokens": 3})
        assert all("index" not in m for m in await read_until(ws, is_end))


@pytest.mark.parametrize("seed", range(6))
async def test_a_dropped_client_that_resumes_reads_exactly_the_uninterrupted_text(
    server: LiveServer, seed: int
) -> None:
    rng = random.Random(seed)
    prompt, max_tokens = rng.choice(PROMPTS), 40
    reference = await uninterrupted(server, prompt, max_tokens)
    stop_at = rng.randrange(max_tokens)  # drop right after this token
    async with open_ws(server) as ws:
        await send(ws, **config(prompt, max_tokens))
        seen = await read_until(ws, after_tokens(stop_at + 1))
        await drop(ws, abruptly=seed % 2 == 0)
    request_id = seen[0]["request_id"]
    async with open_ws(server) as ws:
        await send(ws, type="resume", request_id=request_id, last_index=seen[-1]["index"])
        rest = await read_until(ws, is_end)
    assert rest[0]["index"] == seen[-1]["index"] + 1
    assert [m["index"] for m in rest] == list(range(rest[0]["index"], rest[-1]["index"] + 1))
    assert tokens(seen) + tokens(rest) == tokens(reference)
    assert rest[-1]["generated_text"] == reference[-1]["generated_text"]
    server.wait_idle()


async def test_controls_and_feedback_from_the_new_connection_steer_the_generation(server: LiveServer) -> None:
    greedy = tokens(await uninterrupted(server, PROMPTS[1], LONG))
    async with open_ws(server) as ws:
        await send(ws, **config(PROMPTS[1], LONG))
        seen = await read_until(ws, lambda m: m["type"] == "token")
        await send(ws, type="control", action="pause")
        seen += await read_until(ws, is_status("paused"))
        await drop(ws, abruptly=True)
    request_id = seen[0]["request_id"]
    async with open_ws(server) as ws:
        await send(ws, type="resume", request_id=request_id, last_index=seen[-1]["index"])
        await send(ws, type="control", action="modify", parameters={"top_k": 5})
        after = await read_until(ws, is_status("modified"))
        assert not [m for m in after if m["type"] == "token"]  # still paused: nothing came
        assert after[-1]["parameters"]["top_k"] == 5
        await send(ws, type="control", action="resume")
        after += await read_until(ws, lambda m: m["type"] == "token")
        await send(ws, type="control", action="pause")
        after += await read_until(ws, is_status("paused"))
        await send(ws, type="feedback", rating=1, text="resumed fine")
        after += await read_until(ws, is_status("feedback_received"))
        await send(ws, type="control", action="stop")
        after += await read_until(ws, is_end)
    done = after[-1]
    assert done["type"] == "completion" and done["finish_reason"] == "cancelled"
    text = tokens(seen) + tokens(after)
    assert done["generated_text"] == text and greedy.startswith(text)  # greedy at temperature 0
    assert done["usage"]["completion_tokens"] < LONG
    server.wait_idle()


async def test_a_resume_takes_over_from_a_connection_the_server_still_thinks_alive(server: LiveServer) -> None:
    async with open_ws(server) as old:
        await send(old, **config(PROMPTS[2], LONG))
        seen = await read_until(old, lambda m: m["type"] == "token")
        await send(old, type="control", action="pause")
        seen += await read_until(old, is_status("paused"))
        async with open_ws(server) as new:
            await send(new, type="resume", request_id=seen[0]["request_id"], last_index=-1)
            replay = await read_until(new, is_status("paused"))
            assert replay == seen  # everything, from init on
            with pytest.raises(ConnectionClosed) as closed:
                await recv(old)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 4000
            await send(new, type="control", action="stop")
            assert (await read_until(new, is_end))[-1]["finish_reason"] == "cancelled"
    server.wait_idle()


async def test_a_finished_generation_can_be_read_again_within_the_grace_period(server: LiveServer) -> None:
    reference = await uninterrupted(server, PROMPTS[3], 6)
    async with open_ws(server) as ws:
        await send(ws, type="resume", request_id=reference[0]["request_id"], last_index=2)
        assert await read_until(ws, is_end) == reference[3:]
        # The connection then works as any: a generation of its own.
        await send(ws, type="config", prompt=PROMPTS[3], parameters={"max_tokens": 2})
        assert (await read_until(ws, is_end))[-1]["usage"]["completion_tokens"] == 2


async def test_resume_errors(server: LiveServer) -> None:
    async with open_ws(server) as ws:
        await send(ws, **config(PROMPTS[0], LONG))
        seen = await read_until(ws, lambda m: m["type"] == "token")
        await send(ws, type="control", action="pause")
        seen += await read_until(ws, is_status("paused"))
    request_id = seen[0]["request_id"]
    async with open_ws(server, key="k2") as ws:  # another principal: as if it did not exist
        await send(ws, type="resume", request_id=request_id, last_index=0)
        err = await recv(ws)
        assert (err["error"], err["request_id"], err["recoverable"]) == ("request_not_found", request_id, True)
        await send(ws, type="resume", request_id="gen_nonexistent", last_index=0)
        assert (await recv(ws))["error"] == "request_not_found"
    async with open_ws(server) as ws:
        await send(ws, type="resume", request_id=request_id, last_index=seen[-1]["index"] + 1)
        err = await recv(ws)
        assert (err["error"], err["field"]) == ("invalid_request", "last_index")
        await send(ws, type="resume", request_id=request_id, last_index=-2)
        assert (await recv(ws))["field"] == "last_index"
        await send(ws, type="config", prompt=PROMPTS[0], parameters={"max_tokens": LONG, "ignore_eos": True})
        assert (await recv(ws))["type"] == "init"
        await send(ws, type="resume", request_id=request_id, last_index=0)  # not while generating
        err = await read_until(ws, is_end)
        assert err[-1]["error"] == "invalid_request" and err[-1]["field"] == "type"
    # No one came back for the paused one: its grace period ends, it is cancelled.
    await forgotten(server, request_id)
    stats = server.wait_idle()
    assert stats.kv_used_bytes == 0 and stats.num_paused == 0
    async with open_ws(server) as ws:
        await send(ws, type="resume", request_id=request_id, last_index=0)
        err = await recv(ws)
        assert (err["error"], err["request_id"], err["recoverable"]) == ("resume_expired", request_id, True)


async def test_a_generation_that_is_not_resumable_is_still_aborted_at_disconnect(server: LiveServer) -> None:
    before = server.stats().requests_finished_total.get("cancelled", 0)
    async with open_ws(server) as ws:
        await send(ws, type="config", prompt=PROMPTS[1] * 20, parameters={"max_tokens": LONG, "ignore_eos": True})
        request_id = (await recv(ws))["request_id"]
        await read_until(ws, lambda m: m["type"] == "token")
    stats = server.wait_idle()  # polls engine state; fails if the KV is never freed
    assert stats.kv_used_bytes == 0 and stats.requests_finished_total.get("cancelled", 0) == before + 1
    async with open_ws(server) as ws:
        await send(ws, type="resume", request_id=request_id, last_index=0)
        assert (await recv(ws))["error"] == "request_not_found"


async def test_random_drops_and_resumes_leak_nothing(server: LiveServer) -> None:
    """200 cycles: drop at a random point (right after init, after any token, after the end;
    running or paused; abruptly or not); resume at once in most cycles (from where the client
    was, or from the start), never in the others. Every resumed run reads exactly the
    uninterrupted text; once every grace period has ended, nothing runs and no KV memory is held
    (the paused ones no one came back for were cancelled by the registry)."""
    rng = random.Random(33)
    references = {(p, n): await uninterrupted(server, p, n) for p in PROMPTS for n in (NUM_TOKENS, PAUSED_TOKENS)}
    ids: list[str] = []
    num_resumed = num_paused_left = 0
    for _ in range(200):
        prompt, pauses = rng.choice(PROMPTS), rng.random() < 0.3
        num_tokens = PAUSED_TOKENS if pauses else NUM_TOKENS
        reference = references[prompt, num_tokens]
        stop_after = rng.randrange(-1, NUM_TOKENS + 1)  # tokens read; -1: init only; NUM_TOKENS: all
        async with open_ws(server) as ws:
            await send(ws, **config(prompt, num_tokens))
            if stop_after == NUM_TOKENS and not pauses:
                seen = await read_until(ws, is_end)
            else:
                seen = await read_until(ws, after_tokens(max(stop_after, 0)))
            if pauses:
                await send(ws, type="control", action="pause")
                seen += await read_until(ws, lambda m: is_status("paused")(m) or is_end(m))
            await drop(ws, abruptly=rng.random() < 0.5)
        is_paused = seen[-1]["type"] == "status"
        ids.append(seen[0]["request_id"])
        if rng.random() < 0.3:
            num_paused_left += is_paused
            continue
        num_resumed += 1
        from_start = rng.random() < 0.2
        async with open_ws(server) as ws:
            await send(ws, type="resume", request_id=ids[-1], last_index=-1 if from_start else seen[-1]["index"])
            if is_paused:
                await send(ws, type="control", action="resume")
            rest = await read_until(ws, is_end) if from_start or not is_end(seen[-1]) else []
        text = tokens(rest) if from_start else tokens(seen) + tokens(rest)
        assert text == tokens(reference), (ids[-1], stop_after, is_paused, from_start)
        assert (rest or seen)[-1]["generated_text"] == reference[-1]["generated_text"]
    assert num_resumed > 100 and num_paused_left > 5  # both paths were taken
    for request_id in ids:
        await forgotten(server, request_id)
    stats = server.wait_idle()
    assert (stats.num_running, stats.num_waiting, stats.num_paused) == (0, 0, 0)
    assert stats.kv_used_bytes == 0 and stats.kv_used_tokens == 0
    deps = server.state["deps"]
    assert server.call(len, deps.resumable) == 0
    if deps.memory is not None:
        assert server.call(lambda: deps.memory.used) == 0  # no conversation holds its lease
