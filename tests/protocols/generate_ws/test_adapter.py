"""/generate over a real loopback socket (uvicorn + the websockets client), with the in-process
engine client over a ``FakeRunner`` (the real engine code, no model)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from rill.feedback import FeedbackStore
from rill.frontend.ratelimit import RateLimits
from rill.testing.fake_client import LOADING_PERCENT
from rill.testing.fake_runner import StepGate
from tests.helpers import limit, wait_until
from tests.helpers import recv_json as recv

from .conftest import MAX_CONTEXT


async def send(ws: Any, **msg: Any) -> None:
    await ws.send(json.dumps(msg))


async def until(ws: Any, pred: Any) -> list[dict]:
    """Messages up to and including the first one matching ``pred``."""
    got = []
    while True:
        msg = await recv(ws)
        got.append(msg)
        if pred(msg):
            return got


def is_type(kind: str) -> Any:
    return lambda msg: msg["type"] == kind


def is_status(op: str) -> Any:
    return lambda msg: msg["type"] == "status" and msg["operation"] == op


async def eventually(cond: Any) -> None:
    await wait_until(cond, attempts=500, interval_s=0.005)  # a server-side effect, not a timing assertion


def joined(msgs: list[dict]) -> str:
    """The token texts of ``msgs``, joined."""
    return "".join(m["token"] for m in msgs if m["type"] == "token")


def num_prompt_tokens(live: Any, prompt: str) -> int:
    """Tokens of ``prompt`` as the engine counts them."""
    return len(live.engine.tokenizer.encode(prompt))


def fail_after(live: Any, prompt: str, num_tokens: int) -> None:
    """Make the engine step fail once ``prompt`` has ``num_tokens`` tokens (a model error)."""
    num_prompt = num_prompt_tokens(live, prompt)

    def script(tokens: Any) -> None:
        if len(tokens) >= num_prompt + num_tokens:
            raise RuntimeError("cuda kernel 0xdead failed")

    live.engine.runner.script = script


def is_greedy(live: Any, prompt: str, token_ids: list[int], index: int) -> bool:
    """Whether ``token_ids[index]`` is the fake model's most likely token after what precedes it."""
    history = live.engine.tokenizer.encode(prompt) + token_ids[:index]
    return token_ids[index] == int(np.argmax(live.engine.runner.logits_after(history)))


async def test_basic_flow(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        config = {
            "type": "config",
            "prompt": "Write a story",
            "parameters": {"max_tokens": 5, "temperature": 0.7},
            "options": {"stream": True},
        }
        await ws.send(json.dumps(config).encode())  # a binary frame with the JSON works too
        init = await recv(ws)
        assert init["type"] == "init" and init["model"] == "fake-model"
        assert init["model_info"]["max_tokens"] == MAX_CONTEXT
        msgs = await until(ws, is_type("completion"))
        tokens = [x for x in msgs if x["type"] == "token"]
        assert len(tokens) == 5 and all(len(t["token"]) == 1 for t in tokens)  # one character per fake token
        assert tokens[-1]["finished"] is True and tokens[-1]["finish_reason"] == "length"
        assert all(not t["finished"] for t in tokens[:-1])
        completion = msgs[-1]
        assert completion["generated_text"] == joined(msgs) == tokens[-1]["generated_text"]
        assert completion["finish_reason"] == "length"
        num_prompt = num_prompt_tokens(live, "Write a story")
        assert completion["usage"] == {
            "prompt_tokens": num_prompt,
            "completion_tokens": 5,
            "total_tokens": num_prompt + 5,
        }
        assert live.requests[0].protocol == "generate_ws"


async def test_first_message_must_be_config_and_socket_stays_open(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="control", action="stop")
        err = await recv(ws)
        assert err["type"] == "error" and err["error"] == "invalid_request" and err["recoverable"] is True
        await ws.send("not json")
        assert (await recv(ws))["error"] == "invalid_request"
        await ws.send(b"\xff\xfe binary junk")
        assert (await recv(ws))["error"] == "invalid_request"
        await send(ws, type="config", prompt="x", parameters={"max_tokens": 1})
        assert [m["type"] for m in await until(ws, is_type("completion"))] == ["init", "token", "completion"]


async def test_error_and_recovery_flow(make_server: Any) -> None:
    live = await make_server()
    fail_after(live, "fail: story", 3)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="fail: story", parameters={"max_tokens": 200})
        msgs = await until(ws, is_type("error"))
        err = msgs[-1]
        assert msgs[0]["type"] == "init" and err["request_id"] == msgs[0]["request_id"]
        assert err["error"] == "internal_error" and err["recoverable"] is True and err["recovery_action"] == "retry"
        assert err["generated_text"] == joined(msgs) and len(joined(msgs)) == 3 and "0xdead" not in err["message"]
        live.engine.runner.script = None
        await send(ws, type="config", prompt="story", parameters={"max_tokens": 3})
        msgs = await until(ws, is_type("completion"))
        assert msgs[0]["type"] == "init" and msgs[0]["request_id"] != err["request_id"]
        assert msgs[-1]["generated_text"] == joined(msgs) and len(joined(msgs)) == 3


async def test_memory_pressure_then_retry(make_server: Any) -> None:
    live = await make_server(num_rows=2)
    async with connect(live.ws) as ws:
        # More beams than the KV cache has rows: the request can never fit.
        await send(ws, type="config", prompt="mem: big", parameters={"max_tokens": 200, "num_beams": 4})
        err = await recv(ws)
        assert err == {
            "type": "error",
            "error": "memory_pressure",
            "recoverable": True,
            "recovery_action": "retry",
            "request_id": err["request_id"],
            "message": err["message"],
        }
        await send(ws, type="config", prompt="small", parameters={"max_tokens": 2})
        assert (await until(ws, is_type("completion")))[-1]["finish_reason"] == "length"


async def test_midstream_control_flow(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 10000, "temperature": 0.7})
        await until(ws, is_type("token"))
        await send(ws, type="control", action="modify", parameters={"temperature": 0.9})
        msgs = await until(ws, is_status("modified"))
        assert msgs[-1]["parameters"]["temperature"] == 0.9
        await send(ws, type="control", action="stop")
        msgs = await until(ws, is_type("completion"))
        assert msgs[-1]["finish_reason"] == "cancelled"
        assert len(msgs[-1]["generated_text"]) >= 1
    await eventually(live.is_idle)
    assert live.num_cancelled() == 1


async def test_no_token_between_pause_and_resume(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 10000})
        first = await until(ws, is_type("token"))
        await send(ws, type="control", action="pause")
        before = await until(ws, is_status("paused"))
        last_text = [m for m in first + before if m["type"] == "token"][-1]["generated_text"]
        done = live.engine.runner.num_tokens_fed
        await send(ws, type="control", action="pause")
        assert (await recv(ws))["error"] == "invalid_request"  # already paused: nothing in between
        assert live.engine.runner.num_tokens_fed == done  # the engine did no work while paused
        await send(ws, type="control", action="resume")
        between = await until(ws, is_status("resumed"))
        assert [m["type"] for m in between] == ["status"]
        after = await until(ws, is_type("token"))
        assert after[0]["generated_text"].startswith(last_text)  # continues where it stopped
        await send(ws, type="control", action="stop")
        await until(ws, is_type("completion"))


async def test_stop_while_paused(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 10000})
        await until(ws, is_type("token"))
        await send(ws, type="control", action="pause")
        paused = (await until(ws, is_status("paused")))[-1]
        assert paused["message"] == "generation paused"
        await send(ws, type="control", action="stop")
        msgs = await until(ws, is_type("completion"))
        assert [m["type"] for m in msgs] == ["completion"] and msgs[-1]["finish_reason"] == "cancelled"


async def test_invalid_modify_changes_nothing(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 10000, "temperature": 0.5})
        await until(ws, is_type("token"))
        await send(ws, type="control", action="modify", parameters={"temperature": -1})
        msgs = await until(ws, is_type("error"))
        assert msgs[-1]["field"] == "parameters.temperature" and msgs[-1]["error"] == "invalid_request"
        await until(ws, is_type("token"))  # still generating
        await send(ws, type="control", action="modify", parameters={"top_p": 0.9})
        in_force = (await until(ws, is_status("modified")))[-1]["parameters"]
        assert in_force["temperature"] == 0.5 and in_force["top_p"] == 0.9
        await send(ws, type="control", action="stop")
        await until(ws, is_type("completion"))


async def test_modify_temperature_is_in_force_from_the_next_token(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(
            ws,
            type="config",
            prompt="p",
            parameters={"max_tokens": 10000, "temperature": 0.5},
            options={"include_token_ids": True},
        )
        msgs = await until(ws, is_type("token"))
        await send(ws, type="control", action="modify", parameters={"temperature": 0})
        msgs += await until(ws, is_status("modified"))
        for _ in range(8):
            msgs += await until(ws, is_type("token"))
        ids = [m["token_id"] for m in msgs if m["type"] == "token"]
        # The tokens after the status are the fake model's most likely ones (temperature 0 in force).
        num_after = sum(
            1 for m in msgs[msgs.index(next(m for m in msgs if m["type"] == "status")) :] if m["type"] == "token"
        )
        assert num_after >= 8
        assert all(is_greedy(live, "p", ids, i) for i in range(len(ids) - num_after, len(ids)))
        await send(ws, type="control", action="stop")
        await until(ws, is_type("completion"))


async def test_regenerate_restarts_with_fresh_init(make_server: Any) -> None:
    # One engine step per gate.allow(): the first run (6 tokens) cannot end before the
    # regenerate reaches the engine, however slowly the loop turns.
    live = await make_server()
    gate = live.engine.runner.gate = StepGate()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 6, "temperature": 0})
        init = await recv(ws)
        first: list[dict] = []
        for _ in range(3):
            gate.allow()
            first += await until(ws, is_type("token"))
        await send(ws, type="control", action="regenerate")
        # The step the engine waits in ends (a fourth token), the regenerate applies, and the
        # next step (which reports it) runs.
        gate.allow(2)
        msgs = await until(ws, is_status("regenerating"))
        assert "completion" not in [m["type"] for m in msgs]
        fresh = await recv(ws)
        assert fresh["type"] == "init" and fresh["request_id"] == init["request_id"]
        gate.set()
        msgs = await until(ws, is_type("completion"))
        tokens = [m for m in msgs if m["type"] == "token"]
        assert tokens[0]["generated_text"] == tokens[0]["token"]  # the new run starts from nothing
        assert len(tokens) == 6 and msgs[-1]["generated_text"] == joined(msgs)
        assert msgs[-1]["generated_text"].startswith(joined(first))  # greedy again: the same first tokens


async def test_disconnect_mid_stream_aborts(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 10000})
        await until(ws, is_type("token"))
    await eventually(live.is_idle)
    assert live.num_cancelled() == 1


async def test_control_when_idle_is_an_error_not_a_close(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 1})
        await until(ws, is_type("completion"))
        for action in ("stop", "pause", "resume", "regenerate"):
            await send(ws, type="control", action=action)
            err = await recv(ws)
            assert err["error"] == "invalid_request" and "none is running" in err["message"]
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 1})
        await until(ws, is_type("completion"))


async def test_options_echo_ids_logprobs_timing_and_no_stream(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(
            ws,
            type="config",
            prompt="Hi",
            parameters={"max_tokens": 2},
            options={"echo_prompt": True, "include_token_ids": True, "include_logprobs": True, "include_timing": True},
        )
        msgs = await until(ws, is_type("completion"))
        tok = msgs[1]
        assert tok["generated_text"] == "Hi" + tok["token"]
        assert tok["token_id"] == live.engine.tokenizer.encode(tok["token"], add_special_tokens=False)[0]
        chosen = tok["logprobs"][0]
        assert (chosen["token"], chosen["token_id"]) == (tok["token"], tok["token_id"]) and chosen["logprob"] <= 0
        assert all(set(entry) == {"token", "logprob", "token_id"} for entry in tok["logprobs"])
        assert set(tok["timing"]) == {"token_ms", "total_ms"}
        assert msgs[-1]["generated_text"] == "Hi" + joined(msgs)
        assert set(msgs[-1]["timing"]) == {"first_token_ms", "total_ms"}
        await send(ws, type="config", prompt="Hi", parameters={"max_tokens": 3}, options={"stream": False})
        assert [m["type"] for m in await until(ws, is_type("completion"))] == ["init", "completion"]


async def test_context_length_exceeded(make_server: Any) -> None:
    live = await make_server(max_len=64)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="x" * 100)
        err = await recv(ws)
        assert err["error"] == "context_length_exceeded" and err["recoverable"] is True
        assert (err["prompt_tokens"], err["max_context_tokens"]) == (101, 64)  # <s> and one token a character


async def test_unexpected_exception_is_generic_and_closes(make_server: Any, monkeypatch: Any) -> None:
    live = await make_server()

    async def boom(request: Any) -> Any:
        raise RuntimeError("secret internal detail /etc/passwd")

    monkeypatch.setattr(live.client, "generate", boom)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="boom: now")
        err = await recv(ws)
        assert err["error"] == "internal_error" and err["recoverable"] is False
        assert "passwd" not in err["message"]
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
        assert info.value.rcvd is not None and info.value.rcvd.code == 1011


def limit_to_one_request(live: Any, window_s: float = 2.5) -> None:
    """One request per principal per ``window_s`` on a clock that stands still."""
    limit(live.client, RateLimits(requests=1, window_s=window_s), clock=lambda: 1000.0)


async def test_rate_limited_with_retry_hint(make_server: Any) -> None:
    live = await make_server()
    limit_to_one_request(live)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 2})
        assert (await until(ws, is_type("completion")))[-1]["usage"]["completion_tokens"] == 2
        await send(ws, type="config", prompt="limited: p", parameters={"max_tokens": 8})
        err = await recv(ws)
        assert err["error"] == "rate_limited" and err["recoverable"] is True and err["retry_after_seconds"] == 2.5
        limit(live.client, RateLimits())
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 2})  # socket still usable
        assert (await until(ws, is_type("completion")))[-1]["usage"]["completion_tokens"] == 2


async def test_principal_is_the_key_digest_on_every_route(make_server: Any) -> None:
    live = await make_server(api_key=["k1", "k2"])
    async with connect(live.ws + "?api_key=k1") as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 1})
        await until(ws, is_type("completion"))
    async with connect(live.ws, additional_headers={"Authorization": "Bearer k1"}) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 1})
        await until(ws, is_type("completion"))
    async with httpx.AsyncClient(base_url=live.url, headers={"Authorization": "Bearer k2"}) as http:
        assert (await http.post("/v1/generate", json={"prompt": "p", "max_tokens": 1})).status_code == 200
    principals = [r.principal for r in live.requests]
    assert principals[0] == principals[1] != principals[2]
    assert all(p.startswith("key:") and "k1" not in p and "k2" not in p for p in principals)


async def test_principal_without_keys_is_the_peer_address(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws, additional_headers={"Authorization": "Bearer made-up"}) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 1})
        await until(ws, is_type("completion"))
    assert live.requests[0].principal == "peer:127.0.0.1"  # an unchecked key names nobody


async def test_request_timeout_carries_partial_text(make_server: Any) -> None:
    live = await make_server(request_timeout_s=0.3, step_s=0.05)  # 100 tokens would take 5 s
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 100})
        msgs = await until(ws, is_type("error"))
        err = msgs[-1]
        assert err["error"] == "timeout" and err["recoverable"] is True and err["generated_text"] == joined(msgs)
    await eventually(live.is_idle)


async def test_model_loading_status_then_generation(make_server: Any) -> None:
    loading = threading.Event()
    live = await make_server(loading=loading)
    await eventually(lambda: live.client.load_progress()[0] == LOADING_PERCENT)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 2})
        status = await recv(ws)
        assert status["type"] == "status" and status["operation"] == "model_loading"
        assert status["progress"] == LOADING_PERCENT and status["eta_seconds"] >= 0
        loading.set()
        msgs = await until(ws, is_type("completion"))
        assert [m["type"] for m in msgs if m["type"] != "status"] == ["init", "token", "token", "completion"]


async def test_model_loading_error(make_server: Any) -> None:
    loading = threading.Event()
    live = await make_server(loading=loading, load_error=RuntimeError("no config.json in /models/secret"))
    loading.set()
    await eventually(lambda: live.client.load_error is not None)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p")
        err = await recv(ws)
        assert err["error"] == "model_loading_error" and err["recoverable"] is False and "secret" not in err["message"]


class EngineCrash(BaseException):
    """Not an ``Exception``: the engine loop itself dies of it (as of a bug outside a step's guard)."""


async def test_a_dead_engine_is_an_error_not_a_model_still_loading(make_server: Any) -> None:
    # Was a loop of "model_loading" statuses, sent as fast as the socket took them: a dead
    # engine is not ready, has no load error, and wait_ready() returns at once.
    live = await make_server()

    def crash(tokens: Any) -> None:
        raise EngineCrash

    live.engine.runner.script = crash
    for _ in range(2):  # the request the engine died in, then a new one
        async with connect(live.ws) as ws:
            await send(ws, type="config", prompt="p", parameters={"max_tokens": 3})
            msgs: list[dict] = []
            while not msgs or msgs[-1]["type"] != "error":
                msgs.append(await recv(ws))
                assert msgs[-1].get("operation") != "model_loading"
        assert msgs[-1]["error"] == "internal_error" and msgs[-1]["recoverable"] is False


async def test_feedback_is_stored_before_the_ack(make_server: Any, tmp_path: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 2})
        done = await until(ws, is_type("completion"))
        await send(ws, type="feedback", rating=1, text="Great response!", position=1)
        ack = await recv(ws)
        assert ack["type"] == "status" and ack["operation"] == "feedback_received"
        records = list(FeedbackStore(tmp_path / "data").records())  # a second reader sees the committed row
        assert len(records) == 1 and records[0]["id"] == ack["feedback_id"]
        assert records[0]["rating"] == 1.0 and records[0]["text"] == "Great response!"
        assert records[0]["request_id"] == done[0]["request_id"]
        assert records[0]["generated_text"] == done[-1]["generated_text"] == joined(done) and len(joined(done)) == 2
        await send(ws, type="feedback", rating=5)
        assert (await recv(ws))["field"] == "rating"


async def test_api_key_required_on_socket(make_server: Any) -> None:
    live = await make_server(api_key=["secret"])
    with pytest.raises(InvalidStatus) as info:  # refused at the handshake (rill.middleware)
        async with connect(live.ws + "?api_key=wrong"):
            pass
    assert info.value.response.status_code == 401
    async with connect(live.ws + "?api_key=secret") as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 1})
        await until(ws, is_type("completion"))


async def test_rest_json(make_server: Any) -> None:
    live = await make_server(api_key=["secret"], num_rows=2)
    async with httpx.AsyncClient(base_url=live.url) as http:
        res = await http.post("/v1/generate", json={"prompt": "Write", "max_tokens": 3, "temperature": 0.7})
        assert res.status_code == 401
        headers = {"Authorization": "Bearer secret"}
        res = await http.post(
            "/v1/generate", json={"prompt": "Write", "max_tokens": 3, "stream": False}, headers=headers
        )
        body = res.json()
        assert res.status_code == 200
        assert body["id"].startswith("gen_") and body["model"] == "fake-model"
        assert len(body["generated_text"]) == 3 and body["finish_reason"] == "length"
        num_prompt = num_prompt_tokens(live, "Write")
        assert body["usage"] == {"prompt_tokens": num_prompt, "completion_tokens": 3, "total_tokens": num_prompt + 3}
        res = await http.post("/v1/generate", json={"prompt": "x", "temperature": -3}, headers=headers)
        assert res.status_code == 400 and res.json()["field"] == "parameters.temperature"
        res = await http.post("/v1/generate", content=b"{", headers=headers)
        assert res.status_code == 400 and res.json()["error"] == "invalid_request"
        res = await http.post("/v1/generate", json={"prompt": "mem: x", "num_beams": 4}, headers=headers)
        assert res.status_code == 503 and res.json()["error"] == "memory_pressure"


async def test_rest_rate_limited_has_retry_after(make_server: Any) -> None:
    live = await make_server(api_key=["k"])
    limit_to_one_request(live)
    headers = {"Authorization": "Bearer k"}
    async with httpx.AsyncClient(base_url=live.url, headers=headers) as http:
        assert (await http.post("/v1/generate", json={"prompt": "p", "max_tokens": 1})).status_code == 200
        res = await http.post("/v1/generate", json={"prompt": "limited: p", "max_tokens": 8})
        assert res.status_code == 429 and res.json()["error"] == "rate_limited"
        assert res.headers["Retry-After"] == "3"  # rounded up, as on /v1/chat/completions


async def test_rest_sse_carries_the_socket_messages(make_server: Any) -> None:
    live = await make_server()
    async with httpx.AsyncClient(base_url=live.url) as http:
        async with http.stream(
            "POST", "/v1/generate", json={"prompt": "Write", "max_tokens": 3, "stream": True}
        ) as res:
            assert res.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[6:]) async for line in res.aiter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["init", "token", "token", "token", "completion"]
    assert events[-1]["generated_text"] == joined(events) and len(joined(events)) == 3


async def test_rest_sse_disconnect_aborts(make_server: Any) -> None:
    live = await make_server()
    async with httpx.AsyncClient(base_url=live.url) as http:
        async with http.stream(
            "POST", "/v1/generate", json={"prompt": "W", "max_tokens": 100000, "stream": True}
        ) as res:
            async for line in res.aiter_lines():
                if '"token"' in line:
                    break
    await eventually(live.is_idle)
    assert live.num_cancelled() == 1


async def test_rest_json_client_gone_aborts(make_server: Any) -> None:
    live = await make_server()
    async with httpx.AsyncClient(base_url=live.url) as http:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            await http.post("/v1/generate", json={"prompt": "W", "max_tokens": 1000000}, timeout=0.3)
    await eventually(live.is_idle)
    assert live.num_cancelled() == 1


async def test_rest_sse_keepalive_while_waiting_for_the_model(make_server: Any) -> None:
    loading = threading.Event()
    live = await make_server(loading=loading, sse_keepalive_s=0.05)
    async with httpx.AsyncClient(base_url=live.url) as http:
        async with http.stream("POST", "/v1/generate", json={"prompt": "W", "max_tokens": 2, "stream": True}) as res:
            lines = res.aiter_lines()
            seen: list[str] = []
            async for line in lines:
                seen.append(line)
                if line.startswith(":"):
                    break  # a keep-alive comment arrived while nothing else happened
            loading.set()
            events = [json.loads(x[6:]) for x in seen if x.startswith("data: ")]
            events += [json.loads(x[6:]) async for x in lines if x.startswith("data: ")]
    assert {e["operation"] for e in events if e["type"] == "status"} <= {"model_loading"}
    assert [e["type"] for e in events if e["type"] != "status"] == ["init", "token", "token", "completion"]


# -- issue 12 item 2: feedback cannot amplify disk use ---------------------------------------------------


async def test_feedback_on_a_refused_prompt_writes_nothing(make_server: Any, tmp_path: Any) -> None:
    # Regression: a 3.9 MB prompt refused as too long, then 100 feedback messages, grew the
    # store by 390 MB (each row stored the prompt). A refused generation has nothing to rate.
    from rill.feedback import DB_NAME

    live = await make_server()
    async with connect(live.ws, max_size=None) as ws:
        await send(ws, type="config", prompt="x" * 3_900_000)
        refused = await recv(ws)  # over the admission's prompt size limit
        assert refused["type"] == "error" and refused["error"] == "invalid_request" and "prompt" in refused["message"]
        for _ in range(100):
            await send(ws, type="feedback", rating=1, text="y" * 60000)
        replies = [await recv(ws) for _ in range(100)]
    assert {(r["type"], r["error"], r["field"]) for r in replies} == {("error", "invalid_request", "request_id")}
    path = tmp_path / "data" / DB_NAME
    assert not path.exists() or list(FeedbackStore(tmp_path / "data").records()) == []


async def test_feedback_messages_are_capped_per_generation_and_per_connection(make_server: Any, tmp_path: Any) -> None:
    live = await make_server(feedback_max_per_generation=3, feedback_max_per_connection=5)
    async with connect(live.ws) as ws:
        for expected in (["feedback_received"] * 3 + ["rate_limited"], ["feedback_received"] * 2 + ["rate_limited"]):
            await send(ws, type="config", prompt="p", parameters={"max_tokens": 1})
            await until(ws, is_type("completion"))
            got = []
            for _ in expected:
                await send(ws, type="feedback", rating=1)
                reply = await recv(ws)
                got.append(reply.get("operation") or reply["error"])
                if reply["type"] == "error":
                    assert reply["recoverable"] is True and "the most allowed" in reply["message"]
            assert got == expected
    assert len(list(FeedbackStore(tmp_path / "data").records())) == 5


async def test_stored_feedback_text_is_cut_and_a_full_store_refuses(make_server: Any, tmp_path: Any) -> None:
    live = await make_server(feedback_max_text_bytes=8)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="a prompt longer than eight bytes", parameters={"max_tokens": 1})
        await until(ws, is_type("completion"))
        await send(ws, type="feedback", rating=1, text="é" * 100)
        assert (await recv(ws))["operation"] == "feedback_received"
    [record] = FeedbackStore(tmp_path / "data").records()
    assert (record["prompt"], record["text"], record["truncated"]) == ("a prompt", "éééé", ["text", "prompt"])
    full = await make_server(feedback_max_store_bytes="4KiB", data_dir=str(tmp_path / "full"))
    async with connect(full.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 1})
        await until(ws, is_type("completion"))
        await send(ws, type="feedback", rating=1)
        error = await recv(ws)
        assert error["type"] == "error" and "feedback store is full" in error["message"] and error["recoverable"]


async def test_one_client_over_its_feedback_quota_leaves_room_for_others(make_server: Any, tmp_path: Any) -> None:
    # Issue 31 finding 6: the store's cap was shared, so one client could fill it and
    # refuse everyone's feedback. Without keys the principal is the client address.
    live = await make_server(feedback_max_bytes_per_principal="1500")
    port = int(live.ws.rsplit(":", 1)[1].split("/")[0])

    async def rate(source: str, times: int) -> list[dict]:
        async with connect(live.ws, host="127.0.0.1", port=port, local_addr=(source, 0)) as ws:
            await send(ws, type="config", prompt="a prompt", parameters={"max_tokens": 1})
            await until(ws, is_type("completion"))
            replies = []
            for _ in range(times):
                await send(ws, type="feedback", rating=1, text="x" * 200)
                replies.append(await recv(ws))
            return replies

    greedy = await rate("127.0.0.2", 8)
    outcomes = [r.get("operation") or r["error"] for r in greedy]
    # The spec's code for a store that cannot take the record (StorageFull) is internal_error.
    assert "feedback_received" in outcomes and outcomes[-1] == "internal_error", outcomes
    refusal = greedy[-1]
    assert "feedback-max-bytes-per-principal" in refusal["message"] and refusal["recoverable"] is True
    [other] = await rate("127.0.0.3", 1)
    assert other["type"] == "status" and other["operation"] == "feedback_received"
    records = list(FeedbackStore(tmp_path / "data").records())
    assert len(records) == outcomes.count("feedback_received") + 1
    assert {r["prompt"] for r in records} == {"a prompt"}


async def test_hostile_frames_get_invalid_request_and_the_socket_stays_usable(make_server: Any) -> None:
    # Issue 12 item 5: deep nesting raised RecursionError out of the handler (an ASGI
    # traceback and a 1011 close); bad UTF-8 in a binary frame was handled by luck.
    live = await make_server()
    async with connect(live.ws) as ws:
        for frame in (
            '{"type": "config", "prompt": "p", "x": ' + "[" * 5000 + "]" * 5000 + "}",
            b'{"type": "config", "prompt": "\xff"}',
            '{"type":"config","prompt":"\\ud800"}',
        ):
            await ws.send(frame)
            err = await recv(ws)
            assert err["type"] == "error" and err["error"] == "invalid_request" and err["recoverable"] is True
        await send(ws, type="config", prompt="Write", parameters={"max_tokens": 2})
        done = await until(ws, is_type("completion"))
        assert done[-1]["generated_text"] == joined(done) and len(joined(done)) == 2


async def test_rest_hostile_body_is_a_400(make_server: Any) -> None:
    live = await make_server()
    async with httpx.AsyncClient(base_url=live.url) as http:
        res = await http.post("/v1/generate", content=b'{"prompt": "p", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}")
        assert res.status_code == 400 and res.json()["error"] == "invalid_request"


async def test_a_session_bug_is_the_generic_error_frame_not_a_dead_handler(make_server: Any, monkeypatch: Any) -> None:
    from rill.protocols.generate_ws import session as s

    def broken(self: Any, msg: Any, now: float) -> Any:
        raise KeyError("secret internals")

    monkeypatch.setattr(s.GenerateSession, "receive", broken)
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="Write")
        err = await recv(ws)
        assert err["error"] == "internal_error" and "secret" not in err["message"]
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
        assert info.value.rcvd is not None and info.value.rcvd.code == 1011


async def test_remembered_generations_are_charged_and_the_oldest_forgotten_when_memory_is_short(
    make_server: Any,
) -> None:
    """Issue 31: the generations a connection remembers for feedback count against the
    session-memory budget; past the principal's share the oldest is forgotten (feedback on it
    is refused as for an unknown id), and everything is given back when the socket closes."""
    live = await make_server()
    budget = live.deps.memory
    prompt = "x" * 1500
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt=prompt, parameters={"max_tokens": 2})
        first = (await until(ws, is_type("completion")))[-1]["request_id"]
        await send(ws, type="feedback", rating=1)  # makes the adapter charge what the session holds
        assert (await recv(ws))["operation"] == "feedback_received"
        one = budget.used
        assert one > len(prompt)
        budget.per_principal = one + one // 2  # room for one remembered generation, not two
        await send(ws, type="config", prompt=prompt, parameters={"max_tokens": 2})
        second = (await until(ws, is_type("completion")))[-1]["request_id"]
        await send(ws, type="feedback", rating=1, request_id=second)
        assert (await recv(ws))["operation"] == "feedback_received"
        assert budget.used <= budget.per_principal
        await send(ws, type="feedback", rating=1, request_id=first)
        refused = await recv(ws)
        assert refused["type"] == "error" and refused["field"] == "request_id"
    await eventually(lambda: budget.used == 0)


async def test_a_lagging_reader_still_gets_one_token_message_per_token(make_server: Any) -> None:
    """The request stream folds outputs together while its reader is behind (a slow client):
    the session still sends one ``token`` per token, and the completion counts them all."""
    from rill.protocols.generate_ws import codec
    from rill.protocols.generate_ws import messages as m
    from rill.protocols.generate_ws.conversation import ClientEnd, Conversation
    from rill.protocols.generate_ws.service import GenerateService

    live = await make_server()
    sent: list[Any] = []
    release = asyncio.Event()

    async def write(msg: Any) -> None:
        sent.append(msg)
        if isinstance(msg, m.Token):
            await release.wait()  # the first token's write blocks: the engine runs on meanwhile

    wire = Conversation(GenerateService(live.deps), ClientEnd(write), None, "peer:test")
    folded: list[int] = []
    on_output = wire.session.on_output

    def counting(key: Any, out: Any, now: float) -> Any:
        folded.append(len(out.token_ids))
        return on_output(key, out, now)

    wire.session.on_output = counting  # type: ignore[method-assign]
    await wire.receive(codec.decode(json.dumps({"type": "config", "prompt": "Once", "parameters": {"max_tokens": 20}})))
    await eventually(lambda: any(isinstance(x, m.Token) for x in sent) and live.is_idle())
    release.set()
    await asyncio.wait_for(wire.driver.wait(), 30)
    await wire.shutdown()
    tokens = [x for x in sent if isinstance(x, m.Token)]
    assert isinstance(sent[-1], m.Completion) and sent[-1].usage.completion_tokens == 20
    assert len(tokens) == 20 and "".join(t.token for t in tokens) == sent[-1].generated_text
    assert max(folded) > 1  # the stream did fold outputs: the case under test happened


async def test_refusals_are_counted_in_the_rejection_metric(make_server: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    live = await make_server()
    limit_to_one_request(live)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 1})
        await until(ws, is_type("completion"))
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 1})
        assert (await recv(ws))["error"] == "rate_limited"
    async with httpx.AsyncClient(base_url=live.url) as http:
        text = (await http.get("/metrics")).text
    counted = {
        s.labels["code"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "rill_requests_rejected_total" and s.labels["protocol"] == "generate_ws"
    }
    assert counted == {"rate_limited": 1.0}


async def test_a_folded_output_reaches_the_session_whole(make_server: Any) -> None:
    """A folded output that ends resumed carries the tokens made after the resume: the
    ``resumed`` status goes before all of them, which the session can only do when the driver
    hands the output over whole (not cut into one output per token, events on the last)."""
    from rill.protocols._shared.driver import Driver
    from rill.protocols._shared.session import Started
    from rill.protocols.generate_ws import codec
    from rill.protocols.generate_ws import messages as m
    from rill.protocols.generate_ws.service import GenerateService
    from rill.types import RequestEvent, RequestOutput, Usage

    live = await make_server()
    sent: list[Any] = []

    class Peer:
        async def send(self, message: Any) -> None:
            sent.append(message)

        async def close(self, code: Any, reason: str) -> None:
            pass

        async def perform(self, action: Any) -> None:
            pass

    service = GenerateService(live.deps)
    session = service.new_session()
    session.receive(codec.decode('{"type": "config", "prompt": "p"}'), 1.0)
    assert session.gen is not None
    session.on_started(Started(None, [1], session.gen.sampling))
    session.receive(codec.decode('{"type": "control", "action": "pause"}'), 1.1)
    session.receive(codec.decode('{"type": "control", "action": "resume"}'), 1.2)
    driver = Driver(session, Peer(), live.client, protocol="generate_ws", principal="peer:test")
    folded = RequestOutput(
        request_id=session.gen.request_id,
        text="xy",
        token_ids=[5, 6],
        token_texts=["x", "y"],
        events=[RequestEvent.RESUMED],
        usage=Usage(prompt_tokens=1, completion_tokens=2),
    )
    await driver._deliver(None, folded)
    assert [(type(x).__name__, getattr(x, "operation", None) or getattr(x, "token", None)) for x in sent] == [
        ("Status", "resumed"),
        ("Token", "x"),
        ("Token", "y"),
    ]
    assert all(isinstance(x, (m.Status, m.Token)) for x in sent)
