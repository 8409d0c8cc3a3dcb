"""OpenAI chat messages → rill's neutral ``ChatMessage``s and the chat template's inputs.

Pure: text parts are joined, content parts the model cannot take are refused, tool-call
arguments (JSON text on the wire) become objects as chat templates expect.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec

from rill.errors import InvalidRequest
from rill.protocols.openai_http.messages import ChatCompletionRequest, ChatMessageIn, TokenizeRequest
from rill.types import ChatMessage, check_template_kwargs

if TYPE_CHECKING:
    from rill.protocols.openai_http.codec import ServedModel


def chat_messages(req: ChatCompletionRequest | TokenizeRequest, served: ServedModel) -> list[ChatMessage]:
    """The request's messages as neutral ``ChatMessage``s (text parts joined into strings).

    Raises ``InvalidRequest`` when the model has no chat template, or a message holds a
    content part the model cannot take (e.g. an image for a text-only model).
    """
    if not served.has_chat_template:
        raise InvalidRequest(
            f"model '{served.name}' has no chat template, so /v1/chat/completions cannot format "
            "messages; use /v1/completions with a plain prompt",
            field="messages",
        )
    return [_chat_message(i, m, served) for i, m in enumerate(req.messages or [])]


def _chat_message(index: int, msg: ChatMessageIn, served: ServedModel) -> ChatMessage:
    content: str | list[dict[str, Any]] | None = msg.content
    if isinstance(content, list):
        kinds = {str(part.get("type")) for part in content}
        if kinds <= {"text"}:
            # Most chat templates expect a string; text-only part lists are joined as OpenAI does.
            content = "\n".join(str(part.get("text", "")) for part in content)
        else:
            unknown = sorted(k for k in kinds - {"text"} if k.split("_", 1)[0] not in served.modalities)
            if unknown:
                raise InvalidRequest(
                    f"messages[{index}] has content of type {', '.join(unknown)}, which model "
                    f"'{served.name}' cannot take (it takes {', '.join(served.modalities)})",
                    field="messages",
                )
    if content is None:
        # An assistant turn that only calls tools has null content; templates concatenate it.
        content = ""
    return ChatMessage(
        role=msg.role,
        content=content,
        name=msg.name,
        tool_calls=_template_tool_calls(index, msg),
        tool_call_id=msg.tool_call_id,
    )


def _template_tool_calls(index: int, msg: ChatMessageIn) -> list[dict[str, Any]] | None:
    # OpenAI sends arguments as JSON text; chat templates (Qwen, Llama 3.1) expect an object
    # and render it with tojson, so it is parsed here (as transformers documents it).
    if msg.tool_calls is None:
        return None
    calls = []
    for call in msg.tool_calls:
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest(f"messages[{index}].tool_calls entries need function.name", field="messages")
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError as exc:
                raise InvalidRequest(
                    f"messages[{index}].tool_calls arguments are not valid JSON", field="messages"
                ) from exc
        calls.append({**call, "function": {**fn, "arguments": arguments}})
    return calls


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as plain dicts for a chat template (``None`` fields left out)."""
    return [{k: v for k, v in msgspec.structs.asdict(m).items() if v is not None} for m in messages]


def template_kwargs(req: ChatCompletionRequest) -> dict[str, Any]:
    """Extra variables for the chat template from ``chat_template_kwargs`` (``tools`` go apart,
    see ``template_tools``)."""
    kwargs = check_template_kwargs(req.chat_template_kwargs or {})
    return kwargs


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The ``tools`` to hand to the chat template (None without tools)."""
    return list(req.tools) if req.tools else None
