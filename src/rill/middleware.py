"""ASGI middleware around every HTTP and WebSocket route: API keys, body size, CORS.

``wrap(app, deps)`` returns, from the outside in:

1. Starlette's ``CORSMiddleware`` when ``--cors-origins`` is set (outermost, so browser
   preflights are answered without a key, and error responses carry CORS headers too);
2. ``Guard``: API-key check and body-size limit; under ``/v1/`` it also turns the router's
   plain-text 404 / 405 into OpenAI error JSON.

Keys: when any key is configured (``--api-key``, ``--api-key-file``), every route but
``/health`` needs ``Authorization: Bearer KEY``; WebSockets may instead pass ``?api_key=KEY``
(browsers cannot set headers on a WebSocket). A refused HTTP request gets 401 in OpenAI's
error JSON; a refused WebSocket handshake gets HTTP 401 before it is accepted (or a close
before accept, which servers answer with 403, where the ASGI server lacks the denial
response extension).

Body size: a ``Content-Length`` over ``--max-body-bytes`` is refused before reading; a
chunked body is read up to the limit and refused as soon as it passes it. An accepted body
is handed to the app in one message, after which ``receive`` is the server's own again,
so apps still see ``http.disconnect`` the moment the client leaves.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rill import auth
from rill.protocols.openai_http import codec

PUBLIC_PATHS = frozenset({"/health"})
"""Paths that never need a key (load balancers and orchestrators probe them)."""

DRAIN_LIMIT_BYTES = 16 * 1024 * 1024
"""How much of a refused body is read and dropped so the client can see the 413."""


def wrap(app: ASGIApp, deps: Any) -> ASGIApp:
    """The server's app wrapped in the guard and, when origins are configured, CORS."""
    http = deps.config.http
    wrapped: ASGIApp = Guard(app, api_keys=set(deps.api_keys or ()), max_body_bytes=http.max_body_bytes)
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


class Guard:
    """API-key check and body-size limit for HTTP and WebSocket scopes.

    Args:
        app: the wrapped ASGI app.
        api_keys: accepted keys; empty means no authentication.
        max_body_bytes: largest HTTP request body accepted (413 beyond).
    """

    def __init__(self, app: ASGIApp, api_keys: set[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_keys = frozenset(api_keys)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if not self._is_authorized(scope, allow_query=False):
                await _send_error(send, codec.Unauthorized(), {"WWW-Authenticate": "Bearer"})
                return
            limited = await self._read_body(scope, receive, send)
            if limited is None:
                return
            if scope.get("path", "").startswith("/v1/"):
                send = _json_routing_errors(scope, send)
            await self.app(scope, limited, send)
        elif scope["type"] == "websocket":
            if not self._is_authorized(scope, allow_query=True):
                await _deny_websocket(scope, receive, send)
                return
            await self.app(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def _is_authorized(self, scope: Scope, allow_query: bool) -> bool:
        if not self.api_keys or scope.get("path") in PUBLIC_PATHS:
            return True
        presented = auth.bearer_token(_header(scope, b"authorization"))
        if presented is None and allow_query:
            values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
            presented = values[0] if values else None
        return auth.key_matches(presented, self.api_keys)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """A ``receive`` replaying the whole body, or None after answering 413."""
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._refuse_body(receive, send, 0, int(length))
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                first: Message = message  # the client left while sending; let the app see it
                break
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                if message.get("more_body", False):
                    await self._refuse_body(receive, send, size, None)
                else:
                    await _send_error(send, codec.BodyTooLarge(self.max_body_bytes), {"Connection": "close"})
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return first
            return await receive()

        return replay

    async def _refuse_body(self, receive: Receive, send: Send, size: int, announced: int | None) -> None:
        """Answer 413, first reading and dropping the rest of a body of reasonable size.

        A client still writing its body does not read the answer: without draining, it sees
        a reset connection instead of the 413. Bodies far over the limit are not drained.
        """
        budget = self.max_body_bytes + DRAIN_LIMIT_BYTES
        if announced is None or announced <= budget:
            while size <= budget:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client left; nobody to answer
                size += len(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        await _send_error(send, codec.BodyTooLarge(self.max_body_bytes), {"Connection": "close"})


def _json_routing_errors(scope: Scope, send: Send) -> Send:
    """A ``send`` that turns the router's plain-text 404 / 405 into OpenAI error JSON.

    OpenAI SDKs show the ``error.message`` of a failed call; "Not Found" in plain text
    would reach users as an unparsed body. Only the router's own text responses are
    rewritten; a route's JSON 404 (e.g. an unknown model) passes unchanged.
    """
    rewriting = False

    async def wrapped(message: Message) -> None:
        nonlocal rewriting
        if message["type"] == "http.response.start" and message["status"] in (404, 405):
            headers = dict(message.get("headers", ()))
            if headers.get(b"content-type", b"").startswith(b"text/plain"):
                rewriting = True
                path, method = scope.get("path", ""), scope.get("method", "")
                if message["status"] == 404:
                    exc: Exception = codec.RouteNotFound(f"Unknown path '{path}'")
                else:
                    allowed = headers.get(b"allow", b"").decode("latin-1")
                    exc = codec.MethodNotAllowed(f"Method {method} is not allowed on '{path}' (allowed: {allowed})")
                await _send_error(send, exc, {"Allow": headers[b"allow"].decode("latin-1")} if b"allow" in headers else {})
                return
        if rewriting:
            return  # the router's plain-text body: already replaced
        await send(message)

    return wrapped


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None




async def _send_error(send: Send, exc: Exception, extra_headers: dict[str, str]) -> None:
    wire = codec.error_for(exc)
    headers = {**wire.headers, **extra_headers, "content-type": "application/json",
               "content-length": str(len(wire.body))}
    await send({"type": "http.response.start", "status": wire.status,
                "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})
    await send({"type": "http.response.body", "body": wire.body, "more_body": False})


async def _deny_websocket(scope: Scope, receive: Receive, send: Send) -> None:
    message = await receive()  # ASGI: the app is told about the handshake before it answers
    if message["type"] != "websocket.connect":
        return
    if "websocket.http.response" in scope.get("extensions", {}):
        wire = codec.error_for(codec.Unauthorized())
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(wire.body)).encode()),
                   (b"www-authenticate", b"Bearer")]
        await send({"type": "websocket.http.response.start", "status": wire.status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": wire.body, "more_body": False})
    else:
        await send({"type": "websocket.close", "code": 1008})  # policy violation; server answers 403
