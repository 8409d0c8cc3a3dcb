"""Tool calling and structured output through the ``openai`` client on a real server.

The model is a tiny random-init Qwen2 checkpoint whose chat template takes tools the
Hermes/Qwen way (``rill.testing.checkpoints.TOOL_CHAT_TEMPLATE``), so the server detects the
``hermes`` tool-call format from it. Random weights never choose to call a tool by
themselves: calls are forced by ``tool_choice`` (``required`` or a named function), which
constrains decoding to a valid call; ``auto`` is checked for the template round trip.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import LiveServer, start_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -999, "maximum": 999},
                "b": {"type": "integer", "minimum": -999, "maximum": 999},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from rill.testing.checkpoints import TOOL_CHAT_TEMPLATE, make_checkpoint

    folder = make_checkpoint(
        tmp_path_factory.mktemp("models") / "tiny-qwen",
        arch="qwen2",
        chat_template=TOOL_CHAT_TEMPLATE,
        max_position_embeddings=2048,
    )
    live = start_server(folder, **{"engine.max_model_len": 2048})
    yield live
    live.stop()


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_tools_with_auto_and_a_two_turn_exchange(qwen_server: LiveServer) -> None:
    client = _client(qwen_server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(
        model="tiny-qwen", messages=messages, tools=[WEATHER, ADD], tool_choice="auto", max_tokens=8, seed=1
    )
    assert first.choices[0].finish_reason in ("stop", "length")
    # The second turn carries the assistant's call (content null) and the tool's result.
    messages += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    second = client.chat.completions.create(
        model="tiny-qwen",
        messages=messages,
        tools=[WEATHER, ADD],
        max_tokens=8,
        seed=2,
        extra_body={"ignore_eos": True},
    )
    assert second.choices[0].finish_reason == "length" and second.usage.completion_tokens == 8
    # The call and the result went through the template into the prompt.
    longer = second.usage.prompt_tokens - first.usage.prompt_tokens
    assert longer > len('{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}{"sky": "clear"}') // 4


def test_tool_choice_none_and_plain_chat_still_work(qwen_server: LiveServer) -> None:
    client = _client(qwen_server)
    reply = client.chat.completions.create(
        model="tiny-qwen",
        messages=[{"role": "user", "content": "hi"}],
        tools=[WEATHER],
        tool_choice="none",
        max_tokens=4,
    )
    assert reply.choices[0].message.tool_calls in (None, [])


def _check_call(name: str, arguments: str, tools: list[dict]) -> dict:
    import jsonschema

    (tool,) = [t for t in tools if t["function"]["name"] == name]
    args = json.loads(arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_required_tool_call_comes_back_as_tool_calls(qwen_server: LiveServer) -> None:
    client = _client(qwen_server)
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny-qwen",
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER, ADD],
            tool_choice="required",
            max_tokens=200,
            seed=seed,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        assert choice.message.tool_calls, "a forced call is always a call"
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            _check_call(call.function.name, call.function.arguments, [WEATHER, ADD])


def test_named_tool_call_streams_incremental_arguments(qwen_server: LiveServer) -> None:
    client = _client(qwen_server)
    chunks = list(
        client.chat.completions.create(
            model="tiny-qwen",
            messages=[{"role": "user", "content": "Weather?"}],
            tools=[WEATHER, ADD],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=200,
            seed=7,
            stream=True,
        )
    )
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].id and pieces[0].function.name == "get_weather" and pieces[0].type == "function"
    assert len([p for p in pieces if p.function.arguments]) > 1, "arguments stream in fragments"
    assert {p.index for p in pieces} == {0}
    arguments = "".join(p.function.arguments or "" for p in pieces)
    _check_call("get_weather", arguments, [WEATHER])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_forced_call_cut_by_max_tokens_returns_the_call_so_far(qwen_server: LiveServer) -> None:
    # As OpenAI: finish_reason length, and the call with the arguments written so far (the
    # same text a stream of the same greedy run shows).
    client = _client(qwen_server)
    kwargs: dict = dict(
        model="tiny-qwen",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=46,
        temperature=0,
    )
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None, choice.message.content
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments.startswith("{") and len(call.function.arguments) > 1
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def test_auto_parses_a_call_the_output_was_forced_into(qwen_server: LiveServer) -> None:
    # With tool_choice auto the model is free; a regex forces the text so that parsing is tested.
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>'
    regex = "".join("\\" + ch if ch in ".^$*+?()[]{}|\\/" else ch for ch in text)
    for stream in (False, True):
        kwargs = dict(
            model="tiny-qwen",
            messages=[{"role": "user", "content": "2+40?"}],
            tools=[WEATHER, ADD],
            tool_choice="auto",
            max_tokens=100,
            extra_body={"structured_outputs": {"regex": regex}},
        )
        if stream:
            chunks = list(client_stream := _client(qwen_server).chat.completions.create(stream=True, **kwargs))
            del client_stream
            pieces = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            name, arguments = pieces[0].function.name, "".join(p.function.arguments or "" for p in pieces)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            choice = _client(qwen_server).chat.completions.create(**kwargs).choices[0]
            (call,) = choice.message.tool_calls
            name, arguments, finish = call.function.name, call.function.arguments, choice.finish_reason
        assert (name, json.loads(arguments), finish) == ("add", {"a": 2, "b": 40}, "tool_calls")


NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "count": {"type": "integer", "minimum": -5, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "kind": {"enum": ["person", "team"]},
                "level": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["kind", "level"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "count", "tags", "owner"],
    "additionalProperties": False,
}


def test_json_schema_output_is_valid_in_50_of_50_samples(qwen_server: LiveServer) -> None:
    import jsonschema

    client = _client(qwen_server)
    # max_tokens: the schema bounds every string, number and array, and whitespace is not free
    # (compact JSON), so the longest valid output is far below it: no sample is cut short.
    reply = client.chat.completions.create(
        model="tiny-qwen",
        messages=[{"role": "user", "content": "Describe a thing."}],
        n=50,
        seed=1234,
        max_tokens=400,
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": NESTED, "strict": True}},
    )
    assert len(reply.choices) == 50
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), NESTED)
    assert len({c.message.content for c in reply.choices}) > 10, "seeded samples differ"


def test_bad_constraints_are_400s(qwen_server: LiveServer) -> None:
    client = _client(qwen_server)
    cases = [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"response_format": {"type": "xml"}},
        {"structured_outputs": {"regex": "(("}},
        {"structured_outputs": {"grammar": "start: nothing_defined"}},
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
    ]
    for body in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="tiny-qwen", messages=[{"role": "user", "content": "x"}], max_tokens=4, extra_body=body
            )
        assert caught.value.body["param"] in ("response_format", "structured_outputs"), body


def test_vllm_guided_fields_constrain_both_endpoints(qwen_server: LiveServer) -> None:
    # vLLM's older names of structured_outputs; before, ignored: random weights wrote anything.
    client = _client(qwen_server)
    for seed in range(3):
        chat = client.chat.completions.create(
            model="tiny-qwen",
            messages=[{"role": "user", "content": "Yes or no?"}],
            max_tokens=20,
            seed=seed,
            extra_body={"guided_choice": ["yes", "no"]},
        )
        assert chat.choices[0].message.content in ("yes", "no")
        text = client.completions.create(
            model="tiny-qwen", prompt="Digits:", max_tokens=20, seed=seed, extra_body={"guided_regex": "[0-9]{3}"}
        ).choices[0]
        assert len(text.text) == 3 and text.text.isdigit(), text.text
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model="tiny-qwen", prompt="x", max_tokens=4, extra_body={"guided_regex": "a", "guided_json": {}}
        )
    assert caught.value.body["param"] == "guided_regex"  # type: ignore[index]
