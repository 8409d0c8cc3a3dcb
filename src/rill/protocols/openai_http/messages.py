"""Wire messages of the OpenAI-compatible HTTP API, named exactly as on the wire.

Requests are decoded leniently as OpenAI's own server does: unknown fields are ignored (SDKs
add new ones often) and ``null`` means "absent". Responses follow the shapes of the OpenAI
API reference (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``), including
``usage.prompt_tokens_details.cached_tokens``. Extensions beyond OpenAI's fields are the
sampling knobs vLLM also accepts (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``allowed_token_ids``), ``response_format`` on completions
too, with the extra types ``regex`` and ``grammar``, vLLM's ``structured_outputs``
(``json``, ``regex``, ``grammar``, ``choice``, ``json_object``), vLLM's older ``guided_json``,
``guided_regex``, ``guided_choice`` and ``guided_grammar`` (the same constraints under their old
names; ``guided_decoding_backend`` only ``auto`` or ``guidance``, the one rill runs, and
``guided_whitespace_pattern`` refused), vLLM's ``prompt_logprobs``
(requests) with its answer shape (``PromptLogprobOut``; left out of responses unless asked),
and rill's ``speculative`` (speculative decoding when the server runs it: false or 0 off, N at
most N draft tokens; the output is the same, only the speed differs).
"""

from __future__ import annotations

from typing import Any

import msgspec

from rill.protocols._shared.sampling import Field, SamplingMap, same

# ---------------------------------------------------------------------------- requests


class StreamOptions(msgspec.Struct, kw_only=True):
    """``stream_options``: ``include_usage`` adds a last chunk with usage and no choices."""

    include_usage: bool | None = False


class _CommonRequest(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = False
    user: str | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    prompt_logprobs: int | None = None
    speculative: bool | int | None = None


def _stop_list(stop: str | list[str]) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop)


SAMPLING = SamplingMap(
    _CommonRequest,
    same(
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "seed",
        "stop_token_ids",
        "allowed_token_ids",
        "logit_bias",
        "min_tokens",
        "ignore_eos",
        "speculative",
    ),
    Field("stop", "stop", _stop_list),
)
"""The sampling fields both endpoints share → ``SamplingParams``. ``max_tokens`` (resolved
against the context), ``logprobs`` (two shapes) and the constraint (three sources) are
derived by ``codec.sampling_params``; ``top_k`` -1 means off, as OpenAI-style clients send it."""


class CompletionRequest(_CommonRequest, kw_only=True):
    """``POST /v1/completions`` body.

    ``prompt`` is a string, a list of strings (one completion per prompt), a list of token
    ids, or a list of token-id lists; ``logprobs`` asks for the chosen token's logprob plus
    that many alternatives. ``echo`` puts the prompt before the completion (with ``logprobs``,
    the prompt tokens' too); ``best_of`` candidates are generated per prompt and the ``n``
    with the highest mean token logprob are returned.
    """

    prompt: Any = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessageIn(msgspec.Struct, kw_only=True):
    """One message of a chat request; ``content`` is text or a list of content parts."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(_CommonRequest, kw_only=True):
    """``POST /v1/chat/completions`` body.

    ``logprobs: true`` asks for per-token logprobs, ``top_logprobs`` for that many
    alternatives per token. ``tools`` and ``chat_template_kwargs`` are handed to the
    model's chat template.
    """

    messages: list[ChatMessageIn] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    echo: bool | None = None  # vLLM's chat echo; decoded only to be refused by name
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize`` body (vLLM's shape): a ``prompt``, or chat ``messages`` rendered by
    the chat template. ``add_special_tokens`` defaults to true for a prompt, false for
    messages (the template writes its own special tokens)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_generation_prompt: bool | None = True
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /detokenize`` body (vLLM's shape): the token ids to turn back into text."""

    model: str | None = None
    tokens: list[int] | None = None


# ---------------------------------------------------------------------------- responses


class ErrorDetail(msgspec.Struct, kw_only=True):
    """The ``error`` object: ``type`` is the class of error, ``param`` the offending field."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """OpenAI's error body: ``{"error": {...}}`` (also sent as an SSE event mid-stream)."""

    error: ErrorDetail


class ModelCard(msgspec.Struct, kw_only=True):
    """One entry of ``GET /v1/models``; ``max_model_len`` is a vLLM-style extension."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "rill"
    max_model_len: int | None = None


class TokenizeResponse(msgspec.Struct, kw_only=True):
    """``POST /tokenize`` answer: the ids, their count and the model's context length."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    """``POST /detokenize`` answer."""

    prompt: str


class ModelList(msgspec.Struct, kw_only=True):
    """``GET /v1/models`` body."""

    object: str = "list"
    data: list[ModelCard] = []


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    """``usage.prompt_tokens_details``: prompt tokens served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(msgspec.Struct, kw_only=True):
    """``usage`` of a response: token counts over all choices (each prompt counted once)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    """Legacy completions ``logprobs``: parallel lists, one entry per token (with ``echo``, the
    prompt's first; its first token has null logprob and alternatives)."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = []


class PromptLogprobOut(msgspec.Struct, kw_only=True):
    """One token of vLLM's ``prompt_logprobs`` (keyed by token id): its logprob, its rank among
    all tokens (1 is the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprobOut] | None]
"""vLLM's ``prompt_logprobs``: per prompt token (None for the first), the token and the asked
number of most likely alternatives, keyed by token id."""


class CompletionChoice(msgspec.Struct, kw_only=True):
    """One choice of a completion (or a chunk of one, when streaming)."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class Completion(msgspec.Struct, kw_only=True, omit_defaults=True):
    """``/v1/completions`` body, and each streamed chunk (same ``object`` in both cases).

    Chunks omit ``usage`` except the last one when ``stream_options.include_usage`` is set.
    """

    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class TopLogprobOut(msgspec.Struct, kw_only=True):
    """One alternative token of a chat ``logprobs.content`` entry."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    """One generated token of a chat ``logprobs.content`` list."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprobOut] = []


class ChatLogprobs(msgspec.Struct, kw_only=True):
    """Chat ``logprobs``: one entry per generated token."""

    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(msgspec.Struct, kw_only=True):
    """The function of a tool call: its name and JSON ``arguments`` (as text)."""

    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    """One tool call of a non-streamed assistant message."""

    id: str
    type: str = "function"
    function: FunctionCallOut


class FunctionCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of a streamed function call: the name once, then ``arguments`` fragments."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of tool call ``index`` in a chunk (``id`` and ``type`` only in its first piece)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class ChatMessageOut(msgspec.Struct, kw_only=True):
    """The assistant message of a non-streamed chat choice (``content`` null with only calls;
    ``tool_calls`` left out when there are none)."""

    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    """One choice of a chat completion."""

    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    """``/v1/chat/completions`` body (not streamed)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What a chunk adds to a chat choice: the role once (first chunk), then content."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    """One choice of a streamed chat chunk."""

    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One SSE chunk of a streamed chat completion (``object: chat.completion.chunk``)."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
