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
