"""``codec`` (pure): request decoding, the parameters of a request's choices, error naming, error table.

Parameters are validated once, by the frontend's submission policy; ``_admitted`` validates
them as it does (with ``SERVED``'s vocabulary) and names errors as the adapter does
(``codec.renamed``). Fitting ``max_tokens`` to the context and per-candidate seeds are the
policy's: ``tests/frontend/test_policy.py``.
"""

from __future__ import annotations

import json

import pytest

from rill import errors
from rill.protocols._shared import sse
from rill.protocols.openai_http import codec, tools
from rill.protocols.openai_http.messages import ChatCompletionRequest, CompletionRequest
from rill.types import MAX_TOKENS_LIMIT, SamplingParams

SERVED = codec.ServedModel(name="m", max_context_tokens=100, vocab_size=1000)


def _admitted(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
    """The request's parameters validated as the submission policy validates them, a refusal
    named as the adapter names it."""
    params = codec.sampling_params(req, SERVED)
    try:
        return params.validate(vocab_size=SERVED.vocab_size, allow_prefill_only=isinstance(req, CompletionRequest))
    except errors.InvalidRequest as exc:
        raise codec.renamed(exc, req) from exc


def _completion(**fields: object) -> CompletionRequest:
    return codec.decode_completion(json.dumps({"prompt": "x", **fields}).encode())


def _chat(**fields: object) -> ChatCompletionRequest:
    return codec.decode_chat(json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode())


# -- decoding ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (b"", None, "empty"),
        (b"[1, 2]", None, "object"),
        (b'{"prompt": "x", "temperature": "hot"}', "temperature", "float"),
        (b'{"prompt": "x", "stop": 5}', "stop", ""),
        (b'{"prompt": "x", "logit_bias": {"abc": 1}}', "logit_bias", ""),
        (b'{"prompt": "x", "stream_options": {"include_usage": "yes"}}', "stream_options", ""),
        (b'{"prompt": "x", "suffix": "s"}', "suffix", "not supported"),
        (b'{"prompt": "x", "best_of": 1, "n": 2}', "best_of", "at least 'n'"),
        (b'{"prompt": "x", "best_of": 0}', "best_of", "[1, 128]"),
        (b'{"prompt": "x", "best_of": 3, "stream": true}', "best_of", "cannot be streamed"),
        (b'{"prompt": "x", "prompt_logprobs": 1, "stream": true}', "prompt_logprobs", "cannot be streamed"),
        (b'{"model": "m"}', "prompt", "required"),
        (b'{"prompt": "x"', None, "JSON"),
    ],
)
def test_completion_decode_errors_name_the_field(body: bytes, field: str | None, words: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        codec.decode_completion(body)
    assert caught.value.field == field
    assert words in caught.value.message


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": [{"role": "user", "content": "x"}], "response_format": {"regex": 5}}, "response_format"),
        ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_chat_decode_errors_name_the_field(fields: dict, field: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        codec.decode_chat(json.dumps(fields).encode())
    assert caught.value.field == field


def test_unknown_fields_and_nulls_are_accepted() -> None:
    req = codec.decode_completion(b'{"prompt": "x", "temperature": null, "user": "u", "some_new_field": {"a": 1}}')
    assert req.temperature is None
    chat = codec.decode_chat(b'{"messages": [{"role": "user", "content": "x"}], "logprobs": false, "top_logprobs": 0}')
    assert codec.sampling_params(chat, SERVED).logprobs is None


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]])],
)
def test_prompt_shapes(prompt: object, expected: list) -> None:
    assert codec.completion_prompts(_completion(prompt=prompt)) == expected


@pytest.mark.parametrize("prompt", [[], [1, "a"], [[1], []], [-1], [True], 5])
def test_bad_prompt_shapes(prompt: object) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        codec.completion_prompts(_completion(prompt=prompt))
    assert caught.value.field == "prompt"


def test_model_check() -> None:
    codec.check_model(None, SERVED.name)
    codec.check_model("m", SERVED.name)
    with pytest.raises(codec.ModelNotFound) as caught:
        codec.check_model("gpt-4", SERVED.name)
    assert caught.value.message == "The model 'gpt-4' does not exist; use 'm'"


# -- max tokens and sampling ---------------------------------------------------------------


def test_max_tokens_asked_before_the_context_lowers_it() -> None:
    # What remains of the context, and the server's cap, are the policy's to apply.
    assert codec.max_tokens_asked(_completion()) == MAX_TOKENS_LIMIT  # the whole rest of the context
    assert codec.max_tokens_asked(_completion(max_tokens=10)) == 10
    assert codec.max_tokens_asked(_completion(max_tokens=500)) == 500  # lowered later, never refused
    assert codec.max_tokens_asked(_chat(max_tokens=9, max_completion_tokens=4)) == 4
    assert codec.sampling_params(_completion(max_tokens=7), SERVED).max_tokens == 7


def test_max_tokens_below_range_names_the_field_as_sent() -> None:
    with pytest.raises(errors.InvalidRequest) as zero:
        codec.max_tokens_asked(_chat(max_tokens=0))
    assert zero.value.field == "max_tokens" and "'max_tokens' must be >= 1" in zero.value.message
    with pytest.raises(errors.InvalidRequest) as negative:
        codec.sampling_params(_completion(max_tokens=-1), SERVED)
    assert negative.value.field == "max_tokens" and ">= 0" in negative.value.message
    with pytest.raises(errors.InvalidRequest) as newer:
        codec.max_tokens_asked(_chat(max_completion_tokens=0))
    assert newer.value.field == "max_completion_tokens"


def test_max_tokens_zero_on_completions_prefills_only() -> None:
    assert codec.max_tokens_asked(_completion(max_tokens=0)) == 0
    params = _admitted(_completion(max_tokens=0, echo=True, logprobs=2))
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs) == (0, 2, 2)


def test_echo_and_best_of_mapping() -> None:
    assert codec.sampling_params(_completion(echo=True), SERVED).prompt_logprobs is None  # no logprobs: text only
    assert codec.sampling_params(_completion(echo=True, logprobs=1, prompt_logprobs=4), SERVED).prompt_logprobs == 4
    ranked = codec.sampling_params(_completion(best_of=3), SERVED)
    assert ranked.logprobs == 0  # candidates are ranked by their tokens' logprobs
    assert codec.candidates_per_prompt(_completion(best_of=3, n=2)) == 3
    assert codec.check_choices(_completion(best_of=3, n=2), 2, SERVED) == 6


def test_choices_over_the_server_bound_are_refused() -> None:
    few = codec.ServedModel(name="m", max_context_tokens=100, max_choices=4)
    with pytest.raises(errors.InvalidRequest) as caught:
        codec.check_choices(_chat(n=5), 1, few)
    assert caught.value.field == "n" and "at most 4" in caught.value.message


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"echo": True}, "echo"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ],
)
def test_chat_prompt_logprobs_and_echo_errors(fields: dict, field: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        _admitted(_chat(**fields))
    assert caught.value.field == field


def test_sampling_mapping() -> None:
    params = _admitted(
        _completion(
            temperature=0, top_k=-1, stop="END", logit_bias={"5": 2.5}, logprobs=3, seed=9, min_tokens=2, max_tokens=8
        )
    )
    # -1 is "off" (the engine's rule on every protocol), passed through as /generate does.
    assert (params.temperature, params.top_k, params.stop, params.logit_bias) == (0, -1, ["END"], {5: 2.5})
    assert (params.logprobs, params.seed, params.max_tokens, params.min_tokens) == (3, 9, 8, 2)
    assert codec.sampling_params(_chat(logprobs=True, top_logprobs=4), SERVED).logprobs == 4
    assert codec.sampling_params(_chat(logprobs=True), SERVED).logprobs == 0
    assert codec.sampling_params(_chat(), SERVED).logprobs is None


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"n": 0}, "n"),
        ({"n": 1000}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"logit_bias": {"5000": 1}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"seed": -1}, "seed"),
        ({"top_k": -5}, "top_k"),  # was clamped to 0 here while /generate refused it (issue 12)
        ({"repetition_penalty": 1e9}, "repetition_penalty"),
        ({"temperature": 1e6}, "temperature"),
    ],
)
def test_bad_sampling_values_name_the_field(fields: dict, field: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        _admitted(_completion(**fields))
    assert caught.value.field == field


def test_chat_top_logprobs_errors_use_the_chat_field_name() -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        _admitted(_chat(logprobs=True, top_logprobs=21))
    assert caught.value.field == "top_logprobs" and "top_logprobs" in caught.value.message


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"response_format": {"type": "regex"}}, "response_format", "'response_format' of type regex needs 'regex'"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs", "'structured_outputs' of type regex needs"),
        ({"structured_outputs": {"json": [1]}}, "structured_outputs", "needs json_schema.schema"),
    ],
)
def test_constraint_bounds_are_checked_at_admission_and_named_as_sent(fields: dict, field: str, words: str) -> None:
    # The shape is checked when decoding (the request decodes); the bounds once, with the
    # other parameters, named by the field the constraint came from.
    req = _chat(**fields)
    with pytest.raises(errors.InvalidRequest) as caught:
        _admitted(req)
    assert caught.value.field == field and words in caught.value.message


# -- vLLM's older guided_* fields -------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("decode", [_completion, _chat])
@pytest.mark.parametrize(
    ("fields", "same_as"),
    [
        ({"guided_json": SCHEMA}, {"json": SCHEMA}),
        ({"guided_json": json.dumps(SCHEMA)}, {"json": SCHEMA}),
        ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
        ({"guided_choice": ["yes", "no?"]}, {"choice": ["yes", "no?"]}),
        ({"guided_grammar": 'start: "a"+'}, {"grammar": 'start: "a"+'}),
        ({"guided_regex": "a", "guided_decoding_backend": "guidance"}, {"regex": "a"}),
        ({"guided_regex": "a", "guided_decoding_backend": "auto"}, {"regex": "a"}),
    ],
)
def test_guided_fields_are_the_structured_outputs_of_the_same_name(decode: object, fields: dict, same_as: dict) -> None:
    # Before: ignored, so the output was not constrained at all.
    params = _admitted(decode(**fields))  # type: ignore[operator]
    expected = _admitted(decode(structured_outputs=same_as))  # type: ignore[operator]
    assert params.response_format is not None and params.response_format.is_constraint
    assert params.response_format == expected.response_format


@pytest.mark.parametrize("decode", [_completion, _chat])
@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "both constrain"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice", "both constrain"),
        ({"structured_outputs": {"regex": "a"}, "guided_grammar": "start: x"}, "guided_grammar", "both constrain"),
        ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "'xgrammar'"),
        ({"guided_json": SCHEMA, "guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "not supported"),
        ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
        ({"guided_choice": "yes"}, "guided_choice", "Expected `array"),
        ({"guided_json": "{not json"}, "guided_json", "'guided_json' is not valid JSON"),
    ],
)
def test_guided_fields_that_cannot_be_honoured_are_refused_by_name(
    decode: object, fields: dict, field: str, words: str
) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        _admitted(decode(**fields))  # type: ignore[operator]
    assert caught.value.field == field and words in caught.value.message, caught.value.message
    assert codec.error_for(caught.value).status == 400


@pytest.mark.parametrize(
    ("fields", "field"), [({"guided_regex": ""}, "guided_regex"), ({"guided_json": "[1]"}, "guided_json")]
)
def test_guided_bounds_are_named_as_sent(fields: dict, field: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        _admitted(_chat(**fields))
    assert caught.value.field == field and f"'{field}'" in caught.value.message, caught.value.message


def test_only_parameter_errors_are_renamed() -> None:
    chat = _chat(logprobs=True, top_logprobs=2)
    compile_error = errors.InvalidRequest("response_format cannot be enforced", field="logprobs")
    assert codec.renamed(compile_error, chat) is compile_error
    queue_full = errors.QueueFull("full")
    assert codec.renamed(queue_full, chat) is queue_full


@pytest.mark.parametrize("fields", [{"guided_regex": "a("}, {"structured_outputs": {"grammar": "start: x x"}}])
def test_a_constraint_that_does_not_compile_is_named_as_sent(fields: dict) -> None:
    # The grammar compiles after admission and names the engine's field; the client sent another.
    compile_error = errors.InvalidRequest("response_format cannot be enforced: bad", field="response_format")
    named = codec.renamed(compile_error, _chat(**fields))
    sent = next(iter(fields))
    assert named.field == sent and named.message == f"{sent} cannot be enforced: bad"


# -- chat messages -----------------------------------------------------------------------


def test_chat_text_parts_are_joined_and_none_fields_dropped() -> None:
    req = _chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    messages = codec.chat_messages(req, SERVED)
    assert [m.content for m in messages] == ["be brief", "a\nb"]
    assert codec.template_messages(messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
    ]
    tools = [{"type": "function", "function": {"name": "f"}}]
    req = _chat(tools=tools, chat_template_kwargs={"x": 1})
    # tools go to the template as its own variable, not as a kwarg (which the renderer reserves)
    assert codec.template_kwargs(req) == {"x": 1}
    assert codec.template_tools(req) == tools


def test_tool_messages_round_trip_for_templates() -> None:
    req = _chat(
        messages=[
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}
                ],
            },
            {"role": "tool", "content": None, "tool_call_id": "c1"},
        ]
    )
    plain = codec.template_messages(codec.chat_messages(req, SERVED))
    assert plain[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"city": "Oslo"}}}],
    }
    assert plain[2] == {"role": "tool", "content": "", "tool_call_id": "c1"}
    bad = _chat(messages=[{"role": "assistant", "tool_calls": [{"function": {"name": "w", "arguments": "{oops"}}]}])
    with pytest.raises(errors.InvalidRequest, match="not valid JSON"):
        codec.chat_messages(bad, SERVED)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "name"),
        ({"tool_choice": "required"}, "needs 'tools'"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "'g'",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
            "tool_choice must be",
        ),
        ({"chat_template_kwargs": {"tools": []}}, "'tools'"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(body: dict, needle: str) -> None:
    with pytest.raises(errors.InvalidRequest) as caught:
        req = codec.decode_chat(json.dumps({"messages": [{"role": "user", "content": "x"}], **body}).encode())
        codec.template_kwargs(req)
    assert needle in caught.value.message
    assert caught.value.field in ("tools", "tool_choice", "chat_template_kwargs")


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_text_call_check_validates_names_and_arguments_against_the_schemas() -> None:
    check = tools.text_call_check(_chat(tools=[WEATHER_TOOL, {"type": "function", "function": {"name": "now"}}]))
    assert check is not None
    assert check("get_weather", {"city": "Paris"})
    assert not check("get_weather", {"city": 75})
    assert not check("get_weather", {})
    assert not check("get_time", {"city": "Paris"}), "not a declared tool"
    assert check("now", {}) and check("now", {"any": 1}), "no parameters: any object"


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": 5},
        {"$ref": "https://example.invalid/schema.json"},
        # A client's regex would run on the event loop with Python's backtracking re.
        {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(a+)+$"}}},
        {"type": "object", "$defs": {"x": {"patternProperties": {"(a|a)+": {}}}}},
    ],
)
def test_text_call_check_accepts_nothing_for_a_schema_it_cannot_use(parameters: dict) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    check = tools.text_call_check(_chat(tools=[tool]))
    assert check is not None and not check("f", {})


@pytest.mark.parametrize(
    ("fields", "is_checked"),
    [
        ({}, True),
        ({"tool_choice": "auto"}, True),
        ({"response_format": {"type": "text"}}, True),
        ({"tool_choice": "none"}, False),
        ({"tool_choice": "required"}, False),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, False),
        ({"response_format": {"type": "json_object"}}, False),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
            False,
        ),
        ({"structured_outputs": {"json_object": True}}, False),
        ({"guided_json": {"type": "object"}}, False),
    ],
)
def test_text_calls_only_at_tool_choice_auto_and_never_when_json_is_asked_for(fields: dict, is_checked: bool) -> None:
    assert (tools.text_call_check(_chat(tools=[WEATHER_TOOL], **fields)) is not None) is is_checked
    if "tool_choice" not in fields:
        assert tools.text_call_check(_chat(**fields)) is None, "no tools, no calls"


def test_chat_content_the_model_cannot_take() -> None:
    req = _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}}]}])
    with pytest.raises(errors.InvalidRequest) as caught:
        codec.chat_messages(req, SERVED)
    assert "image_url" in caught.value.message and caught.value.field == "messages"
    vision = codec.ServedModel(name="m", max_context_tokens=100, modalities=("text", "image"))
    assert isinstance(codec.chat_messages(req, vision)[0].content, list)


def test_chat_without_template_is_a_clear_400() -> None:
    bare = codec.ServedModel(name="m", max_context_tokens=100, has_chat_template=False)
    with pytest.raises(errors.InvalidRequest) as caught:
        codec.chat_messages(_chat(), bare)
    assert "no chat template" in caught.value.message and "/v1/completions" in caught.value.message


# -- errors ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "status", "kind", "code"),
    [
        (errors.InvalidRequest("bad", field="top_p"), 400, "invalid_request_error", "invalid_request"),
        (errors.ContextLengthExceeded(200, 100), 400, "invalid_request_error", "context_length_exceeded"),
        (codec.Unauthorized(), 401, "invalid_request_error", "invalid_api_key"),
        (codec.ModelNotFound("no model x"), 404, "invalid_request_error", "model_not_found"),
        (codec.BodyTooLarge(10), 413, "invalid_request_error", "request_too_large"),
        (errors.QueueFull(retry_after_s=0.2), 429, "rate_limit_error", "queue_full"),
        (errors.RateLimited(retry_after_s=3.5), 429, "rate_limit_error", "rate_limited"),
        (errors.MemoryPressure("too big"), 400, "invalid_request_error", "memory_pressure"),
        (errors.ModelNotReady(), 503, "service_unavailable_error", "model_loading"),
        (errors.RequestTimeout(), 504, "timeout_error", "timeout"),
        (errors.GenerationError("x"), 500, "server_error", "generation_error"),
        (errors.EngineDead(), 503, "server_error", "engine_dead"),
        (ValueError("internal detail"), 500, "server_error", "internal_error"),
    ],
)
def test_error_table(exc: Exception, status: int, kind: str, code: str) -> None:
    wire = codec.error_for(exc)
    body = json.loads(wire.body)["error"]
    assert (wire.status, body["type"], body["code"]) == (status, kind, code)
    assert set(body) == {"message", "type", "param", "code"}
    assert "internal detail" not in body["message"]


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    assert codec.error_for(errors.QueueFull(retry_after_s=0.2)).headers == {"Retry-After": "1"}
    assert codec.error_for(errors.RateLimited(retry_after_s=3.5)).headers == {"Retry-After": "4"}
    assert codec.error_for(errors.ModelNotReady()).headers == {"Retry-After": "1"}
    assert codec.error_for(errors.InvalidRequest("x")).headers == {}
    assert json.loads(codec.error_for(errors.InvalidRequest("bad", field="top_p")).body)["error"]["param"] == "top_p"


def test_sse_framing() -> None:
    assert sse.encode_event('{"a":1}') == b'data: {"a":1}\n\n'
    assert sse.encode_event("a\nb", event="x") == b"event: x\ndata: a\ndata: b\n\n"
    assert sse.encode_comment("keep-alive") == sse.KEEP_ALIVE
    assert sse.DONE == b"data: [DONE]\n\n"


def test_pure_modules_import_no_io_engine_or_frontend() -> None:
    import ast
    from pathlib import Path

    import rill.protocols.openai_http as package

    forbidden = ("asyncio", "socket", "threading", "starlette", "uvicorn", "torch", "rill.engine", "rill.frontend")
    for name in ("messages", "codec", "session"):
        tree = ast.parse((Path(package.__file__).parent / f"{name}.py").read_text())
        for node in ast.walk(tree):
            modules = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else ([node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            )
            for module in modules:
                assert not module.startswith(forbidden), f"{name}.py imports {module}"
            assert not isinstance(node, (ast.Await, ast.AsyncFunctionDef)), f"{name}.py awaits"


def test_a_forced_tool_call_sets_response_format_aside() -> None:
    # Agent frameworks force a tool in a first turn while asking for a structured last answer:
    # the forced call is the output (a text format shapes text, which a forced call never gives).
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "required",
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"type": "object"}}},
    }
    params = codec.sampling_params(codec.decode_chat(json.dumps(body).encode()), SERVED)
    assert params.response_format is not None and params.response_format.type == "grammar"
    body["tool_choice"] = "auto"
    params = codec.sampling_params(codec.decode_chat(json.dumps(body).encode()), SERVED)
    assert params.response_format is not None and params.response_format.type == "json_schema"
