"""``Guard``: Host/Origin, API-key, body-size and read-time checks for HTTP and WebSocket scopes
(the order and the rules are ``rill.middleware``'s docstring)."""

from __future__ import annotations

import asyncio
from urllib.parse import parse_qs

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rill import auth
from rill.connections import ConnectionGate, ErrorRenderer
from rill.errors import BodyTooLarge, Forbidden, IdleTimeout, TooManyConnections, Unauthorized
from rill.middleware.first_message import FirstMessageWatch
from rill.middleware.replies import (
    deny_websocket,
    header,
    json_routing_errors,
    on_response_end,
    select_subprotocol,
    send_error,
)
from rill.middleware.sites import SiteCheck

PUBLIC_PATHS = frozenset({"/health", "/version"})
"""Paths that never need a key and pass the Host check (load balancers, orchestrators and
clients probe them; they tell nothing of any request or session)."""

PAGE_PATHS = frozenset({"/", "/favicon.ico"})
PAGE_PREFIX = "/playground/static/"
"""The playground page, its icon and its static files: HTTP requests for them need no key (they hold
no data; the page asks for the key and sends it on every call it makes). The Host and
Origin checks still apply."""

DRAIN_LIMIT_BYTES = 16 * 1024 * 1024
"""How much of a refused body is read and dropped so the client can see the 413."""


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

    def __init__(
        self,
        app: ASGIApp,
        render_error: ErrorRenderer,
        api_keys: set[str],
        max_body_bytes: int,
        sites: SiteCheck | None = None,
        gate: ConnectionGate | None = None,
        body_timeout_s: float | None = None,
        first_message_timeout_s: float | None = None,
        forwarded_allow_ips: list[str] | None = None,
    ) -> None:
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
                send = on_response_end(send, connection.request_done)
        if scope["type"] == "websocket" and self.first_message_timeout_s is not None:
            watch = FirstMessageWatch(receive, send, self.first_message_timeout_s, connection)
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
            await send_error(self.render_error, send, exc, {"Connection": "close"})
        else:
            await deny_websocket(self.render_error, scope, receive, send, exc)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self.sites is not None and scope.get("path") not in PUBLIC_PATHS:
            refusal = self.sites.refusal(scope)
            if refusal is not None:
                if scope["type"] == "http":
                    await send_error(self.render_error, send, Forbidden(refusal), {})
                else:
                    await deny_websocket(self.render_error, scope, receive, send, Forbidden(refusal))
                return
        if scope["type"] == "http":
            if not self._is_authorized(scope, allow_query=False):
                await send_error(self.render_error, send, Unauthorized(), {"WWW-Authenticate": "Bearer"})
                return
            limited = await self._read_body(scope, receive, send)
            if limited is None:
                return
            if scope.get("path", "").startswith("/v1/"):
                send = json_routing_errors(self.render_error, scope, send)
            await self.app(scope, limited, send)
        elif scope["type"] == "websocket":
            if not self._is_authorized(scope, allow_query=True):
                await deny_websocket(self.render_error, scope, receive, send)
                return
            await self.app(scope, receive, select_subprotocol(scope, send))
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
        authorization = header(scope, b"authorization")
        if not allow_query:
            presented = auth.bearer_token(authorization)
        else:
            values = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("api_key")
            presented = auth.websocket_key(
                authorization, scope.get("subprotocols") or (), values[0] if values else None
            )
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
            await send_error(self.render_error, send, exc, {"Connection": "close"})
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
        length = header(scope, b"content-length")
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
                    await send_error(
                        self.render_error, send, BodyTooLarge(self.max_body_bytes), {"Connection": "close"}
                    )
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
        await send_error(self.render_error, send, BodyTooLarge(self.max_body_bytes), {"Connection": "close"})
