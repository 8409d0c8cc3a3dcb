"""Decode the ``/ws/chat`` request, encode server messages, and the protocol's error table.

Pure: msgspec, ``rill.errors`` and this package's messages; no I/O.
"""

from __future__ import annotations

import msgspec

from rill.errors import (
    ContextLengthExceeded,
    EngineDead,
    EngineError,
    InvalidRequest,
    ModelNotReady,
    QueueFull,
    RateLimited,
    ReplicaLost,
    RequestRejected,
    RequestTimeout,
    ResourceExhausted,
    RillError,
)
from rill.protocols._shared import jsonguard
from rill.protocols._shared.errors import ErrorEntry, ErrorTable, lookup
from rill.protocols.chat_ws.messages import ChatRequest, Error, ServerMessage

_request_decoder = msgspec.json.Decoder(ChatRequest)
_encoder = msgspec.json.Encoder()

CLOSE_NORMAL = 1000
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_INTERNAL_ERROR = 1011

GENERIC_ERROR = "Internal server error"
"""What a client sees for an unexpected exception (details go to the log only)."""

# NOTE: looked up by MRO, so the most specific class wins. Without a text the client reads
# the exception's own message (our messages are written for clients); a fixed text replaces it.
ERROR_TABLE: ErrorTable = {
    QueueFull: ErrorEntry(status=CLOSE_TRY_AGAIN_LATER, text="Queue full"),
    RateLimited: ErrorEntry(status=CLOSE_TRY_AGAIN_LATER),
    ResourceExhausted: ErrorEntry(status=CLOSE_TRY_AGAIN_LATER),
    ModelNotReady: ErrorEntry(status=CLOSE_TRY_AGAIN_LATER, text="Service not ready: the model is still loading"),
    RequestRejected: ErrorEntry(status=CLOSE_NORMAL),
    ContextLengthExceeded: ErrorEntry(status=CLOSE_NORMAL),
    InvalidRequest: ErrorEntry(status=CLOSE_NORMAL),
    RequestTimeout: ErrorEntry(status=CLOSE_NORMAL),
    ReplicaLost: ErrorEntry(status=CLOSE_TRY_AGAIN_LATER, text="Engine replica stopped; try again"),
    EngineDead: ErrorEntry(status=CLOSE_INTERNAL_ERROR, text="Engine stopped; the server must be restarted"),
    EngineError: ErrorEntry(status=CLOSE_NORMAL, text="Generation failed"),
    RillError: ErrorEntry(status=CLOSE_NORMAL),
}


def decode_request(text: str | bytes) -> ChatRequest:
    """The client's request, validated.

    Raises:
        InvalidRequest: not UTF-8 JSON, or a field of the wrong type or value (msgspec names its
            path, e.g. ``$.generation.temperature``), or no messages.
    """
    try:
        request = jsonguard.decode(_request_decoder, text)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request: {exc}") from exc
    except msgspec.DecodeError as exc:  # jsonguard.UnsafeJson included: too deep, not UTF-8
        raise InvalidRequest(f"invalid request: not valid JSON ({exc})") from exc
    if not request.messages:
        raise InvalidRequest("invalid request: 'messages' is empty", field="messages")
    return request


def encode(message: ServerMessage) -> str:
    """The JSON text frame of a server message."""
    return _encoder.encode(message).decode("utf-8")


def error_for(exc: BaseException) -> tuple[Error, int]:
    """The ``error`` message and WebSocket close code for an exception (generic when unknown)."""
    entry = lookup(ERROR_TABLE, exc, None)
    if entry is None:
        return Error(error=GENERIC_ERROR), CLOSE_INTERNAL_ERROR
    return Error(error=entry.message(exc)), entry.status if entry.status is not None else CLOSE_NORMAL
