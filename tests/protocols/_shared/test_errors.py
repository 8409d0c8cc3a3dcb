"""``rill.protocols._shared.errors``: the MRO walk every codec's error table uses, and the one
entry type all six tables hold."""

from __future__ import annotations

from rill.errors import ContextLengthExceeded, InvalidRequest, QueueFull, RequestRejected, RillError
from rill.protocols._shared.errors import ErrorEntry, lookup
from rill.protocols.batch_ws import codec as batch_ws
from rill.protocols.chat_ws import codec as chat_ws
from rill.protocols.evergreen import codec as evergreen
from rill.protocols.framed_uds import codec as framed_uds
from rill.protocols.generate_ws import codec as generate_ws
from rill.protocols.openai_http import codec as openai_http

TABLE = {RillError: "base", InvalidRequest: "invalid", ContextLengthExceeded: "too long", RequestRejected: "rejected"}


def test_the_most_specific_class_wins_whatever_the_table_order() -> None:
    assert lookup(TABLE, ContextLengthExceeded(10, 5), "generic") == "too long"
    assert lookup(TABLE, InvalidRequest("x"), "generic") == "invalid"


def test_a_class_not_in_the_table_takes_its_nearest_base() -> None:
    assert lookup(TABLE, QueueFull(), "generic") == "rejected"


def test_an_unexpected_exception_gets_the_default() -> None:
    assert lookup(TABLE, ValueError("secret"), "generic") == "generic"
    assert lookup(TABLE, ValueError("secret"), None) is None


def test_every_protocol_table_holds_error_entries() -> None:
    tables = [
        batch_ws.ERROR_TABLE,
        chat_ws.ERROR_TABLE,
        evergreen.ERROR_STATUS,
        framed_uds.ERROR_CODES,
        generate_ws.ERROR_TABLE,
        openai_http.ERROR_TABLE,
    ]
    for table in tables:
        assert table and all(isinstance(entry, ErrorEntry) for entry in table.values())
        assert all(isinstance(cls, type) and issubclass(cls, BaseException) for cls in table)


def test_an_entry_shows_its_fixed_text_or_the_exceptions_own() -> None:
    assert ErrorEntry("x").message(InvalidRequest("'top_p' must be in (0, 1]")) == "'top_p' must be in (0, 1]"
    assert ErrorEntry("x", text="generation failed").message(RillError("cuda says: at 0x7f")) == "generation failed"
