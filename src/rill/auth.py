"""The one API-key check of every protocol: header parsing and a constant-time compare.

HTTP, the WebSocket routes (at the middleware and in ``/generate``) and gRPC all call these
two functions, so a key accepted on one protocol is accepted on every other, and none can be
weaker than the rest. A key taken from elsewhere (a query parameter, a WebSocket
subprotocol) is checked with ``key_matches`` directly; ``websocket_key`` finds it.

Browsers cannot set headers on a WebSocket, so a WebSocket handshake may carry the key as
a subprotocol instead: the client offers ``rill`` and ``rill.key.<base64url(KEY)>``, and the
server selects ``rill`` (``APP_SUBPROTOCOL``), so the key is never echoed back. Unlike a
query parameter, a subprotocol never appears in access logs.

Keys are validated at start-up by ``rill.config`` (no empty key, printable ASCII without
spaces), so every key here can be sent in an ``Authorization`` header.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import logging
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

APP_SUBPROTOCOL = "rill"
"""The subprotocol a server selects when a client offers it (with or without a key)."""

KEY_SUBPROTOCOL_PREFIX = "rill.key."
"""Prefix of the subprotocol that carries an API key, base64url-encoded without padding."""

MAX_KEY_SUBPROTOCOL_CHARS = 4096
"""Longer key subprotocols are ignored unread (keys are short; this bounds the decode)."""


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


PRINCIPAL_SCOPE_KEY = "rill.principal"
"""The ASGI scope key where the middleware leaves the principal of an HTTP or WebSocket request."""


def principal(key: str | None, peer: str | None) -> str:
    """Who asks, as the admission step's per-principal limits see it.

    With an API key that authenticated: ``key:`` and the first 16 hex digits of the key's
    SHA-256, so every connection and protocol using one key shares its limits, and logs or
    metrics that show a principal never show a key. Without one (auth off): ``peer:`` and
    the client's address as ``client_key`` counts it (an IPv4 address, an
    IPv6 /64), or ``uds:uid=N`` for a Unix-socket peer; ``peer:unknown`` when the transport
    does not say.
    """
    if key:
        return "key:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return peer if peer and peer.startswith("uds:") else f"peer:{peer or 'unknown'}"


def scope_principal(scope: Mapping[str, Any]) -> str:
    """The principal of an ASGI request: the one the middleware recorded after checking the
    key, else (no middleware, auth off) the client's address."""
    recorded = scope.get(PRINCIPAL_SCOPE_KEY)
    if isinstance(recorded, str):
        return recorded
    client = scope.get("client")
    return principal(None, client_key(client[0]) if client else None)


ANONYMOUS_OWNER = "anonymous"
"""The owner of what a request without a key stores (auth off)."""


def owner(principal_: str) -> str:
    """Whose stored responses and resumable streams a request of ``principal_`` may read: its
    key's principal, or, with auth off, ``ANONYMOUS_OWNER`` for everyone. Not the client's
    address: an address changes when a phone changes networks, which is when a client
    resumes; without keys the unguessable id of a response or generation is the only secret
    there is."""
    return principal_ if principal_.startswith("key:") else ANONYMOUS_OWNER


def scope_owner(scope: Mapping[str, Any]) -> str:
    """``owner`` of the principal of an ASGI ``scope`` (``scope_principal``)."""
    return owner(scope_principal(scope))


def client_key(host: str) -> str:
    """The per-client unit of an IP address: itself for IPv4, its /64 network for IPv6.

    Every per-client count uses it: principals without a key (``principal``) and the
    connection gate's per-address limits (``rill.connections``). One IPv6 host usually holds
    a whole /64 (SLAAC, privacy addresses), so counting single IPv6 addresses would let one
    client open the per-client limit 2**64 times. An IPv4-mapped IPv6 address (a dual-stack
    listener) counts as its IPv4 address.
    """
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def key_subprotocol(key: str) -> str:
    """The WebSocket subprotocol that carries ``key`` (base64url, so every key is a valid token)."""
    return KEY_SUBPROTOCOL_PREFIX + base64.urlsafe_b64encode(key.encode("utf-8")).decode("ascii").rstrip("=")


def subprotocol_key(offered: Iterable[str]) -> str | None:
    """The key carried by the first ``rill.key.*`` entry of ``offered`` subprotocols, or None.

    A malformed entry (bad base64url, not UTF-8, over ``MAX_KEY_SUBPROTOCOL_CHARS``) gives
    None, so it can never match a key.
    """
    for name in offered:
        if not name.startswith(KEY_SUBPROTOCOL_PREFIX):
            continue
        encoded = name[len(KEY_SUBPROTOCOL_PREFIX) :]
        if not encoded or len(encoded) > MAX_KEY_SUBPROTOCOL_CHARS:
            return None
        try:
            raw = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
            return raw.decode("utf-8") or None
        except (binascii.Error, ValueError):
            return None
    return None


def websocket_key(authorization: str | bytes | None, subprotocols: Iterable[str], query_key: str | None) -> str | None:
    """The key a WebSocket handshake presents: ``Authorization: Bearer``, else the key
    subprotocol, else the ``api_key`` query parameter (the middleware accepts the last two
    on WebSocket handshakes only)."""
    return bearer_token(authorization) or subprotocol_key(subprotocols) or query_key or None


_QUERY_KEY = re.compile(r"([?&](?:api_key|api-key|apikey)=)[^&\s\"']*", re.IGNORECASE)


def redact_query_keys(text: str) -> str:
    """``text`` with the value of every ``api_key=`` query parameter replaced by ``***``."""
    return _QUERY_KEY.sub(r"\1***", text)


class QueryKeyRedactor(logging.Filter):
    """Removes ``?api_key=KEY`` values from log records before any handler sees them.

    uvicorn logs every WebSocket handshake's path with its query string (and every HTTP
    request line in its access log), so a key passed as a query parameter would otherwise
    land in the server's logs. Installed on uvicorn's loggers by ``rill.server``.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        """Rewrite the record's message when it holds a query key; never drops a record."""
        message = record.getMessage()
        redacted = redact_query_keys(message)
        if redacted != message:
            record.msg, record.args = redacted, ()
        return True


QUERY_KEY_REDACTOR = QueryKeyRedactor()
"""The one instance (``Logger.addFilter`` ignores a filter already installed)."""
