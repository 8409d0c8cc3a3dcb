"""The one API-key check of every protocol: header parsing and a constant-time compare.

HTTP, the WebSocket routes (at the middleware and in ``/generate``) and gRPC all call these
two functions, so a key accepted on one protocol is accepted on every other, and none can be
weaker than the rest. A key taken from elsewhere (a query parameter, a WebSocket
subprotocol) is checked with ``key_matches`` directly.

Keys are validated at start-up by ``rill.config`` (no empty key, printable ASCII without
spaces), so every key here can be sent in an ``Authorization`` header.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Collection


def bearer_token(authorization: str | bytes | None) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` value, or None.

    The scheme is matched case-insensitively (RFC 7235 §2.1: ``bearer`` and ``BEARER`` are
    the same scheme); surrounding whitespace is ignored. An empty token, another scheme or a
    value with no scheme gives None, so it can never match a key.
    """
    if authorization is None:
        return None
    if isinstance(authorization, bytes):
        authorization = authorization.decode("latin-1")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return None
    return token


def key_matches(presented: str | bytes | None, keys: Collection[str]) -> bool:
    """Whether ``presented`` is one of ``keys``, in time independent of which key (if any) matches.

    Both sides are hashed first, so the compare runs over equal lengths and says nothing
    about a key's length; every key is compared (no early exit). None, an empty value and
    an empty key set never match: callers decide whether auth is on (``is_authorized``).
    """
    if not presented or not keys:
        return False
    raw = presented if isinstance(presented, bytes) else presented.encode("utf-8", "surrogatepass")
    digest = hashlib.sha256(raw).digest()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(digest, hashlib.sha256(key.encode("utf-8")).digest())
    return matched


def is_authorized(keys: Collection[str], presented: str | bytes | None) -> bool:
    """True when no key is configured (auth off), else ``key_matches(presented, keys)``."""
    return not keys or key_matches(presented, keys)
