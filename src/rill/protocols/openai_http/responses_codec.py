"""Pure translation of OpenAI's Responses API requests (``POST /v1/responses``).

A Responses request is decoded, checked field by field (an unsupported field that is set
gets a 400 naming it: built-in tools, reasoning, stored prompts, conversations), and
translated into the chat request the chat-completions path already knows how to run: its
``input`` items (messages, ``function_call`` and ``function_call_output`` items), after the
``instructions`` and the history a ``previous_response_id`` brings, become chat messages;
function tools, ``tool_choice`` and ``text.format`` become their chat shapes, so the same tool
parser, constraint grammars and submission policy serve both routes.

Items are kept as the JSON objects the API shows (``input_items``, stored history): each
with an ``id`` (``msg_…``, ``fc_…``, ``fco_…``) and a ``type``.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from rill.errors import InvalidRequest
from rill.protocols.openai_http.codec import decode_body, field_of
from rill.protocols.openai_http.messages import ChatCompletionRequest, ChatMessageIn

SUPPORTED = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "parallel_tool_calls",
        "metadata",
        "store",
        "previous_response_id",
        "include",
        "stream",
        "background",
        "top_logprobs",
        "user",
        "seed",
    }
)
"""Fields this server acts on."""

IGNORED = frozenset(
    {
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "stream_options",
        "truncation",  # checked below: only "disabled" (OpenAI's default) is accepted
    }
)
"""Fields accepted with any value because they change nothing here (billing, caching hints,
stream obfuscation); every other field not in ``SUPPORTED`` is refused when set."""

INCLUDABLE = frozenset({"message.output_text.logprobs"})

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The fields of ``POST /v1/responses`` this server reads."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    include: list[str] | None = None
    stream: bool | None = None
    background: bool | None = None
    top_logprobs: int | None = None
    user: str | None = None
    seed: int | None = None
    truncation: str | None = None

    @property
    def stores(self) -> bool:
        """``store`` (OpenAI's default: true)."""
        return self.store is not False

    @property
    def wants_logprobs(self) -> bool:
        """Whether the output text's logprobs are to be shown (``include``)."""
        return "message.output_text.logprobs" in (self.include or [])


_any_decoder = msgspec.json.Decoder(dict[str, Any])


def decode(body: bytes) -> ResponsesRequest:
    """Parse and check a ``/v1/responses`` body; ``InvalidRequest`` names the bad field."""
    raw = decode_body(_any_decoder, body)
    for name, value in raw.items():
        if name not in SUPPORTED and name not in IGNORED and value is not None:
            raise InvalidRequest(f"'{name}' is not supported by this server's Responses API", field=name)
    try:
        req = msgspec.convert(raw, ResponsesRequest)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}", field=field_of(str(exc))) from exc
    _check(req)
    return req


def _check(req: ResponsesRequest) -> None:
    if req.input is None or req.input == "" or req.input == []:
        raise InvalidRequest("'input' is required: a string or a non-empty list of items", field="input")
    if req.truncation not in (None, "disabled"):
        raise InvalidRequest(
            "'truncation' other than 'disabled' is not supported: a conversation longer than the "
            "context is refused, never cut",
            field="truncation",
        )
    if req.background and not req.stores:
        raise InvalidRequest("'background' needs 'store' (a background response is kept to be read)", field="store")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise InvalidRequest("'max_output_tokens' must be >= 1", field="max_output_tokens")
    for item in req.include or []:
        if item not in INCLUDABLE:
            raise InvalidRequest(
                f"'include' value {item!r} is not supported (supported: {sorted(INCLUDABLE)})", field="include"
            )
    if req.metadata is not None:
        if len(req.metadata) > MAX_METADATA_PAIRS:
            raise InvalidRequest(f"'metadata' holds at most {MAX_METADATA_PAIRS} pairs", field="metadata")
        for key, value in req.metadata.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise InvalidRequest(
                    f"'metadata' keys are at most {MAX_METADATA_KEY} characters and values {MAX_METADATA_VALUE}",
                    field="metadata",
                )
    for index, tool in enumerate(req.tools or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequest(
                f"tools[{index}]: only function tools are supported (built-in tool {kind!r} is not)", field="tools"
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidRequest(f"tools[{index}]: a function tool needs a 'name'", field="tools")
    input_items(req.input)  # shapes checked before anything runs


# ----------------------------------------------------------------------------- items


def new_id(prefix: str) -> str:
    """A fresh item or response id (``prefix_`` + 32 hex digits)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(value: str | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``input`` as a list of items with ids, each checked; a string is one user message."""
    if value is None:
        return []
    if isinstance(value, str):
        return [_message_item("user", [{"type": "input_text", "text": value}])]
    return [_input_item(index, item) for index, item in enumerate(value)]


def _message_item(role: str, content: list[dict[str, Any]], item_id: str | None = None) -> dict[str, Any]:
    return {"id": item_id or new_id("msg"), "type": "message", "role": role, "status": "completed", "content": content}


def _input_item(index: int, item: Any) -> dict[str, Any]:
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise InvalidRequest(f"{where} must be an object", field="input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise InvalidRequest(f"{where}.role must be user, assistant, system or developer", field="input")
        return _message_item(role, _content_parts(where, role, item.get("content")), item.get("id"))
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise InvalidRequest(f"{where}: a function_call item needs a string '{key}'", field="input")
        return {
            "id": item.get("id") or new_id("fc"),
            "type": "function_call",
            "call_id": item["call_id"],
            "name": item["name"],
            "arguments": item["arguments"],
            "status": "completed",
        }
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(item.get("call_id"), str):
            raise InvalidRequest(f"{where}: a function_call_output item needs a string 'call_id'", field="input")
        if isinstance(output, list):
            output = "".join(_part_text(where, part) for part in output)
        if not isinstance(output, str):
            raise InvalidRequest(f"{where}: 'output' must be a string or text parts", field="input")
        return {
            "id": item.get("id") or new_id("fco"),
            "type": "function_call_output",
            "call_id": item["call_id"],
            "output": output,
            "status": "completed",
        }
    raise InvalidRequest(
        f"{where}: input items of type {kind!r} are not supported (message, function_call and "
        "function_call_output are)",
        field="input",
    )


def _content_parts(where: str, role: str, content: Any) -> list[dict[str, Any]]:
    kind = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [{"type": kind, "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of content parts", field="input")
    return [{"type": kind, "text": _part_text(where, part)} for part in content]


def _part_text(where: str, part: Any) -> str:
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"):
        text = part.get("text")
        if isinstance(text, str):
            return text
    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
    raise InvalidRequest(f"{where}: content parts of type {kind!r} are not supported (text parts are)", field="input")


def item_text(item: dict[str, Any]) -> str:
    """The text of a message item (its parts joined)."""
    return "".join(part.get("text", "") for part in item.get("content", []))


# ----------------------------------------------------------------------------- to chat


def chat_request(
    req: ResponsesRequest, history: list[dict[str, Any]], items: list[dict[str, Any]]
) -> ChatCompletionRequest:
    """The chat request that runs this response: instructions, then ``history`` (the items of
    the responses it continues), then this request's ``items``; tools, tool choice, output
    format and sampling in their chat shapes."""
    messages: list[ChatMessageIn] = []
    if req.instructions:
        messages.append(ChatMessageIn(role="system", content=req.instructions))
    for item in [*history, *items]:
        _add_item(messages, item)
    logprobs = req.wants_logprobs or bool(req.top_logprobs)
    return ChatCompletionRequest(
        model=req.model,
        messages=messages,
        max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        user=req.user,
        tools=[_chat_tool(t) for t in req.tools] if req.tools else None,
        tool_choice=_chat_tool_choice(req.tool_choice),
        response_format=_chat_format(req.text),
        logprobs=logprobs,
        top_logprobs=req.top_logprobs if logprobs else None,
    )


def _add_item(messages: list[ChatMessageIn], item: dict[str, Any]) -> None:
    kind = item["type"]
    if kind == "message":
        role = "system" if item["role"] == "developer" else item["role"]
        messages.append(ChatMessageIn(role=role, content=item_text(item)))
    elif kind == "function_call":
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant" and last.tool_calls is not None:
            last.tool_calls.append(call)  # parallel calls: one assistant turn
        else:
            messages.append(ChatMessageIn(role="assistant", content=None, tool_calls=[call]))
    elif kind == "function_call_output":
        messages.append(ChatMessageIn(role="tool", content=item["output"], tool_call_id=item["call_id"]))


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequest(
                "'tool_choice' must be auto, none, required or {type: function, name}", field="tool_choice"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _chat_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if not text:
        return None
    unknown = set(text) - {"format", "verbosity"}
    if unknown:
        raise InvalidRequest(f"'text.{sorted(unknown)[0]}' is not supported", field="text")
    spec = text.get("format")
    if spec is None:
        return None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(spec, dict)
        schema = {key: spec[key] for key in ("name", "schema", "strict", "description") if key in spec}
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest("'text.format.type' must be text, json_object or json_schema", field="text")


RENAMES = {
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "messages": "input",
    "logprobs": "top_logprobs",
}
"""Chat field names in errors, as this API names them."""


def renamed(exc: BaseException) -> BaseException:
    """``exc`` with its field named as a Responses request names it."""
    if isinstance(exc, InvalidRequest) and exc.field in RENAMES:
        exc.message = exc.message.replace(f"'{exc.field}'", f"'{RENAMES[exc.field]}'")
        exc.args = (exc.message,)
        exc.field = RENAMES[exc.field]
    return exc
