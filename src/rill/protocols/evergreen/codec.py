"""Codec of Evergreen: protobuf ⇄ structs, proto3 JSON ⇄ structs, configs, and the error table.

* ``from_pb`` / ``to_pb``: ``evergreen.v2.SessionMessage`` ⇄ ``messages.SessionMessage``.
* ``decode_json(text)`` / ``encode_json(msg)``: the standard proto3 JSON mapping the public
  TypeScript client (actionengine-ts) speaks over WebSocket: lowerCamelCase field names out,
  snake_case also accepted in, ``bytes`` as base64, ``Any`` as ``{"@type": ..., fields}``.
  Output omits default values except ``seq`` and ``continued``, printed always for clients
  that test ``continued === false``.
* ``decode_config(AnyMessage)``: rill's ``GenerateConfig`` (or None for an unknown type).
* ``ERROR_STATUS`` / ``status_of(exc)``: THE error table (by MRO, most specific class wins)
  from exception to gRPC status name and client-safe message; ``ws_close(exc)`` the WebSocket
  close code (4000 + the gRPC status number) and reason.

Pure: protobuf message classes only, no I/O, no grpc, no engine or frontend import.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
from google.protobuf import json_format
from google.protobuf.message import DecodeError

from rill.errors import (
    CacheMiss,
    ContextLengthExceeded,
    EngineDead,
    EngineError,
    InvalidRequest,
    ModelNotReady,
    ReplicaLost,
    RequestRejected,
    RequestTimeout,
    RillError,
)
from rill.protocols._shared import jsonguard
from rill.protocols._shared.errors import ErrorEntry, ErrorTable, lookup
from rill.protocols.evergreen import errors
from rill.protocols.evergreen._pb import evergreen_pb2 as pb
from rill.protocols.evergreen._pb import evergreen_service_pb2 as service_pb
from rill.protocols.evergreen._pb import rill_config_pb2 as config_pb
from rill.protocols.evergreen.messages import (
    GENERATE_CONFIG_TYPE_URL,
    Action,
    AnyMessage,
    Chunk,
    ChunkMetadata,
    GenerateConfig,
    NamedParameter,
    NodeFragment,
    SessionMessage,
    TargetSpec,
    Timestamp,
)

PROTOCOL_NAME = "evergreen"
"""``GenerateRequest.protocol`` of requests from this protocol (labels metrics)."""

# -- protobuf ⇄ structs ------------------------------------------------------------------------


def from_pb(message: service_pb.SessionMessage) -> SessionMessage:
    """The struct form of a protobuf ``SessionMessage`` (all fields kept)."""
    return SessionMessage(
        node_fragments=tuple(_fragment_from_pb(f) for f in message.node_fragments),
        actions=tuple(_action_from_pb(a) for a in message.actions),
    )


def _fragment_from_pb(f: pb.NodeFragment) -> NodeFragment:
    return NodeFragment(
        id=f.id,
        seq=f.seq,
        continued=f.continued,
        child_ids=tuple(f.child_ids),
        chunk_fragment=_chunk_from_pb(f.chunk_fragment) if f.HasField("chunk_fragment") else None,
    )


def _chunk_from_pb(c: pb.Chunk) -> Chunk:
    payload = c.WhichOneof("payload")
    return Chunk(
        metadata=_metadata_from_pb(c.metadata) if c.HasField("metadata") else None,
        ref=c.ref if payload == "ref" else None,
        data=c.data if payload == "data" else None,
    )


def _metadata_from_pb(m: pb.ChunkMetadata) -> ChunkMetadata:
    return ChunkMetadata(
        mimetype=m.mimetype,
        role=m.role,
        original_file_name=m.original_file_name,
        capture_time=Timestamp(seconds=m.capture_time.seconds, nanos=m.capture_time.nanos)
        if m.HasField("capture_time")
        else None,
        experimental=tuple(AnyMessage(type_url=a.type_url, value=a.value) for a in m.experimental),
    )


def _action_from_pb(a: pb.Action) -> Action:
    return Action(
        name=a.name,
        inputs=tuple(NamedParameter(name=p.name, id=p.id) for p in a.inputs),
        outputs=tuple(NamedParameter(name=p.name, id=p.id) for p in a.outputs),
        configs=tuple(AnyMessage(type_url=c.type_url, value=c.value) for c in a.configs),
        target_spec=TargetSpec(id=a.target_spec.id) if a.HasField("target_spec") else None,
    )


def to_pb(message: SessionMessage) -> service_pb.SessionMessage:
    """The protobuf form of a struct ``SessionMessage``."""
    out = service_pb.SessionMessage()
    for f in message.node_fragments:
        frag = out.node_fragments.add(id=f.id, seq=f.seq, continued=f.continued, child_ids=f.child_ids)
        if f.chunk_fragment is not None:
            frag.chunk_fragment.SetInParent()  # an empty chunk (EndOfTurn without data) still counts
            _chunk_to_pb(f.chunk_fragment, frag.chunk_fragment)
    for a in message.actions:
        action = out.actions.add(name=a.name)
        for p in a.inputs:
            action.inputs.add(name=p.name, id=p.id)
        for p in a.outputs:
            action.outputs.add(name=p.name, id=p.id)
        for c in a.configs:
            action.configs.add(type_url=c.type_url, value=c.value)
        if a.target_spec is not None:
            action.target_spec.id = a.target_spec.id
            action.target_spec.SetInParent()
    return out


def _chunk_to_pb(chunk: Chunk, out: pb.Chunk) -> None:
    if chunk.metadata is not None:
        m = chunk.metadata
        out.metadata.SetInParent()
        out.metadata.mimetype = m.mimetype
        out.metadata.role = m.role
        out.metadata.original_file_name = m.original_file_name
        if m.capture_time is not None:
            out.metadata.capture_time.seconds = m.capture_time.seconds
            out.metadata.capture_time.nanos = m.capture_time.nanos
        for a in m.experimental:
            out.metadata.experimental.add(type_url=a.type_url, value=a.value)
    if chunk.ref is not None:
        out.ref = chunk.ref
    elif chunk.data is not None:
        out.data = chunk.data


def decode_pb(payload: bytes) -> SessionMessage:
    """Parse a serialized ``SessionMessage``; raise ``InvalidMessage`` when it is not one."""
    message = service_pb.SessionMessage()
    try:
        message.ParseFromString(payload)
    except DecodeError as exc:
        raise errors.InvalidMessage(f"not a serialized evergreen.v2.SessionMessage: {exc}") from exc
    return from_pb(message)


# -- proto3 JSON ---------------------------------------------------------------------------------


_json_decoder = msgspec.json.Decoder()


def decode_json(text: str | bytes) -> SessionMessage:
    """Parse one proto3-JSON ``SessionMessage`` (camelCase or snake_case names, base64 bytes).

    A config ``Any`` whose ``@type`` rill does not know is kept as a bare type URL, so that the
    session rejects it with the same message as over gRPC.

    Raises:
        InvalidMessage: not JSON, an unknown field, or a wrong type (the message names the
            field path).
    """
    try:
        # Bounded depth, strict UTF-8, no lone surrogates: json_format cannot take those.
        obj = jsonguard.decode(_json_decoder, text)
    except msgspec.DecodeError as exc:
        raise errors.InvalidMessage(f"invalid JSON: {_short(str(exc))}") from exc
    if not isinstance(obj, dict):
        raise errors.InvalidMessage("a SessionMessage must be a JSON object")
    unknown_configs = _take_unknown_configs(obj)
    message = service_pb.SessionMessage()
    try:
        json_format.ParseDict(obj, message)
    # NOTE: json_format documents ParseError only, but wrong JSON types reach protobuf's
    # setters and raise TypeError, AttributeError, ValueError, OverflowError, even SystemError
    # from upb: at this library boundary every failure is the client's bad message.
    except Exception as exc:
        raise errors.InvalidMessage(f"invalid SessionMessage: {_short(str(exc))}") from exc
    for index, type_urls in unknown_configs.items():
        for type_url in type_urls:
            message.actions[index].configs.add(type_url=type_url)
    return from_pb(message)


def _take_unknown_configs(obj: Any) -> dict[int, list[str]]:
    # json_format cannot hold an Any of a type missing from the descriptor pool; take those
    # out (by action index) before parsing and put them back as bare type URLs afterwards.
    taken: dict[int, list[str]] = {}
    actions = obj.get("actions") if isinstance(obj, dict) else None
    if not isinstance(actions, list):
        return taken
    for index, action in enumerate(actions):
        configs = action.get("configs") if isinstance(action, dict) else None
        if not isinstance(configs, list):
            continue
        keep = []
        for config in configs:
            type_url = config.get("@type") if isinstance(config, dict) else None
            if isinstance(type_url, str) and not _known_type(type_url):
                taken.setdefault(index, []).append(type_url)
            else:
                keep.append(config)
        action["configs"] = keep
    return taken


def _known_type(type_url: str) -> bool:
    from google.protobuf import descriptor_pool

    try:
        descriptor_pool.Default().FindMessageTypeByName(type_url.rsplit("/", 1)[-1])
    except (KeyError, TypeError, ValueError):  # TypeError: a name upb cannot take (e.g. a NUL)
        return False
    return True


def encode_json(message: SessionMessage) -> str:
    """One compact proto3-JSON text for ``message`` (lowerCamelCase, base64 ``data``)."""
    as_dict = json_format.MessageToDict(to_pb(message))
    for fragment in as_dict.get("nodeFragments", ()):
        # Printed even at their defaults: some clients test `continued === false`.
        fragment.setdefault("seq", 0)
        fragment.setdefault("continued", False)
    return json.dumps(as_dict, separators=(",", ":"), ensure_ascii=False)


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# -- configs ------------------------------------------------------------------------------------

_CONFIG_FIELDS = tuple(GenerateConfig.__struct_fields__)


def decode_config(config: AnyMessage) -> GenerateConfig | None:
    """rill's ``GenerateConfig`` from an ``Any``; None when the type is not one rill knows.

    Raises:
        InvalidMessage: the type is ``GenerateConfig`` but the bytes do not parse.
    """
    if config.type_url.rsplit("/", 1)[-1] != GENERATE_CONFIG_TYPE_URL.rsplit("/", 1)[-1]:
        return None
    message = config_pb.GenerateConfig()
    try:
        message.ParseFromString(config.value)
    except DecodeError as exc:
        raise errors.InvalidMessage(f"configs: {config.type_url} does not parse: {exc}") from exc
    values: dict[str, Any] = {}
    for name in _CONFIG_FIELDS:
        if name == "stop":
            values[name] = tuple(message.stop)
        elif message.HasField(name):
            values[name] = getattr(message, name)
    return GenerateConfig(**values)


def encode_config(config: GenerateConfig) -> AnyMessage:
    """Pack a ``GenerateConfig`` into an ``Any`` (for clients and tests)."""
    message = config_pb.GenerateConfig()
    for name in _CONFIG_FIELDS:
        value = getattr(config, name)
        if name == "stop":
            message.stop.extend(value)
        elif value is not None:
            setattr(message, name, value)
    return AnyMessage(type_url=GENERATE_CONFIG_TYPE_URL, value=message.SerializeToString())


# -- errors -------------------------------------------------------------------------------------

STATUS_NUMBERS: dict[str, int] = {
    "OK": 0,
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}
"""gRPC status names and numbers (as in grpc.StatusCode), without importing grpc here."""

ERROR_STATUS: ErrorTable = {
    RillError: ErrorEntry("INTERNAL"),
    errors.InvalidMessage: ErrorEntry("INVALID_ARGUMENT"),
    errors.RuleBroken: ErrorEntry("INVALID_ARGUMENT"),
    errors.UnsupportedInput: ErrorEntry("INVALID_ARGUMENT"),
    errors.UnknownTarget: ErrorEntry("NOT_FOUND"),
    errors.RefDenied: ErrorEntry("PERMISSION_DENIED"),
    errors.RefNotFound: ErrorEntry("NOT_FOUND"),
    errors.SessionLimit: ErrorEntry("RESOURCE_EXHAUSTED"),
    errors.InputMissing: ErrorEntry("FAILED_PRECONDITION"),
    errors.NeedsChatTemplate: ErrorEntry("FAILED_PRECONDITION"),
    InvalidRequest: ErrorEntry("INVALID_ARGUMENT"),
    ContextLengthExceeded: ErrorEntry("OUT_OF_RANGE"),
    RequestRejected: ErrorEntry("RESOURCE_EXHAUSTED"),  # QueueFull, RateLimited, MemoryPressure
    ModelNotReady: ErrorEntry("UNAVAILABLE"),
    RequestTimeout: ErrorEntry("DEADLINE_EXCEEDED"),
    CacheMiss: ErrorEntry("INTERNAL"),
    EngineError: ErrorEntry("INTERNAL"),  # GenerationError: the action failed, so the session is aborted
    ReplicaLost: ErrorEntry("UNAVAILABLE"),  # retryable: the same action runs on another replica
    EngineDead: ErrorEntry("UNAVAILABLE"),
}
"""Exception class → its gRPC status name (``code``); looked up along the MRO so subclasses win."""

GENERIC_MESSAGE = "internal server error"


def status_of(exc: BaseException) -> tuple[str, str]:
    """The gRPC status name and the client-safe message that abort a session for ``exc``.

    Unexpected exceptions (not ``RillError``) get ``INTERNAL`` and a generic message, never
    their own text.
    """
    if not isinstance(exc, RillError):
        return "INTERNAL", GENERIC_MESSAGE
    entry = lookup(ERROR_STATUS, exc, None)
    if entry is None or entry.code is None:
        return "INTERNAL", GENERIC_MESSAGE
    return entry.code, entry.message(exc)


WS_CLOSE_BASE = 4000
"""WebSocket close code of an aborted session = 4000 + its gRPC status number."""

WS_REASON_MAX_BYTES = 123  # RFC 6455: a close frame's reason fits in 123 bytes


def ws_close(exc: BaseException) -> tuple[int, str]:
    """The WebSocket close code and reason (``"STATUS: message"``, cut to 123 bytes) for ``exc``."""
    name, message = status_of(exc)
    reason = f"{name}: {message}".encode(errors="replace")  # a message quoting input must still close
    if len(reason) > WS_REASON_MAX_BYTES:
        reason = reason[: WS_REASON_MAX_BYTES - 3].decode(errors="ignore").encode() + "…".encode()
    return WS_CLOSE_BASE + STATUS_NUMBERS[name], reason.decode()
