"""Render Hugging Face chat templates (Jinja) in a sandbox.

Chat templates ship inside model folders and are untrusted code, so they run in jinja2's
``ImmutableSandboxedEnvironment`` with the same settings, globals and filters that
``transformers`` gives them (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``,
``raise_exception``, ``strftime_now``, ``tojson`` without HTML escaping, a ``namespace`` that
refuses underscore names, a no-op ``{% generation %}`` block). On top of the stock sandbox,
any access to an unsafe attribute (``''.__class__``) fails instead of rendering as empty.

Everything a template sees is rebuilt from plain JSON-like data first (``dict``/``list``/
``str``/numbers), so objects with dangerous methods never reach it. As in transformers 5,
message keys whose value is ``None`` are dropped and reasoning text given as ``reasoning``
or ``thinking`` is also exposed as ``reasoning_content`` (and the other way round).

Every failure of a template (``raise_exception``, syntax, undefined values, sandbox
violations) becomes ``rill.errors.InvalidRequest``. Imports: jinja2, msgspec, rill.errors.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import msgspec
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rill.errors import InvalidRequest
from rill.types import RESERVED_TEMPLATE_KWARGS

NO_TEMPLATE_MESSAGE = (
    "this model has no chat template; send a plain prompt instead of messages, "
    "or serve the model with a tokenizer that defines a chat template"
)

# Names the renderer passes itself; template kwargs may not replace them.
RESERVED_NAMES = RESERVED_TEMPLATE_KWARGS

# Reasoning text is passed under several names; templates read one of them.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _TemplateRaised(TemplateError):
    """Raised by ``raise_exception()`` inside a template; its message goes to the client."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # NOTE: Jinja's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # `format` shadows the builtin: it is the name templates use
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates: builds dicts without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed attributes (no path to internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes ({name!r})")


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant spans with it.

    We do not compute assistant masks, so the block just renders its body.
    """

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, except that unsafe attribute access raises at once.

    The stock sandbox returns an Undefined for ``''.__class__``, which prints as "" and only
    fails on further use; a template that probes internals should fail loudly.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _new_environment() -> _StrictSandbox:
    env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _new_environment()


@functools.lru_cache(maxsize=32)
def _compile_cached(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once; later calls with the same source reuse the result.

    Raises:
        InvalidRequest: the template has a syntax error (message names the line).
    """
    try:
        return _compile_cached(source)
    except TemplateSyntaxError as exc:
        raise InvalidRequest(
            f"the model's chat template has a syntax error: {exc.message} (line {exc.lineno})", field="messages"
        ) from exc


def render_chat_template(
    source: str | None,
    messages: Sequence[Any],
    /,
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Any] | None = None,
    documents: Sequence[Any] | None = None,
    special_tokens: Mapping[str, str] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with the template ``source`` and return the prompt text.

    Args:
        source: the Jinja template text; None means the model has no template.
        messages: chat turns as dicts (or msgspec structs such as ``ChatMessage``) with
            ``role`` and ``content``; content may be a string or a list of parts, which is
            passed through unchanged.
        add_generation_prompt: ask the template to open an assistant turn at the end.
        tools: JSON schemas of tools, passed as ``tools`` (None when absent).
        documents: retrieval documents, passed as ``documents`` (may also come in the kwargs).
        special_tokens: ``bos_token``, ``eos_token``... as strings; the kwargs win over them
            when both name the same variable.
        template_kwargs: variables from a client (``chat_template_kwargs``); a mapping, so any
            key is safe to pass.
        kwargs: more variables (``enable_thinking``...); they win over ``template_kwargs``.

    Raises:
        InvalidRequest: no template, empty or malformed messages or tools, a reserved
            variable name (``messages``, ``tools``, ``add_generation_prompt``), or any
            template failure; ``raise_exception`` messages are passed through verbatim.
    """
    if source is None:
        raise InvalidRequest(NO_TEMPLATE_MESSAGE, field="messages")
    variables, documents = _checked_variables(messages, tools, documents, {**(template_kwargs or {}), **kwargs})
    template = compile_template(source)
    context = _context(messages, add_generation_prompt, tools, documents, {**(special_tokens or {}), **variables})
    return _render(template, context)


def _checked_variables(
    messages: Sequence[Any], tools: Sequence[Any] | None, documents: Sequence[Any] | None, variables: dict[str, Any]
) -> tuple[dict[str, Any], Sequence[Any] | None]:
    """Refuse empty messages, reserved variable names and tools or documents that are not
    lists; return the variables and the documents (taken from the variables when not given)."""
    if not messages:
        raise InvalidRequest("messages must contain at least one message", field="messages")
    clash = RESERVED_NAMES.intersection(variables)
    if clash:
        raise InvalidRequest(f"chat template kwarg '{sorted(clash)[0]}' is reserved", field="chat_template_kwargs")
    if documents is None:
        documents = variables.pop("documents", None)
    for name, value in (("tools", tools), ("documents", documents)):
        if value is not None and not isinstance(value, (list, tuple)):
            raise InvalidRequest(f"'{name}' must be a list", field=name)
    return variables, documents


def _context(
    messages: Sequence[Any],
    add_generation_prompt: bool,
    tools: Sequence[Any] | None,
    documents: Sequence[Any] | None,
    variables: dict[str, Any],
) -> dict[str, Any]:
    """The template's variables, as plain Python values."""
    return {
        "messages": _plain_messages(messages),
        "tools": _plain(list(tools)) if tools is not None else None,
        "documents": _plain(list(documents)) if documents is not None else None,
        "add_generation_prompt": bool(add_generation_prompt),
        **_plain(variables),
    }


def _render(template: jinja2.Template, context: dict[str, Any]) -> str:
    """Render ``template``; every failure of the template becomes ``InvalidRequest``
    (``raise_exception`` messages verbatim)."""
    try:
        return template.render(**context)
    except _TemplateRaised as exc:
        raise InvalidRequest(exc.message or "the chat template rejected the messages", field="messages") from exc
    except TemplateError as exc:
        raise InvalidRequest(f"chat template error: {exc.message or type(exc).__name__}", field="messages") from exc
    except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError, RecursionError) as exc:
        # Python errors from template expressions (e.g. adding a string to a list).
        raise InvalidRequest(f"chat template failed: {type(exc).__name__}: {exc}", field="messages") from exc


def tool_call_format(source: str | None) -> str | None:
    """The tool-call format a chat template teaches its model (names as in
    ``rill.protocols._shared.tool_calls.FORMATS``), or None if it shows none."""
    if not source:
        return None
    if "<tool_call>" in source:
        return "hermes"
    if "<|python_tag|>" in source or "ipython" in source:
        return "llama3_json"
    return None


def _plain_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    plain = []
    for index, message in enumerate(messages):
        if isinstance(message, msgspec.Struct):
            message = msgspec.to_builtins(message)
        if not isinstance(message, Mapping):
            raise InvalidRequest(f"message {index} must be an object with 'role' and 'content'", field="messages")
        # transformers 5 drops None values: templates test for missing keys, not for None.
        cleaned = {key: value for key, value in message.items() if value is not None}
        plain.append(_alias_reasoning(_plain(cleaned)))
    return plain


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _plain(value: Any) -> Any:
    """Rebuild ``value`` from plain JSON-like types; anything else becomes ``"<TypeName>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # subclasses (enums) may carry methods
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, msgspec.Struct):
        return _plain(msgspec.to_builtins(value))
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    return f"<{type(value).__name__}>"


_PROBE_TOOL_NAME = "rill_probe_tool_7d41c2"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_TOOL_NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


@functools.lru_cache(maxsize=32)
def renders_tools(source: str) -> bool:
    """Whether the chat template ``source`` shows its model the ``tools`` it is given.

    A probe conversation is rendered with one probe tool; the template renders tools when the
    tool's name is in the text and not in the same conversation rendered without tools. The
    answer is cached per template source. A template that fails on the probe counts as
    rendering tools: nothing is added for it, and a real request meets the template's own error.
    """
    probe = [{"role": "user", "content": "probe"}]
    try:
        without = render_chat_template(source, probe, add_generation_prompt=True)
        with_tool = render_chat_template(source, probe, add_generation_prompt=True, tools=[_PROBE_TOOL])
    except InvalidRequest:
        return True
    # The name, not any difference: a template that only says "tools are available" without
    # listing them still leaves the model unaware of what it may call.
    return _PROBE_TOOL_NAME in with_tool and _PROBE_TOOL_NAME not in without
