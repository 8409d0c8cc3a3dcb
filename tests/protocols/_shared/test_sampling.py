"""The declared wire → ``SamplingParams`` tables: the shared machinery and every protocol's table."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from rill.errors import InvalidRequest
from rill.protocols._shared.sampling import Field, SamplingMap, same
from rill.protocols.batch_ws import messages as batch
from rill.protocols.chat_ws import messages as chat
from rill.protocols.evergreen import messages as evergreen
from rill.protocols.framed_uds import messages as framed
from rill.protocols.generate_ws import messages as generate
from rill.protocols.openai_http import messages as openai
from rill.types import ResponseFormat, SamplingParams


class Wire(msgspec.Struct, kw_only=True):
    """A made-up wire struct."""

    heat: float | None = None
    max_new: int | None = None
    stops: str | None = None


TABLE = SamplingMap(
    Wire,
    Field("heat", "temperature"),
    Field("max_new", "max_tokens"),
    Field("stops", "stop", lambda text: text.split(",")),
)


def test_a_table_naming_a_missing_field_fails_when_declared() -> None:
    with pytest.raises(TypeError, match="Wire has no field 'cold'"):
        SamplingMap(Wire, Field("cold", "temperature"))
    with pytest.raises(TypeError, match="SamplingParams has no field 'heat'"):
        SamplingMap(Wire, same("heat"))


def test_patch_holds_the_set_fields_under_engine_names_converted() -> None:
    assert TABLE.patch(Wire()) == {}
    assert TABLE.patch(Wire(heat=0.0, stops="a,b")) == {"temperature": 0.0, "stop": ["a", "b"]}


def test_params_applies_the_patch_to_a_base_and_validates_once() -> None:
    base = SamplingParams(top_k=5, max_tokens=9)
    params = TABLE.params(TABLE.patch(Wire(heat=0.5)), base)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.5, 5, 9)
    assert base.temperature == 1.0  # the base is not changed
    with pytest.raises(InvalidRequest) as caught:
        TABLE.params({"logit_bias": {50: 1.0}}, vocab_size=10)
    assert caught.value.field == "logit_bias"


def test_a_bad_value_is_named_as_on_the_wire() -> None:
    with pytest.raises(InvalidRequest) as caught:
        TABLE.params(TABLE.patch(Wire(max_new=0)))
    assert caught.value.field == "max_new" and "'max_new' must be >= 1" in str(caught.value)
    with pytest.raises(InvalidRequest) as caught:
        TABLE.params({"top_p": 2.0})  # not in the table: the engine's name is the wire's
    assert caught.value.field == "top_p"


def test_build_does_not_validate() -> None:
    assert TABLE.build({"temperature": -1.0}).temperature == -1.0


# -- every protocol's table --------------------------------------------------------------------

ENGINE_VALUES: dict[str, Any] = {
    "temperature": 0.5,
    "top_k": 7,
    "top_p": 0.75,
    "min_p": 0.125,
    "repetition_penalty": 1.25,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "logit_bias": {3: 1.5},
    "seed": 42,
    "max_tokens": 33,
    "min_tokens": 2,
    "stop": ["END"],
    "stop_token_ids": [4],
    "allowed_token_ids": [5, 6],
    "ignore_eos": True,
    "logprobs": 3,
    "num_beams": 2,
    "length_penalty": 0.75,
    "early_stopping": True,
    "response_format": ResponseFormat(type="regex", regex="a+"),
    "speculative": 3,
}
"""A valid value, other than the default, for each ``SamplingParams`` field."""

WIRE_VALUES: dict[tuple[str, str], Any] = {
    ("evergreen", "stop"): ("END",),
    ("evergreen", "response_format"): json.dumps({"type": "regex", "regex": "a+"}),
    ("openai", "stop"): "END",
}
"""Wire values where the wire's type differs from the engine's."""

TABLES = {
    "batch": batch.SAMPLING,
    "chat": chat.SAMPLING,
    "evergreen": evergreen.SAMPLING,
    "framed": framed.SAMPLING,
    "generate": generate.SAMPLING,
    "openai": openai.SAMPLING,
}
REQUIRED = {"framed": {"id": "r", "prompt": "p"}}
"""Required fields of a wire struct that are not sampling fields."""

CASES = [(name, f) for name, table in TABLES.items() for f in table.fields]


@pytest.mark.parametrize(("protocol", "field"), CASES, ids=[f"{p}.{f.wire}" for p, f in CASES])
def test_every_declared_field_reaches_sampling_params(protocol: str, field: Field) -> None:
    table = TABLES[protocol]
    wire_value = WIRE_VALUES.get((protocol, field.wire), ENGINE_VALUES[field.engine])
    message = table.wire_type(**REQUIRED.get(protocol, {}), **{field.wire: wire_value})
    params = table.params(table.patch(message), vocab_size=100)
    assert getattr(params, field.engine) == ENGINE_VALUES[field.engine]
    assert ENGINE_VALUES[field.engine] != getattr(SamplingParams(), field.engine)  # the value did travel
