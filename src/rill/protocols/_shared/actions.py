"""The actions every protocol session returns to its adapter, defined once (plain data, no I/O).

A sans-I/O session answers each input with a list of actions; its adapter performs them.
``Send``, ``Start``, ``Abort``, ``Rejected`` and ``Close`` mean the same on every wire, so they live here;
a protocol adds only the actions its wire alone has (``/generate``'s ``Pause`` and ``Modify``,
chat's ``Speak``, Evergreen's ``Generate``…) in its own session module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from rill.types import GenerateRequest

M = TypeVar("M")


@dataclass(frozen=True, slots=True)
class Send(Generic[M]):
    """Write ``message`` to the peer (the adapter encodes it with its protocol's codec)."""

    message: M


@dataclass(frozen=True, slots=True)
class Start:
    """Submit ``request`` to the engine and feed its outputs back to the session.

    ``key`` names the stream where one connection runs several (batch ``/ws``); None is the
    connection's one stream.
    """

    request: GenerateRequest
    key: str | None = None


@dataclass(frozen=True, slots=True)
class Abort:
    """Cancel the engine request of stream ``key`` (None: the connection's one stream); its
    final output still comes back."""

    key: str | None = None


@dataclass(frozen=True, slots=True)
class Close:
    """Close the connection once what was sent is flushed; ``code`` and ``reason`` where the
    transport has them (a WebSocket close code; None: the adapter's normal close)."""

    code: int | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Rejected:
    """Count a request the session refused before it reached the engine (a bad frame, a broken
    rule) in ``rill_requests_rejected_total``, under the error's wire-neutral ``code``."""

    code: str
