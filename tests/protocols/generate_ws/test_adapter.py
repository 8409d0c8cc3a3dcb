"""/generate over a real loopback socket (uvicorn + the websockets client) with a FakeClient."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from rill.feedback import FeedbackStore
from rill.types import RequestEvent
from tests.helpers import recv_json as recv
from tests.helpers import wait_until

from .fakes import FakeClient


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


async def test_basic_flow(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        config = {"type": "config", "prompt": "Write a story", "parameters": {"max_tokens": 5, "temperature": 0.7},
                  "options": {"stream": True}}
        await ws.send(json.dumps(config).encode())  # a binary frame with the JSON works too
        init = await recv(ws)
        assert init["type"] == "init" and init["model"] == "fake-model" and init["model_info"]["max_tokens"] == 64
        msgs = await until(ws, is_type("completion"))
        tokens = [x for x in msgs if x["type"] == "token"]
        assert [t["token"] for t in tokens] == [" w0", " w1", " w2", " w3", " w4"]
        assert tokens[-1]["finished"] is True and tokens[-1]["finish_reason"] == "length"
        assert all(not t["finished"] for t in tokens[:-1])
        completion = msgs[-1]
        assert completion["generated_text"] == " w0 w1 w2 w3 w4" == tokens[-1]["generated_text"]
        assert completion["finish_reason"] == "length"
        assert completion["usage"] == {"prompt_tokens": 13, "completion_tokens": 5, "total_tokens": 18}
        assert live.client.requests[0].protocol == "generate_ws"


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
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="fail: story", parameters={"max_tokens": 200})
        msgs = await until(ws, is_type("error"))
        err = msgs[-1]
        assert msgs[0]["type"] == "init" and err["request_id"] == msgs[0]["request_id"]
        assert err["error"] == "internal_error" and err["recoverable"] is True and err["recovery_action"] == "retry"
        assert err["generated_text"] == " w0 w1 w2" and "0xdead" not in err["message"]
        await send(ws, type="config", prompt="story", parameters={"max_tokens": 3})
        msgs = await until(ws, is_type("completion"))
        assert msgs[0]["type"] == "init" and msgs[0]["request_id"] != err["request_id"]
        assert msgs[-1]["generated_text"] == " w0 w1 w2"


async def test_memory_pressure_then_retry(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="mem: big", parameters={"max_tokens": 200})
        err = await recv(ws)
        assert err == {"type": "error", "error": "memory_pressure", "recoverable": True, "recovery_action": "retry",
                       "request_id": err["request_id"], "message": err["message"]}
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
        assert msgs[-1]["generated_text"].startswith(" w0 w1")
        assert live.client.aborted == [live.client.requests[0].request_id]


async def test_no_token_between_pause_and_resume(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 10000})
        first = await until(ws, is_type("token"))
        await send(ws, type="control", action="pause")
        before = await until(ws, is_status("paused"))
        last_text = [m for m in first + before if m["type"] == "token"][-1]["generated_text"]
        req = next(iter(live.client.live.values()))
        done = req.num_generated
        await send(ws, type="control", action="pause")
        assert (await recv(ws))["error"] == "invalid_request"  # already paused: nothing in between
        assert req.num_generated == done  # the engine did no work while paused
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
        assert next(iter(live.client.live.values())).sampling.temperature == 0.5
        await until(ws, is_type("token"))  # still generating
        await send(ws, type="control", action="stop")
        await until(ws, is_type("completion"))


async def test_modify_temperature_is_in_force_from_the_next_token(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 10000, "temperature": 0.5},
                   options={"include_token_ids": True})
        await until(ws, is_type("token"))
        await send(ws, type="control", action="modify", parameters={"temperature": 0})
        await until(ws, is_status("modified"))
        after = await until(ws, is_type("token"))
        assert after[-1]["token_id"] >= 500  # the fake's "greedy" ids
        await send(ws, type="control", action="stop")
        await until(ws, is_type("completion"))


async def test_regenerate_restarts_with_fresh_init(make_server: Any) -> None:
    # One token per gate.set(): the first run (6 tokens) cannot end before the regenerate
    # reaches the engine, however slowly the loop turns (a free-running fake raced it).
    client = FakeClient()
    client.gate = asyncio.Event()
    live = await make_server(client=client)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 6})
        init = await recv(ws)
        for _ in range(3):  # w0 w1 w2
            client.gate.set()
            await until(ws, is_type("token"))
        await send(ws, type="control", action="regenerate")
        req = next(iter(client.live.values()))
        await eventually(lambda: RequestEvent.REGENERATING in req.events)  # in force from the next token
        client.gate.set()
        msgs = await until(ws, is_status("regenerating"))
        assert "completion" not in [m["type"] for m in msgs]
        fresh = await recv(ws)
        assert fresh["type"] == "init" and fresh["request_id"] == init["request_id"]
        msgs = [await recv(ws)]
        while msgs[-1]["type"] != "completion":
            if msgs[-1]["type"] == "token" and not msgs[-1]["finished"]:
                client.gate.set()  # the next token of the new run
            msgs.append(await recv(ws))
        assert msgs[0]["token"] == " w0" and msgs[0]["generated_text"] == " w0"
        assert msgs[-1]["generated_text"] == " w0 w1 w2 w3 w4 w5"


async def test_disconnect_mid_stream_aborts(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 10000})
        await until(ws, is_type("token"))
    await eventually(lambda: not live.client.live)
    assert live.client.aborted == [live.client.requests[0].request_id]


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
        await send(ws, type="config", prompt="Hi", parameters={"max_tokens": 2},
                   options={"echo_prompt": True, "include_token_ids": True, "include_logprobs": True,
                            "include_timing": True})
        msgs = await until(ws, is_type("completion"))
        tok = msgs[1]
        assert tok["generated_text"] == "Hi w0" and tok["token_id"] == 100
        assert tok["logprobs"][0] == {"token": " w0", "logprob": -0.5, "token_id": 100}
        assert tok["logprobs"][1]["token_id"] == 101 and tok["logprobs"][1]["token"] == "<101>"
        assert set(tok["timing"]) == {"token_ms", "total_ms"}
        assert msgs[-1]["generated_text"] == "Hi w0 w1" and set(msgs[-1]["timing"]) == {"first_token_ms", "total_ms"}
        await send(ws, type="config", prompt="Hi", parameters={"max_tokens": 3}, options={"stream": False})
        assert [m["type"] for m in await until(ws, is_type("completion"))] == ["init", "completion"]


async def test_context_length_exceeded(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="x" * 100)
        err = await recv(ws)
        assert err["error"] == "context_length_exceeded" and err["recoverable"] is True
        assert (err["prompt_tokens"], err["max_context_tokens"]) == (100, 64)


async def test_unexpected_exception_is_generic_and_closes(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="boom: now")
        err = await recv(ws)
        assert err["error"] == "internal_error" and err["recoverable"] is False
        assert "passwd" not in err["message"]
        with pytest.raises(ConnectionClosed) as info:
            await ws.recv()
        assert info.value.rcvd is not None and info.value.rcvd.code == 1011


async def test_rate_limited_with_retry_hint(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="limited: p", parameters={"max_tokens": 8})
        err = await recv(ws)
        assert err["error"] == "rate_limited" and err["recoverable"] is True and err["retry_after_seconds"] == 2.5
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
    principals = [r.principal for r in live.client.requests]
    assert principals[0] == principals[1] != principals[2]
    assert all(p.startswith("key:") and "k1" not in p and "k2" not in p for p in principals)


async def test_principal_without_keys_is_the_peer_address(make_server: Any) -> None:
    live = await make_server()
    async with connect(live.ws, additional_headers={"Authorization": "Bearer made-up"}) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 1})
        await until(ws, is_type("completion"))
    assert live.client.requests[0].principal == "peer:127.0.0.1"  # an unchecked key names nobody


async def test_request_timeout_carries_partial_text(make_server: Any) -> None:
    client = FakeClient()
    client.gate = asyncio.Event()
    live = await make_server(client=client, request_timeout_s=0.3)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 100})
        client.gate.set()  # exactly one token, then the fake stalls
        msgs = await until(ws, is_type("error"))
        err = msgs[-1]
        assert err["error"] == "timeout" and err["recoverable"] is True and err["generated_text"] == " w0"
    await eventually(lambda: not client.live)


async def test_model_loading_status_then_generation(make_server: Any) -> None:
    client = FakeClient(is_ready=False)
    client.progress = 42.0
    live = await make_server(client=client)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p", parameters={"max_tokens": 2})
        status = await recv(ws)
        assert status["type"] == "status" and status["operation"] == "model_loading"
        assert status["progress"] == 42.0 and status["eta_seconds"] == 1.5
        client.ready.set()
        msgs = await until(ws, is_type("completion"))
        assert [m["type"] for m in msgs if m["type"] != "status"] == ["init", "token", "token", "completion"]


async def test_model_loading_error(make_server: Any) -> None:
    client = FakeClient(is_ready=False)
    client.load_error = RuntimeError("no config.json in /models/secret")  # type: ignore[attr-defined]
    live = await make_server(client=client)
    async with connect(live.ws) as ws:
        await send(ws, type="config", prompt="p")
        err = await recv(ws)
        assert err["error"] == "model_loading_error" and err["recoverable"] is False and "secret" not in err["message"]


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
        assert records[0]["request_id"] == done[0]["request_id"] and records[0]["generated_text"] == " w0 w1"
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
    live = await make_server(api_key=["secret"])
    async with httpx.AsyncClient(base_url=live.url) as http:
        res = await http.post("/v1/generate", json={"prompt": "Write", "max_tokens": 3, "temperature": 0.7})
        assert res.status_code == 401
        headers = {"Authorization": "Bearer secret"}
        res = await http.post("/v1/generate", json={"prompt": "Write", "max_tokens": 3, "stream": False}, headers=headers)
        body = res.json()
        assert res.status_code == 200
        assert body["id"].startswith("gen_") and body["model"] == "fake-model"
        assert body["generated_text"] == " w0 w1 w2" and body["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        res = await http.post("/v1/generate", json={"prompt": "x", "temperature": -3}, headers=headers)
        assert res.status_code == 400 and res.json()["field"] == "parameters.temperature"
        res = await http.post("/v1/generate", content=b"{", headers=headers)
        assert res.status_code == 400 and res.json()["error"] == "invalid_request"
        res = await http.post("/v1/generate", json={"prompt": "mem: x"}, headers=headers)
        assert res.status_code == 503 and res.json()["error"] == "memory_pressure"


async def test_rest_rate_limited_has_retry_after(make_server: Any) -> None:
    live = await make_server(api_key=["k"])
    headers = {"Authorization": "Bearer k"}
    async with httpx.AsyncClient(base_url=live.url, headers=headers) as http:
        res = await http.post("/v1/generate", json={"prompt": "limited: p", "max_tokens": 8})
        assert res.status_code == 429 and res.json()["error"] == "rate_limited"
        assert res.headers["Retry-After"] == "3"  # rounded up, as on /v1/chat/completions


async def test_rest_sse_carries_the_socket_messages(make_server: Any) -> None:
    live = await make_server()
    async with httpx.AsyncClient(base_url=live.url) as http:
        async with http.stream("POST", "/v1/generate", json={"prompt": "Write", "max_tokens": 3, "stream": True}) as res:
            assert res.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(line[6:]) async for line in res.aiter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["init", "token", "token", "token", "completion"]
    assert events[-1]["generated_text"] == " w0 w1 w2"


async def test_rest_sse_disconnect_aborts(make_server: Any) -> None:
    live = await make_server()
    async with httpx.AsyncClient(base_url=live.url) as http:
        async with http.stream("POST", "/v1/generate", json={"prompt": "W", "max_tokens": 100000, "stream": True}) as res:
            async for line in res.aiter_lines():
                if '"token"' in line:
                    break
    await eventually(lambda: not live.client.live)
    assert live.client.aborted


async def test_rest_json_client_gone_aborts(make_server: Any) -> None:
    live = await make_server()
    async with httpx.AsyncClient(base_url=live.url) as http:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            await http.post("/v1/generate", json={"prompt": "W", "max_tokens": 1000000}, timeout=0.3)
    await eventually(lambda: not live.client.live)
    assert live.client.aborted == [live.client.requests[0].request_id]


async def test_rest_sse_keepalive_while_waiting_for_the_model(make_server: Any) -> None:
    client = FakeClient(is_ready=False)
    live = await make_server(client=client, sse_keepalive_s=0.05)
    async with httpx.AsyncClient(base_url=live.url) as http:
        async with http.stream("POST", "/v1/generate", json={"prompt": "W", "max_tokens": 2, "stream": True}) as res:
            lines = res.aiter_lines()
            seen: list[str] = []
            async for line in lines:
                seen.append(line)
                if line.startswith(":"):
                    break  # a keep-alive comment arrived while nothing else happened
            client.ready.set()
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
        refused = await recv(ws)
        assert refused["type"] == "error" and refused["error"] == "context_length_exceeded"
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


async def test_hostile_frames_get_invalid_request_and_the_socket_stays_usable(make_server: Any) -> None:
    # Issue 12 item 5: deep nesting raised RecursionError out of the handler (an ASGI
    # traceback and a 1011 close); bad UTF-8 in a binary frame was handled by luck.
    live = await make_server()
    async with connect(live.ws) as ws:
        for frame in ('{"type": "config", "prompt": "p", "x": ' + "[" * 5000 + "]" * 5000 + "}", b'{"type": "config", "prompt": "\xff"}', '{"type":"config","prompt":"\\ud800"}'):
            await ws.send(frame)
            err = await recv(ws)
            assert err["type"] == "error" and err["error"] == "invalid_request" and err["recoverable"] is True
        await send(ws, type="config", prompt="Write", parameters={"max_tokens": 2})
        assert (await until(ws, is_type("completion")))[-1]["generated_text"] == " w0 w1"


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
