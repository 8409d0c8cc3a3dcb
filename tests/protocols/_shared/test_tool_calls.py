"""The incremental tool-call parsers give the same calls and content whatever the chunking."""

from __future__ import annotations

import json
import random

import pytest

from rill.protocols._shared.tool_calls import (
    ContentDelta,
    ToolCallDelta,
    call_grammar,
    make_parser,
)


def run(fmt: str, text: str, chunks: list[int]) -> tuple[str, list[dict]]:
    """Feed ``text`` cut at ``chunks`` sizes; return the content and the calls rebuilt from deltas."""
    parser = make_parser(fmt, "resp-0")
    deltas = []
    pos = 0
    sizes = iter(chunks)
    while pos < len(text):
        n = next(sizes, len(text))
        deltas += parser.feed(text[pos : pos + n])
        pos += n
    deltas += parser.finish()
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, dict] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            if d.id is not None:
                assert d.index not in calls, "a call is announced once"
                calls[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
            calls[d.index]["arguments"] += d.arguments
    rebuilt = [calls[i] for i in sorted(calls)]
    # The deltas agree with the parser's own list of complete calls.
    assert [(c.id, c.name, c.arguments) for c in parser.calls] == [(c["id"], c["name"], c["arguments"]) for c in rebuilt]
    return content, rebuilt


def chunkings(text: str, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[len(text)], [1] * len(text), [2] * len(text), [3] * len(text)] + [
        [rng.randint(1, 7) for _ in range(len(text))] for _ in range(20)
    ]


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], '
    '"note": "a } tricky \\" string {"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
    "</tool_call>"
)


@pytest.mark.parametrize("chunks", chunkings(HERMES))
def test_hermes_two_calls_any_chunking(chunks: list[int]) -> None:
    content, calls = run("hermes", HERMES, chunks)
    assert content == "Let me check.\n"
    assert [c["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": [1, 2], "note": 'a } tricky " string {'}
    assert json.loads(calls[1]["arguments"]) == {"a": 1, "b": 2}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("call_")


@pytest.mark.parametrize("chunks", chunkings("plain <tool answer> text < done", 1))
def test_hermes_plain_text_passes_through(chunks: list[int]) -> None:
    text = "plain <tool answer> text < done"
    assert run("hermes", text, chunks) == (text, [])


def test_hermes_broken_call_becomes_content() -> None:
    text = "<tool_call>\nnot json at all</tool_call>"
    content, calls = run("hermes", text, [5] * 20)
    assert calls == [] and content.startswith("<tool_call>") and "not json" in content


def test_hermes_arguments_stream_before_the_call_ends() -> None:
    parser = make_parser("hermes", "x")
    first = parser.feed('<tool_call>\n{"name": "f", "arguments": {"q": "abc')
    assert [type(d) for d in first] == [ToolCallDelta, ToolCallDelta]
    assert first[0].name == "f" and first[0].id and first[1].arguments == '{"q": "abc'
    more = parser.feed('def"}}\n</tool_call>')
    assert "".join(d.arguments for d in more if isinstance(d, ToolCallDelta)) == 'def"}'
    assert parser.calls[0].arguments == '{"q": "abcdef"}'


def test_hermes_arguments_before_name_are_parsed_at_the_end() -> None:
    content, calls = run("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "g"}</tool_call>', [4] * 30)
    assert content == "" and calls[0]["name"] == "g" and json.loads(calls[0]["arguments"]) == {"x": 1}


LLAMA = '<|python_tag|>{"name": "search", "parameters": {"query": "rill; streams"}}; {"name": "noop", "parameters": {}}'


@pytest.mark.parametrize("chunks", chunkings(LLAMA, 2))
def test_llama3_json_calls_any_chunking(chunks: list[int]) -> None:
    content, calls = run("llama3_json", LLAMA, chunks)
    assert content == ""
    assert [c["name"] for c in calls] == ["search", "noop"]
    assert json.loads(calls[0]["arguments"]) == {"query": "rill; streams"}
    assert json.loads(calls[1]["arguments"]) == {}


@pytest.mark.parametrize("chunks", chunkings("Sure, {here} it is.", 3))
def test_llama3_json_text_is_content(chunks: list[int]) -> None:
    assert run("llama3_json", "Sure, {here} it is.", chunks) == ("Sure, {here} it is.", [])


def test_llama3_json_bare_object_without_tag() -> None:
    content, calls = run("llama3_json", '  {"name": "f", "parameters": {"n": 3}}', [3] * 20)
    assert content == "" and calls[0]["name"] == "f" and calls[0]["arguments"] == '{"n": 3}'


def test_call_grammar_names_the_functions() -> None:
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "b"}}]
    both = call_grammar("hermes", tools)
    assert "<tool_call>" in both and '"const": "a"' in both and '"const": "b"' in both
    only_b = call_grammar("llama3_json", tools, name="b")
    assert '"const": "b"' in only_b and '"const": "a"' not in only_b and '"parameters"' in only_b
