"""From a flattened GENERATE input to an engine request: mimetypes, roles, turns, file refs.

The session flattens an action's input graph depth-first into ``PromptItem``s with
``leaf_item``; the adapter reads the file refs they name; ``build_request`` then makes the
``GenerateRequest``:

* ``text/*`` leaves (and ``application/json``, ``application/x-latex``) are UTF-8 text,
  joined across their fragments before decoding (fragment boundaries carry no meaning);
* ``ChunkMetadata.role`` maps to a chat role (``ROLES``; empty means ``user``); a change of
  role or an ``application/x-protobuf; type=EndOfTurn`` chunk ends a turn; the turns go to
  the chat template as ``messages``;
* on a model without a chat template, a prompt that is one plain user turn is sent as text
  (the spec defines an action's input as its flattened chunks); roles or several turns
  abort with ``NeedsChatTemplate`` rather than being silently flattened away;
* image, audio and video leaves abort naming the mimetype (the model takes text only);
* refs must be ``file://`` URIs under a configured root (``file_ref``; the adapter re-checks
  after resolving symlinks).

Pure: no I/O, no ``await``, no engine import.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from rill.errors import InvalidRequest
from rill.protocols.evergreen import codec
from rill.protocols.evergreen.errors import NeedsChatTemplate, RefDenied, UnsupportedInput
from rill.protocols.evergreen.messages import SAMPLING, Chunk, ChunkMetadata, GenerateConfig
from rill.types import ChatMessage, GenerateRequest, SamplingParams

END_OF_TURN = "application/x-protobuf; type=EndOfTurn"

ROLES: dict[str, str] = {
    "user": "user",
    "model": "assistant",
    "assistant": "assistant",
    "system": "system",
    "context": "user",
    "tool": "tool",
}
"""``ChunkMetadata.role`` (any case) → chat-template role; an empty role means ``user``."""

TEXT_MIMETYPES = ("application/json", "application/x-latex")
"""Mimetypes read as text besides ``text/*``."""

MEDIA_PREFIXES = ("image/", "audio/", "video/")


@dataclass(frozen=True)
class ModelFacts:
    """What the session must know of the served model."""

    name: str
    has_chat_template: bool = True
    modalities: tuple[str, ...] = ("text",)


@dataclass(frozen=True)
class FileRef:
    """A ``file://`` ref allowed by the roots: ``path`` is normalised and absolute. The adapter
    must still resolve symlinks and re-check the roots before reading."""

    uri: str
    path: str


@dataclass(frozen=True)
class TextLeaf:
    """A text leaf of a prompt: its chat role and its pieces (inline bytes or file refs) in order."""

    node_id: str
    role: str
    pieces: tuple[bytes | FileRef, ...]


@dataclass(frozen=True)
class TurnEnd:
    """An ``EndOfTurn`` chunk."""


PromptItem = TextLeaf | TurnEnd


def leaf_item(
    node_id: str, metadata: ChunkMetadata, chunks: list[Chunk], model: ModelFacts, file_roots: tuple[str, ...]
) -> PromptItem:
    """The prompt item of a client leaf whose seq 0 carries ``metadata``, from its chunks in seq order.

    Raises:
        UnsupportedInput: a media or other non-text mimetype, an unknown role, a non-file ref.
        RefDenied: a file ref outside the roots.
    """
    mimetype = metadata.mimetype.strip()
    main_type = mimetype.split(";", 1)[0].strip().lower()
    if _normalise_mimetype(mimetype) == _normalise_mimetype(END_OF_TURN):
        return TurnEnd()
    if main_type.startswith(MEDIA_PREFIXES):
        kind = main_type.split("/", 1)[0]
        if kind in model.modalities:  # the model could, but this protocol does not pass media on yet
            raise UnsupportedInput(
                f"node '{node_id}' has mimetype '{mimetype}': Evergreen GENERATE does not "
                f"pass {kind} input to the model yet"
            )
        raise UnsupportedInput(
            f"node '{node_id}' has mimetype '{mimetype}': the model '{model.name}' "
            f"cannot take {kind} input (it takes {', '.join(model.modalities)})"
        )
    if not (main_type.startswith("text/") or main_type in TEXT_MIMETYPES):
        raise UnsupportedInput(
            f"node '{node_id}' has mimetype '{mimetype}', which GENERATE cannot take (text/* and EndOfTurn only)"
        )
    role = ROLES.get(metadata.role.lower()) if metadata.role else "user"
    if role is None:
        raise UnsupportedInput(f"node '{node_id}' has role '{metadata.role}' (use one of {', '.join(ROLES)})")
    pieces: list[bytes | FileRef] = []
    for chunk in chunks:
        if chunk.ref is not None:
            pieces.append(file_ref(chunk.ref, node_id, file_roots))
        elif chunk.data:
            pieces.append(chunk.data)
    return TextLeaf(node_id, role, tuple(pieces))


def file_ref(uri: str, node_id: str, file_roots: tuple[str, ...]) -> FileRef:
    """Check a ref against the scheme and root rules (no file-system access).

    Raises:
        UnsupportedInput: not a ``file://`` URI (or one naming a remote host), a path with a
            NUL or not UTF-8 once percent-decoded.
        RefDenied: no roots configured, or the path is outside every root.
    """
    parts = urlsplit(uri)
    if parts.scheme != "file":
        raise UnsupportedInput(
            f"node '{node_id}': ref '{uri}' has scheme '{parts.scheme or '(none)'}'; rill reads file:// refs only"
        )
    if parts.netloc not in ("", "localhost"):
        raise UnsupportedInput(
            f"node '{node_id}': ref '{uri}' names host '{parts.netloc}'; file:// refs must be local (file:///path)"
        )
    if not file_roots:
        raise RefDenied(
            f"node '{node_id}': file:// refs are disabled on this server (start it with --evergreen-file-root DIR)"
        )
    try:
        # strict: a percent-escape that is not UTF-8 must not silently name another file
        path = posixpath.normpath(unquote(parts.path, errors="strict"))
        path.encode("utf-8")  # a lone surrogate cannot name a file either
    except UnicodeError as exc:
        raise UnsupportedInput(
            f"node '{node_id}': ref '{uri}' is not a valid path (not UTF-8 once percent-decoded)"
        ) from exc
    if "\x00" in path:
        raise UnsupportedInput(f"node '{node_id}': ref '{uri}' contains a NUL character (%00)")
    if not path.startswith("/"):
        raise RefDenied(f"node '{node_id}': ref '{uri}' is not an absolute file:///path")
    if not any(is_under(path, root) for root in file_roots):
        raise RefDenied(f"node '{node_id}': ref '{uri}' is outside the allowed file roots")
    return FileRef(uri, path)


def build_request(
    action_id: str,
    items: tuple[PromptItem, ...],
    config: GenerateConfig,
    ref_bytes: dict[str, bytes],
    model: ModelFacts,
    *,
    deadline_s: float | None = None,
) -> GenerateRequest:
    """The engine request of action ``action_id``; ``ref_bytes`` holds each file ref's content by path.

    Raises:
        InvalidRequest: text that is not UTF-8, or an empty prompt.
        NeedsChatTemplate: roles or several turns on a model without a chat template.
    """
    turns = chat_turns(items, ref_bytes)
    if not any(turn.content for turn in turns):
        raise InvalidRequest(f"action {action_id}: the prompt is empty", field="prompt")
    common: dict[str, Any] = dict(sampling=sampling_params(config), protocol=codec.PROTOCOL_NAME, deadline_s=deadline_s)
    if model.has_chat_template:
        return GenerateRequest(messages=turns, **common)
    if len(turns) > 1 or turns[0].role != "user":
        raise NeedsChatTemplate(
            f"action {action_id}: the prompt has roles or several turns, but the "
            f"model '{model.name}' has no chat template to render them"
        )
    return GenerateRequest(prompt=str(turns[0].content), **common)


def chat_turns(items: tuple[PromptItem, ...], ref_bytes: dict[str, bytes]) -> list[ChatMessage]:
    """Group the items into chat turns: a role change or an EndOfTurn ends a turn."""
    turns: list[ChatMessage] = []
    role: str | None = None
    texts: list[str] = []
    for item in items:
        if isinstance(item, TextLeaf) and role in (None, item.role):
            role = item.role
        else:
            if role is not None:
                turns.append(ChatMessage(role=role, content="".join(texts)))
            role, texts = (item.role, []) if isinstance(item, TextLeaf) else (None, [])
        if isinstance(item, TextLeaf):
            data = b"".join(p if isinstance(p, bytes) else ref_bytes[p.path] for p in item.pieces)
            try:
                texts.append(data.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise InvalidRequest(f"node '{item.node_id}': text content is not valid UTF-8") from exc
    if role is not None:
        turns.append(ChatMessage(role=role, content="".join(texts)))
    return turns


def sampling_params(config: GenerateConfig) -> SamplingParams:
    """``SamplingParams`` from the fields the config sets (the server's ``--max-tokens-cap``
    is applied at admission, as on every protocol)."""
    return SAMPLING.build(SAMPLING.patch(config))


def _normalise_mimetype(mimetype: str) -> str:
    return "".join(mimetype.lower().split())


def is_under(path: str, root: str) -> bool:
    """Whether normalised absolute ``path`` is ``root`` itself or inside it."""
    root = posixpath.normpath(root)
    return path == root or path.startswith(root.rstrip("/") + "/")
