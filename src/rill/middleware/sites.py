"""``SiteCheck``: which ``Host`` and ``Origin`` headers a browser-reachable route accepts
(DNS rebinding and cross-site requests; see the class)."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from starlette.types import Scope

from rill.middleware.replies import header

_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


class SiteCheck:
    """Which ``Host`` and ``Origin`` headers a browser-reachable route accepts.

    Host (DNS rebinding): a page on ``evil.example`` whose name is re-pointed at 127.0.0.1
    reaches a loopback server with ``Host: evil.example``. The rule depends on the bind:

    - bound to loopback (``127.0.0.0/8``, ``::1``, ``localhost``, or a name that resolves
      only to loopback), or with ``--allowed-hosts`` given on any bind: accepted are IP
      literals (a browser only sends one when it connected to that address itself),
      ``localhost`` and ``*.localhost``, the bound host, the machine's host name when bound
      to every interface (``0.0.0.0`` / ``::``), and ``--allowed-hosts``;
    - bound to any other address (every interface, a LAN address) without
      ``--allowed-hosts``: any Host. Such a server is reached by names this process cannot
      know (a compose service, a LAN or DNS name, a proxy's upstream name); rebinding a
      name to a LAN address is what firewalls and the API key answer, and Ollama draws the
      same line (it checks Host only when bound to loopback).

    A request with no Host (HTTP/1.0, not a browser) passes.

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
        self.any_host = "*" in allowed_hosts or (not allowed_hosts and not _is_loopback_bind(bind_host))
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
                return (
                    f"Host '{name}' is not a name of this server; start it with --allowed-hosts "
                    f"{_split_host(name)[0] or name} to accept it"
                )
        host = hosts[0] if hosts else None
        origin = header(scope, b"origin")
        if origin is None or self.any_origin:
            return None
        scheme = "https" if scope.get("scheme") in ("https", "wss") else "http"
        own = _origin(f"{scheme}://{host}") if host is not None else None
        presented = "null" if origin.strip() == "null" else _origin(origin)
        if presented is not None and (presented == own or presented in self.origins):
            return None
        return (
            f"requests from web pages at '{origin}' are not allowed; start the server with "
            f"--allowed-origins {origin} to accept them"
        )

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


def _is_loopback_bind(bind_host: str) -> bool:
    """Whether a ``--host`` value listens on loopback only (an unresolvable name counts as
    loopback: the strict Host rule is the safe side when it cannot be told)."""
    name = bind_host.strip("[]").lower()
    if name in _WILDCARD_BINDS:
        return False
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.split("%", 1)[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return True
    return all(ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]).is_loopback for info in infos)


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
