"""Incremental parsing of a model's tool-call text into calls (pure, sans-I/O).

A model asked to call a function writes the call as text in a model-specific format. A
parser is fed that text chunk by chunk, as it is generated, and returns what can be shown
so far: ``ContentDelta`` (text meant for the user) and ``ToolCallDelta`` (a call's name once,
then its JSON arguments in fragments). Concatenating every fragment of a call gives its
arguments exactly as the model wrote them (a JSON text); chunk boundaries never change the
result. ``finish`` flushes what was held back when the generation ends; a call the generation
ended inside (cut by ``max_tokens``) is then the parser's ``cut``: its name and the arguments
shown so far, never one of its complete ``calls``.

Formats (``FORMATS``):

- ``hermes`` (``hermes.py``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, possibly several, between ordinary text (Hermes, Qwen2.5, Qwen3 templates).
- ``llama3_json`` (``llama3_json.py``): the whole output is one or more ``{"name": ...,
  "parameters": {...}}`` objects separated by ``;``, optionally after ``<|python_tag|>``
  (Llama 3.1/3.2/3.3 templates); an output that does not start that way is ordinary text.

Both follow each call object's JSON text as it arrives with ``json_call.CallScanner``.

``rill.models.chat_template.tool_call_format`` picks one from a chat template's source.
``call_grammar`` (``grammar.py``) builds the Lark grammar that forces an output to be valid
calls of the offered functions, in the same format (used for ``tool_choice: required`` and
named functions).

Calls written as plain JSON (``accept_text_calls``): some tool models, Qwen2.5-Coder among
them, answer a question that needs a tool with a reply that is only the call object, fenced
(```` ```json ````, or ```` ``` ```` alone) or bare, instead of their template's tags. Wrapped
around any format's parser, ``TextCallParser`` (``text_calls.py``) makes such a reply one call when its whole text
(surrounding whitespace aside) is ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``)
and an injected check says the name is a declared tool and the arguments are valid for it.
Anything else is the inner parser's output, unchanged: text exactly as written, tagged calls
as the format reads them. While the text could still become such a call, it is held back.

This package's modules import only the standard library and each other; importers use the
names this module gathers (the deltas are ``deltas.py``'s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rill.protocols._shared.tool_calls.deltas import (
    ContentDelta,
    Delta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    call_id,
)
from rill.protocols._shared.tool_calls.grammar import call_grammar
from rill.protocols._shared.tool_calls.hermes import HermesParser
from rill.protocols._shared.tool_calls.llama3_json import Llama3JsonParser
from rill.protocols._shared.tool_calls.text_calls import TextCallParser

__all__ = [
    "FORMATS",
    "ContentDelta",
    "Delta",
    "HermesParser",
    "Llama3JsonParser",
    "TextCallParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "accept_text_calls",
    "call_grammar",
    "call_id",
    "make_parser",
]

FORMATS = ("hermes", "llama3_json")
"""The tool-call formats a parser exists for."""


def make_parser(fmt: str, call_id_prefix: str) -> ToolCallParser:
    """A fresh parser for ``fmt``; call ids are derived from ``call_id_prefix`` (unique per choice)."""
    if fmt == "hermes":
        return HermesParser(call_id_prefix)
    if fmt == "llama3_json":
        return Llama3JsonParser(call_id_prefix)
    raise ValueError(f"unknown tool-call format {fmt!r}; use one of {', '.join(FORMATS)}")


def accept_text_calls(
    inner: ToolCallParser, is_valid: Callable[[str, dict[str, Any]], bool], call_id_prefix: str
) -> ToolCallParser:
    """``inner``, also reading a reply that is only a JSON call object as a call (``TextCallParser``).

    ``is_valid(name, arguments)`` says whether ``name`` is a declared tool and ``arguments``
    (the parsed object) are valid for it; ``call_id_prefix`` is the one ``inner`` was made with.
    """
    return TextCallParser(inner, is_valid, call_id_prefix)
