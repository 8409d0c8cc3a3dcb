"""What the guard writes on the wire besides the app: refusals in the server's error format
(``ErrorRenderer``), the router's 404/405 rewritten as OpenAI error JSON, the ``rill``
subprotocol selected, and a hook on a response's end."""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import Message, Receive, Scope, Send

from rill import auth
from rill.connections import ErrorRenderer
from rill.errors import MethodNotAllowed, RouteNotFound, Unauthorized


def on_response_end(send: Send, callback: Callable[[], None]) -> Send:
    """A ``send`` that calls ``callback`` once the response's last body part has been sent."""

    async def wrapped(message: Message) -> None:
        await send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            callback()

    return wrapped


def json_routing_errors(render: ErrorRenderer, scope: Scope, send: Send) -> Send:
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
                    exc: Exception = RouteNotFound(f"Unknown path '{path}'")
                else:
                    allowed = headers.get(b"allow", b"").decode("latin-1")
                    exc = MethodNotAllowed(f"Method {method} is not allowed on '{path}' (allowed: {allowed})")
                await send_error(
                    render, send, exc, {"Allow": headers[b"allow"].decode("latin-1")} if b"allow" in headers else {}
                )
                return
        if rewriting:
            return  # the router's plain-text body: already replaced
        await send(message)

    return wrapped


def select_subprotocol(scope: Scope, send: Send) -> Send:
    """A ``send`` that accepts with ``rill`` when the client offered it and the app chose none.

    Browsers fail a handshake whose answer selects no subprotocol after they offered some,
    and the playground offers ``rill`` beside its key subprotocol (``rill.auth``).
    """
    if auth.APP_SUBPROTOCOL not in (scope.get("subprotocols") or ()):
        return send

    async def wrapped(message: Message) -> None:
        if message["type"] == "websocket.accept" and not message.get("subprotocol"):
            message = {**message, "subprotocol": auth.APP_SUBPROTOCOL}
        await send(message)

    return wrapped


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lowercase bytes) in an ASGI scope, or None."""
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def send_error(render: ErrorRenderer, send: Send, exc: Exception, extra_headers: dict[str, str]) -> None:
    """Answer an HTTP request with ``render``'s status, headers and JSON body for ``exc``, plus
    ``extra_headers``."""
    status, wire_headers, body = render(exc)
    headers = {**wire_headers, **extra_headers, "content-type": "application/json", "content-length": str(len(body))}
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def deny_websocket(
    render: ErrorRenderer, scope: Scope, receive: Receive, send: Send, exc: Exception | None = None
) -> None:
    """Refuse a WebSocket handshake with the HTTP status and JSON body of ``exc`` (401 by default)."""
    message = await receive()  # ASGI: the app is told about the handshake before it answers
    if message["type"] != "websocket.connect":
        return
    exc = exc if exc is not None else Unauthorized()
    if "websocket.http.response" in scope.get("extensions", {}):
        status, _, body = render(exc)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if isinstance(exc, Unauthorized):
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
    else:
        await send({"type": "websocket.close", "code": 1008})  # policy violation; server answers 403
