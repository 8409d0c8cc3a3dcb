"""Tool calling and structured output through the ``openai`` client on a real server.

The model is a tiny random-init Qwen2 checkpoint whose chat template takes tools the
Hermes/Qwen way (``rill.testing.checkpoints.TOOL_CHAT_TEMPLATE``), so the server detects the
``hermes`` tool-call format from it. Random weights never choose to call a tool by
themselves: calls are forced by ``tool_choice`` (``required`` or a named function), which
constrains decoding to a valid call; ``auto`` is checked for the template round trip.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

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
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False},
    },
}


@pytest.fixture(scope="module")
def qwen_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from rill.testing.checkpoints import TOOL_CHAT_TEMPLATE, make_checkpoint

    folder = make_checkpoint(tmp_path_factory.mktemp("models") / "tiny-qwen", arch="qwen2",
                             chat_template=TOOL_CHAT_TEMPLATE, max_position_embeddings=2048)
    live = start_server(folder, **{"engine.max_model_len": 2048})
    yield live
    live.stop()


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_tools_with_auto_and_a_two_turn_exchange(qwen_server: LiveServer) -> None:
    client = _client(qwen_server)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    first = client.chat.completions.create(model="tiny-qwen", messages=messages, tools=[WEATHER, ADD],
                                           tool_choice="auto", max_tokens=8, seed=1)
    assert first.choices[0].finish_reason in ("stop", "length")
    # The second turn carries the assistant's call (content null) and the tool's result.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
    ]
    second = client.chat.completions.create(model="tiny-qwen", messages=messages, tools=[WEATHER, ADD],
                                            max_tokens=8, seed=2, extra_body={"ignore_eos": True})
    assert second.choices[0].finish_reason == "length" and second.usage.completion_tokens == 8
    # The call and the result went through the template into the prompt.
    longer = second.usage.prompt_tokens - first.usage.prompt_tokens
    assert longer > len('{"name": "get_weather", "arguments": {"city": "Oslo", "days": 1}}{"sky": "clear"}') // 4


def test_tool_choice_none_and_plain_chat_still_work(qwen_server: LiveServer) -> None:
    client = _client(qwen_server)
    reply = client.chat.completions.create(model="tiny-qwen", messages=[{"role": "user", "content": "hi"}],
                                           tools=[WEATHER], tool_choice="none", max_tokens=4)
    assert reply.choices[0].message.tool_calls in (None, [])
