"""Tests of rill.models.chat_template: sandboxed rendering of Hugging Face chat templates.

Templates here are written in the style of Llama-3 and Qwen (ChatML); rendering is compared
with transformers' own renderer (a test-only dependency).
"""

from __future__ import annotations

import msgspec
import pytest

from rill.errors import InvalidRequest
from rill.models.chat_template import compile_template, render_chat_template
from rill.types import ChatMessage

LLAMA3_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions:\\n\\n" }}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content | tojson + "<|eot_id|>" }}
    {%- elif 'tool_calls' in message %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

CHATML_THINKING = """{%- macro render_content(content) -%}
{%- if content is string -%}{{ content }}
{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- elif part.type == 'image' -%}<|image|>{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- render_content(messages[0].content) + '\\n\\n' }}{%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}
    {%- elif message.role in ['user', 'assistant', 'tool'] %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if message.role == 'assistant' and message.reasoning_content is defined %}
            {{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- render_content(message.content) + '<|im_end|>\\n' }}
    {%- else %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo à Paris",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi 😀"}],
    [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "日本語で?"},
        {"role": "assistant", "content": "はい"},
        {"role": "user", "content": "ok"},
    ],
    [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}],
        },
        {"role": "tool", "content": "12°C"},
    ],
]
SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


@pytest.fixture(scope="module")
def hf_render():
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")

    def render(template, messages, **kwargs):
        rendered, _ = chat_utils.render_jinja_template(conversations=[messages], chat_template=template, **kwargs)
        return rendered[0]

    return render


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_llama3_style_matches_transformers(hf_render, messages, tools, add_generation_prompt) -> None:
    kwargs = dict(add_generation_prompt=add_generation_prompt, tools=tools, date_string="26 Jul 2024")
    ours = render_chat_template(LLAMA3_STYLE, messages, special_tokens=SPECIALS, **kwargs)
    assert ours == hf_render(LLAMA3_STYLE, messages, **SPECIALS, **kwargs)
    assert ours.startswith("<|begin_of_text|><|start_header_id|>system")


@pytest.mark.parametrize("enable_thinking", [None, True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
def test_chatml_thinking_matches_transformers(hf_render, enable_thinking, tools) -> None:
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You are terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image"}]},
        {"role": "assistant", "content": "A cat.", "reasoning": "It has whiskers."},
        {"role": "user", "content": "and now?", "name": None},
    ]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ours = render_chat_template(CHATML_THINKING, messages, tools=tools, **kwargs)
    assert ours == hf_render(CHATML_THINKING, messages, tools=tools, add_generation_prompt=True, **kwargs)
    assert "<|im_start|>user\nlook: <|image|><|im_end|>" in ours
    assert "<think>\nIt has whiskers.\n</think>" in ours  # "reasoning" seen as reasoning_content
    assert ours.endswith("<think>\n\n</think>\n\n") == (enable_thinking is False)


def test_raise_exception_message_reaches_the_client() -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}]
    with pytest.raises(InvalidRequest, match="^System message must be at the beginning.$") as info:
        render_chat_template(CHATML_THINKING, messages)
    assert info.value.field == "messages"
    with pytest.raises(InvalidRequest, match="Unexpected message role: robot"):
        render_chat_template(CHATML_THINKING, [{"role": "robot", "content": "x"}])


def test_msgspec_chat_messages_and_none_fields() -> None:
    messages = [ChatMessage(role="user", content="hi"), ChatMessage(role="assistant", content=None, name=None)]
    text = render_chat_template(
        "{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m | length }};{% endfor %}", messages
    )
    assert text == "user:hi|2;assistant:|1;"  # None values are dropped, not rendered as "None"


def test_tojson_is_plain_json_without_html_escaping() -> None:
    text = render_chat_template(
        "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
        "{{ {'b': 1, 'a': '<é>'} | tojson(separators=(',', ':'), sort_keys=true) }}",
        [{"role": "user", "content": "<b>é & 'x'</b>"}],
    )
    first, second, third = text.split("|")
    assert first == '{"role": "user", "content": "<b>é & \'x\'</b>"}'
    assert second.startswith('{\n  "role"')
    assert third == '{"a":"<é>","b":1}'


def test_special_tokens_and_kwargs_are_variables() -> None:
    template = "{{ bos_token }}{{ eos_token }}{{ custom }}{{ add_generation_prompt }}"
    assert (
        render_chat_template(template, [{"role": "user", "content": ""}], special_tokens=SPECIALS, custom=[1])
        == "<|begin_of_text|><|eot_id|>[1]True"
    )
    assert (
        render_chat_template(
            template,
            [{"role": "user", "content": ""}],
            special_tokens=SPECIALS,
            eos_token="E",
            add_generation_prompt=False,
        )
        == "<|begin_of_text|>EFalse"
    )


def test_loop_controls_generation_block_and_namespace() -> None:
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% set ns.n = ns.n + 1 %}"
        "{% if ns.n == 2 %}{% break %}{% endif %}{% endfor %}{{ ns.n }}{{ dict(a=1).a }}"
    )
    messages = [{"role": "user", "content": c} for c in "abcd"]
    assert render_chat_template(template, messages) == "bc21"


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ self._TemplateReference__context }}",
        "{{ cycler.__init__.__globals__.os }}",
        "{{ lipsum.__globals__['os'].popen('id').read() }}",
        "{{ raise_exception.__globals__ }}",
        "{% set ns = namespace(_hidden=1) %}",
        "{% set ns = namespace() %}{% set ns._x = 1 %}",
        "{% for m in messages %}{{ messages.append(m) }}{% endfor %}",
        "{{ messages[0].update({'role': 'system'}) }}",
        "{{ dict.__call__.__globals__ }}",
    ],
)
def test_sandbox_escapes_fail_with_invalid_request(template: str) -> None:
    with pytest.raises(InvalidRequest, match="unsafe|underscore"):
        render_chat_template(template, [{"role": "user", "content": "x"}])


def test_rich_objects_are_replaced_by_placeholders() -> None:
    class Secret:
        def read(self) -> str:
            return "leaked"

    text = render_chat_template(
        "{{ messages[0].content[0].data }}|{{ messages[0].content[0].data.read }}",
        [{"role": "user", "content": [{"type": "image", "data": Secret()}]}],
    )
    assert text == "<Secret>|"


@pytest.mark.parametrize(
    ("template", "pattern"),
    [
        ("{% for %}", "syntax error.*line 1"),
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ missing.attr }}", "'missing' is undefined"),
    ],
)
def test_template_failures_become_invalid_request(template: str, pattern: str) -> None:
    with pytest.raises(InvalidRequest, match=pattern):
        render_chat_template(template, [{"role": "user", "content": "x"}])


def test_bad_inputs() -> None:
    with pytest.raises(InvalidRequest, match="this model has no chat template"):
        render_chat_template(None, [{"role": "user", "content": "x"}])
    with pytest.raises(InvalidRequest, match="at least one message"):
        render_chat_template("x", [])
    with pytest.raises(InvalidRequest, match="message 1"):
        render_chat_template("x", [{"role": "user", "content": "x"}, "oops"])
    with pytest.raises(InvalidRequest, match="reserved") as info:
        render_chat_template("x", [{"role": "user", "content": "x"}], messages=[])
    assert info.value.field == "chat_template_kwargs"
    with pytest.raises(InvalidRequest, match="reserved"):
        render_chat_template("x", [{"role": "user", "content": "x"}], template_kwargs={"add_generation_prompt": 1})
    with pytest.raises(InvalidRequest, match="'tools' must be a list"):
        render_chat_template("x", [{"role": "user", "content": "x"}], tools={"name": "f"})


def test_client_kwargs_mapping_accepts_any_name() -> None:
    template = "{{ special_tokens }}{{ source }}{{ template_kwargs }}{{ documents | length }}{{ enable_thinking }}"
    client = {
        "special_tokens": "S",
        "source": "R",
        "template_kwargs": "T",
        "documents": [{"text": "d"}],
        "enable_thinking": True,
    }
    assert (
        render_chat_template(template, [{"role": "user", "content": ""}], template_kwargs=client, enable_thinking=False)
        == "SRT1False"
    )  # explicit kwargs win


def test_templates_are_compiled_once() -> None:
    source = "{{ messages | length }} compiled-once-test"
    assert compile_template(source) is compile_template(source)


def test_content_parts_pass_through_unchanged() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:..."}}]
    text = render_chat_template("{{ messages[0].content | tojson }}", [{"role": "user", "content": parts}])
    assert msgspec.json.decode(text) == parts


def test_tool_call_format_is_detected_from_the_template() -> None:
    from rill.models.chat_template import tool_call_format

    assert tool_call_format("{{ '<tool_call>' }}") == "hermes"
    assert tool_call_format("{{ '<|python_tag|>' }} ipython") == "llama3_json"
    assert tool_call_format("{{ messages }}") is None
    assert tool_call_format(None) is None
