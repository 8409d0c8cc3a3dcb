"""Forcing a call: the Lark grammar whose sentences are valid calls of the offered functions,
in a format's own syntax (``tool_choice: required`` and named functions). Imports only the
standard library.
"""

from __future__ import annotations

import json
from typing import Any


def call_grammar(fmt: str, tools: list[dict[str, Any]], name: str | None = None) -> str:
    """A Lark grammar (llguidance dialect) whose sentences are valid calls in format ``fmt``.

    ``name`` restricts it to one function (a named ``tool_choice``), else any of ``tools``
    (``tool_choice: required``). The output is one call whose arguments follow the function's
    ``parameters`` schema (any object when it has none), written as compact JSON: free
    whitespace would let a model pad the call without end.
    """
    functions = [t["function"] for t in tools if t.get("type", "function") == "function" and "function" in t]
    if name is not None:
        functions = [f for f in functions if f.get("name") == name]
    args_key = "parameters" if fmt == "llama3_json" else "arguments"
    options = []
    for fn in functions:
        params = fn.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, args_key: params},
                "required": ["name", args_key],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    schema["x-guidance"] = {"whitespace_flexible": False}
    body = "%json " + json.dumps(schema)
    if fmt == "llama3_json":
        return f"start: {body}\n"
    return f'start: "<tool_call>\\n" obj "\\n</tool_call>"\nobj: {body}\n'
