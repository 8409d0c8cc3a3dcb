"""Bounded JSON decoding, and the hostile inputs of issue 12 against every JSON codec."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from rill.errors import InvalidRequest, RillError
from rill.protocols._shared import jsonguard
from rill.protocols.batch_ws import codec as batch_codec
from rill.protocols.chat_ws import codec as chat_codec
from rill.protocols.evergreen import codec as evergreen_codec
from rill.protocols.evergreen.errors import InvalidMessage as EvergreenInvalid
from rill.protocols.framed_uds import codec as uds_codec
from rill.protocols.generate_ws import codec as generate_codec
from rill.protocols.openai_http import codec as openai_codec


def reference_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(reference_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(reference_depth, value), default=0)
    return 0


@pytest.mark.parametrize(
    "value",
    [
        [],
        {},
        [[[]]],
        {"a": [1, {"b": []}]},
        ["[[[[", {"]]": "{{"}],
        ["\\", ['\\"']],
        [[["\\\\"], '"]]]']],
        [
            [
                [
                    [
                        [
                            [
                                [
                                    [
                                        [
                                            [
                                                [
                                                    [
                                                        [
                                                            [
                                                                [
                                                                    [
                                                                        [
                                                                            [
                                                                                [
                                                                                    [
                                                                                        [
                                                                                            [
                                                                                                [
                                                                                                    [
                                                                                                        [
                                                                                                            [
                                                                                                                [
                                                                                                                    [
                                                                                                                        [
                                                                                                                            [
                                                                                                                                [
                                                                                                                                    [
                                                                                                                                        [
                                                                                                                                            [
                                                                                                                                                [
                                                                                                                                                    [
                                                                                                                                                        [
                                                                                                                                                            [
                                                                                                                                                                [
                                                                                                                                                                    [
                                                                                                                                                                        [
                                                                                                                                                                            [
                                                                                                                                                                                [
                                                                                                                                                                                    [
                                                                                                                                                                                        [
                                                                                                                                                                                            [
                                                                                                                                                                                                [
                                                                                                                                                                                                    [
                                                                                                                                                                                                        [
                                                                                                                                                                                                            [
                                                                                                                                                                                                                [
                                                                                                                                                                                                                    [
                                                                                                                                                                                                                        [
                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                                [
                                                                                                                                                                                                                                                                                    [
                                                                                                                                                                                                                                                                                        [
                                                                                                                                                                                                                                                                                            [
                                                                                                                                                                                                                                                                                                "x"
                                                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                                ]
                                                                                                                                                                                                                            ]
                                                                                                                                                                                                                        ]
                                                                                                                                                                                                                    ]
                                                                                                                                                                                                                ]
                                                                                                                                                                                                            ]
                                                                                                                                                                                                        ]
                                                                                                                                                                                                    ]
                                                                                                                                                                                                ]
                                                                                                                                                                                            ]
                                                                                                                                                                                        ]
                                                                                                                                                                                    ]
                                                                                                                                                                                ]
                                                                                                                                                                            ]
                                                                                                                                                                        ]
                                                                                                                                                                    ]
                                                                                                                                                                ]
                                                                                                                                                            ]
                                                                                                                                                        ]
                                                                                                                                                    ]
                                                                                                                                                ]
                                                                                                                                            ]
                                                                                                                                        ]
                                                                                                                                    ]
                                                                                                                                ]
                                                                                                                            ]
                                                                                                                        ]
                                                                                                                    ]
                                                                                                                ]
                                                                                                            ]
                                                                                                        ]
                                                                                                    ]
                                                                                                ]
                                                                                            ]
                                                                                        ]
                                                                                    ]
                                                                                ]
                                                                            ]
                                                                        ]
                                                                    ]
                                                                ]
                                                            ]
                                                        ]
                                                    ]
                                                ]
                                            ]
                                        ]
                                    ]
                                ]
                            ]
                        ]
                    ]
                ]
            ]
        ],
        [{"k": "[" * 100}] * 80,
    ],
)
def test_nesting_depth_counts_brackets_outside_strings_only(value: Any) -> None:
    text = json.dumps(value)
    depth = reference_depth(value)
    assert jsonguard.nesting_depth(text) == jsonguard.nesting_depth(text.encode()) == depth
    assert jsonguard.is_too_deep(text, limit=depth) is False
    assert jsonguard.is_too_deep(text.encode(), limit=depth - 1) is (depth > 0)


def test_depth_limit_is_exact() -> None:
    decoder = msgspec.json.Decoder()
    at_limit = b"[" * jsonguard.MAX_DEPTH + b"]" * jsonguard.MAX_DEPTH
    assert reference_depth(jsonguard.decode(decoder, at_limit)) == jsonguard.MAX_DEPTH
    with pytest.raises(jsonguard.UnsafeJson, match="deeper than 64"):
        jsonguard.decode(decoder, b"[" + at_limit + b"]")
    # deep text inside a string is only text
    assert jsonguard.decode(decoder, json.dumps(["[" * 5000]).encode()) == ["[" * 5000]


@pytest.mark.parametrize("data", [b'"\xff"', b'["\xed\xa0\x80"]', '"\ud800"', b"[" * 100_000, '{"a":' * 5000])
def test_decode_turns_unicode_and_recursion_failures_into_decode_errors(data: str | bytes) -> None:
    with pytest.raises(jsonguard.UnsafeJson):
        jsonguard.decode(msgspec.json.Decoder(), data)


HOSTILE = [
    pytest.param(b'{"nodeFragments":[{"\\ud800":1}]}', id="surrogate-key"),
    pytest.param(b"[" * 5000 + b"]" * 5000, id="5000-deep-array"),
    pytest.param(
        b'{"type":"config","prompt":"p","id":"i","messages":[],"prompts":[],"zz":' + b"[" * 5000 + b"]" * 5000 + b"}",
        id="5000-deep-unknown-field",
    ),
    pytest.param(b'{"a":' * 5000 + b"1" + b"}" * 5000, id="5000-deep-object"),
    pytest.param(b'{"actions":[{"configs":[{"@type":"\\ud800"}]}]}', id="surrogate-type"),
    pytest.param(b'{"prompt":"\xff\xfe","id":"x","messages":[]}', id="bad-utf8"),
    pytest.param(b'{"messages":[{"role":"user","content":"\\udc00"}]}', id="lone-low-surrogate"),
]

DECODERS: dict[str, tuple[Callable[[bytes], Any], tuple[type[BaseException], ...]]] = {
    "openai-completion": (openai_codec.decode_completion, (InvalidRequest,)),
    "openai-chat": (openai_codec.decode_chat, (InvalidRequest,)),
    "generate": (generate_codec.decode, (generate_codec.InvalidMessage,)),
    "generate-rest": (generate_codec.decode_rest, (generate_codec.InvalidMessage,)),
    "batch": (batch_codec.decode, (InvalidRequest,)),
    "chat": (chat_codec.decode_request, (InvalidRequest,)),
    "framed-uds": (uds_codec.decode, (uds_codec.InvalidJson, InvalidRequest)),
    "evergreen-json": (evergreen_codec.decode_json, (EvergreenInvalid,)),
}


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("data", HOSTILE)
def test_every_json_codec_refuses_hostile_input_with_its_documented_error(name: str, data: bytes) -> None:
    # Issue 12 items 4 and 5: RecursionError, UnicodeDecodeError, SystemError and TypeError
    # escaped these decoders before.
    decode, documented = DECODERS[name]
    with pytest.raises(documented) as info:
        decode(data)
    assert isinstance(info.value, RillError) and info.value.message
    if name != "evergreen-json":  # valid text (a str) behaves the same as its bytes
        with pytest.raises(documented):
            decode(data.decode("utf-8", "surrogateescape"))  # type: ignore[arg-type]


def test_framed_uds_wire_id_never_raises_on_deep_input() -> None:
    assert uds_codec.wire_id(b"[" * 5000) is None
    assert uds_codec.wire_id(b'{"id":"a","x":' + b"[" * 5000 + b"]" * 5000 + b"}") is None


@pytest.mark.parametrize(
    "text",
    [
        '{"nodeFragments":[{"seq":1' + "0" * 400 + "}]}",
        '{"nodeFragments":[{"seq":"1' + "0" * 400 + '"}]}',
        '{"nodeFragments":[{"seq":1e400}]}',
        '{"nodeFragments":[{"seq":NaN}]}',
        '{"actions":[{"configs":[{"@type":null}]}]}',
        '{"actions":[{"configs":[{"@type":"type.googleapis.com/google.protobuf.Any","value":{"@type":1}}]}]}',
        '{"nodeFragments":[{"id":"\\ud800"}]}',
        '{"nodeFragments":[{"chunkFragment":{"data":"\\ud800"}}]}',
    ],
)
def test_evergreen_json_out_of_range_or_mistyped_values_are_invalid_messages(text: str) -> None:
    with pytest.raises(EvergreenInvalid):
        evergreen_codec.decode_json(text)


def test_evergreen_json_config_type_with_a_nul_is_kept_as_an_unknown_type() -> None:
    message = evergreen_codec.decode_json('{"actions":[{"configs":[{"@type":"a\\u0000b"}]}]}')
    assert message.actions[0].configs[0].type_url == "a\x00b"
