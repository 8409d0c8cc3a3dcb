"""The ``/v1/embeddings`` wire (``rill.protocols.openai_http.embeddings``), without a server:
the four input shapes, the two encodings, and each refusal with its status."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from rill.errors import ContextLengthExceeded, InvalidRequest
from rill.protocols.openai_http import codec
from rill.protocols.openai_http.embeddings import (
    decode_embeddings,
    embedding_inputs,
    encode_embeddings,
    no_embedding_model,
    wire_named,
)


@pytest.mark.parametrize(
    ("given", "inputs"),
    [
        ("one text", ["one text"]),
        (["a", ""], ["a", ""]),
        ([101, 7592, 102], [[101, 7592, 102]]),
        ([[101, 102], [101, 7, 102]], [[101, 102], [101, 7, 102]]),
    ],
)
def test_the_four_input_shapes(given: object, inputs: list) -> None:
    assert embedding_inputs(decode_embeddings(json.dumps({"input": given}).encode())) == inputs


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({}, "'input' is required"),
        ({"input": []}, "must not be an empty list"),
        ({"input": ["a", 1]}, "a string, a list of strings"),
        ({"input": [-1]}, "a string, a list of strings"),
        ({"input": [True]}, "a string, a list of strings"),
        ({"input": [[1], "a"]}, "a string, a list of strings"),
        ({"input": {"text": "a"}}, "a string, a list of strings"),
    ],
)
def test_inputs_of_no_shape_are_refused(body: dict, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as caught:
        embedding_inputs(decode_embeddings(json.dumps(body).encode()))
    assert caught.value.field == "input"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "dimensions": "384"}, "dimensions"),
        ({"input": "a", "model": 3}, "model"),
    ],
)
def test_bad_fields_are_named(body: dict, field: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_embeddings(json.dumps(body).encode())
    assert caught.value.field == field


def test_unknown_fields_and_user_are_accepted() -> None:
    req = decode_embeddings(b'{"input": "a", "user": "u-1", "new_sdk_field": 1, "truncate_prompt_tokens": -1}')
    assert (req.user, req.truncate_prompt_tokens, req.encoding_format) == ("u-1", -1, None)


def test_float_and_base64_answers_carry_the_same_float32_numbers() -> None:
    vectors = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    floats = json.loads(encode_embeddings(vectors, 11, "m", "float"))
    packed = json.loads(encode_embeddings(vectors, 11, "m", "base64"))
    assert floats["object"] == "list" and floats["model"] == "m"
    assert floats["usage"] == {"prompt_tokens": 11, "total_tokens": 11}
    assert [d["index"] for d in floats["data"]] == [0, 1, 2] and floats["data"][0]["object"] == "embedding"
    np.testing.assert_array_equal(np.float32([d["embedding"] for d in floats["data"]]), vectors)
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in packed["data"]]
    np.testing.assert_array_equal(decoded, vectors)
    assert json.loads(encode_embeddings(vectors, 11, "m", None))["data"] == floats["data"]  # float by default


def test_model_errors_are_404s() -> None:
    codec.check_model(None, "m", route="/v1/embeddings")
    codec.check_model("m", "m", route="/v1/embeddings")
    with pytest.raises(InvalidRequest) as caught:
        codec.check_model("text-embedding-3-small", "m", route="/v1/embeddings")
    assert caught.value.message == "The model 'text-embedding-3-small' does not exist for /v1/embeddings; use 'm'"
    for exc in (caught.value, no_embedding_model()):
        wire = codec.error_for(exc)
        error = json.loads(wire.body)["error"]
        assert wire.status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    assert "--embedding-model" in no_embedding_model().message


def test_the_services_field_names_become_the_wires() -> None:
    """The embedding service names its submission's fields; the wire names its own, in the
    error's field and where the message quotes it, keeping the error's class."""
    too_long = ContextLengthExceeded(600, 512, "input 0 has 600 tokens; shorten it, or set 'truncate_to'", "inputs")
    assert wire_named(too_long) is too_long
    assert (too_long.field, str(too_long)) == (
        "input",
        "input 0 has 600 tokens; shorten it, or set 'truncate_prompt_tokens'",
    )
    cut = wire_named(InvalidRequest("'truncate_to' must be -1 or in [1, 512], not 0", field="truncate_to"))
    assert isinstance(cut, InvalidRequest) and (cut.field, cut.message) == (
        "truncate_prompt_tokens",
        "'truncate_prompt_tokens' must be -1 or in [1, 512], not 0",
    )
    same = InvalidRequest("'dimensions' 7 is not supported", field="dimensions")
    assert wire_named(same) is same and same.field == "dimensions"
