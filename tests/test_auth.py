"""``rill.auth``: the one bearer parser and key compare every protocol uses."""

from __future__ import annotations

from typing import Any

import pytest

from rill import auth


@pytest.mark.parametrize(
    "value, token",
    [
        ("Bearer k1", "k1"),
        ("bearer k1", "k1"),
        ("BEARER k1", "k1"),
        ("  Bearer   k1 ", "k1"),
        (b"Bearer k1", "k1"),
        ("Bearer ", None),
        ("Bearer", None),
        ("k1", None),
        ("Basic k1", None),
        ("", None),
        (None, None),
    ],
)
def test_bearer_token(value: str | bytes | None, token: str | None) -> None:
    assert auth.bearer_token(value) == token


def test_key_matches_only_an_exact_configured_key() -> None:
    keys = {"alpha", "beta"}
    assert auth.key_matches("alpha", keys) and auth.key_matches(b"beta", keys)
    for presented in ("alph", "alphaa", "ALPHA", "", None, "clé"):
        assert not auth.key_matches(presented, keys), presented
    assert not auth.key_matches("alpha", set())  # no keys: nothing matches; is_authorized decides


def test_is_authorized_is_open_only_without_keys() -> None:
    assert auth.is_authorized(set(), None) and auth.is_authorized(set(), "anything")
    assert not auth.is_authorized({"k"}, None) and not auth.is_authorized({"k"}, "")
    assert auth.is_authorized({"k"}, "k")


@pytest.mark.parametrize("key", ["k1", "sk-ABC/def+ghi=", "clé-ünïcode", "x" * 200])
def test_key_subprotocol_round_trips_every_key_as_a_token(key: str) -> None:
    offered = auth.key_subprotocol(key)
    assert offered.startswith(auth.KEY_SUBPROTOCOL_PREFIX)
    # RFC 6455 subprotocols are HTTP tokens: no separators, no padding '='.
    assert all(c.isalnum() or c in "-_." for c in offered)
    assert auth.subprotocol_key(["rill", offered]) == key


@pytest.mark.parametrize(
    "offered",
    [
        [],
        ["rill"],
        ["rill.key."],
        ["rill.key.!!!"],
        ["rill.key.//"],
        ["rill.key." + "A" * (auth.MAX_KEY_SUBPROTOCOL_CHARS + 1)],
        ["rill.key._w"],
    ],
)
def test_malformed_key_subprotocols_present_no_key(offered: list[str]) -> None:
    assert auth.subprotocol_key(offered) is None


def test_websocket_key_prefers_the_header_then_the_subprotocol_then_the_query() -> None:
    sub = [auth.key_subprotocol("from-sub")]
    assert auth.websocket_key("Bearer from-header", sub, "from-query") == "from-header"
    assert auth.websocket_key(None, sub, "from-query") == "from-sub"
    assert auth.websocket_key(None, ["rill"], "from-query") == "from-query"
    assert auth.websocket_key(None, [], "") is None


def test_query_keys_are_redacted_from_log_text() -> None:
    assert (
        auth.redact_query_keys('"WebSocket /generate?api_key=s3cret" [accepted]')
        == '"WebSocket /generate?api_key=***" [accepted]'
    )
    assert auth.redact_query_keys("GET /x?a=1&API_KEY=s3cret&b=2 HTTP/1.1") == "GET /x?a=1&API_KEY=***&b=2 HTTP/1.1"
    assert auth.redact_query_keys("no key here") == "no key here"


def test_a_served_websocket_handshake_never_logs_its_query_key(tiny_model_dir: Any) -> None:
    import logging

    import websockets.sync.client

    from tests.conftest import start_server

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    collector = Collect()
    live = start_server(tiny_model_dir, **{"http.api_key": ["s3cret-key"], "http.log_level": "info"})
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addHandler(collector)
    try:
        with websockets.sync.client.connect(f"{live.ws_url}/generate?api_key=s3cret-key") as ws:
            ws.send('{"type": "config", "prompt": "hi", "parameters": {"max_tokens": 1}}')
            while '"completion"' not in ws.recv(timeout=60):
                pass
    finally:
        uvicorn_log.removeHandler(collector)
        live.stop()
    assert any("api_key=***" in line for line in lines), lines
    assert not any("s3cret-key" in line for line in lines)


def test_scope_owner_is_the_key_or_everyone_without_keys() -> None:
    # A phone that changes networks changes address: with auth off, the address must not own
    # what it stores, or it could never resume; with a key, the key's principal owns it.
    keyed = {auth.PRINCIPAL_SCOPE_KEY: auth.principal("k-1", "10.0.0.1"), "client": ("10.0.0.1", 1)}
    assert auth.scope_owner(keyed) == auth.principal("k-1", None)
    assert auth.scope_owner({"client": ("10.0.0.1", 1)}) == auth.scope_owner({"client": ("10.9.9.9", 2)})
    assert auth.scope_owner({"client": ("10.0.0.1", 1)}) == auth.ANONYMOUS_OWNER


def test_owner_of_a_principal_is_its_key_or_everyone() -> None:
    """The one rule behind ``scope_owner`` and ``/generate``'s resume (which has a principal,
    not a scope)."""
    assert auth.owner(auth.principal("k-1", "10.0.0.1")) == auth.principal("k-1", None)
    assert auth.owner(auth.principal(None, "10.0.0.1")) == auth.ANONYMOUS_OWNER
