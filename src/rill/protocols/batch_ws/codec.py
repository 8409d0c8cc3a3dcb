"""Text ⇄ messages for the batch WebSocket ``/ws``, and its one error table.

Pure: no I/O, no await, no engine or frontend import. ``decode`` returns a ``BatchRequest``
or raises ``InvalidRequest`` whose text names what is wrong; ``encode_events`` and
``encode_socket_error`` never fail. ``error_text`` maps every ``rill.errors`` class to the
text of an ERROR event (looked up by MRO, most specific class first); unexpected exceptions
become a generic text, never ``str(exc)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from rill.errors import (
    CacheMiss,
    ContextLengthExceeded,
    EngineDead,
    EngineError,
    Forbidden,
    InvalidRequest,
    MemoryPressure,
    MethodNotAllowed,
    ModelNotReady,
    QueueFull,
    RateLimited,
    ReplicaLost,
    RequestRejected,
    RequestTimeout,
    ResourceExhausted,
    RouteNotFound,
    Unauthorized,
)
from rill.protocols._shared import jsonguard
from rill.protocols._shared.errors import ErrorEntry, ErrorTable, lookup
from rill.protocols.batch_ws.messages import BatchRequest, ServerEvent, SocketError

# Texts the source project puts on the wire; kept as prefixes so clients matching them work.
INVALID_JSON = "Invalid JSON received"
INVALID_PAYLOAD = "Invalid prompts or generation_config"
BINARY_FRAME = "Binary frames are not supported; send the batch as a JSON text frame"
GENERIC_ERROR = "Something broke"
CANCELLED = "the generation was cancelled"

_decoder = msgspec.json.Decoder(BatchRequest)
_encoder = msgspec.json.Encoder()


def decode(text: str | bytes) -> BatchRequest:
    """Parse one client text frame.

    Raises:
        InvalidRequest: the frame is not JSON (``Invalid JSON received: …``) or not a valid
            batch (``Invalid prompts or generation_config: … - at `$.prompts[0].request_id```).
    """
    try:
        return jsonguard.decode(_decoder, text)
    except msgspec.ValidationError as exc:  # subclass of DecodeError: check it first
        raise InvalidRequest(f"{INVALID_PAYLOAD}: {exc}") from exc
    except msgspec.DecodeError as exc:  # jsonguard.UnsafeJson included: too deep, not UTF-8
        raise InvalidRequest(f"{INVALID_JSON}: {exc}") from exc


def encode_events(events: Sequence[ServerEvent]) -> str:
    """One server frame: the JSON array of ``events`` (all of one batch)."""
    return _encoder.encode(list(events)).decode()


def encode_socket_error(text: str) -> str:
    """A frame-level error: ``[{"error": text}]``."""
    return _encoder.encode([SocketError(error=text)]).decode()


_OWN_TEXT = ErrorEntry()
"""The exception's own message (written for clients) is the ERROR text."""

# NOTE: one table per protocol (STYLE §6.8). Errors whose own text is written for clients
# pass through; engine failures get fixed texts so internals never leak.
ERROR_TABLE: ErrorTable = {
    ContextLengthExceeded: _OWN_TEXT,
    InvalidRequest: _OWN_TEXT,
    QueueFull: ErrorEntry(text="the server's waiting queue is full; retry later"),
    RateLimited: _OWN_TEXT,
    ResourceExhausted: _OWN_TEXT,
    MemoryPressure: ErrorEntry(text="the prompt can never fit in the server's KV cache memory"),
    ModelNotReady: ErrorEntry(text="the model is still loading; retry later"),
    RequestRejected: ErrorEntry(text="the server refused the request; retry later"),
    CacheMiss: _OWN_TEXT,
    RequestTimeout: ErrorEntry(text="the request ran past the server's time limit"),
    ReplicaLost: ErrorEntry(text="the engine replica running this request stopped; send it again"),
    EngineDead: ErrorEntry(text="the engine stopped; no generation can run until the server restarts"),
    EngineError: ErrorEntry(text="generation failed"),
    # HTTP-level refusals (the middleware answers them before a socket opens); listed so the
    # whole error tree has an entry here too.
    Unauthorized: _OWN_TEXT,
    Forbidden: _OWN_TEXT,
    RouteNotFound: _OWN_TEXT,
    MethodNotAllowed: _OWN_TEXT,
}


def error_text(exc: BaseException) -> str:
    """The ERROR event text for ``exc`` (the most specific table entry wins by MRO)."""
    entry = lookup(ERROR_TABLE, exc, None)
    return GENERIC_ERROR if entry is None else entry.message(exc)
