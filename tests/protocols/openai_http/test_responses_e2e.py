"""OpenAI's Responses API on a real server, driven by the ``openai`` client and by raw HTTP.

The model is a tiny random-init Qwen2 checkpoint with a Hermes-style tool template (the
server reads ``hermes`` calls from it). Random weights never call a tool by themselves, so
calls are forced with ``tool_choice``; greedy decoding (``temperature: 0``) makes a run
repeatable, which the resume checks compare against.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import LiveServer, start_server

KEY_A, KEY_B = "key-alice-0123456789", "key-bob-0123456789"

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from rill.testing.checkpoints import TOOL_CHAT_TEMPLATE, make_checkpoint

    folder = make_checkpoint(
        tmp_path_factory.mktemp("models") / "tiny-qwen",
        arch="qwen2",
        chat_template=TOOL_CHAT_TEMPLATE,
        max_position_embeddings=2048,
    )
    live = start_server(
        folder,
        **{
            "engine.max_model_len": 2048,
            "http.data_dir": str(tmp_path_factory.mktemp("data")),
            "policy.api_key": [KEY_A, KEY_B],
            "resume.responses_max_history_bytes": "3KiB",
        },
    )
    yield live
    live.stop()


def _client(server: LiveServer, key: str = KEY_A) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def _http(server: LiveServer, key: str = KEY_A) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of an SSE body, one per ``data:`` line."""
    for line in lines:
        if line.startswith("data: "):
            yield json.loads(line[len("data: ") :])


def _text(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


GREEDY = {"model": "tiny-qwen", "temperature": 0, "max_output_tokens": 24}


def test_create_retrieve_stream_and_usage(server: LiveServer) -> None:
    client = _client(server)
    made = client.responses.create(input="Tell me a story", **GREEDY)
    assert made.status in ("completed", "incomplete") and made.output_text
    assert made.usage is not None and made.usage.output_tokens > 0 and made.usage.input_tokens > 0
    assert client.responses.retrieve(made.id).output_text == made.output_text
    streamed = list(client.responses.create(input="Tell me a story", stream=True, **GREEDY))
    kinds = [e.type for e in streamed]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response." + made.status,
    ]
    assert [e.sequence_number for e in streamed] == list(range(len(streamed)))
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == made.output_text
    items = client.responses.input_items.list(made.id)
    assert [i.type for i in items.data] == ["message"]


def test_tool_round_trip_with_previous_response_id(server: LiveServer) -> None:
    client = _client(server)
    first = client.responses.create(
        input="Weather in Oslo?", tools=[WEATHER], tool_choice="required", model="tiny-qwen", max_output_tokens=120
    )
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and calls and calls[0].name == "get_weather"
    assert "city" in json.loads(calls[0].arguments)
    second = client.responses.create(
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}],
        tools=[WEATHER],
        **GREEDY,
    )
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    # The same conversation sent whole gives the same greedy answer: the history was used.
    whole = client.responses.create(
        input=[
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"},
        ],
        tools=[WEATHER],
        **GREEDY,
    )
    assert whole.output_text == second.output_text


def test_streamed_function_call_events(server: LiveServer) -> None:
    client = _client(server)
    events = list(
        client.responses.create(
            input="Weather?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            model="tiny-qwen",
            max_output_tokens=120,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == deltas and json.loads(deltas)["city"]
    assert kinds[-1] == "response.completed"


def test_json_schema_text_format(server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    made = _client(server).responses.create(
        input="A number",
        model="tiny-qwen",
        max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "num", "schema": schema, "strict": True}},
    )
    assert made.status == "completed"
    assert 0 <= json.loads(made.output_text)["n"] <= 99


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
        ({"input": "x", "background": True, "store": False}, "store"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "top_p": 2}, "top_p"),
        ({}, "input"),
    ],
)
def test_unsupported_or_bad_fields_are_named(server: LiveServer, body: dict[str, Any], field: str) -> None:
    with _http(server) as http:
        reply = http.post("/v1/responses", json={"model": "tiny-qwen", **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field


def _drop_after(server: LiveServer, body: dict[str, Any], keep: int) -> tuple[str, list[dict[str, Any]]]:
    """Stream a response, read ``keep`` events, then drop the connection."""
    seen: list[dict[str, Any]] = []
    with _http(server) as http, http.stream("POST", "/v1/responses", json={**body, "stream": True}) as reply:
        for event in _events(reply.iter_lines()):
            seen.append(event)
            if len(seen) >= keep:
                break
    return seen[0]["response"]["id"], seen


def _resume(server: LiveServer, response_id: str, after: int, key: str = KEY_A) -> httpx.Response:
    with _http(server, key) as http:
        return http.get(f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": after})


def test_dropped_stream_resumes_to_the_uninterrupted_text(server: LiveServer) -> None:
    body = {**GREEDY, "input": "Once upon a time", "max_output_tokens": 32}
    expected = _client(server).responses.create(**body).output_text
    rng = random.Random(33)
    for _ in range(4):
        keep = rng.randint(1, 12)
        response_id, seen = _drop_after(server, body, keep)
        rest = list(_events(iter(_resume(server, response_id, seen[-1]["sequence_number"]).text.splitlines())))
        assert [e["sequence_number"] for e in rest] == list(range(len(seen), len(seen) + len(rest)))
        assert _text(seen + rest) == expected
        assert rest[-1]["type"] in ("response.completed", "response.incomplete")


def test_background_runs_without_a_connection_and_resumes(server: LiveServer) -> None:
    client = _client(server)
    made = client.responses.create(input="Hi", background=True, **GREEDY)
    assert made.status in ("queued", "in_progress") and made.background
    events = list(client.responses.retrieve(made.id, stream=True, starting_after=0))
    assert events[0].sequence_number == 1 and events[-1].type in ("response.completed", "response.incomplete")
    final = client.responses.retrieve(made.id)
    assert final.status == events[-1].response.status
    assert final.output_text == "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_cancel_a_background_response(server: LiveServer) -> None:
    client = _client(server)
    with server.hold_engine():
        made = client.responses.create(input="Hi", background=True, **GREEDY)
        cancelled = client.responses.cancel(made.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(made.id).status == "cancelled"
    server.wait_idle()


def test_resume_errors(server: LiveServer) -> None:
    body = {**GREEDY, "input": "Hello"}
    response_id, seen = _drop_after(server, body, 2)
    stranger = _resume(server, response_id, 0, key=KEY_B)
    assert stranger.status_code == 404 and stranger.json()["error"]["code"] == "request_not_found"
    with _http(server, KEY_B) as http:
        assert http.get(f"/v1/responses/{response_id}").status_code == 404
        assert http.delete(f"/v1/responses/{response_id}").status_code == 404
    # Read to the end, then ask for events after the last one + 1.
    rest = list(_events(iter(_resume(server, response_id, 1).text.splitlines())))
    past = _resume(server, response_id, rest[-1]["sequence_number"] + 1)
    assert past.status_code == 400 and past.json()["error"]["param"] == "starting_after"
    # Past the grace period: the events are gone, the stored response is not.
    registry = server.state["deps"].resumable
    old = registry.grace_s
    server.call(setattr, registry, "grace_s", 0.0)
    try:
        dropped_id, _ = _drop_after(server, body, 2)
        _wait_forgotten(server, dropped_id)
    finally:
        server.call(setattr, registry, "grace_s", old)
    expired = _resume(server, dropped_id, 0)
    assert expired.status_code == 404 and expired.json()["error"]["code"] == "resume_expired"
    assert _client(server).responses.retrieve(dropped_id).status in ("completed", "incomplete", "cancelled")
    server.wait_idle()


def test_over_long_history_is_refused(server: LiveServer) -> None:
    client = _client(server)
    first = client.responses.create(input="a" * 1500, **{**GREEDY, "max_output_tokens": 4})
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(input="b" * 1500, previous_response_id=first.id, **GREEDY)
    assert caught.value.body["code"] == "history_too_long"
    assert caught.value.body["param"] == "previous_response_id"


def _wait_forgotten(server: LiveServer, response_id: str) -> None:
    import asyncio

    registry = server.state["deps"].resumable
    asyncio.run_coroutine_threadsafe(registry.wait_forgotten(response_id), server.loop).result(30)


def test_random_drop_resume_cycles_leak_nothing(server: LiveServer) -> None:
    """200 streams dropped at a random event, about half of them resumed; with a short grace
    period a resume may find its stream expired (a typed 404), never anything else; once
    every grace period has passed, nothing runs and no KV is held."""
    registry = server.state["deps"].resumable
    rng = random.Random(200)
    body = {**GREEDY, "input": "Go", "max_output_tokens": 6, "store": False}
    ids, resumed, expired = [], 0, 0
    old = registry.grace_s
    server.call(setattr, registry, "grace_s", 0.5)
    try:
        for _ in range(200):
            response_id, seen = _drop_after(server, body, rng.randint(1, 9))
            ids.append(response_id)
            if rng.random() < 0.5:
                reply = _resume(server, response_id, seen[-1]["sequence_number"])
                if reply.status_code == 200:
                    rest = list(_events(iter(reply.text.splitlines())))
                    assert not rest or rest[-1]["type"].startswith("response.")
                    resumed += 1
                else:
                    assert reply.status_code == 404 and reply.json()["error"]["code"] == "resume_expired"
                    expired += 1
        for response_id in ids:
            _wait_forgotten(server, response_id)
    finally:
        server.call(setattr, registry, "grace_s", old)
    assert resumed + expired > 50 and resumed > 0
    assert not [i for i in ids if server.call(registry.__contains__, i)]
    stats = server.wait_idle()
    assert stats.num_running == 0 and stats.kv_used_bytes == 0


def test_output_text_logprobs_when_included(server: LiveServer) -> None:
    made = _client(server).responses.create(
        input="Hi", include=["message.output_text.logprobs"], top_logprobs=2, **{**GREEDY, "max_output_tokens": 4}
    )
    part = made.output[0].content[0]
    assert len(part.logprobs) == made.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in part.logprobs)
    assert "".join(entry.token for entry in part.logprobs) == part.text
