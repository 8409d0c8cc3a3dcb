"""``SamplingParams.validate`` bounds every numeric field, and the chat admission checks.

Issue 12: ``length_penalty`` ±1000 reached the beam scorer (overflow); ``top_k: -5`` passed on
OpenAI routes; ``role: "wizard"`` and ``chat_template_kwargs: {"messages": 1}`` were not
refused as bad input. The bounds live in one place (``rill.types``), so these tests are the
rule every protocol applies.
"""

from __future__ import annotations

import math

import pytest

from rill import types
from rill.errors import InvalidRequest
from rill.types import ChatMessage, SamplingParams, check_chat_messages, check_template_kwargs

# (field, values accepted at the edges, values refused just past them or malformed)
BOUNDS = [
    ("temperature", [0.0, types.MAX_TEMPERATURE], [-1e-9, types.MAX_TEMPERATURE * 1.01, math.inf, math.nan, "1", True]),
    ("top_k", [-1, 0, 1, types.MAX_TOP_K], [-2, -5, types.MAX_TOP_K + 1, 1.5, None]),
    ("top_p", [1e-9, 1.0], [0.0, 1.0001, math.nan, -1.0]),
    ("min_p", [0.0, 1.0], [-0.01, 1.01, math.nan]),
    (
        "repetition_penalty",
        [types.MIN_REPETITION_PENALTY, types.MAX_REPETITION_PENALTY],
        [0.0, 0.001, 1e9, math.inf, math.nan],
    ),
    ("presence_penalty", [-2.0, 2.0], [-2.01, 2.01, math.nan]),
    ("frequency_penalty", [-2.0, 2.0], [-2.01, 2.01, math.inf]),
    (
        "length_penalty",
        [-types.MAX_ABS_LENGTH_PENALTY, 0.0, types.MAX_ABS_LENGTH_PENALTY],
        [1000.0, -1000.0, 10.01, math.inf, -math.inf, math.nan, "1"],
    ),
    ("max_tokens", [1, types.MAX_TOKENS_LIMIT], [0, -1, types.MAX_TOKENS_LIMIT + 1, 2**80, 1.0]),
    ("num_beams", [1, types.MAX_NUM_BEAMS], [0, types.MAX_NUM_BEAMS + 1]),
    ("seed", [None, 0, 2**63 - 1], [-1, 2**63, 1.5]),
    ("logprobs", [None, 0, 20], [-1, 21]),
    ("prompt_logprobs", [None, 0, 20], [-1, 21, 1.0]),
]


@pytest.mark.parametrize(("field", "good", "bad"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_every_numeric_field_has_finite_bounds(field: str, good: list, bad: list) -> None:
    for value in good:
        SamplingParams(**{field: value}).validate()
    for value in bad:
        with pytest.raises(InvalidRequest) as caught:
            SamplingParams(**{field: value}).validate()
        assert caught.value.field == field, (field, value)


def test_list_and_mapping_fields_are_bounded() -> None:
    SamplingParams(stop=["x" * types.MAX_STOP_STRING_CHARS] * types.MAX_STOP_STRINGS).validate()
    SamplingParams(logit_bias=dict.fromkeys(range(types.MAX_LOGIT_BIAS_ENTRIES), 100.0)).validate()
    SamplingParams(stop_token_ids=list(range(types.MAX_STOP_TOKEN_IDS))).validate(vocab_size=types.MAX_STOP_TOKEN_IDS)
    SamplingParams(allowed_token_ids=[0, 9]).validate(vocab_size=10)
    refused = [
        ("stop", dict(stop=["x"] * (types.MAX_STOP_STRINGS + 1))),
        ("stop", dict(stop=["x" * (types.MAX_STOP_STRING_CHARS + 1)])),
        ("stop", dict(stop=[""])),
        ("logit_bias", dict(logit_bias=dict.fromkeys(range(types.MAX_LOGIT_BIAS_ENTRIES + 1), 1.0))),
        ("logit_bias", dict(logit_bias={-1: 1.0})),
        ("logit_bias", dict(logit_bias={1: math.nan})),
        ("logit_bias", dict(logit_bias={1: 100.5})),
        ("stop_token_ids", dict(stop_token_ids=[-3])),
        ("stop_token_ids", dict(stop_token_ids=[0] * (types.MAX_STOP_TOKEN_IDS + 1))),
        ("allowed_token_ids", dict(allowed_token_ids=[])),
        ("allowed_token_ids", dict(allowed_token_ids=[-1])),
        ("allowed_token_ids", dict(allowed_token_ids=[1.5])),
        ("allowed_token_ids", dict(allowed_token_ids=[0] * (types.MAX_ALLOWED_TOKEN_IDS + 1))),
        ("min_tokens", dict(min_tokens=5, max_tokens=4)),
        ("ignore_eos", dict(ignore_eos=1)),
    ]
    for field, kwargs in refused:
        with pytest.raises(InvalidRequest) as caught:
            SamplingParams(**kwargs).validate()
        assert caught.value.field == field, kwargs


def test_patches_go_through_the_same_bounds() -> None:
    base = SamplingParams(num_beams=4)
    assert base.updated({"length_penalty": 2.5}).length_penalty == 2.5
    for value in (1000.0, -1000.0):
        with pytest.raises(InvalidRequest) as caught:
            base.updated({"length_penalty": value})
        assert caught.value.field == "length_penalty"


def test_unknown_roles_are_refused() -> None:
    check_chat_messages([ChatMessage(role=r, content="x") for r in sorted(types.CHAT_ROLES)])
    check_chat_messages([{"role": "user", "content": "x"}])
    for bad in ("wizard", "", "USER", None, 5):
        with pytest.raises(InvalidRequest) as caught:
            check_chat_messages([{"role": "user", "content": "a"}, {"role": bad, "content": "b"}])
        assert caught.value.field == "messages" and "messages[1]" in caught.value.message


def test_template_kwargs_may_not_set_reserved_names_or_be_ill_typed() -> None:
    assert check_template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    for bad in ({"messages": 1}, {"add_generation_prompt": True}, {"tools": []}, [1], "x", {1: 2}):
        with pytest.raises(InvalidRequest) as caught:
            check_template_kwargs(bad)
        assert caught.value.field == "chat_template_kwargs"


def test_allowed_token_ids_must_lie_in_the_vocabulary() -> None:
    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(allowed_token_ids=[3, 10]).validate(vocab_size=10)
    assert caught.value.field == "allowed_token_ids" and "10" in str(caught.value)
