"""The Responses API's pure parts: request translation and the event builder."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rill.errors import GenerationError, InvalidRequest
from rill.protocols.openai_http import responses_codec
from rill.protocols.openai_http.responses_session import ResponsesSession
from rill.types import RequestOutput, Usage


def _out(text: str = "", finish: str | None = None, n: int = 1, error: Any = None) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        text=text,
        finished=finish is not None,
        finish_reason=finish,  # type: ignore[arg-type]
        error=error,
        usage=Usage(prompt_tokens=3, completion_tokens=n),
    )


def _session(**kwargs: Any) -> ResponsesSession:
    return ResponsesSession(response_id="resp_1", created_at=1, model="m", echo={}, **kwargs)


def _run(session: ResponsesSession, *outs: RequestOutput) -> list[dict[str, Any]]:
    events = session.start()
    for out in outs:
        events += session.on_output(out)
    return events


def test_text_events_and_sequence_numbers() -> None:
    session = _session()
    events = _run(session, _out("Hel"), _out("lo", "stop", 2))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["status"] == "completed" and session.output_text == "Hello"
    assert final["usage"] == {
        "input_tokens": 3,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 5,
    }


def test_length_is_incomplete_and_a_failure_is_failed() -> None:
    cut = _run(_session(), _out("Hi", "length"))
    assert cut[-1]["type"] == "response.incomplete"
    assert cut[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    failed = _run(_session(), _out("Hi"), _out("", "error", error=GenerationError("boom")))
    assert [e["type"] for e in failed[-2:]] == ["error", "response.failed"]
    assert failed[-1]["response"]["error"]["code"] == "generation_error"
    assert failed[-1]["response"]["output"][0]["status"] == "incomplete"


def test_tool_calls_become_function_call_items_and_leading_space_opens_no_message() -> None:
    session = _session(tool_format="hermes")
    text = '\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    events = _run(session, *[_out(ch) for ch in text], _out("", "stop"))
    output = events[-1]["response"]["output"]
    assert [(item["type"], item["name"]) for item in output] == [("function_call", "f"), ("function_call", "g")]
    assert json.loads(output[0]["arguments"]) == {"a": 1}
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    deltas = "".join(
        e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta" and e["output_index"] == 0
    )
    assert deltas == done[0]["arguments"] == output[0]["arguments"]
    single = _session(tool_format="hermes", parallel_tool_calls=False)
    events = _run(single, _out(text), _out("", "stop"))
    assert [item["name"] for item in events[-1]["response"]["output"]] == ["f"]


def test_background_starts_queued_and_cancel_ends_it() -> None:
    session = ResponsesSession(response_id="resp_1", created_at=1, model="m", echo={"background": True})
    events = session.start()
    assert [e["type"] for e in events] == ["response.created", "response.queued"]
    assert events[0]["response"]["status"] == "queued"
    assert session.on_output(_out("a"))[0]["type"] == "response.in_progress"
    last = session.cancel()
    assert last[-1]["response"]["status"] == "cancelled" and session.is_done
    assert session.on_output(_out("b")) == [] and session.cancel() == []


def test_items_translate_to_chat_messages() -> None:
    req = responses_codec.decode(
        json.dumps(
            {
                "instructions": "Be brief.",
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                    {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}"},
                    {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                    {"role": "developer", "content": "Answer in French."},
                ],
                "tools": [{"type": "function", "name": "w", "parameters": {"type": "object"}}],
                "tool_choice": {"type": "function", "name": "w"},
                "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
                "max_output_tokens": 5,
            }
        ).encode()
    )
    items = responses_codec.input_items(req.input)
    chat = responses_codec.chat_request(req, [], items)
    roles = [(m.role, m.content, len(m.tool_calls or [])) for m in chat.messages or []]
    assert roles == [
        ("system", "Be brief.", 0),
        ("user", "Weather?", 0),
        ("assistant", None, 2),
        ("tool", "sunny", 0),
        ("system", "Answer in French.", 0),
    ]
    assert chat.tools == [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "w"}}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert chat.max_completion_tokens == 5


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
        ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        req = responses_codec.decode(json.dumps(body).encode())
        responses_codec.chat_request(req, [], responses_codec.input_items(req.input))
    assert caught.value.field == field


def test_ignored_and_null_fields_pass() -> None:
    req = responses_codec.decode(
        json.dumps({"input": "x", "service_tier": "auto", "reasoning": None, "truncation": "disabled"}).encode()
    )
    assert req.input == "x"
