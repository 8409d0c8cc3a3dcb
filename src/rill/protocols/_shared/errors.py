"""The entry type of every protocol's error table, and the one lookup (pure).

Each protocol's ``codec.py`` keeps its own table from exception class to ``ErrorEntry``
(STYLE §6.8): the same shape on every wire, each using the parts its wire has. The lookup
walks the exception's MRO, so the most specific class in the table wins, whatever order
the table is written in (as httpx ``map_httpcore_exceptions`` does).

Imports nothing: no I/O, no engine, no frontend.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

V = TypeVar("V")
D = TypeVar("D")


@dataclass(frozen=True, slots=True)
class ErrorEntry:
    """How one exception class appears on one wire.

    Attributes:
        code: the wire's name for the error (an OpenAI error type, a gRPC status name, an
            ``E_*`` code, ``/generate``'s ``error``), or None where the wire has none.
        status: the number sent with it (an HTTP status, a WebSocket close code), or None.
        text: a fixed client-safe message that replaces the exception's own (which, for rill's
            errors, is written for clients); set it where the message could show internals.
        recoverable: whether the connection stays usable afterwards.
        action: what the client should do next (``/generate``'s ``recovery_action``).
    """

    code: str | None = None
    status: int | None = None
    text: str | None = None
    recoverable: bool = True
    action: str | None = None

    def message(self, exc: BaseException) -> str:
        """What the client reads: ``text``, else the exception's own message."""
        return self.text if self.text is not None else str(exc)


ErrorTable = Mapping[type[BaseException], ErrorEntry]
"""A protocol's table: exception class → its entry (looked up by ``lookup``)."""


def lookup(table: Mapping[type[BaseException], V], exc: BaseException, default: D) -> V | D:
    """The entry of the most specific class of ``exc`` that ``table`` names.

    Args:
        table: exception class → whatever the protocol sends for it.
        exc: the exception to translate.
        default: returned when no class in ``exc``'s MRO is in the table (an unexpected
            exception, to be answered with a generic message).

    Returns:
        ``table[cls]`` for the first ``cls`` of ``type(exc).__mro__`` in ``table``, else ``default``.
    """
    for cls in type(exc).__mro__:
        if cls in table:
            return table[cls]
    return default
