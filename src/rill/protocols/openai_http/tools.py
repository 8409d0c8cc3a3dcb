"""The tools an OpenAI chat request offers: their shape, and when a reply is a call (pure).

``check_tools`` refuses a malformed ``tools`` list or ``tool_choice`` when the request is
decoded; ``parses_tool_calls`` says whether the reply is read for calls at all;
``text_call_check`` gives the ``ArgumentsCheck`` that lets a reply written only as a JSON
call object (at ``tool_choice`` ``auto``) count as a call when its arguments are valid for
the function's schema. How calls are written and parsed is ``_shared/tool_calls``'.
"""

from __future__ import annotations

from typing import Any

from rill.errors import InvalidRequest
from rill.protocols.openai_http.constraints import constraint_field
from rill.protocols.openai_http.messages import ChatCompletionRequest

MAX_TOOLS = 128
"""Most functions one request may offer."""


def check_tools(req: ChatCompletionRequest) -> None:
    """Refuse a ``tools`` list or ``tool_choice`` of the wrong shape, or naming a function not offered."""
    names = []
    for i, tool in enumerate(req.tools or []):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", field="tools")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise InvalidRequest(f"tools[{i}].function.name must be a non-empty string", field="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON schema object", field="tools")
        names.append(fn["name"])
    if len(names) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools per request", field="tools")
    choice = req.tool_choice
    if choice is None or choice in ("none", "auto"):
        return
    if choice == "required":
        if not names:
            raise InvalidRequest("tool_choice 'required' needs 'tools'", field="tool_choice")
        return
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or not isinstance(name, str):
        raise InvalidRequest(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            field="tool_choice",
        )
    if name not in names:
        raise InvalidRequest(f"tool_choice names function '{name}', which is not in 'tools'", field="tool_choice")


def parses_tool_calls(req: ChatCompletionRequest) -> bool:
    """Whether the output is read for tool calls: tools offered and ``tool_choice`` not ``none``."""
    return bool(req.tools) and req.tool_choice != "none"


def text_call_check(req: ChatCompletionRequest) -> ArgumentsCheck | None:
    """The check that makes a reply written only as a JSON call object a tool call
    (``tool_calls.accept_text_calls``), or None when such a reply stays the answer.

    Only at ``tool_choice`` ``auto`` (or unset) with tools offered: ``required`` and a named
    function are forced into the format's own call syntax by a grammar already. Never when the
    request shapes the output (``response_format`` other than ``text``, ``structured_outputs``,
    a ``guided_*`` field):
    a client that asked for JSON gets its JSON as the answer. The check passes when the name is
    an offered function and the arguments are valid for its ``parameters`` (JSON Schema). A
    function whose schema holds a regular expression (``pattern``, ``patternProperties``) is
    never matched: ``jsonschema`` runs them with Python's backtracking ``re`` on the event loop,
    where the client's pattern over the model's text could take minutes.

    Building a validator is costly (``check_schema`` of a 45 KB schema takes ~300 ms): the
    adapter calls ``ArgumentsCheck.prepare`` off the event loop before the request starts.
    """
    if not parses_tool_calls(req) or req.tool_choice not in (None, "auto"):
        return None
    if constraint_field(req) is not None:
        return None
    functions = (tool["function"] for tool in req.tools or [])
    return ArgumentsCheck({fn["name"]: fn.get("parameters") or {"type": "object"} for fn in functions})


class ArgumentsCheck:
    """``check(name, arguments)``: ``name`` is one of ``schemas`` and ``arguments`` satisfy it.

    ``prepare`` builds every validator (in a worker thread: the adapter runs it where grammar
    compiles run); without it, a function's validator is built the first time a reply names it.
    """

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self.schemas = schemas
        self.validators: dict[str, Any] = {}

    def prepare(self) -> None:
        """Build the validator of every function now (CPU work: call it off the event loop)."""
        for name, schema in self.schemas.items():
            if name not in self.validators:
                self.validators[name] = _validator(schema)

    def __call__(self, name: str, arguments: dict[str, Any]) -> bool:
        """True when ``name`` is offered and ``arguments`` are valid for its schema."""
        if name not in self.schemas:
            return False
        if name not in self.validators:
            self.validators[name] = _validator(self.schemas[name])
        validator = self.validators[name]
        try:
            return validator is not None and bool(validator.is_valid(arguments))
        except Exception:  # noqa: BLE001 - the client's schema: an unknown type, a $ref nowhere to be found, ...
            return False


def _validator(schema: dict[str, Any]) -> Any:
    """A ``jsonschema`` validator of ``schema``, or None when it is malformed or holds a regex."""
    if _has_regex(schema):
        return None
    import jsonschema

    try:
        cls = jsonschema.validators.validator_for(schema)
        cls.check_schema(schema)
        return cls(schema)
    except Exception:  # noqa: BLE001 - the client's schema: SchemaError, or a "$schema" of the wrong type, ...
        return None


def _has_regex(schema: Any) -> bool:
    """Whether a schema may hold a regular expression (a key ``pattern`` with a string or
    ``patternProperties`` with an object anywhere, a property so named included)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str) or isinstance(node.get("patternProperties"), dict):
                return True
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return False
