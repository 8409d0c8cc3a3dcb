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
``/health`` and the playground's static files need ``Authorization: Bearer KEY``; WebSockets
may instead offer the key subprotocol or pass ``?api_key=KEY`` (browsers cannot set headers
on a WebSocket; ``rill.auth.websocket_key``). A refused HTTP request gets 401 in OpenAI's
error JSON; a refused WebSocket handshake gets HTTP 401 before it is accepted (or a close
before accept, which servers answer with 403, where the ASGI server lacks the denial
response extension).

Body size: a ``Content-Length`` over ``--max-body-bytes`` is refused before reading; a
chunked body is read up to the limit and refused as soon as it passes it. An accepted body
is handed to the app in one message, after which ``receive`` is the server's own again,
so apps still see ``http.disconnect`` the moment the client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import socket
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rill import auth
from rill.connections import ConnectionGate, ErrorRenderer, GuardedProtocol
from rill.deps import Deps
from rill.errors import (
    BodyTooLarge,
    Forbidden,
    IdleTimeout,
    MethodNotAllowed,
    RouteNotFound,
    TooManyConnections,
    Unauthorized,
)

PUBLIC_PATHS = frozenset({"/health"})
"""Paths that never need a key (load balancers and orchestrators probe them)."""

PAGE_PATHS = frozenset({"/"})
PAGE_PREFIX = "/playground/static/"
"""The playground page and its static files: HTTP requests for them need no key (they hold
no data; the page asks for the key and sends it on every call it makes). The Host and
Origin checks still apply."""

DRAIN_LIMIT_BYTES = 16 * 1024 * 1024
"""How much of a refused body is read and dropped so the client can see the 413."""


def wrap(app: ASGIApp, deps: Deps, render_error: ErrorRenderer) -> ASGIApp:
    """The server's app wrapped in the guard and, when origins are configured, CORS; refusals
    are written by ``render_error`` (``rill.connections.ErrorRenderer``: the server passes
    the OpenAI API's error format, so this module knows no protocol)."""
    http = deps.config.http
    limits = deps.config.connections
    sites = SiteCheck(http.host, http.allowed_hosts, [*http.allowed_origins, *http.cors_origins])
    wrapped: ASGIApp = Guard(app, render_error, api_keys=set(deps.api_keys or ()), max_body_bytes=http.max_body_bytes,
                             sites=sites,
                             gate=deps.gate, body_timeout_s=limits.body_timeout_s,
                             first_message_timeout_s=limits.first_message_timeout_s,
                             forwarded_allow_ips=http.forwarded_allow_ips)
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
    """Host/Origin, API-key, body-size and read-time checks for HTTP and WebSocket scopes.

    Args:
        app: the wrapped ASGI app.
        render_error: writes every refusal (status, headers, JSON body).
        api_keys: accepted keys; empty means no authentication.
        max_body_bytes: largest HTTP request body accepted (413 beyond).
        sites: the Host/Origin policy (None: no check).
        gate: the server's connection gate; its connection's header timer is stopped while
            a request is with the app and restarted when the response has ended.
        body_timeout_s: time allowed to receive a whole request body (408 beyond).
        first_message_timeout_s: time an accepted WebSocket may go without sending a
            message (closed with 1008 beyond).
        forwarded_allow_ips: proxies whose ``X-Forwarded-For`` / ``X-Forwarded-Proto`` are
            believed (IPs, networks, ``*``); empty: none.
    """

    def __init__(self, app: ASGIApp, render_error: ErrorRenderer, api_keys: set[str], max_body_bytes: int,
                 sites: SiteCheck | None = None,
                 gate: ConnectionGate | None = None, body_timeout_s: float | None = None,
                 first_message_timeout_s: float | None = None, forwarded_allow_ips: list[str] | None = None) -> None:
        self.app = app
        self.render_error = render_error
        self.api_keys = frozenset(api_keys)
        self.max_body_bytes = max_body_bytes
        self.sites = sites
        self.gate = gate
        self.body_timeout_s = body_timeout_s
        self.first_message_timeout_s = first_message_timeout_s
        self._checked: ASGIApp = self._handle
        if forwarded_allow_ips:
            from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

            self._checked = ProxyHeadersMiddleware(self._handle, trusted_hosts=list(forwarded_allow_ips))  # type: ignore[arg-type,assignment]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        connection = self.gate.http_connection(scope) if self.gate is not None else None
        if connection is not None and scope["type"] in ("http", "websocket"):
            if not connection.request_started():
                # Closed by the gate for another client before this request reached the app.
                await self._refuse_evicted(scope, receive, send)
                return
            if scope["type"] == "http":
                send = _on_response_end(send, connection.request_done)
        if scope["type"] == "websocket" and self.first_message_timeout_s is not None:
            watch = _FirstMessageWatch(receive, send, self.first_message_timeout_s, connection)
            try:
                await self._checked(scope, watch.receive, watch.send)
            finally:
                watch.stop()
            return
        await self._checked(scope, receive, send)

    async def _refuse_evicted(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer a request whose connection the gate has closed (the answer goes nowhere;
        it keeps the ASGI server from reporting an app that returned without one)."""
        exc = TooManyConnections("the server is at its connection limit; retry later")
        if scope["type"] == "http":
            await _send_error(self.render_error, send, exc, {"Connection": "close"})
        else:
            await _deny_websocket(self.render_error, scope, receive, send, exc)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.sites is not None and scope.get("path") not in PUBLIC_PATHS:
            refusal = self.sites.refusal(scope)
            if refusal is not None:
                if scope["type"] == "http":
                    await _send_error(self.render_error, send, Forbidden(refusal), {})
                else:
                    await _deny_websocket(self.render_error, scope, receive, send, Forbidden(refusal))
                return
        if scope["type"] == "http":
            if not self._is_authorized(scope, allow_query=False):
                await _send_error(self.render_error, send, Unauthorized(), {"WWW-Authenticate": "Bearer"})
                return
            limited = await self._read_body(scope, receive, send)
            if limited is None:
                return
            if scope.get("path", "").startswith("/v1/"):
                send = _json_routing_errors(self.render_error, scope, send)
            await self.app(scope, limited, send)
        elif scope["type"] == "websocket":
            if not self._is_authorized(scope, allow_query=True):
                await _deny_websocket(self.render_error, scope, receive, send)
                return
            await self.app(scope, receive, _select_subprotocol(scope, send))
        else:
            await self.app(scope, receive, send)

    def _is_authorized(self, scope: Scope, allow_query: bool) -> bool:
        """Check the key; when it matches, record the request's principal in the scope
        (``rill.auth.scope_principal`` reads it)."""
        path = scope.get("path", "")
        if not self.api_keys or path in PUBLIC_PATHS:
            return True
        if scope["type"] == "http" and (path in PAGE_PATHS or path.startswith(PAGE_PREFIX)):
            return True
        authorization = _header(scope, b"authorization")
        if not allow_query:
            presented = auth.bearer_token(authorization)
        else:
            values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
            presented = auth.websocket_key(authorization, scope.get("subprotocols") or (), values[0] if values else None)
        if not auth.key_matches(presented, self.api_keys):
            return False
        scope[auth.PRINCIPAL_SCOPE_KEY] = auth.principal(presented, None)
        return True

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """A ``receive`` replaying the whole body, or None after answering 413 or 408."""
        if self.body_timeout_s is None:
            return await self._read_whole_body(scope, receive, send)
        # A slowloris body (a byte now and then) must not hold the connection forever.
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s

        async def timed_receive() -> Message:
            async with asyncio.timeout_at(deadline):
                return await receive()

        try:
            limited = await self._read_whole_body(scope, timed_receive, send)
        except TimeoutError:
            exc = IdleTimeout(f"the request body did not arrive within {self.body_timeout_s:g} s")
            await _send_error(self.render_error, send, exc, {"Connection": "close"})
            return None
        if limited is None:
            return None
        replayed = False

        async def untimed() -> Message:
            # The body is read: later receives wait for the disconnect, for as long as the app runs.
            nonlocal replayed
            if not replayed:
                replayed = True
                return await limited()
            return await receive()

        return untimed

    async def _read_whole_body(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
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
                    await _send_error(self.render_error, send, BodyTooLarge(self.max_body_bytes), {"Connection": "close"})
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
        await _send_error(self.render_error, send, BodyTooLarge(self.max_body_bytes), {"Connection": "close"})


def _on_response_end(send: Send, callback: Callable[[], None]) -> Send:
    """A ``send`` that calls ``callback`` once the response's last body part has been sent."""

    async def wrapped(message: Message) -> None:
        await send(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            callback()

    return wrapped


class _FirstMessageWatch:
    """Closes an accepted WebSocket (1008) that sends no message within the time allowed.

    Wraps the app's ``receive`` and ``send``: the clock starts when the app accepts and stops
    at the first message (or disconnect). After the close, the app's pending ``receive``
    sees the disconnect, and its sends are dropped (the peer is being closed). Meanwhile the
    connection (``rill.connections.GuardedProtocol``, when known) is marked idle, so the
    connection gate may close it to make room for another client.
    """

    def __init__(self, receive: Receive, send: Send, timeout_s: float, connection: GuardedProtocol | None = None) -> None:
        self._receive = receive
        self._send = send
        self.timeout_s = timeout_s
        self._connection = connection
        self._timer: asyncio.Task[None] | None = None
        self.heard = False
        self.closed = False

    async def receive(self) -> Message:
        """The app's ``receive``: the first message (or a disconnect) stops the clock."""
        message = await self._receive()
        if message["type"] in ("websocket.receive", "websocket.disconnect"):
            self.heard = True
            self.stop()
            if self._connection is not None:
                self._connection.set_idle(False)
        return message

    async def send(self, message: Message) -> None:
        """The app's ``send``: the accept starts the clock; after the timeout's close, nothing is sent."""
        if self.closed:
            return
        if message["type"] == "websocket.close":
            self.closed = True
            self.stop()
        await self._send(message)
        if message["type"] == "websocket.accept" and not self.heard:
            self._timer = asyncio.create_task(self._expire())
            if self._connection is not None:
                self._connection.set_idle(True)

    def stop(self) -> None:
        """Stop the clock (the app has finished, closed, or heard from the client)."""
        if self._timer is not None and self._timer is not asyncio.current_task():
            self._timer.cancel()
        self._timer = None

    async def _expire(self) -> None:
        await asyncio.sleep(self.timeout_s)
        if self.heard or self.closed:
            return
        self.closed = True
        self._timer = None
        reason = f"no message within {self.timeout_s:g} s of connecting"
        with contextlib.suppress(Exception):  # the peer may already be gone
            await self._send({"type": "websocket.close", "code": 1008, "reason": reason})


def _json_routing_errors(render: ErrorRenderer, scope: Scope, send: Send) -> Send:
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
                await _send_error(render, send, exc,
                                  {"Allow": headers[b"allow"].decode("latin-1")} if b"allow" in headers else {})
                return
        if rewriting:
            return  # the router's plain-text body: already replaced
        await send(message)

    return wrapped


def _select_subprotocol(scope: Scope, send: Send) -> Send:
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


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None




async def _send_error(render: ErrorRenderer, send: Send, exc: Exception, extra_headers: dict[str, str]) -> None:
    status, wire_headers, body = render(exc)
    headers = {**wire_headers, **extra_headers, "content-type": "application/json",
               "content-length": str(len(body))}
    await send({"type": "http.response.start", "status": status,
                "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _deny_websocket(render: ErrorRenderer, scope: Scope, receive: Receive, send: Send,
                          exc: Exception | None = None) -> None:
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


_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


class SiteCheck:
    """Which ``Host`` and ``Origin`` headers a browser-reachable route accepts.

    Host (DNS rebinding): a page on ``evil.example`` whose name is re-pointed at 127.0.0.1
    reaches a loopback server with ``Host: evil.example``. Accepted are IP literals (a
    browser only sends one when it connected to that address itself), ``localhost`` and
    ``*.localhost``, the bound host, the machine's host name when bound to every interface
    (``0.0.0.0`` / ``::``), and ``--allowed-hosts``. A request with no Host (HTTP/1.0, not a
    browser) passes.

    Origin (cross-site requests): browsers send it on WebSocket handshakes and on
    cross-origin or POST requests; ``curl`` and the Python clients send none and pass.
    Accepted are the server's own origin (the request's scheme and Host: pages rill serves
    itself), ``--allowed-origins`` and ``--cors-origins``; ``*`` in either accepts any.

    Args:
        bind_host: the ``--host`` the HTTP listener is bound to.
        allowed_hosts: extra host names; ``.example.com`` also accepts its subdomains.
        allowed_origins: extra origins as ``scheme://host[:port]``.
    """

    def __init__(self, bind_host: str, allowed_hosts: list[str], allowed_origins: list[str]) -> None:
        names = {"localhost", bind_host.strip("[]").lower()}
        if bind_host in _WILDCARD_BINDS:
            names.add(socket.gethostname().lower())
        self.any_host = "*" in allowed_hosts
        self.host_names = names | {h.lower() for h in allowed_hosts if not h.startswith(".")}
        self.host_suffixes = tuple({".localhost"} | {h.lower() for h in allowed_hosts if h.startswith(".")})
        self.any_origin = "*" in allowed_origins
        self.origins = {o for o in (_origin(text) for text in allowed_origins) if o is not None}
        self.origins |= {"null"} & set(allowed_origins)

    def refusal(self, scope: Scope) -> str | None:
        """Why this request is refused (the 403 message), or None when it may proceed."""
        hosts = [value.decode("latin-1") for key, value in scope.get("headers", ()) if key.lower() == b"host"]
        for name in hosts:  # every one: a second Host header must not smuggle a foreign name past the first
            if not self._host_ok(name):
                return (f"Host '{name}' is not a name of this server; start it with --allowed-hosts "
                        f"{_split_host(name)[0] or name} to accept it")
        host = hosts[0] if hosts else None
        origin = _header(scope, b"origin")
        if origin is None or self.any_origin:
            return None
        scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
        own = _origin(f"{scheme}://{host}") if host is not None else None
        presented = "null" if origin.strip() == "null" else _origin(origin)
        if presented is not None and (presented == own or presented in self.origins):
            return None
        return (f"requests from web pages at '{origin}' are not allowed; start the server with "
                f"--allowed-origins {origin} to accept them")

    def _host_ok(self, host: str) -> bool:
        if self.any_host:
            return True
        name, _ = _split_host(host)
        if name is None:
            return False
        if name in self.host_names or name.endswith(self.host_suffixes):
            return True
        try:
            ipaddress.ip_address(name.split("%", 1)[0])
        except ValueError:
            return False
        return True


def _split_host(host: str) -> tuple[str | None, int | None]:
    """``(name, port)`` of a Host header value (name lowercased, IPv6 brackets removed)."""
    try:
        parts = urlsplit("//" + host.strip())
        return (parts.hostname or None), parts.port
    except ValueError:
        return None, None


def _origin(text: str) -> str | None:
    """``scheme://host:port`` with the default port made explicit, or None if not an origin."""
    try:
        parts = urlsplit(text.strip())
        scheme, name, port = parts.scheme.lower(), parts.hostname, parts.port
    except ValueError:
        return None
    if scheme not in _DEFAULT_PORTS or not name:
        return None
    if ":" in name:
        name = f"[{name}]"
    return f"{scheme}://{name}:{port or _DEFAULT_PORTS[scheme]}"
