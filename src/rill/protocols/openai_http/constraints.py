"""The output constraint of an OpenAI request: ``response_format``, ``structured_outputs``,
vLLM's older ``guided_*`` fields (``GUIDED``) or a forced tool call (``tool_choice``
``required`` or a named function), as one ``ResponseFormat``. Pure.

Shapes are checked here (a value that cannot be a ``ResponseFormat`` is a 400 when the request
is decoded); bounds (a schema's size, a regex that is there) once, when the frontend's
submission policy validates the request's parameters, whose errors ``constraint_field``
then names as the request did.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import msgspec

from rill.errors import InvalidRequest
from rill.protocols._shared.tool_calls import call_grammar
from rill.protocols.openai_http.messages import ChatCompletionRequest, CompletionRequest
from rill.types import ResponseFormat

if TYPE_CHECKING:
    from rill.protocols.openai_http.codec import ServedModel

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
"""vLLM's older constraint fields, each the ``structured_outputs`` key of the same meaning."""

GUIDED_BACKENDS = ("auto", "guidance")
"""The ``guided_decoding_backend`` values that can be honoured: the engine's choice, or
llguidance (vLLM calls it ``guidance``), the only one rill runs."""


def response_format(req: CompletionRequest | ChatCompletionRequest, served: ServedModel) -> ResponseFormat | None:
    """The constraint of a request: ``response_format``, ``structured_outputs`` or a forced tool
    call (not validated: the submission policy does that once).

    At most one of them may constrain; ``tool_choice`` ``required`` / a named function is
    enforced with a grammar of valid calls in the model's tool-call format. A forced call
    sets ``response_format`` aside rather than clash with it, as OpenAI does: the format shapes
    a text answer, and a forced call gives none (agent frameworks send both, forcing a tool
    in the first turn of a conversation whose last answer is structured).
    """
    found = _constraints(req, served)
    if any(name == "tool_choice" for name, _ in found):
        found = [(name, fmt) for name, fmt in found if name != "response_format"]
    if len(found) > 1:
        raise InvalidRequest(
            f"'{found[0][0]}' and '{found[1][0]}' both constrain the output; send one", field=found[1][0]
        )
    return found[0][1] if found else None


def constraint_field(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The wire field the request's constraint came from (``response_format``,
    ``structured_outputs``, a ``guided_*`` field or ``tool_choice``), None without one."""
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        return "response_format"
    if req.structured_outputs is not None:
        return "structured_outputs"
    for name in GUIDED:
        if getattr(req, name) is not None:
            return name
    if isinstance(req, ChatCompletionRequest) and forced_tool(req)[0]:
        return "tool_choice"
    return None


def _constraints(
    req: CompletionRequest | ChatCompletionRequest, served: ServedModel | None
) -> list[tuple[str, ResponseFormat]]:
    found: list[tuple[str, ResponseFormat]] = []
    if req.response_format is not None:
        fmt = _convert_format(req.response_format, "response_format")
        if fmt.is_constraint:
            found.append(("response_format", fmt))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(req.structured_outputs)))
    found += [(name, _constraint_of(kind, getattr(req, name), name)) for name, kind in _guided(req)]
    if isinstance(req, ChatCompletionRequest):
        forced, name = forced_tool(req)
        if forced and served is not None:
            grammar = call_grammar(served.tool_format, list(req.tools or []), name)
            found.append(("tool_choice", ResponseFormat(type="grammar", grammar=grammar)))
    return found


def check_formats(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse a ``response_format`` or ``structured_outputs`` of the wrong shape when the
    request is decoded (a 400 before any tokenizing); bounds are checked at admission, with the
    other parameters, and compiling after."""
    _constraints(req, None)


def _convert_format(value: Any, field: str) -> ResponseFormat:
    try:
        return msgspec.convert(value, ResponseFormat)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid {field}: {exc}", field=field) from exc


def _guided(req: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, str]]:
    """The ``guided_*`` constraint fields the request sets, with their kind; ``InvalidRequest``
    for a backend or whitespace pattern that cannot be honoured."""
    backend = req.guided_decoding_backend
    if backend is not None and backend not in GUIDED_BACKENDS:
        raise InvalidRequest(
            f"guided_decoding_backend '{backend}' is not available; this server constrains with llguidance "
            f"({' or '.join(repr(b) for b in GUIDED_BACKENDS)}, or leave it out)",
            field="guided_decoding_backend",
        )
    if req.guided_whitespace_pattern is not None:
        # llguidance writes JSON's whitespace its own way; a pattern would be silently ignored.
        raise InvalidRequest(
            "'guided_whitespace_pattern' is not supported by this server", field="guided_whitespace_pattern"
        )
    return [(name, kind) for name, kind in GUIDED.items() if getattr(req, name) is not None]


def _structured_outputs(spec: dict[str, Any]) -> ResponseFormat:
    field = "structured_outputs"
    given = [k for k in ("json", "regex", "grammar", "choice", "json_object") if spec.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest(
            "'structured_outputs' needs exactly one of json, regex, grammar, choice, json_object", field=field
        )
    kind = given[0]
    return _constraint_of(kind, spec[kind], field, f"structured_outputs.{kind}")


def _constraint_of(kind: str, value: Any, field: str, label: str | None = None) -> ResponseFormat:
    """The constraint of one ``structured_outputs`` key ``kind`` (or the ``guided_*`` field of
    the same meaning), given as ``field``; errors call the value ``label`` (``field`` unless given)."""
    label = label or field
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequest(f"'{label}' is not valid JSON", field=field) from exc
        return _convert_format({"type": "json_schema", "json_schema": {"schema": value}}, field)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise InvalidRequest(f"'{label}' must be a non-empty list of strings", field=field)
        return _convert_format({"type": "regex", "regex": "|".join(_regex_escape(c) for c in value)}, field)
    if kind == "json_object":
        return ResponseFormat(type="json_object")
    return _convert_format({"type": kind, kind: value}, field)


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in ".^$*+?()[]{}|\\/" else ch for ch in text)


def forced_tool(req: ChatCompletionRequest) -> tuple[bool, str | None]:
    """Whether the request forces a tool call (``required`` or a named function), and which."""
    choice = req.tool_choice
    if choice == "required":
        return True, None
    if isinstance(choice, dict):
        return True, choice["function"]["name"]
    return False, None
