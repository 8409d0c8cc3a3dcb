"""``rill.auth``: the one bearer parser and key compare every protocol uses."""

from __future__ import annotations

import pytest

from rill import auth


@pytest.mark.parametrize("value, token", [
    ("Bearer k1", "k1"), ("bearer k1", "k1"), ("BEARER k1", "k1"), ("  Bearer   k1 ", "k1"), (b"Bearer k1", "k1"),
    ("Bearer ", None), ("Bearer", None), ("k1", None), ("Basic k1", None), ("", None), (None, None),
])
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


@pytest.mark.parametrize("offered", [[], ["rill"], ["rill.key."], ["rill.key.!!!"], ["rill.key.//"],
                                     ["rill.key." + "A" * (auth.MAX_KEY_SUBPROTOCOL_CHARS + 1)], ["rill.key._w"]])
def test_malformed_key_subprotocols_present_no_key(offered: list[str]) -> None:
    assert auth.subprotocol_key(offered) is None


def test_websocket_key_prefers_the_header_then_the_subprotocol_then_the_query() -> None:
    sub = [auth.key_subprotocol("from-sub")]
    assert auth.websocket_key("Bearer from-header", sub, "from-query") == "from-header"
    assert auth.websocket_key(None, sub, "from-query") == "from-sub"
    assert auth.websocket_key(None, ["rill"], "from-query") == "from-query"
    assert auth.websocket_key(None, [], "") is None
