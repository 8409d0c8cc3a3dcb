"""One response of OpenAI's Responses API, built from engine outputs (pure).

The adapter's producer feeds a ``ResponsesSession`` the outputs of the response's one engine
request and appends every event it returns to the response's resumable stream; the events'
``sequence_number`` is their position in that stream, so a client resumes with
``starting_after`` = the last number it saw::

    start() → on_output(out)* → (events end with response.completed | .incomplete | .failed)
    cancel() / fail(exc) from outside end it early.

Output items: the model's text is one ``message`` item with one ``output_text`` part; each
tool call the chat tool parser reads is a ``function_call`` item. Text before a call that is
only whitespace opens no message item. ``snapshot()`` is the response object as it stands
(``GET /v1/responses/{id}`` while it runs); ``response()`` the same once it ended.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from rill.protocols._shared.tool_calls import (
    ContentDelta,
    ToolCallDelta,
    ToolCallParser,
    accept_text_calls,
    make_parser,
)
from rill.protocols.openai_http import codec
from rill.protocols.openai_http.logprobs import LogprobShapes
from rill.protocols.openai_http.responses_codec import new_id
from rill.protocols.openai_http.session import failure
from rill.types import RequestOutput

Event = dict[str, Any]

TERMINAL = ("completed", "incomplete", "failed", "cancelled")


class ResponsesSession:
    """Events and the response object of one ``/v1/responses`` response.

    Args:
        response_id: ``resp_…``.
        created_at: Unix seconds.
        model: the served model's name.
        echo: the request fields a response object repeats (instructions, tools, tool_choice,
            temperature, top_p, max_output_tokens, metadata, parallel_tool_calls, text,
            previous_response_id, store, background, ...).
        tool_format: read the output for tool calls in this format; None: all text.
        text_calls: see ``ResponseSession``'s argument of that name.
        logprobs: None, or how many alternatives each output token's logprobs show.
        token_text: the text of one token id (logprobs).
        parallel_tool_calls: False keeps only the first call.
    """

    def __init__(
        self,
        *,
        response_id: str,
        created_at: int,
        model: str,
        echo: dict[str, Any],
        tool_format: str | None = None,
        text_calls: Callable[[str, dict[str, Any]], bool] | None = None,
        logprobs: int | None = None,
        token_text: Callable[[int], str] = str,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.id = response_id
        self.created_at = created_at
        self.model = model
        self.echo = echo
        self.status = "queued" if echo.get("background") else "in_progress"
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.incomplete_details: dict[str, Any] | None = None
        self.completed_at: int | None = None
        self.sequence = 0
        self.parallel_tool_calls = parallel_tool_calls
        self.logprobs = logprobs
        self.shapes = LogprobShapes(logprobs, None, token_text)
        self.parser: ToolCallParser | None = None
        if tool_format is not None:
            parser = make_parser(tool_format, response_id)
            self.parser = parser if text_calls is None else accept_text_calls(parser, text_calls, response_id)
        self._message: dict[str, Any] | None = None  # the open message item
        self._held_space = ""  # whitespace not yet shown: it opens no message item alone
        self._call: dict[str, Any] | None = None  # the open function_call item
        self._calls_seen = 0

    @property
    def is_done(self) -> bool:
        """True once the response reached a final status."""
        return self.status in TERMINAL

    # -- events ----------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def start(self) -> list[Event]:
        """``response.created``, then ``response.queued`` (background) or ``response.in_progress``."""
        events = [self._event("response.created", response=self.snapshot())]
        kind = "response.queued" if self.status == "queued" else "response.in_progress"
        events.append(self._event(kind, response=self.snapshot()))
        return events

    def on_output(self, out: RequestOutput) -> list[Event]:
        """The events one engine output brings (deltas, items closed, the final event)."""
        if self.is_done:
            return []
        events: list[Event] = []
        if self.status == "queued":  # a background response's request got its first output
            self.status = "in_progress"
            events.append(self._event("response.in_progress", response=self.snapshot()))
        finish = out.finish_reason if out.finished else None
        failed = finish is not None and finish not in ("stop", "length")
        events += self._text(out, final=finish is not None and not failed)
        self.usage = _usage(out)
        if failed:
            return events + self._failed(failure(out))
        if finish is not None:
            if finish == "length" and self._call is not None:
                self._call["status"] = "incomplete"  # cut inside the call: not a call to run
            events += self._close_items()
            self.completed_at = self.created_at  # replaced by the adapter's clock when it stores
            if finish == "length":
                self.status = "incomplete"
                self.incomplete_details = {"reason": "max_output_tokens"}
                events.append(self._event("response.incomplete", response=self.snapshot()))
            else:
                self.status = "completed"
                events.append(self._event("response.completed", response=self.snapshot()))
        return events

    def _text(self, out: RequestOutput, *, final: bool) -> list[Event]:
        events: list[Event] = []
        logprobs = self._logprobs(out)
        if self.parser is None:
            events += self._content(out.text, logprobs)
            return events
        deltas = self.parser.feed(out.text) + (self.parser.finish() if final else [])
        for delta in deltas:
            if isinstance(delta, ContentDelta):
                events += self._content(delta.text, logprobs)
                logprobs = []
            elif isinstance(delta, ToolCallDelta):
                events += self._tool_delta(delta)
        return events

    def _logprobs(self, out: RequestOutput) -> list[dict[str, Any]]:
        if self.logprobs is None or not out.logprobs:
            return []
        shaped = self.shapes.chat(out.logprobs)
        content = shaped.content if shaped is not None else None
        return [msgspec.to_builtins(entry) for entry in content or []]

    def _content(self, text: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        if not text:
            return []
        events: list[Event] = []
        if self._message is None:
            if not text.strip():
                self._held_space += text
                return []
            text, self._held_space = self._held_space + text, ""
            events += self._close_call()
            events += self._open_message()
        message = self._message
        assert message is not None
        part = message["content"][0]
        part["text"] += text
        if self.logprobs is not None:
            part.setdefault("logprobs", []).extend(logprobs)
        events.append(
            self._event(
                "response.output_text.delta",
                item_id=message["id"],
                output_index=self._index(message),
                content_index=0,
                delta=text,
                logprobs=logprobs,
            )
        )
        return events

    def _open_message(self) -> list[Event]:
        message: dict[str, Any] = {
            "id": new_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._message = message
        self.output.append(message)
        index = self._index(message)
        events = [self._event("response.output_item.added", output_index=index, item=_copy(message))]
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
        if self.logprobs is not None:
            part["logprobs"] = []
        message["content"].append(part)
        events.append(
            self._event(
                "response.content_part.added",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                part=_copy(part),
            )
        )
        return events

    def _close_message(self) -> list[Event]:
        message, self._message = self._message, None
        if message is None:
            return []
        index = self._index(message)
        part = message["content"][0]
        message["status"] = "completed"
        return [
            self._event(
                "response.output_text.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=part.get("logprobs", []),
            ),
            self._event(
                "response.content_part.done",
                item_id=message["id"],
                output_index=index,
                content_index=0,
                part=_copy(part),
            ),
            self._event("response.output_item.done", output_index=index, item=_copy(message)),
        ]

    def _tool_delta(self, delta: ToolCallDelta) -> list[Event]:
        events: list[Event] = []
        if delta.id is not None:
            events += self._close_message() + self._close_call()
            self._calls_seen += 1
            if self._calls_seen > 1 and not self.parallel_tool_calls:
                return events  # parallel_tool_calls false: the first call only
            self._held_space = ""
            opened: dict[str, Any] = {
                "id": new_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": delta.id,
                "name": delta.name or "",
                "arguments": "",
            }
            self._call = opened
            self.output.append(opened)
            events.append(
                self._event("response.output_item.added", output_index=self._index(opened), item=_copy(opened))
            )
        call = self._call
        if call is None or not delta.arguments:
            return events
        call["arguments"] += delta.arguments
        events.append(
            self._event(
                "response.function_call_arguments.delta",
                item_id=call["id"],
                output_index=self._index(call),
                delta=delta.arguments,
            )
        )
        return events

    def _close_call(self) -> list[Event]:
        call, self._call = self._call, None
        if call is None:
            return []
        index = self._index(call)
        if call["status"] == "in_progress":
            call["status"] = "completed"
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=call["id"],
                output_index=index,
                name=call["name"],
                arguments=call["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=_copy(call)),
        ]

    def _close_items(self) -> list[Event]:
        return self._close_message() + self._close_call()

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, other in enumerate(self.output) if other is item)

    # -- ending from outside -----------------------------------------------------------------
    def fail(self, exc: BaseException) -> list[Event]:
        """End the response as failed (``error`` then ``response.failed``)."""
        if self.is_done:
            return []
        return self._failed(exc)

    def _failed(self, exc: BaseException) -> list[Event]:
        _, detail = codec.error_detail(exc)
        self.status = "failed"
        self.error = {"code": detail.code or "server_error", "message": detail.message}
        self._abandon_items()
        return [
            self._event("error", code=detail.code, message=detail.message, param=detail.param),
            self._event("response.failed", response=self.snapshot()),
        ]

    def cancel(self) -> list[Event]:
        """End the response as cancelled (``POST …/cancel``); its last event is
        ``response.failed`` with status ``cancelled`` (the API has no event of its own for it)."""
        if self.is_done:
            return []
        self.status = "cancelled"
        self._abandon_items()
        return [self._event("response.failed", response=self.snapshot())]

    def _abandon_items(self) -> None:
        """Items still being written end ``incomplete`` (and are never continued)."""
        for item in self.output:
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
        self._message = self._call = None

    # -- the response object -------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands now."""
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "model": self.model,
            "output": [_copy(item) for item in self.output],
            "error": self.error,
            "incomplete_details": self.incomplete_details,
            "usage": self.usage,
            "completed_at": self.completed_at if self.status == "completed" else None,
            **self.echo,
        }

    @property
    def output_text(self) -> str:
        """All output text (the SDKs' ``output_text``)."""
        return "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    copied: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(item))
    return copied


def _usage(out: RequestOutput) -> dict[str, Any]:
    usage = out.usage
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
