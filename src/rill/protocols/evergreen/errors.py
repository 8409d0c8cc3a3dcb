"""The ways an Evergreen session can fail, each a ``rill.errors`` class.

Every one aborts the whole session (the spec has no per-action error); ``codec.ERROR_STATUS``
maps each to a gRPC status (and through it to a WebSocket close code). Messages name the
node, action or rule involved and are safe to send to the client.
"""

from __future__ import annotations

from rill.errors import InvalidRequest, RequestRejected, RillError


class InvalidMessage(InvalidRequest):
    """A message is not a valid ``SessionMessage`` (bad JSON, bad protobuf, bad field)."""

    code = "invalid_message"


class RuleBroken(InvalidRequest):
    """A fragment or action breaks a rule of the session (fragment past the final one,
    conflicting metadata, leaf and parent mixed, cycle, nesting too deep, bad action)."""

    code = "session_rule_broken"


class UnsupportedInput(InvalidRequest):
    """An input the model or server cannot take (media mimetype, ref scheme, role)."""

    code = "unsupported_input"


class UnknownTarget(RillError):
    """``target_spec.id`` names no model served here."""

    code = "target_not_found"


class RefDenied(RillError):
    """A ``file://`` ref points outside every ``--evergreen-file-root`` (or none is set)."""

    code = "ref_denied"


class RefNotFound(RillError):
    """A ``file://`` ref names a file that does not exist or cannot be read."""

    code = "ref_not_found"


class SessionLimit(RequestRejected):
    """A per-session limit (nodes, bytes, open actions) was reached."""

    code = "session_limit"
    retryable = False


class InputMissing(RillError):
    """The client ended its input while an action still waits for nodes that never came."""

    code = "input_missing"


class NeedsChatTemplate(RillError):
    """A prompt with roles or several turns, but the model has no chat template."""

    code = "needs_chat_template"
