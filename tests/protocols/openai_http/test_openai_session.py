"""``ResponseSession`` (pure) driven by golden vectors: engine outputs in, SSE bytes or JSON out.

``vectors/session.json`` holds each case's outputs (``[choice index, RequestOutput]``) and the
exact events (streamed) or body (not streamed) expected; it doubles as documentation of the
wire shapes. Token strings come from ``token_text`` = ``"<id>"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rill.errors import EngineDead
from rill.protocols.openai_http.session import Kind, ResponseSession
from rill.types import RequestOutput

CASES = json.loads((Path(__file__).parent / "vectors" / "session.json").read_text())


def _session(case: dict[str, Any]) -> ResponseSession:
    return ResponseSession(kind=Kind.CHAT if case["kind"] == "chat" else Kind.COMPLETION, response_id="id-1",
                           created=1, model="m", num_choices=case["num_choices"], n=case["n"],
                           include_usage=case["include_usage"], logprobs=case["logprobs"],
                           token_text=lambda token_id: f"<{token_id}>")


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_session_vectors(case: dict[str, Any]) -> None:
    session = _session(case)
    events: list[bytes] = session.start() if case["stream"] else []
    for index, output in case["outputs"]:
        produced = session.on_output(index, msgspec.convert(output, RequestOutput))
        if case["stream"]:
            events += produced
        if session.failed is not None:
            break
    if case["stream"]:
        events += session.end()
        assert [e.decode() for e in events] == case["expected"]
    elif session.failed is not None:
        assert case["expected"] == {"failed": type(session.failed).__name__}
    else:
        assert session.is_done
        assert json.loads(session.body()) == case["expected"]


def test_outputs_with_nothing_to_show_produce_no_event() -> None:
    session = _session({"kind": "completion", "num_choices": 1, "n": 1, "include_usage": False, "logprobs": None})
    assert session.on_output(0, RequestOutput(request_id="r", events=[])) == []
    assert not session.is_done


def test_outside_failure_is_reported_once() -> None:
    session = _session({"kind": "chat", "num_choices": 2, "n": 2, "include_usage": True, "logprobs": None})
    (event,) = session.fail(EngineDead("the engine stopped"))
    assert json.loads(event.decode()[len("data: "):])["error"]["code"] == "engine_dead"
    assert session.fail(EngineDead()) == []
    assert session.on_output(0, RequestOutput(request_id="r", text="late")) == []
    assert session.end() == [b"data: [DONE]\n\n"]  # no usage chunk after a failure


def test_unexpected_failure_text_is_not_shown() -> None:
    session = _session({"kind": "completion", "num_choices": 1, "n": 1, "include_usage": False, "logprobs": None})
    (event,) = session.fail(RuntimeError("secret detail /etc/passwd"))
    error = json.loads(event.decode()[len("data: "):])["error"]
    assert "secret" not in error["message"] and error["code"] == "internal_error"


CALL_TEXT = ['Checking.\n<tool_', 'call>\n{"name": "get_weather", "argu', 'ments": {"city": "Pa', 'ris"}}\n</tool_call>']


def _tool_session() -> ResponseSession:
    return ResponseSession(kind=Kind.CHAT, response_id="id-1", created=1, model="m", num_choices=1,
                           tool_format="hermes")


def test_tool_calls_stream_as_openai_does() -> None:
    session = _tool_session()
    session.start()
    chunks = []
    for i, text in enumerate(CALL_TEXT):
        last = i == len(CALL_TEXT) - 1
        out = RequestOutput(request_id="r", text=text, finished=last, finish_reason="stop" if last else None)
        chunks += [json.loads(e.decode().removeprefix("data: ")) for e in session.on_output(0, out)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking.\n"
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in tc and "name" not in tc["function"] for tc in calls[1:])
    assert len(calls) > 2, "arguments arrive in several fragments"
    assert json.loads("".join(tc["function"]["arguments"] for tc in calls)) == {"city": "Paris"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_calls_in_a_body() -> None:
    session = _tool_session()
    for i, text in enumerate(CALL_TEXT):
        last = i == len(CALL_TEXT) - 1
        session.on_output(0, RequestOutput(request_id="r", text=text, finished=last, finish_reason="stop" if last else None))
    choice = json.loads(session.body())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking.\n"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_text_without_a_call_keeps_stop() -> None:
    session = _tool_session()
    session.on_output(0, RequestOutput(request_id="r", text="no call <tool", finished=True, finish_reason="stop"))
    choice = json.loads(session.body())["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == "no call <tool"
    assert "tool_calls" not in choice["message"]
