"""Codec of the framed Unix-socket protocol: payload bytes ⇄ typed messages, plus the error table.

* ``decode(payload)`` → ``Request | Cancel | MetricsQuery`` or raises ``InvalidJson`` /
  ``InvalidRequest`` (its ``field`` names the bad field).
* ``build_request(Request, …)`` → ``rill.types.GenerateRequest`` (sampling defaults of the
  spec, ``slo`` → scheduling priority); raises ``InvalidRequest`` naming the field.
* ``encode(ServerMessage)`` → one complete frame (header + JSON).
* ``error_code`` / ``error_message``: THE error table of this protocol (by MRO, most specific
  class wins); unexpected exceptions become a generic message, never their text.
* ``metrics_snapshot(EngineStats, …)``: the admin metrics frame, with the source project's key
  names where they mean the same thing.

Pure: no I/O, no ``await``, no engine or frontend import.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from rill.errors import (
    ContextLengthExceeded,
    EngineDead,
    EngineError,
    InvalidRequest,
    MemoryPressure,
    ModelNotReady,
    QueueFull,
    RateLimited,
    ReplicaLost,
    RequestRejected,
    RequestTimeout,
    RillError,
    Unauthorized,
)
from rill.protocols._shared import jsonguard
from rill.protocols._shared.errors import ErrorEntry, ErrorTable, lookup
from rill.protocols.framed_uds.framing import FrameTooLarge, InvalidFrameLength, encode_frame
from rill.protocols.framed_uds.messages import (
    SAMPLING,
    Cancel,
    ClientMessage,
    MetricsQuery,
    Request,
    ServerMessage,
    Slo,
)
from rill.types import EngineStats, GenerateRequest, SamplingParams

PROTOCOL_NAME = "framed_uds"
"""``GenerateRequest.protocol`` of requests from this protocol (labels metrics)."""

DEFAULT_MAX_TOKENS = SamplingParams().max_tokens

SLO_HORIZON_MS = 60_000
"""TTFT targets at or above this many milliseconds all get the mildest SLO priority (-1)."""


class InvalidJson(RillError):
    """A frame's payload is not a UTF-8 JSON document."""

    code = "invalid_json"


class Busy(RillError):
    """A request arrived while this connection's previous request is still running."""

    code = "busy"


ERROR_CODES: ErrorTable = {
    FrameTooLarge: ErrorEntry("E_PROTO_FRAME_TOO_LARGE"),
    InvalidFrameLength: ErrorEntry("E_PROTO_INVALID_LEN"),
    InvalidJson: ErrorEntry("E_PROTO_INVALID_JSON"),
    Busy: ErrorEntry("E_PROTO_BUSY"),
    Unauthorized: ErrorEntry("E_AUTH_UNAUTHORIZED"),
    InvalidRequest: ErrorEntry("E_PROTO_BAD_REQUEST"),
    ContextLengthExceeded: ErrorEntry("E_LIMIT_PROMPT_TOO_LARGE"),
    MemoryPressure: ErrorEntry("E_LIMIT_PROMPT_TOO_LARGE"),  # the request can never fit in the KV budget
    RequestRejected: ErrorEntry("E_LIMIT_REJECTED"),
    QueueFull: ErrorEntry("E_LIMIT_QUEUE_FULL"),
    RateLimited: ErrorEntry("E_LIMIT_RATE_LIMITED"),
    ModelNotReady: ErrorEntry("E_RUNTIME_NOT_READY"),
    RequestTimeout: ErrorEntry("E_RUNTIME_TIMEOUT"),
    EngineError: ErrorEntry("E_RUNTIME_DECODE"),  # GenerationError: this request failed, others go on
    ReplicaLost: ErrorEntry("E_RUNTIME_UNAVAILABLE"),
    EngineDead: ErrorEntry("E_RUNTIME_UNAVAILABLE"),
    RillError: ErrorEntry("E_RUNTIME_INTERNAL"),
}
"""Exception class → wire ``code``. Looked up along the MRO, so subclasses override bases."""

GENERIC_CODE = "E_RUNTIME_INTERNAL"
GENERIC_MESSAGE = "internal server error"

_PROMPT_TOO_LARGE = (ContextLengthExceeded, MemoryPressure)


def error_code(exc: BaseException) -> str:
    """The wire code for ``exc`` (generic for anything that is not a ``RillError``)."""
    entry = lookup(ERROR_CODES, exc, None)
    return GENERIC_CODE if entry is None or entry.code is None else entry.code


def error_message(exc: BaseException) -> str:
    """Client-safe text for ``exc``: our own messages, never an unexpected exception's text."""
    if not isinstance(exc, RillError):
        return GENERIC_MESSAGE
    if isinstance(exc, _PROMPT_TOO_LARGE):
        # NOTE: uma-serve clients look for "prompt too large" in this message.
        return f"prompt too large: {exc.message}"
    return exc.message


# -- decoding ------------------------------------------------------------------------------

_json_decoder = msgspec.json.Decoder()
_KINDS: dict[Any, type] = {None: Request, "cancel": Cancel, "metrics": MetricsQuery}


def decode(payload: bytes) -> ClientMessage:
    """Parse one frame's payload into a client message.

    Raises:
        InvalidJson: not UTF-8 JSON.
        InvalidRequest: JSON but not a valid message (``field`` names the offending field).
    """
    try:
        obj = jsonguard.decode(_json_decoder, payload)
    except msgspec.DecodeError as exc:  # jsonguard.UnsafeJson included: too deep, not UTF-8
        raise InvalidJson(f"invalid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidRequest("a frame must carry a JSON object", field=None)
    kind = obj.get("event")
    if kind == "metrics" or obj.get("type") == "metrics":
        key = obj.get("api_key")
        return MetricsQuery(api_key=key if isinstance(key, str) else None)
    # A request has no "event"; other values of "type" are ignored like any unknown field.
    cls = _KINDS.get(kind) if isinstance(kind, str) or kind is None else None
    if cls is None:
        raise InvalidRequest(
            f"'event': unknown value {kind!r} (use cancel or metrics, or omit it for a request)", field="event"
        )
    try:
        message: Request | Cancel = msgspec.convert(obj, cls)
    except msgspec.ValidationError as exc:
        raise _bad_field(exc) from exc
    if isinstance(message, Request):
        _check_request(message)
    elif not message.id:
        raise InvalidRequest("'id' must be a non-empty string", field="id")
    return message


def _bad_field(exc: msgspec.ValidationError) -> InvalidRequest:
    text = str(exc)
    if text.startswith("Object missing required field `"):
        field: str | None = text.split("`")[1]
        return InvalidRequest(f"missing required field '{field}'", field=field)
    field = None
    if " - at `$." in text:
        field = text.split(" - at `$.", 1)[1].rstrip("`")
        text = text.split(" - at `$.", 1)[0]
    return InvalidRequest(
        f"'{field}': {text[0].lower()}{text[1:]}" if field else f"invalid message: {text}", field=field
    )


def _check_request(request: Request) -> None:
    if not request.id:
        raise InvalidRequest("'id' must be a non-empty string", field="id")
    if not request.prompt:
        raise InvalidRequest("'prompt' must be a non-empty string", field="prompt")
    if request.slo is not None:
        for name in ("target_ttft_ms", "target_tbt_ms"):
            value = getattr(request.slo, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise InvalidRequest(f"'slo.{name}' must be a number > 0", field=f"slo.{name}")


def wire_id(payload: bytes) -> str | None:
    """Best effort: the string ``id`` of a payload that failed to decode (for its error event)."""
    try:
        obj = jsonguard.decode(_json_decoder, payload)
    except msgspec.DecodeError:
        return None
    value = obj.get("id") if isinstance(obj, dict) else None
    return value if isinstance(value, str) and value else None


# -- to the engine -------------------------------------------------------------------------


def slo_priority(slo: Slo | None) -> int:
    """Scheduling priority for ``slo`` (lower runs first; 0 = no targets).

    A TTFT target of t ms gives ``-1 - (SLO_HORIZON_MS - t)`` (clamped), so any request with a
    target goes ahead of requests without one and tighter targets go first (earliest deadline
    first among SLO requests). A TBT target alone gives -1.
    """
    if slo is None or (slo.target_ttft_ms is None and slo.target_tbt_ms is None):
        return 0
    if slo.target_ttft_ms is None:
        return -1
    return -1 - max(0, SLO_HORIZON_MS - math.ceil(slo.target_ttft_ms))


def build_request(request: Request, request_timeout_s: float | None = None) -> GenerateRequest:
    """The engine request for a wire ``Request``.

    Defaults of the spec: temperature 0.0, top_p 1.0, top_k 0 (off), ``max_tokens`` the
    server's limit (``--max-tokens-cap`` bounds it at admission, as on every protocol);
    ``request_timeout_s`` (``--request-timeout-s``) becomes the request's time limit.

    Raises:
        InvalidRequest: a sampling field is out of range (``field`` names it).
    """
    sampling = SAMPLING.params(SAMPLING.patch(request))
    return GenerateRequest(
        prompt=request.prompt,
        sampling=sampling,
        priority=slo_priority(request.slo),
        protocol=PROTOCOL_NAME,
        deadline_s=request_timeout_s,
    )


# -- encoding ------------------------------------------------------------------------------

_json_encoder = msgspec.json.Encoder()


def encode(message: ServerMessage) -> bytes:
    """One complete frame (length header + JSON) carrying ``message``."""
    return encode_frame(_json_encoder.encode(message))


def metrics_snapshot(stats: EngineStats, num_active_sessions: int) -> dict[str, Any]:
    """The admin ``metrics`` object, read from the same ``EngineStats`` as ``/metrics``.

    Keys of the source project (uma-serve ``Metrics::to_json``) come first where they mean
    the same thing: one engine step is one batch call (``batch_calls_total``), its duration
    is ``decode_ms_*``. rill's own gauges follow. Floats are rounded to 3 decimals as there.
    """
    return {
        "tokens_generated_total": stats.generation_tokens_total,
        "batch_calls_total": stats.num_steps_total,
        "last_batch_size": stats.last_batch_size,
        "decode_ms_last": round(stats.last_step_ms, 3),
        "decode_ms_ewma": round(stats.step_ms_ewma, 3),
        "prefill_tokens_total": stats.prompt_tokens_total,
        "active_sessions": num_active_sessions,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_paused": stats.num_paused,
        "num_preemptions_total": stats.num_preemptions_total,
        "kv_capacity_bytes": stats.kv_capacity_bytes,
        "kv_used_bytes": stats.kv_used_bytes,
        "kv_cached_bytes": stats.kv_cached_bytes,
        "kv_capacity_tokens": stats.kv_capacity_tokens,
        "kv_used_tokens": stats.kv_used_tokens,
        "prefix_cache_queries_tokens": stats.prefix_cache_queries_tokens,
        "prefix_cache_hits_tokens": stats.prefix_cache_hits_tokens,
        "requests_finished_total": dict(stats.requests_finished_total),
    }
