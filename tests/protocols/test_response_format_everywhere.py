"""Every protocol that carries sampling parameters carries ``response_format`` into the one
``SamplingParams`` (constrained decoding is then the engine's, alike for all)."""

from __future__ import annotations

import json

import msgspec
import pytest

from rill.errors import InvalidRequest
from rill.protocols.batch_ws.messages import BatchRequest, GenerationConfig
from rill.protocols.batch_ws.session import BatchSession, Limits
from rill.protocols.batch_ws.store import ContinuationStore
from rill.protocols.evergreen import codec as evergreen_codec
from rill.protocols.evergreen.messages import GenerateConfig
from rill.protocols.evergreen.prompt import sampling_params as evergreen_sampling
from rill.protocols.framed_uds import codec as uds_codec
from rill.protocols.generate_ws.messages import SAMPLING, Parameters
from rill.types import ResponseFormat, SamplingParams

FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}
EXPECTED = msgspec.convert(FORMAT, ResponseFormat)


def test_framed_uds() -> None:
    message = uds_codec.decode(json.dumps({"id": "r", "prompt": "hi", "response_format": FORMAT}).encode())
    assert uds_codec.build_request(message).sampling.response_format == EXPECTED


def test_batch_ws_generation_config() -> None:
    defaults = GenerationConfig(
        num_beams=1,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=8,
        repetition_penalty=1.0,
        length_penalty=1.0,
    )
    session = BatchSession(ContinuationStore(4, 100, 1.0), defaults, Limits(), "k")
    request = msgspec.convert(
        {"prompts": [{"request_id": "a", "prompt": "x"}], "generation_config": {"response_format": FORMAT}},
        BatchRequest,
    )
    start = session.receive(request, 0.0)[1]
    assert start.request.sampling.response_format == EXPECTED


def test_evergreen_config_round_trips_through_protobuf() -> None:
    config = evergreen_codec.decode_config(
        evergreen_codec.encode_config(GenerateConfig(response_format=json.dumps(FORMAT)))
    )
    assert evergreen_sampling(config).response_format == EXPECTED
    with pytest.raises(InvalidRequest) as caught:
        evergreen_sampling(GenerateConfig(response_format="{not json"))
    assert caught.value.field == "response_format"


def test_generate_parameters_patch() -> None:
    patch = SAMPLING.patch(msgspec.convert({"response_format": FORMAT}, Parameters))
    assert SamplingParams().updated(patch).response_format == EXPECTED
    lifted = SamplingParams(response_format=EXPECTED).updated({"response_format": {"type": "text"}})
    assert lifted.constraint is None


@pytest.mark.parametrize(
    "bad",
    [
        {"type": "json_schema"},
        {"type": "regex", "regex": ""},
        {"type": "grammar"},
        {"type": "regex", "regex": "a" * 70000},
    ],
)
def test_shapes_are_checked_once_for_all(bad: dict) -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams().updated({"response_format": bad})
    assert caught.value.field == "response_format"


def test_beam_search_cannot_be_constrained() -> None:
    with pytest.raises(InvalidRequest, match="beam"):
        SamplingParams(num_beams=2, response_format=EXPECTED).validate()
