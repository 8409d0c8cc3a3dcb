"""Wire structs of Evergreen ``evergreen.v2``: one frozen msgspec Struct per proto message.

Field names are the proto's (snake_case); ``codec`` converts protobuf messages and proto3
JSON to and from these, so the session never touches protobuf or JSON. Defaults are the
proto3 ones (``seq`` 0, ``continued`` false), which the spec makes normative.

``GenerateConfig`` is rill's own action configuration (``rill_config.proto``), carried in
``Action.configs`` as a ``google.protobuf.Any``; unset fields are None.

Pure: no I/O, no protobuf import.
"""

from __future__ import annotations

import msgspec

from rill.errors import InvalidRequest
from rill.protocols._shared.sampling import Field, SamplingMap, same
from rill.types import ResponseFormat

GENERATE_CONFIG_TYPE_URL = "type.googleapis.com/rill.evergreen.v1.GenerateConfig"
"""``Any.type_url`` of rill's ``GenerateConfig``."""


class AnyMessage(msgspec.Struct, frozen=True, kw_only=True):
    """A ``google.protobuf.Any``: a type URL and the serialized message."""

    type_url: str
    value: bytes = b""


class Timestamp(msgspec.Struct, frozen=True, kw_only=True):
    """A ``google.protobuf.Timestamp`` (kept only so metadata compares and round-trips whole)."""

    seconds: int = 0
    nanos: int = 0


class ChunkMetadata(msgspec.Struct, frozen=True, kw_only=True):
    """How to interpret a chunk: its mimetype and conversation role."""

    mimetype: str = ""
    role: str = ""
    original_file_name: str = ""
    capture_time: Timestamp | None = None
    experimental: tuple[AnyMessage, ...] = ()


class Chunk(msgspec.Struct, frozen=True, kw_only=True):
    """A piece of a leaf's payload: inline ``data`` or an external ``ref`` (URI), or neither."""

    metadata: ChunkMetadata | None = None
    ref: str | None = None
    data: bytes | None = None


class NodeFragment(msgspec.Struct, frozen=True, kw_only=True):
    """One fragment of node ``id``: its ``seq``-th part; ``continued`` says more follow."""

    id: str = ""
    seq: int = 0
    continued: bool = False
    child_ids: tuple[str, ...] = ()
    chunk_fragment: Chunk | None = None


class NamedParameter(msgspec.Struct, frozen=True, kw_only=True):
    """An action's input or output: parameter ``name`` bound to root node ``id``."""

    name: str = ""
    id: str = ""


class TargetSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Which model runs the action (empty ``id``: the server's default)."""

    id: str = ""


class Action(msgspec.Struct, frozen=True, kw_only=True):
    """A function (``GENERATE``) over input nodes producing output nodes."""

    name: str = ""
    inputs: tuple[NamedParameter, ...] = ()
    outputs: tuple[NamedParameter, ...] = ()
    configs: tuple[AnyMessage, ...] = ()
    target_spec: TargetSpec | None = None


class SessionMessage(msgspec.Struct, frozen=True, kw_only=True):
    """What both sides send on the stream: node fragments and actions."""

    node_fragments: tuple[NodeFragment, ...] = ()
    actions: tuple[Action, ...] = ()


class GenerateConfig(msgspec.Struct, frozen=True, kw_only=True):
    """rill's ``GENERATE`` configuration; None means "rill's default" (names as in the proto)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool | None = None
    response_format: str | None = None  # JSON text of a rill.types.ResponseFormat
    speculative: int | None = None  # 0 = off, N = at most N draft tokens


def _response_format(text: str) -> ResponseFormat:
    try:
        return msgspec.json.decode(text, type=ResponseFormat)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequest(
            f"'response_format' is not a valid response format: {exc}", field="response_format"
        ) from exc


SAMPLING = SamplingMap(
    GenerateConfig,
    same(
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "max_tokens",
        "min_tokens",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "ignore_eos",
        "speculative",
    ),
    Field("stop", "stop", list),
    Field("response_format", "response_format", _response_format),
)
"""``GenerateConfig`` → ``SamplingParams``; the values are validated at admission, as the
other requests' (the server's ``--max-tokens-cap`` applies first)."""
