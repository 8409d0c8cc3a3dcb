"""ASGI middleware around every HTTP and WebSocket route: Host/Origin, API keys, body size, CORS.

``wrap(app, deps)`` returns, from the outside in:

1. Starlette's ``CORSMiddleware`` when ``--cors-origins`` is set (outermost, so browser
   preflights are answered without a key, and error responses carry CORS headers too);
2. ``Guard``: Host and Origin check (``SiteCheck``: 403, so neither a foreign web page nor
   a DNS-rebinding name can drive a server on loopback), API-key check and body-size
   limit; under ``/v1/`` it also turns the router's plain-text 404 / 405 into OpenAI error
   JSON. It also bounds time: a request body must arrive within ``--body-timeout-s``
   (408), an accepted WebSocket must send its first message within
   ``--first-message-timeout-s`` (close 1008), and it tells the connection's
   ``rill.connections.GuardedProtocol`` when a request starts and ends (header timeout).
   Only then, for a request from an address in ``--forwarded-allow-ips``, does it take the
   client address (and scheme) from ``X-Forwarded-For`` (``X-Forwarded-Proto``), so every
   per-client limit (``rill.auth.scope_principal``) follows the one setting, while the
   connection is still found, and counted, by its socket's peer. With no such address
   (the default) the headers are ignored: a client cannot name itself anew per request.

Keys: when any key is configured (``--api-key``, ``--api-key-file``), every route but
``/health``, ``/version`` and the playground's page, icon and static files need ``Authorization: Bearer KEY``; WebSockets
may instead offer the key subprotocol or pass ``?api_key=KEY`` (browsers cannot set headers
on a WebSocket; ``rill.auth.websocket_key``). A refused HTTP request gets 401 in OpenAI's
error JSON; a refused WebSocket handshake gets HTTP 401 before it is accepted (or a close
before accept, which servers answer with 403, where the ASGI server lacks the denial
response extension).

Body size: a ``Content-Length`` over ``--max-body-bytes`` is refused before reading; a
chunked body is read up to the limit and refused as soon as it passes it. An accepted body
is handed to the app in one message, after which ``receive`` is the server's own again,
so apps still see ``http.disconnect`` the moment the client leaves.

Modules: ``guard`` (``Guard``: the checks in order), ``sites`` (``SiteCheck``: Host and
Origin), ``first_message`` (the WebSocket first-message timeout), ``replies`` (the refusals
and rewrites written on the wire, in the format of the ``ErrorRenderer`` the server passes).
"""

from __future__ import annotations

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp

from rill.connections import ErrorRenderer
from rill.deps import Deps
from rill.middleware.guard import DRAIN_LIMIT_BYTES, PAGE_PATHS, PAGE_PREFIX, PUBLIC_PATHS, Guard
from rill.middleware.sites import SiteCheck

__all__ = ["DRAIN_LIMIT_BYTES", "PAGE_PATHS", "PAGE_PREFIX", "PUBLIC_PATHS", "Guard", "SiteCheck", "wrap"]


def wrap(app: ASGIApp, deps: Deps, render_error: ErrorRenderer) -> ASGIApp:
    """The server's app wrapped in the guard and, when origins are configured, CORS; refusals
    are written by ``render_error`` (``rill.connections.ErrorRenderer``: the server passes
    the OpenAI API's error format, so this module knows no protocol)."""
    http = deps.config.http
    limits = deps.config.connections
    sites = SiteCheck(http.host, http.allowed_hosts, [*http.allowed_origins, *http.cors_origins])
    wrapped: ASGIApp = Guard(
        app,
        render_error,
        api_keys=set(deps.api_keys or ()),
        max_body_bytes=http.max_body_bytes,
        sites=sites,
        gate=deps.gate,
        body_timeout_s=limits.body_timeout_s,
        first_message_timeout_s=limits.first_message_timeout_s,
        forwarded_allow_ips=http.forwarded_allow_ips,
    )
    if http.cors_origins:
        wrapped = CORSMiddleware(
            wrapped,
            allow_origins=list(http.cors_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["Retry-After"],
            # Keys travel in the Authorization header, not cookies; '*' forbids credentials anyway.
            allow_credentials=False,
        )
    return wrapped
