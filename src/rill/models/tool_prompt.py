"""A system prompt that shows a model its tools when its chat template does not.

Some chat templates (SmolLM2's among them) ignore the ``tools`` they are given, so a model
offered functions never learns of them and never calls one. For such a template the
frontend adds this prompt to the conversation: the functions as JSON schemas and how to
call them, in the tool-call format the server's parser reads (names as in
``rill.protocols._shared.tool_calls.FORMATS``). It is merged into the conversation's leading
system message rather than added as a second one, which many templates refuse or misplace.

Whether a template renders tools is ``rill.models.chat_template.renders_tools``.
Imports: json, msgspec, rill.errors, rill.types.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from rill.errors import InvalidRequest
from rill.types import ChatMessage

_HERMES = (
    "# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)

_LLAMA3_JSON = (
    "You have access to the following functions:\n\n{tools}\n\n"
    "To call a function, respond only with a JSON object in the format "
    '{{"name": <function-name>, "parameters": <args-json-object>}}, and nothing else. '
    "Do not use variables."
)

_TEMPLATES = {"hermes": _HERMES, "llama3_json": _LLAMA3_JSON}


def tool_system_prompt(tools: Sequence[Any], fmt: str) -> str:
    """The system prompt text that lists ``tools`` (one JSON schema a line) and teaches ``fmt``.

    Raises:
        ValueError: ``fmt`` is not a known tool-call format.
        InvalidRequest: a tool is not JSON (or nested past what ``json`` can walk), as a
            template's ``tojson`` would refuse it.
    """
    if fmt not in _TEMPLATES:
        raise ValueError(f"no tool prompt for the tool-call format {fmt!r}")
    try:
        listed = "\n".join(json.dumps(_plain(tool), ensure_ascii=False) for tool in tools)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequest(f"tools cannot be written as JSON: {type(exc).__name__}", field="tools") from exc
    return _TEMPLATES[fmt].format(tools=listed)


def with_tool_prompt(messages: Sequence[Any], tools: Sequence[Any], fmt: str) -> list[Any]:
    """``messages`` with the tool prompt in their leading system message (a new one when none).

    Messages may be ``ChatMessage`` structs or dicts; the ones given are not changed. A system
    message's text content gets the prompt after a blank line; a content given as parts gets
    it as one more text part.
    """
    prompt = tool_system_prompt(tools, fmt)
    out = list(messages)
    first = out[0] if out else None
    if isinstance(first, ChatMessage) and first.role == "system":
        out[0] = msgspec.structs.replace(first, content=_joined(first.content, prompt))
    elif isinstance(first, dict) and first.get("role") == "system":
        out[0] = {**first, "content": _joined(first.get("content"), prompt)}
    else:
        out.insert(0, ChatMessage(role="system", content=prompt))
    return out


def _joined(content: Any, prompt: str) -> Any:
    if content is None or content == "":
        return prompt
    if isinstance(content, str):
        return f"{content}\n\n{prompt}"
    if isinstance(content, list):
        return [*content, {"type": "text", "text": f"\n\n{prompt}"}]
    return content  # not a chat content: the template (or its checks) will say so


def _plain(value: Any) -> Any:
    # Tools normally arrive as parsed JSON; a struct is turned into the same builtins.
    return msgspec.to_builtins(value) if isinstance(value, msgspec.Struct) else value
