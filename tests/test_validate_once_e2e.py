"""A request's parameters are validated once, by the frontend's submission policy (issue 32).

A ``/generate`` ``modify`` used to be validated three times (the session, the patch, the
client) and an OpenAI chat request's ``response_format`` four times (decoding, the constraint,
the codec's parameters, the client). Here both go through a real server on the tiny
checkpoint, with a counter on each validator; the server is otherwise idle, so every call
counted is the request's.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from rill.types import ResponseFormat, SamplingParams

JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Calls of ``SamplingParams.validate`` and ``ResponseFormat.validate`` from now on, by class
    name (the validators still run; the test may reset the counts)."""
    counts = {"SamplingParams": 0, "ResponseFormat": 0}
    for cls in (SamplingParams, ResponseFormat):
        original = cls.validate

        def counted(self: Any, *args: Any, _original: Any = original, _name: str = cls.__name__, **kwargs: Any) -> Any:
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "validate", counted)
    return counts


async def _until(ws: Any, done: Any) -> dict:
    """Messages from ``ws`` until one ``done`` accepts (which is returned)."""
    while True:
        message = json.loads(await ws.recv())
        assert message["type"] != "error", message
        if done(message):
            return message


async def test_a_generate_modify_is_validated_once(server: Any, validations: dict[str, int]) -> None:
    async with connect(f"{server.ws_url}/generate") as ws:
        await ws.send(
            json.dumps(
                {"type": "config", "prompt": "Once upon a time", "parameters": {"max_tokens": 400, "ignore_eos": True}}
            )
        )
        await _until(ws, lambda m: m["type"] == "token")
        validations.update(SamplingParams=0, ResponseFormat=0)  # the config's are not the modify's
        await ws.send(
            json.dumps(
                {
                    "type": "control",
                    "action": "modify",
                    "parameters": {"temperature": 0.5, "response_format": JSON_SCHEMA},
                }
            )
        )
        modified = await _until(ws, lambda m: m["type"] == "status" and m["operation"] == "modified")
        assert modified["parameters"]["temperature"] == 0.5
        assert modified["parameters"]["response_format"]["type"] == "json_schema"
        assert validations == {"SamplingParams": 1, "ResponseFormat": 1}
        await ws.send(json.dumps({"type": "control", "action": "stop"}))
        await _until(ws, lambda m: m["type"] == "completion")
    server.wait_idle()


async def test_an_openai_chat_request_with_a_response_format_is_validated_once(
    server: Any, validations: dict[str, int]
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        reply = await http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Answer in JSON."}],
                "max_tokens": 8,
                "n": 1,
                "response_format": JSON_SCHEMA,
            },
        )
    assert reply.status_code == 200, reply.text
    assert validations == {"SamplingParams": 1, "ResponseFormat": 1}
    server.wait_idle()
