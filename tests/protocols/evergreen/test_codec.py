"""Codec: the proto3 JSON mapping (golden vectors), protobuf round trips, configs, the error table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rill import errors as rill_errors
from rill.protocols.evergreen import codec, errors
from rill.protocols.evergreen.messages import AnyMessage, GenerateConfig, SessionMessage

from .helpers import conversation_turn_1, customized_generate, streamed_chains

VECTORS = json.loads((Path(__file__).parent / "vectors" / "json_mapping.json").read_text())


@pytest.mark.parametrize("case", VECTORS, ids=[c["name"] for c in VECTORS])
def test_json_vectors_decode_encode_and_match_protobuf_bytes(case):
    message = codec.decode_json(json.dumps(case["json"]))
    assert json.loads(codec.encode_json(message)) == case["canonical"]
    assert codec.to_pb(message).SerializeToString().hex() == case["protobuf_hex"]
    assert codec.decode_pb(bytes.fromhex(case["protobuf_hex"])) == message
    assert codec.decode_json(codec.encode_json(message)) == message


def test_output_json_is_lower_camel_case_with_base64_data_and_explicit_seq_continued():
    message = codec.decode_json(
        '{"node_fragments":[{"id":"r","chunk_fragment":{"metadata":{"mimetype":"text/plain",'
        '"role":"model"},"data":"SGk="}}]}'
    )
    text = codec.encode_json(message)
    assert '"nodeFragments"' in text and '"chunkFragment"' in text and "node_fragments" not in text
    assert json.loads(text)["nodeFragments"][0] == {
        "id": "r",
        "seq": 0,
        "continued": False,
        "chunkFragment": {"metadata": {"mimetype": "text/plain", "role": "model"}, "data": "SGk="},
    }
    assert message.node_fragments[0].chunk_fragment.data == b"Hi"


@pytest.mark.parametrize("build", [customized_generate, streamed_chains, conversation_turn_1])
def test_readme_examples_round_trip_through_protobuf_and_json(build):
    for message in build(GenerateConfig(temperature=0.5, max_tokens=3)):
        assert codec.from_pb(codec.to_pb(message)) == message
        assert codec.decode_json(codec.encode_json(message)) == message


@pytest.mark.parametrize(
    "text, where",
    [
        ("{", "invalid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"nodeFragments":[{"id":3}]}', "id"),
        ('{"nodeFragment":[]}', "nodeFragment"),
        ('{"nodeFragments":[{"seq":"x"}]}', "seq"),
        (b"\xff", "invalid JSON"),
    ],
)
def test_bad_json_is_invalid_message(text, where):
    with pytest.raises(errors.InvalidMessage, match=where) as info:
        codec.decode_json(text)
    assert codec.status_of(info.value)[0] == "INVALID_ARGUMENT"


def test_unknown_any_type_in_json_is_kept_for_the_session_to_reject():
    message = codec.decode_json(
        '{"actions":[{"name":"GENERATE","configs":[{"@type":"type.googleapis.com/x.Y","a":1}]}]}'
    )
    assert message.actions[0].configs == (AnyMessage(type_url="type.googleapis.com/x.Y"),)
    assert codec.decode_config(message.actions[0].configs[0]) is None


def test_bad_protobuf_bytes_are_invalid_message():
    with pytest.raises(errors.InvalidMessage):
        codec.decode_pb(b"\x0a\xff\xff")


def test_generate_config_round_trip_keeps_unset_fields_unset():
    config = GenerateConfig(temperature=0.0, max_tokens=9, stop=("a", "b"), seed=2**40)
    packed = codec.encode_config(config)
    assert packed.type_url == "type.googleapis.com/rill.evergreen.v1.GenerateConfig"
    assert codec.decode_config(packed) == config
    assert codec.decode_config(codec.encode_config(GenerateConfig())) == GenerateConfig()


def test_generate_config_with_bad_bytes_is_invalid():
    with pytest.raises(errors.InvalidMessage):
        codec.decode_config(AnyMessage(type_url=codec.GENERATE_CONFIG_TYPE_URL, value=b"\x08"))


@pytest.mark.parametrize(
    "exc, name",
    [
        (errors.InvalidMessage("x"), "INVALID_ARGUMENT"),
        (errors.RuleBroken("x"), "INVALID_ARGUMENT"),
        (errors.UnsupportedInput("x"), "INVALID_ARGUMENT"),
        (errors.UnknownTarget("x"), "NOT_FOUND"),
        (errors.RefDenied("x"), "PERMISSION_DENIED"),
        (errors.RefNotFound("x"), "NOT_FOUND"),
        (errors.SessionLimit("x"), "RESOURCE_EXHAUSTED"),
        (errors.InputMissing("x"), "FAILED_PRECONDITION"),
        (errors.NeedsChatTemplate("x"), "FAILED_PRECONDITION"),
        (rill_errors.InvalidRequest("x"), "INVALID_ARGUMENT"),
        (rill_errors.ContextLengthExceeded(10, 5), "OUT_OF_RANGE"),
        (rill_errors.QueueFull(), "RESOURCE_EXHAUSTED"),
        (rill_errors.MemoryPressure("x"), "RESOURCE_EXHAUSTED"),
        (rill_errors.ModelNotReady("x"), "UNAVAILABLE"),
        (rill_errors.RequestTimeout("x"), "DEADLINE_EXCEEDED"),
        (rill_errors.GenerationError("x"), "INTERNAL"),
        (rill_errors.EngineDead("x"), "UNAVAILABLE"),
    ],
)
def test_error_table(exc, name):
    assert codec.status_of(exc) == (name, exc.message)


def test_unexpected_exceptions_never_leak_their_text():
    assert codec.status_of(KeyError("secret path /x")) == ("INTERNAL", "internal server error")


def test_ws_close_code_is_4000_plus_status_and_reason_fits_a_close_frame():
    assert codec.ws_close(errors.UnknownTarget("nope")) == (4005, "NOT_FOUND: nope")
    code, reason = codec.ws_close(errors.RuleBroken("é" * 300))
    assert code == 4003 and len(reason.encode()) <= 123 and reason.startswith("INVALID_ARGUMENT: é")


def test_empty_message_round_trips():
    assert codec.decode_json("{}") == SessionMessage()
    assert codec.encode_json(SessionMessage()) == "{}"
