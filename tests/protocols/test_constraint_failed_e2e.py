"""A grammar that compiles but cannot be followed while sampling, over the wire (issue 31).

The engine's compiler is made to hand out matchers over llguidance limits that fail at the
first sampled token (with llguidance's verbose errors on, so the message holds the whole
grammar, as it did before): the request must end with ``constraint_failed``, a client
error in each protocol's own shape (OpenAI 400 JSON, an SSE error event; ``/generate``
``invalid_request``), never a 500, and the log must get one short line.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest

from tests.frontend.test_loop_budget import BIG_SCHEMA, failing_matcher_factory
from tests.protocols.generate_ws.conftest import make_server  # noqa: F401 - the whole app over a FakeRunner client

SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}


@pytest.fixture
async def live(make_server: Any) -> Any:  # noqa: F811 - the fixture imported above
    server = await make_server()
    server.engine.grammars.matcher = failing_matcher_factory(server.engine.grammars)
    return server


def _bounded_log(caplog: pytest.LogCaptureFixture) -> None:
    lines = [r.getMessage() for r in caplog.records if "could not be followed" in r.getMessage()]
    assert len(lines) == 1 and len(lines[0]) <= 400
    assert "field_199" not in caplog.text and all(r.exc_info is None for r in caplog.records)


async def test_openai_non_streaming_gets_a_400_constraint_failed(live: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
        response = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "response_format": SCHEMA_FORMAT},
        )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "constraint_failed" and error["type"] == "invalid_request_error"
    assert error["param"] == "response_format" and "Too many items" in error["message"]
    assert len(error["message"]) <= 300
    _bounded_log(caplog)


async def test_openai_streaming_gets_an_error_event(live: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
        async with http.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 20, "stream": True, "response_format": SCHEMA_FORMAT},
        ) as response:
            assert response.status_code == 200
            data = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    errors = [json.loads(d)["error"] for d in data if d != "[DONE]" and "error" in json.loads(d)]
    assert [e["code"] for e in errors] == ["constraint_failed"]
    assert data[-1] == "[DONE]"
    _bounded_log(caplog)


async def test_generate_rest_gets_invalid_request_naming_the_constraint(live: Any) -> None:
    async with httpx.AsyncClient(base_url=live.url, timeout=60) as http:
        response = await http.post(
            "/v1/generate", json={"prompt": "hi", "max_tokens": 20, "response_format": SCHEMA_FORMAT}
        )
    assert response.status_code == 400, response.text
    body = response.json()
    assert body["error"] == "invalid_request" and "could not be followed" in body["message"]
