"""``rill.protocols._shared.errors.lookup``: the MRO walk every codec's error table uses."""

from __future__ import annotations

from rill.errors import ContextLengthExceeded, InvalidRequest, QueueFull, RequestRejected, RillError
from rill.protocols._shared.errors import lookup

TABLE = {RillError: "base", InvalidRequest: "invalid", ContextLengthExceeded: "too long", RequestRejected: "rejected"}


def test_the_most_specific_class_wins_whatever_the_table_order() -> None:
    assert lookup(TABLE, ContextLengthExceeded(10, 5), "generic") == "too long"
    assert lookup(TABLE, InvalidRequest("x"), "generic") == "invalid"


def test_a_class_not_in_the_table_takes_its_nearest_base() -> None:
    assert lookup(TABLE, QueueFull(), "generic") == "rejected"


def test_an_unexpected_exception_gets_the_default() -> None:
    assert lookup(TABLE, ValueError("secret"), "generic") == "generic"
    assert lookup(TABLE, ValueError("secret"), None) is None
