"""Text ⇄ typed messages for ``/generate``, and the protocol's one error table.

``decode`` turns a WebSocket text frame into a ``messages.ClientMessage`` or raises
``InvalidMessage`` (an ``InvalidRequest`` whose ``field`` is the JSON path of the bad value,
e.g. ``parameters.temperature``). ``encode`` never fails for a valid struct. ``error_message``
maps any exception to the spec's ``error`` message: rill's own errors by MRO through
``ERROR_TABLE``, anything else to a generic ``internal_error`` that leaks nothing.

Pure: msgspec, ``rill.errors`` and this package's messages; no I/O.
"""

from __future__ import annotations

import math
import re

import msgspec

from rill.errors import (
    CacheMiss,
    ContextLengthExceeded,
    EngineDead,
    GenerationError,
    InvalidRequest,
    MemoryPressure,
    ModelLoadError,
    ModelNotReady,
    QueueFull,
    RateLimited,
    ReplicaLost,
    RequestNotFound,
    RequestRejected,
    RequestTimeout,
    ResourceExhausted,
    ResumeExpired,
    RillError,
    StorageFull,
)
from rill.protocols._shared import jsonguard, sse
from rill.protocols._shared.errors import ErrorEntry, ErrorTable, lookup
from rill.protocols.generate_ws import messages as m


class InvalidMessage(InvalidRequest):
    """A client message is not valid JSON or does not match the spec's schema."""


class FeedbackLimit(RequestRejected):
    """A generation or a connection has received the most feedback messages allowed
    (``--feedback-max-per-generation``, ``--feedback-max-per-connection``)."""

    code = "feedback_limit"
    retryable = False


class UnknownGeneration(RequestNotFound):
    """A ``resume`` named a generation this server does not know, or another principal's
    (the two look alike on purpose)."""


class Unauthorized(RillError):
    """No API key, or a wrong one, was sent while the server requires one."""

    code = "unauthorized"


# Most specific class first does not matter: lookup walks the exception's MRO.
ERROR_TABLE: ErrorTable = {
    InvalidRequest: ErrorEntry("invalid_request", 400, action="fix_request"),
    ContextLengthExceeded: ErrorEntry("context_length_exceeded", 400, action="shorten_prompt"),
    RequestNotFound: ErrorEntry("invalid_request", 400, action="send_config"),
    UnknownGeneration: ErrorEntry("request_not_found", 404, action="send_config"),
    ResumeExpired: ErrorEntry("resume_expired", 410, action="send_config"),
    MemoryPressure: ErrorEntry("memory_pressure", 503, action="retry"),
    ResourceExhausted: ErrorEntry("memory_pressure", 503, action="retry"),
    QueueFull: ErrorEntry("rate_limited", 429, action="retry"),
    RateLimited: ErrorEntry("rate_limited", 429, action="retry"),
    ModelNotReady: ErrorEntry("model_loading_error", 503, action="retry"),
    ModelLoadError: ErrorEntry("model_loading_error", 503, text="the model failed to load", recoverable=False),
    RequestTimeout: ErrorEntry("timeout", 504, action="retry"),
    FeedbackLimit: ErrorEntry("rate_limited", 429),
    StorageFull: ErrorEntry("internal_error", 507),
    Unauthorized: ErrorEntry("unauthorized", 401, recoverable=False, action="fix_request"),
    CacheMiss: ErrorEntry("internal_error", 500, text="internal error; the generation was dropped", action="retry"),
    GenerationError: ErrorEntry("internal_error", 500, text="internal error; the generation failed", action="retry"),
    ReplicaLost: ErrorEntry(
        "internal_error", 503, text="the engine replica stopped; retry the generation", action="retry"
    ),
    EngineDead: ErrorEntry(
        "internal_error", 503, text="the engine stopped; reconnect later", recoverable=False, action="reconnect"
    ),
    RillError: ErrorEntry("internal_error", 500, text="internal error", action="retry"),
    BaseException: ErrorEntry("internal_error", 500, text="internal error", recoverable=False, action="reconnect"),
}


HTTP_STATUS: dict[str | None, int | None] = {entry.code: entry.status for entry in ERROR_TABLE.values()} | {
    "internal_error": 500
}
"""The HTTP status of each wire error code (``POST /v1/generate``)."""


def wire_error(exc: BaseException) -> ErrorEntry:
    """The table entry of ``exc``'s most specific class."""
    return lookup(ERROR_TABLE, exc, ERROR_TABLE[BaseException])


def error_message(exc: BaseException, request_id: str | None = None, generated_text: str | None = None) -> m.Error:
    """The ``error`` message a client receives for ``exc``.

    Args:
        exc: what went wrong.
        request_id: the generation it concerns (None before any ``init``).
        generated_text: the partial text when the error cut a generation short.
    """
    entry = wire_error(exc)
    msg = m.Error(
        error=entry.code or "internal_error",
        message=entry.message(exc),
        recoverable=entry.recoverable,
        recovery_action=entry.action,
        request_id=request_id,
    )
    if isinstance(exc, InvalidRequest) and exc.field:
        msg.field = exc.field
    if isinstance(exc, ContextLengthExceeded):
        msg.prompt_tokens = exc.num_prompt_tokens
        msg.max_context_tokens = exc.max_context_tokens
    if isinstance(exc, (RateLimited, QueueFull)) and exc.retry_after_s is not None:
        msg.retry_after_seconds = round(float(exc.retry_after_s), 3)
    if generated_text is not None:
        msg.generated_text = generated_text
    return msg


def rest_reply(sent: list[m.ServerMessage], model_name: str) -> tuple[int, m.RestResponse | m.Error, dict[str, str]]:
    """The ``POST /v1/generate`` answer once a generation's messages were all sent: (HTTP
    status, body, headers).

    A completion becomes the spec's REST shape (its id and model from ``init`` when one was
    sent); an error keeps the socket's message with its code's HTTP status and, with a retry
    hint, ``Retry-After`` in whole seconds (rounded up: a client that waits the header's
    whole seconds must not be early). Neither is an internal error.
    """
    init = next((x for x in sent if isinstance(x, m.Init)), None)
    for msg in sent:
        if isinstance(msg, m.Completion):
            return (
                200,
                m.RestResponse(
                    id=msg.request_id or (init.request_id if init else ""),
                    model=init.model if init else model_name,
                    generated_text=msg.generated_text,
                    finish_reason=msg.finish_reason,
                    usage=msg.usage,
                    timing=msg.timing,
                ),
                {},
            )
        if isinstance(msg, m.Error):
            headers = (
                {"Retry-After": str(max(1, math.ceil(msg.retry_after_seconds)))}
                if isinstance(msg.retry_after_seconds, float)
                else {}
            )
            return HTTP_STATUS.get(msg.error, 500) or 500, msg, headers
    exc = RillError("the generation ended without a result")
    return wire_error(exc).status or 500, error_message(exc), {}


_decoder: msgspec.json.Decoder[m.ClientMessage] = msgspec.json.Decoder(m.ClientMessage)
_rest_decoder = msgspec.json.Decoder(m.RestRequest)
_encoder = msgspec.json.Encoder()
_UNKNOWN_RE = re.compile(r"unknown field `([^`]+)`")
_MISSING_RE = re.compile(r"missing required field `([^`]+)`")
_PATH_RE = re.compile(r"- at `\$\.?([^`]*)`")


def _field_of(text: str) -> str | None:
    # msgspec names the path ("- at `$.parameters.top_p`") and, for unknown or missing
    # fields, the name itself; join them so the client sees e.g. "parameters.foo".
    path_match = _PATH_RE.search(text)
    path = re.sub(r"\[\d+\]", "", path_match.group(1)) if path_match else ""
    name_match = _UNKNOWN_RE.search(text) or _MISSING_RE.search(text)
    if name_match:
        return f"{path}.{name_match.group(1)}" if path else name_match.group(1)
    return path or None


def _invalid(exc: msgspec.DecodeError) -> InvalidMessage:
    text = str(exc)
    if not isinstance(exc, msgspec.ValidationError):
        return InvalidMessage(f"message is not valid JSON: {text}")
    field = _field_of(text)
    if field == "type":
        text = "'type' must be one of config, control, feedback, resume" + (
            f" ({text})" if "Invalid value" in text else ""
        )
    return InvalidMessage(f"invalid message: {text}", field=field)


def decode(text: str | bytes) -> m.ClientMessage:
    """Parse one client frame. Raises ``InvalidMessage`` naming the bad field."""
    try:
        return jsonguard.decode(_decoder, text)
    except msgspec.DecodeError as exc:  # ValidationError and jsonguard.UnsafeJson included
        raise _invalid(exc) from exc


def decode_rest(body: bytes) -> m.RestRequest:
    """Parse a ``POST /v1/generate`` body. Raises ``InvalidMessage`` naming the bad field."""
    try:
        return jsonguard.decode(_rest_decoder, body)
    except msgspec.DecodeError as exc:
        raise _invalid(exc) from exc


def _finite(value: float | None) -> float | None:
    # JSON has no NaN/Infinity; a clock glitch must not produce an unparseable frame.
    return value if value is None or math.isfinite(value) else None


def encode(msg: m.ServerMessage | m.RestResponse) -> str:
    """One server message as a JSON text frame."""
    return _encoder.encode(msg).decode()


def encode_sse(msg: m.ServerMessage) -> bytes:
    """One server message as a Server-Sent Events ``data:`` event (same JSON as the socket)."""
    return sse.encode_event(_encoder.encode(msg))


def round_ms(seconds: float | None) -> float | None:
    """Seconds → milliseconds rounded to 0.01 ms (None stays None)."""
    value = _finite(seconds)
    return None if value is None else round(value * 1000.0, 2)
