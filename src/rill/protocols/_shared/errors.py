"""The one lookup of a protocol's error table (pure).

Each protocol's ``codec.py`` keeps its own table from exception class to wire
representation (STYLE §6.8); this module only finds the entry that applies. The lookup
walks the exception's MRO, so the most specific class in the table wins, whatever order
the table is written in (as httpx ``map_httpcore_exceptions`` does).

Imports nothing: no I/O, no engine, no frontend.
"""

from __future__ import annotations

from typing import Mapping, TypeVar

V = TypeVar("V")
D = TypeVar("D")


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
