"""Pure translation between OpenAI's HTTP wire format and rill's neutral types.

Request side: ``decode_*`` turns a body into a typed request (or ``InvalidRequest`` naming
the field; the ``tools`` of a chat request are checked by ``tools.check_tools``); ``sampling_params`` maps it to the parameters of its choices, which the
adapter submits with the prompts in one ``Submission`` (the frontend's policy tokenizes,
fits ``max_tokens`` to the context, validates once and starts one engine request per
choice); ``renamed`` names the policy's refusals as this request named the fields.
Error side: ``ERROR_TABLE`` maps every ``rill.errors`` class (looked up by MRO, so the most
specific class wins) to an HTTP status and OpenAI error ``type``; ``error_for`` renders the
status, headers and ``{"error": {...}}`` body. Unexpected exceptions get a generic message:
their text never reaches a client.

No I/O, no engine, no clock: tokenizing and timing are the adapter's job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar, cast

import msgspec

from rill.errors import (  # the HTTP-level classes stay reachable as codec.X for the adapter and tests
    BodyTooLarge,
    CacheMiss,
    ContextLengthExceeded,
    EngineDead,
    EngineError,
    Forbidden,
    IdleTimeout,
    InvalidRequest,
    MemoryPressure,
    MethodNotAllowed,
    ModelNotReady,
    QueueFull,
    RateLimited,
    ReplicaLost,
    RequestNotFound,
    RequestRejected,
    RequestTimeout,
    RillError,
    RouteNotFound,
    Unauthorized,
)
from rill.protocols._shared import jsonguard
from rill.protocols._shared.errors import ErrorEntry, ErrorTable, lookup
from rill.protocols.openai_http.chat_messages import (  # reachable as codec.X, as before
    chat_messages,
)
from rill.protocols.openai_http.chat_messages import (
    template_kwargs as template_kwargs,
)
from rill.protocols.openai_http.chat_messages import (
    template_messages as template_messages,
)
from rill.protocols.openai_http.chat_messages import (
    template_tools as template_tools,
)
from rill.protocols.openai_http.constraints import GUIDED, check_formats, constraint_field, response_format
from rill.protocols.openai_http.messages import (
    SAMPLING,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorDetail,
    ErrorResponse,
    TokenizeRequest,
)
from rill.protocols.openai_http.tools import check_tools
from rill.types import MAX_TOKENS_LIMIT, GenerateRequest, InvalidParameter, SamplingParams, check_template_kwargs

PROTOCOL = "openai_http"

T = TypeVar("T")
"""``GenerateRequest.protocol`` of every request of this API (labels metrics)."""

MAX_N = 128
"""Most choices (``n``) per request, as OpenAI allows."""

MAX_LOGPROBS = 20
"""Most alternatives per token for ``logprobs`` / ``top_logprobs`` (OpenAI's chat bound)."""


# ----------------------------------------------------------------------------- errors


class ModelNotFound(InvalidRequest):
    """The request names a model its route does not serve, or the route's model is off on
    this server (HTTP 404, ``model_not_found``: every route's, as OpenAI's)."""

    code = "model_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message, field="model")


def model_off(what: str, flag: str) -> ModelNotFound:
    """The route's model is off on this server: ``flag`` turns it on."""
    return ModelNotFound(f"this server serves no {what}: start it with {flag}")


class RequestCancelled(RillError):
    """The server cancelled the request before it finished (e.g. while shutting down)."""

    code = "cancelled"
    retryable = True


@dataclass(frozen=True)
class WireError:
    """An error as sent: HTTP status, extra headers and the JSON body bytes."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


ERROR_TABLE: ErrorTable = {
    # class: (OpenAI error type, HTTP status); the most specific class in the MRO wins.
    ModelNotFound: ErrorEntry("invalid_request_error", 404),
    BodyTooLarge: ErrorEntry("invalid_request_error", 413),
    ContextLengthExceeded: ErrorEntry("invalid_request_error", 400),
    InvalidRequest: ErrorEntry("invalid_request_error", 400),
    Unauthorized: ErrorEntry("invalid_request_error", 401),
    Forbidden: ErrorEntry("invalid_request_error", 403),
    RouteNotFound: ErrorEntry("invalid_request_error", 404),
    MethodNotAllowed: ErrorEntry("invalid_request_error", 405),
    QueueFull: ErrorEntry("rate_limit_error", 429),
    RateLimited: ErrorEntry("rate_limit_error", 429),
    MemoryPressure: ErrorEntry("invalid_request_error", 400),
    ModelNotReady: ErrorEntry("service_unavailable_error", 503),
    RequestRejected: ErrorEntry("service_unavailable_error", 503),
    RequestCancelled: ErrorEntry("service_unavailable_error", 503),
    RequestNotFound: ErrorEntry("invalid_request_error", 404),
    CacheMiss: ErrorEntry("invalid_request_error", 400),
    RequestTimeout: ErrorEntry("timeout_error", 504),
    IdleTimeout: ErrorEntry("timeout_error", 408),  # the client was too slow to send its request
    ReplicaLost: ErrorEntry("service_unavailable_error", 503),
    EngineDead: ErrorEntry("server_error", 503),
    EngineError: ErrorEntry("server_error", 500),
    RillError: ErrorEntry("server_error", 500),
}

_GENERIC_MESSAGE = "The server had an error while processing your request"

_encoder = msgspec.json.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    """JSON bytes of a response struct."""
    return _encoder.encode(message)


def error_detail(exc: BaseException) -> tuple[int, ErrorDetail]:
    """HTTP status and OpenAI ``error`` object for ``exc`` (generic text for non-rill errors)."""
    entry = lookup(ERROR_TABLE, exc, None)
    if entry is None:
        return 500, ErrorDetail(message=_GENERIC_MESSAGE, type="server_error", code="internal_error")
    status, kind = entry.status or 500, cast(str, entry.code)  # every entry of this table names a type
    assert isinstance(exc, RillError)  # only rill classes are in the table
    param = exc.field if isinstance(exc, InvalidRequest) else None
    return status, ErrorDetail(message=exc.message, type=kind, param=param, code=exc.code)


def error_for(exc: BaseException) -> WireError:
    """The complete HTTP error for ``exc``, with ``Retry-After`` for retryable refusals."""
    status, detail = error_detail(exc)
    headers = {}
    retry_after_s = exc.retry_after_s if isinstance(exc, RillError) else None
    if retry_after_s is None and isinstance(exc, ModelNotReady):
        retry_after_s = 1.0  # loading progress lives on /health; a second is a fair poll
    if retry_after_s is not None and status in (429, 503):
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))  # RFC 9110: whole seconds
    return WireError(status=status, body=encode(ErrorResponse(error=detail)), headers=headers)


def error_event_data(exc: BaseException) -> bytes:
    """The ``{"error": {...}}`` JSON sent as an SSE event when a stream fails mid-way."""
    _, detail = error_detail(exc)
    return encode(ErrorResponse(error=detail))


# ----------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class ServedModel:
    """What the codec needs to know about the served model and the server's limits."""

    name: str
    max_context_tokens: int
    vocab_size: int | None = None
    tool_format: str = "hermes"  # how tool calls are written (and forced), see _shared.tool_calls
    has_chat_template: bool = True
    modalities: tuple[str, ...] = ("text",)
    max_choices: int | None = None  # --max-choices-per-request: prompts x n of one request


_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)


def decode_completion(body: bytes) -> CompletionRequest:
    """Parse a ``/v1/completions`` body; ``InvalidRequest`` names the bad field."""
    req = decode_body(_completion_decoder, body)
    _reject_unsupported(suffix=req.suffix is not None)
    check_formats(req)
    _check_prompt_logprobs(req)
    if req.best_of is not None:
        n = 1 if req.n is None else req.n
        if not 1 <= req.best_of <= MAX_N:
            raise InvalidRequest(f"'best_of' must be in [1, {MAX_N}]", field="best_of")
        if req.best_of < n:
            raise InvalidRequest(f"'best_of' ({req.best_of}) must be at least 'n' ({n})", field="best_of")
        if req.best_of > n and req.stream:
            # As OpenAI: the best candidates are known only once all of them have finished.
            raise InvalidRequest("'best_of' greater than 'n' cannot be streamed; send stream: false", field="best_of")
    if req.prompt is None:
        raise InvalidRequest("'prompt' is required", field="prompt")
    return req


def decode_chat(body: bytes) -> ChatCompletionRequest:
    """Parse a ``/v1/chat/completions`` body; ``InvalidRequest`` names the bad field."""
    req = decode_body(_chat_decoder, body)
    check_chat(req)
    return req


def check_chat(req: ChatCompletionRequest) -> None:
    """The checks of a decoded chat request (also of one translated from another route's
    request, such as ``/v1/responses``); ``InvalidRequest`` names the bad field."""
    if not req.messages:
        raise InvalidRequest("'messages' must be a non-empty list", field="messages")
    if req.echo:
        raise InvalidRequest(
            "'echo' is a /v1/completions field; chat completions do not echo the messages", field="echo"
        )
    _check_prompt_logprobs(req)
    if req.top_logprobs and not req.logprobs:  # 0 or null without logprobs is harmless
        raise InvalidRequest("'top_logprobs' needs 'logprobs' set to true", field="top_logprobs")
    check_tools(req)
    check_formats(req)


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def decode_tokenize(body: bytes) -> TokenizeRequest:
    """Parse a ``/tokenize`` body: exactly one of ``prompt`` and ``messages``."""
    req = decode_body(_tokenize_decoder, body)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("give exactly one of 'prompt' and 'messages'", field="prompt")
    if req.messages is not None and not req.messages:
        raise InvalidRequest("'messages' must be a non-empty list", field="messages")
    return req


def decode_detokenize(body: bytes) -> DetokenizeRequest:
    """Parse a ``/detokenize`` body (``tokens`` is a list of token ids)."""
    req = decode_body(_detokenize_decoder, body)
    if req.tokens is None:
        raise InvalidRequest("'tokens' is required", field="tokens")
    return req


def tokenize_prompt(req: TokenizeRequest, served: ServedModel) -> tuple[str | GenerateRequest, bool]:
    """What ``/tokenize`` hands to admission, and whether to add special tokens (vLLM's
    defaults: yes for a prompt, no for messages, whose template writes its own)."""
    if req.messages is None:
        return req.prompt or "", req.add_special_tokens is not False
    prompt = GenerateRequest(
        messages=chat_messages(req, served),
        add_generation_prompt=req.add_generation_prompt is not False,
        chat_template_kwargs=check_template_kwargs(req.chat_template_kwargs or {}),
        tools=list(req.tools) if req.tools else None,
    )
    return prompt, bool(req.add_special_tokens)


def _check_prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> None:
    # The bounds are SamplingParams'; streaming is this wire's limit (as vLLM's).
    if req.prompt_logprobs is not None and req.stream:
        raise InvalidRequest(
            "'prompt_logprobs' cannot be streamed; send stream: false (or, on /v1/completions, "
            "echo with logprobs, which streams)",
            field="prompt_logprobs",
        )


def decode_body(decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    """A body decoded by ``decoder``: ``InvalidRequest`` for an empty body, bad JSON, or a
    field of the wrong type (named as ``field``)."""
    if not body.strip():
        raise InvalidRequest("request body is empty; send a JSON object")
    try:
        return jsonguard.decode(decoder, body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        return _raise_invalid(text, field_of(text))
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc


def _raise_invalid(text: str, name: str | None) -> NoReturn:
    raise InvalidRequest(f"invalid request: {text}", field=name)


def field_of(text: str) -> str | None:
    """The top-level field a msgspec validation message names (it ends with "- at
    `$.field[0].sub`"), or None."""
    marker = "`$."
    if marker not in text:
        return None
    return text.split(marker, 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0]


def _reject_unsupported(**flags: bool) -> None:
    for name, is_set in flags.items():
        if is_set:
            raise InvalidRequest(f"'{name}' is not supported by this server", field=name)


def check_model(requested: str | None, served: str, aliases: tuple[str, ...] = (), route: str = "") -> None:
    """Raise ``ModelNotFound`` unless ``requested`` is absent, ``served`` (the route's model)
    or one of its ``aliases``; ``route`` names the route where the server has other models."""
    if requested is not None and requested not in ("", served, *aliases):
        where = f" for {route}" if route else ""
        also = f" (or {', '.join(aliases)})" if aliases else ""
        raise ModelNotFound(f"The model '{requested}' does not exist{where}; use '{served}'{also}")


def completion_prompts(req: CompletionRequest, max_choices: int | None = None) -> list[str | list[int]]:
    """The prompts of a completions request: strings, or lists of token ids.

    Raises:
        InvalidRequest: ``prompt`` has none of those shapes, or it holds more prompts (times
            ``n``) than ``max_choices``; checked before anything is tokenized or submitted.
    """
    prompts = _completion_prompts(req)
    n = candidates_per_prompt(req)
    if max_choices is not None and len(prompts) * max(n, 1) > max_choices:
        raise InvalidRequest(
            f"'prompt' holds {len(prompts)} prompts and n (or best_of) is {n}: {len(prompts) * n} choices, but this server "
            f"takes at most {max_choices} per request; send them in several requests",
            field="prompt",
        )
    return prompts


def candidates_per_prompt(req: CompletionRequest | ChatCompletionRequest) -> int:
    """How many completions are generated per prompt: ``best_of`` when set, else ``n``."""
    n = 1 if req.n is None else req.n
    best_of = req.best_of if isinstance(req, CompletionRequest) else None
    return max(n, best_of) if best_of is not None else n


def _completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token_id(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise InvalidRequest(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
        field="prompt",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def max_tokens_asked(req: CompletionRequest | ChatCompletionRequest) -> int:
    """The most tokens the request lets each choice generate, before the context and the
    server's cap lower it (the submission policy does): ``max_completion_tokens`` (the newer
    name) wins over ``max_tokens``; neither set asks for the whole rest of the context
    (``MAX_TOKENS_LIMIT``). A request never fails for asking too much: it ends with
    ``finish_reason: length``. ``max_tokens`` 0 on ``/v1/completions`` computes the prompt
    only (echo and prompt logprobs of a whole context).

    Raises:
        InvalidRequest: a value below 1 (below 0 on ``/v1/completions``), named as sent.
    """
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if asked is None:
        return MAX_TOKENS_LIMIT
    low = 0 if isinstance(req, CompletionRequest) else 1
    if asked < low:
        name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        raise InvalidRequest(f"'{name}' must be >= {low}", field=name)
    return asked


def sampling_params(req: CompletionRequest | ChatCompletionRequest, served: ServedModel) -> SamplingParams:
    """The parameters of every choice (``seed`` is the request's; the policy varies it per
    candidate), mapped from the wire and not yet validated: the submission policy validates
    them once, and ``renamed`` names its refusals as the request did.

    Raises:
        InvalidRequest: ``max_tokens`` below range, ``n`` outside ``[1, MAX_N]``, or two
            fields that both constrain the output.
    """
    max_tokens = max_tokens_asked(req)
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"'n' must be in [1, {MAX_N}]", field="n")
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
        if req.echo and logprobs is not None and (prompt_logprobs is None or 0 <= prompt_logprobs < logprobs):
            prompt_logprobs = logprobs  # the echoed prompt's tokens get the same alternatives as generated ones
        if req.best_of is not None and req.best_of > (req.n or 1) and logprobs is None:
            logprobs = 0  # candidates are ranked by their tokens' mean logprob (not shown unless asked)
    patch = SAMPLING.patch(req) | {
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "response_format": response_format(req, served),
    }
    return SAMPLING.build(patch)


def check_choices(req: CompletionRequest | ChatCompletionRequest, num_prompts: int, served: ServedModel) -> int:
    """The number of engine requests (choices) the request asks for: each prompt's ``n`` (or
    ``best_of``) candidates; ``InvalidRequest`` when that is over ``--max-choices-per-request``."""
    num_choices = num_prompts * candidates_per_prompt(req)
    if served.max_choices is not None and num_choices > served.max_choices:
        raise InvalidRequest(
            f"{num_choices} choices asked (prompts x n); this server takes at most {served.max_choices} per request",
            field="n",
        )
    return num_choices


def renamed(exc: BaseException, req: CompletionRequest | ChatCompletionRequest) -> BaseException:
    """``exc`` as this request names the field: the policy's parameter errors (and a grammar
    that does not compile) carry the engine's names, a chat request says ``top_logprobs`` for
    ``logprobs`` and a constraint given as ``structured_outputs`` or a ``guided_*`` field is
    named so (``exc`` itself when nothing is renamed)."""
    if not isinstance(exc, InvalidRequest) or exc.field is None:
        return exc
    wire: str | None = exc.field
    if exc.field == "response_format" and constraint_field(req) in ("structured_outputs", *GUIDED):
        wire = cast(str, constraint_field(req))  # a bound or a grammar that does not compile
    elif not isinstance(exc, InvalidParameter):
        return exc
    elif exc.field == "logprobs" and isinstance(req, ChatCompletionRequest):
        wire = "top_logprobs"
    else:
        wire = SAMPLING.wire_name(exc.field)
    if wire is None or wire == exc.field:
        return exc
    message = exc.message.replace(f"'{exc.field}'", f"'{wire}'")
    if message.startswith(exc.field + " "):  # "response_format cannot be enforced: ..."
        message = wire + message[len(exc.field) :]
    if type(exc) is InvalidParameter:
        return InvalidParameter(message, field=wire)
    exc.message, exc.field, exc.args = message, wire, (message,)
    return exc
