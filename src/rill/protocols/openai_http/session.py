"""Per-request response state of the OpenAI API (pure): engine outputs in, bytes out.

One ``ResponseSession`` lives for one HTTP request with ``num_choices`` engine requests
behind it (``n`` per prompt). The adapter feeds it every ``RequestOutput`` with the choice
index it belongs to, in arrival order, and writes what it returns:

    streamed:      start() → on_output(i, out)* → end()        (SSE event bytes)
    not streamed:  on_output(i, out)* → body()                 (one JSON document)

A choice's failure (``finish_reason`` ``error``, or ``cancelled`` while the client is still
there) sets ``failed``; the adapter then stops, sends ``end()`` (streamed: an error event,
then ``[DONE]``) or an error response (not streamed). Token strings for logprobs come from
``token_text`` (the client's ``decode([id])``), passed in so this module stays pure; the
logprobs' shapes are ``logprobs.py``'s.

Completions ``echo``: a choice's text starts with its prompt, and with ``logprobs`` its legacy
``logprobs`` lists start with the prompt tokens (the first one's logprob and alternatives
null); streamed, the echo goes in the choice's first chunk, once the engine has the prompt's
logprobs (a choice's text is held until then). The prompt's logprobs come with the first
candidate of each prompt only. ``best_of``: ``candidates`` engine requests per prompt, of which the ``n`` with the
highest mean token logprob (``cumulative_logprob / completion tokens``, end-of-sequence
included) are shown, most likely first (never streamed).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rill.errors import GenerationError, RillError
from rill.protocols._shared import sse
from rill.protocols._shared.tool_calls import (
    ContentDelta,
    ToolCallDelta,
    ToolCallParser,
    accept_text_calls,
    make_parser,
)
from rill.protocols.openai_http import codec
from rill.protocols.openai_http.logprobs import LogprobShapes, join
from rill.protocols.openai_http.messages import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionCallDelta,
    FunctionCallOut,
    PromptTokensDetails,
    ToolCallDeltaOut,
    ToolCallOut,
    UsageInfo,
)
from rill.types import RequestOutput, TokenLogprob, Usage

FINISH_REASONS = {"stop": "stop", "length": "length"}
"""Engine finish reasons a client may see, in OpenAI's words (eos, stop string and stop
token are all ``stop``; max tokens and a full context are ``length``)."""


class Kind(enum.Enum):
    """Which endpoint the session answers (decides the response shapes)."""

    COMPLETION = "text_completion"
    CHAT = "chat.completion"


@dataclass(frozen=True)
class EchoPrompt:
    """A prompt as the client sent it (``text``) and as the engine read it (``token_ids``)."""

    text: str
    token_ids: list[int]


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    num_chars: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    parser: ToolCallParser | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cumulative_logprob: float = 0.0
    has_output: bool = False
    is_echoed: bool = False  # streamed: the prompt (and what was held until then) went out


class ResponseSession:
    """Builds the chunks or the body of one OpenAI response from engine outputs.

    Args:
        kind: completions or chat completions.
        response_id: ``cmpl-…`` / ``chatcmpl-…``, the same in every chunk.
        created: Unix seconds, the same in every chunk.
        model: the served model name.
        num_choices: engine requests behind this response; choice ``k`` is for prompt ``k // n``.
        n: choices per prompt.
        include_usage: send a last chunk with usage (``stream_options.include_usage``).
        logprobs: None, or how many alternatives per token the client asked for.
        token_text: the text of one token id (for logprobs).
        tool_format: chat only: read each choice's text for tool calls in this format
            (``rill.protocols._shared.tool_calls.FORMATS``); None leaves the text as it is.
        text_calls: with ``tool_format``: a reply that is only a JSON call object (fenced or
            bare) becomes a call when this ``(name, arguments) -> bool`` accepts it
            (``tools.text_call_check``); None leaves such a reply as content.
        candidates: engine requests per prompt (``best_of``; ``n`` when None); the best ``n``
            of each prompt are shown (not streamed).
        echo: completions only: the prompt of each prompt index, put before its completions.
        prompt_logprobs: None, or how many alternatives vLLM's ``prompt_logprobs`` shows.
    """

    def __init__(
        self,
        *,
        kind: Kind,
        response_id: str,
        created: int,
        model: str,
        num_choices: int,
        n: int = 1,
        include_usage: bool = False,
        logprobs: int | None = None,
        token_text: Callable[[int], str] = str,
        tool_format: str | None = None,
        candidates: int | None = None,
        echo: list[EchoPrompt] | None = None,
        prompt_logprobs: int | None = None,
        text_calls: Callable[[str, dict[str, Any]], bool] | None = None,
    ) -> None:
        self.kind = kind
        self.response_id = response_id
        self.created = created
        self.model = model
        self.n = n
        self.candidates = max(n, candidates or n)
        self.echo = echo if kind is Kind.COMPLETION else None
        self.prompt_logprobs = prompt_logprobs
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.token_text = token_text
        self.shapes = LogprobShapes(logprobs, prompt_logprobs, token_text)
        self.choices = [_Choice() for _ in range(num_choices)]
        if tool_format is not None and kind is Kind.CHAT:
            for i, choice in enumerate(self.choices):
                prefix = f"{response_id}/{i}"
                parser = make_parser(tool_format, prefix)
                choice.parser = parser if text_calls is None else accept_text_calls(parser, text_calls, prefix)
        self.failed: BaseException | None = None

    @property
    def builds_per_token_detail(self) -> bool:
        """True when the response carries per-token detail (logprobs, prompt logprobs, an
        echoed prompt): building it costs time in proportion to the tokens, up to hundreds of
        milliseconds for a long scored prompt, so the adapter builds it off the event loop."""
        return self.logprobs is not None or self.prompt_logprobs is not None or self.echo is not None

    @property
    def is_done(self) -> bool:
        """True once every choice finished or one failed."""
        return self.failed is not None or all(c.finish_reason is not None for c in self.choices)

    # -- streaming -----------------------------------------------------------------------
    def start(self) -> list[bytes]:
        """First events of a stream: for chat, one chunk per choice announcing the role."""
        if self.kind is not Kind.CHAT:
            return []
        return [
            self._chat_chunk(ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content="")))
            for i in range(len(self.choices))
        ]

    def on_output(self, index: int, out: RequestOutput) -> list[bytes]:
        """Record one output of choice ``index``; return the SSE events to send (if streaming).

        Returns an empty list when there is nothing new to show (e.g. only lifecycle events).
        Callers that do not stream ignore the return value.
        """
        if self.failed is not None:
            return []
        choice = self.choices[index]
        choice.usage = out.usage
        if out.prompt_logprobs is not None:
            choice.prompt_logprobs = out.prompt_logprobs
        if out.cumulative_logprob is not None:
            choice.cumulative_logprob = out.cumulative_logprob
        failed = out.finished and out.finish_reason not in FINISH_REASONS
        # A coalesced output may carry tokens and the failure together: show the tokens first.
        events = self._append(index, out, None if failed else FINISH_REASONS.get(out.finish_reason or ""))
        if failed:
            self.failed = failure(out)
            events.append(sse.encode_event(codec.error_event_data(self.failed)))
        return events

    def _append(self, index: int, out: RequestOutput, finish: str | None) -> list[bytes]:
        choice = self.choices[index]
        if self.kind is Kind.CHAT:
            return self._append_chat(index, choice, out, finish)
        offset = choice.num_chars
        choice.text.append(out.text)
        choice.num_chars += len(out.text)
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        choice.finish_reason = finish
        choice.has_output = True
        if self.echo is not None and not choice.is_echoed:
            # Until its echo can go out, a choice's text and logprobs are held (in ``choice``).
            # The prompt's logprobs come with the first candidate of the prompt: when they
            # arrive, the held choices of that prompt go out too.
            first = index - index % self.candidates
            group = range(first, min(first + self.candidates, len(self.choices))) if index == first else [index]
            return [event for j in group for event in self._echo_chunk(j)]
        if not out.text and not out.logprobs and finish is None:
            return []
        if self.echo is not None:
            offset += len(self.echo[index // self.candidates].text)
        choice_chunk = CompletionChoice(
            index=index, text=out.text, finish_reason=finish, logprobs=self.shapes.completion(out.logprobs, offset)
        )
        return [sse.encode_event(codec.encode(self._completion([choice_chunk])))]

    def _echo_chunk(self, index: int) -> list[bytes]:
        """Streamed: choice ``index``'s first chunk (its prompt, then what it holds) once the
        prompt's logprobs are there (when asked); nothing before that or after it was sent."""
        choice = self.choices[index]
        if choice.is_echoed or not choice.has_output:
            return []
        if self.logprobs is not None and self._prompt_logprobs_of(index) is None:
            return []
        choice.is_echoed = True
        echo_text, echo_logprobs = self._echo(index)
        logprobs = self.shapes.completion(choice.logprobs, len(echo_text))
        if echo_logprobs is not None and logprobs is not None:
            logprobs = join(echo_logprobs, logprobs)
        chunk = CompletionChoice(
            index=index, text=echo_text + "".join(choice.text), finish_reason=choice.finish_reason, logprobs=logprobs
        )
        return [sse.encode_event(codec.encode(self._completion([chunk])))]

    def _prompt_logprobs_of(self, index: int) -> list[TokenLogprob | None] | None:
        """The prompt logprobs of choice ``index``'s prompt (the engine computes them for the
        prompt's first candidate only, see ``codec.generate_requests``)."""
        return self.choices[index - index % self.candidates].prompt_logprobs

    def _echo(self, index: int) -> tuple[str, CompletionLogprobs | None]:
        """The prompt of choice ``index`` as text and, with ``logprobs``, as legacy logprobs."""
        assert self.echo is not None
        prompt = self.echo[index // self.candidates]
        if self.logprobs is None:
            return prompt.text, None
        return prompt.text, self.shapes.prompt(prompt.token_ids, self._prompt_logprobs_of(index))

    def _append_chat(self, index: int, choice: _Choice, out: RequestOutput, finish: str | None) -> list[bytes]:
        text, calls = out.text, []
        if choice.parser is not None:
            deltas = choice.parser.feed(out.text) + (choice.parser.finish() if finish is not None else [])
            text = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
            calls = [_call_delta(d) for d in deltas if isinstance(d, ToolCallDelta)]
            if finish == "stop" and choice.parser.calls:
                finish = "tool_calls"
        choice.text.append(text)
        if out.logprobs:
            choice.logprobs.extend(out.logprobs)
        choice.finish_reason = finish
        if not text and not calls and not out.logprobs and finish is None:
            return []
        content = text if text or (finish is None and not calls) else None
        delta = ChatDelta(content=content, tool_calls=calls or None)
        chunk = ChatChunkChoice(index=index, delta=delta, logprobs=self.shapes.chat(out.logprobs), finish_reason=finish)
        return [self._chat_chunk(chunk)]

    def end(self) -> list[bytes]:
        """Last events of a stream: the error (if failed) or the usage chunk, then ``[DONE]``."""
        events: list[bytes] = []
        if self.failed is None and self.include_usage:
            if self.kind is Kind.CHAT:
                events.append(self._chat_chunk(None, usage=self.usage()))
            else:
                events.append(sse.encode_event(codec.encode(self._completion([], usage=self.usage()))))
        events.append(sse.DONE)
        return events

    def fail(self, exc: BaseException) -> list[bytes]:
        """Fail the response from outside (e.g. the engine died); return the error event."""
        if self.failed is not None:
            return []
        self.failed = exc
        return [sse.encode_event(codec.error_event_data(exc))]

    # -- not streaming ---------------------------------------------------------------------
    def body(self) -> bytes:
        """The whole JSON response, once ``is_done`` and not ``failed``."""
        if self.kind is Kind.CHAT:
            choices = [
                ChatChoice(
                    index=i, message=_message(c), logprobs=self.shapes.chat(c.logprobs), finish_reason=c.finish_reason
                )
                for i, c in enumerate(self.choices)
            ]
            return codec.encode(
                ChatCompletion(
                    id=self.response_id,
                    object="chat.completion",
                    created=self.created,
                    model=self.model,
                    choices=choices,
                    usage=self.usage(),
                    prompt_logprobs=self.shapes.vllm_prompt(self.choices[0].prompt_logprobs),
                )
            )
        choices_out: list[CompletionChoice] = []
        for index in self._shown():
            c = self.choices[index]
            echo_text, echo_logprobs = self._echo(index) if self.echo is not None else ("", None)
            logprobs = self.shapes.completion(c.logprobs, len(echo_text))
            if echo_logprobs is not None and logprobs is not None:
                logprobs = join(echo_logprobs, logprobs)
            choices_out.append(
                CompletionChoice(
                    index=len(choices_out),
                    text=echo_text + "".join(c.text),
                    finish_reason=c.finish_reason,
                    logprobs=logprobs,
                    prompt_logprobs=self.shapes.vllm_prompt(self._prompt_logprobs_of(index)),
                )
            )
        return codec.encode(self._completion(choices_out, usage=self.usage()))

    def _shown(self) -> list[int]:
        """The choices to show, in order: all of them, or the best ``n`` of each prompt's candidates."""
        if self.candidates == self.n:
            return list(range(len(self.choices)))
        shown = []
        for first in range(0, len(self.choices), self.candidates):
            group = range(first, min(first + self.candidates, len(self.choices)))
            ranked = sorted(group, key=lambda i: -self._mean_logprob(self.choices[i]))  # stable: ties keep order
            shown.extend(ranked[: self.n])
        return shown

    @staticmethod
    def _mean_logprob(choice: _Choice) -> float:
        num_tokens = choice.usage.completion_tokens
        return choice.cumulative_logprob / num_tokens if num_tokens else 0.0

    def usage(self) -> UsageInfo:
        """Token counts over all choices; each prompt's tokens are counted once, not ``n`` times."""
        firsts = self.choices[:: max(1, self.candidates)]
        prompt = sum(c.usage.prompt_tokens for c in firsts)
        cached = sum(c.usage.cached_tokens for c in firsts)
        completion = sum(c.usage.completion_tokens for c in self.choices)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    # -- shapes ------------------------------------------------------------------------------
    def _completion(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> Completion:
        return Completion(
            id=self.response_id,
            object="text_completion",
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
        )

    def _chat_chunk(self, choice: ChatChunkChoice | None, usage: UsageInfo | None = None) -> bytes:
        chunk = ChatCompletionChunk(
            id=self.response_id,
            object="chat.completion.chunk",
            created=self.created,
            model=self.model,
            choices=[choice] if choice else [],
            usage=usage,
        )
        return sse.encode_event(codec.encode(chunk))


def _call_delta(delta: ToolCallDelta) -> ToolCallDeltaOut:
    if delta.id is not None:
        return ToolCallDeltaOut(
            index=delta.index,
            id=delta.id,
            type="function",
            function=FunctionCallDelta(name=delta.name, arguments=delta.arguments),
        )
    return ToolCallDeltaOut(index=delta.index, function=FunctionCallDelta(arguments=delta.arguments))


def _message(choice: _Choice) -> ChatMessageOut:
    content = "".join(choice.text)
    calls = list(choice.parser.calls) if choice.parser is not None else []
    if choice.parser is not None and choice.parser.cut is not None:
        # Cut inside a call (``max_tokens``): the call as far as it was written, as a stream
        # showed it; ``finish_reason`` stays ``length`` so the client knows it is not whole.
        calls.append(choice.parser.cut)
    if not calls:
        return ChatMessageOut(content=content)
    tool_calls = [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls]
    return ChatMessageOut(content=content if content.strip() else None, tool_calls=tool_calls)


def failure(out: RequestOutput) -> RillError:
    """The error of an engine output that ended without a result (cancelled by the server, or failed)."""
    if out.finish_reason == "cancelled":
        return codec.RequestCancelled("the request was cancelled by the server before it finished")
    if isinstance(out.error, RillError):
        return out.error
    return GenerationError("generation failed")
