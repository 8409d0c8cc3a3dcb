"""The tool system prompt for chat templates that drop ``tools`` (``rill.models.tool_prompt``)
and the probe that tells such templates apart (``rill.models.chat_template.renders_tools``)."""

from __future__ import annotations

import json

import pytest

from rill.errors import InvalidRequest
from rill.models.chat_template import render_chat_template, renders_tools
from rill.models.tool_prompt import tool_system_prompt, with_tool_prompt
from rill.protocols._shared.tool_calls import make_parser
from rill.testing.checkpoints import CHAT_TEMPLATE, TOOL_CHAT_TEMPLATE
from rill.types import ChatMessage

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_a_template_that_drops_tools_is_told_from_one_that_renders_them() -> None:
    assert renders_tools(CHAT_TEMPLATE) is False
    assert renders_tools(TOOL_CHAT_TEMPLATE) is True


def test_a_template_that_only_mentions_tools_does_not_count_as_rendering_them() -> None:
    # The rendering differs with tools, but no tool's name reaches the model.
    template = "{% if tools %}tools available\n{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert renders_tools(template) is False


def test_a_template_that_fails_on_the_probe_gets_nothing_added() -> None:
    assert renders_tools("{{ raise_exception('no') }}") is True


def test_the_hermes_prompt_lists_each_tool_and_the_call_format_its_parser_reads() -> None:
    prompt = tool_system_prompt([WEATHER], "hermes")
    assert json.dumps(WEATHER, ensure_ascii=False) in prompt.splitlines()
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in prompt
    # A reply written as the prompt says is read as a call by the hermes parser.
    parser = make_parser("hermes", "call")
    parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Paris"})]


def test_the_llama3_json_prompt_teaches_parameters() -> None:
    prompt = tool_system_prompt([WEATHER], "llama3_json")
    assert '"name": "get_weather"' in prompt
    assert '{"name": <function-name>, "parameters": <args-json-object>}' in prompt
    with pytest.raises(ValueError, match="pythonic"):
        tool_system_prompt([WEATHER], "pythonic")


def test_a_tool_nested_too_deep_for_json_is_an_invalid_request() -> None:
    deep: dict = {}
    inner = deep
    for _ in range(100_000):
        inner["a"] = inner = {}
    with pytest.raises(InvalidRequest) as caught:
        tool_system_prompt([{"type": "function", "function": {"name": "f", "parameters": deep}}], "hermes")
    assert caught.value.field == "tools"


def test_the_prompt_is_merged_into_an_existing_system_message() -> None:
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="hi")]
    out = with_tool_prompt(messages, [WEATHER], "hermes")
    assert [m.role for m in out] == ["system", "user"]
    assert out[0].content == "Be brief.\n\n" + tool_system_prompt([WEATHER], "hermes")
    assert messages[0].content == "Be brief."  # the caller's messages are left as they were

    as_dicts = with_tool_prompt(
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}], [WEATHER], "hermes"
    )
    assert as_dicts[0]["content"][0] == {"type": "text", "text": "Be brief."}
    assert "get_weather" in as_dicts[0]["content"][1]["text"]


def test_a_conversation_without_a_system_message_gets_one_first() -> None:
    out = with_tool_prompt([ChatMessage(role="user", content="hi")], [WEATHER], "hermes")
    assert [(m.role, m.content) for m in out] == [
        ("system", tool_system_prompt([WEATHER], "hermes")),
        ("user", "hi"),
    ]
    text = render_chat_template(CHAT_TEMPLATE, out, special_tokens={"bos_token": "<s>"})
    assert text.startswith("<s><|system|>\n# Tools")


def test_the_default_models_template_drops_tools() -> None:
    """SmolLM2-135M-Instruct (``rill.models.default``): its template never reads ``tools``."""
    from rill.models.default import default_gguf_path
    from rill.models.gguf_loader import read_gguf

    template = read_gguf(default_gguf_path()).metadata["tokenizer.chat_template"]
    assert renders_tools(template) is False
