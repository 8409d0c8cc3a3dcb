"""Codec of /generate: golden decode vectors, encoding, and the error table."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rill import errors
from rill.protocols.generate_ws import codec
from rill.protocols.generate_ws import messages as m

VECTORS = json.loads((Path(__file__).parent / "vectors" / "decode.json").read_text())


@pytest.mark.parametrize("case", VECTORS, ids=[c["name"] for c in VECTORS])
def test_decode_vectors(case: dict) -> None:
    if "expected" in case:
        msg = codec.decode(case["input"])
        assert json.loads(msgspec.json.encode(msg)) == case["expected"]
    else:
        with pytest.raises(codec.InvalidMessage) as info:
            codec.decode(case["input"])
        assert info.value.field == case["error_field"]
        assert info.value.message


def test_decode_rest_flat_shape_becomes_config() -> None:
    req = codec.decode_rest(b'{"prompt": "Write", "max_tokens": 200, "temperature": 0.7, "stream": false}')
    config = req.to_config()
    assert config.prompt == "Write"
    assert config.parameters is not None and m.SAMPLING.patch(config.parameters) == {
        "max_tokens": 200,
        "temperature": 0.7,
    }
    assert config.options == m.Options(stream=False)


def test_decode_rest_names_unknown_field() -> None:
    with pytest.raises(codec.InvalidMessage) as info:
        codec.decode_rest(b'{"prompt": "x", "maxtokens": 3}')
    assert info.value.field == "maxtokens"


def test_encode_token_omits_unrequested_fields_but_keeps_null_finish_reason() -> None:
    text = codec.encode(m.Token(token=" the", generated_text="Once the"))
    assert json.loads(text) == {
        "type": "token",
        "token": " the",
        "generated_text": "Once the",
        "finished": False,
        "finish_reason": None,
    }


def test_encode_sse_is_one_data_event() -> None:
    data = codec.encode_sse(m.Status(operation="paused"))
    assert data == b'data: {"type":"status","operation":"paused"}\n\n'


ERROR_CASES = [
    (
        errors.InvalidRequest("'temperature' must be >= 0", field="temperature"),
        "invalid_request",
        True,
        {"field": "temperature"},
    ),
    (
        errors.ContextLengthExceeded(100, 64),
        "context_length_exceeded",
        True,
        {"prompt_tokens": 100, "max_context_tokens": 64},
    ),
    (errors.MemoryPressure("too big"), "memory_pressure", True, {}),
    (errors.RateLimited(retry_after_s=2.5), "rate_limited", True, {"retry_after_seconds": 2.5}),
    (errors.QueueFull(), "rate_limited", True, {"retry_after_seconds": 1.0}),
    (errors.RequestTimeout("too slow"), "timeout", True, {}),
    (errors.ModelLoadError("missing config.json in /secret/path"), "model_loading_error", False, {}),
    (errors.ModelNotReady(), "model_loading_error", True, {}),
    (errors.GenerationError("kernel at 0xdead"), "internal_error", True, {}),
    (errors.EngineDead("thread died: KeyError"), "internal_error", False, {}),
    (errors.RequestNotFound("req gone"), "invalid_request", True, {}),
    (codec.Unauthorized("key"), "unauthorized", False, {}),
    (RuntimeError("/etc/passwd"), "internal_error", False, {}),
]


@pytest.mark.parametrize(
    "exc,code,recoverable,extra", ERROR_CASES, ids=[c[1] + "-" + type(c[0]).__name__ for c in ERROR_CASES]
)
def test_error_table(exc: BaseException, code: str, recoverable: bool, extra: dict) -> None:
    msg = json.loads(codec.encode(codec.error_message(exc, "gen_1", "partial")))
    assert msg["type"] == "error" and msg["error"] == code and msg["recoverable"] is recoverable
    assert msg["request_id"] == "gen_1" and msg["generated_text"] == "partial"
    assert "recovery_action" in msg
    for key, value in extra.items():
        assert msg[key] == value
    if codec.wire_error(exc).text is not None:  # internals never reach the client
        assert str(exc) not in msg["message"]


def _mutations(seed: int, count: int) -> list[bytes]:
    """Seeded random mutations of the golden inputs (flips, cuts, splices, junk)."""
    import random

    rng = random.Random(seed)
    bases = [c["input"].encode() for c in VECTORS]
    out = []
    for _ in range(count):
        data = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(4)
            pos = rng.randrange(len(data) + 1)
            if op == 0 and data:
                data[min(pos, len(data) - 1)] = rng.randrange(256)
            elif op == 1:
                del data[pos : pos + rng.randint(1, 8)]
            elif op == 2:
                data[pos:pos] = rng.choice(bases)[: rng.randint(0, 20)]
            else:
                data[pos:pos] = rng.choice([b'"', b"{", b"}", b"[", b"-1e999", b"null", b"\xff", b'"type"', b"1" * 30])
        out.append(bytes(data))
    return out


def test_decode_raises_only_invalid_message_on_garbage() -> None:
    from rill.protocols.generate_ws import session as s
    from rill.types import ModelInfo

    info = ModelInfo(name="t", architecture="a", max_context_tokens=64, vocab_size=100, dtype="float32", device="cpu")
    num_decoded = 0
    for data in _mutations(seed=1, count=3000):
        for decode in (codec.decode, codec.decode_rest):
            try:
                msg = decode(data)
            except codec.InvalidMessage as exc:
                assert exc.message
                continue
            num_decoded += 1
            # Whatever decodes, a fresh session answers with actions, never an exception.
            sess = s.GenerateSession(s.Limits(model_name="t", model_info=info))
            config = msg.to_config() if isinstance(msg, m.RestRequest) else msg
            assert isinstance(sess.receive(config, now=0.0), list)
    assert 0 < num_decoded < 6000  # some edits keep the message valid; refusing all must fail


def test_random_parameter_values_never_crash_the_session() -> None:
    import random

    from rill.protocols.generate_ws import session as s
    from rill.types import ModelInfo

    rng = random.Random(2)
    values = [
        0,
        1,
        -1,
        2**63,
        2**64 - 1,
        -(2**63),
        0.5,
        -0.0,
        1e308,
        -1e308,
        1e-320,
        "x",
        "",
        [],
        ["a"],
        [""],
        {},
        {"1": 2.0},
        {"-5": 1e9},
        {"99999": 1.0},
        None,
        True,
        False,
        [1, 2],
        ["a"] * 20,
    ]
    info = ModelInfo(name="t", architecture="a", max_context_tokens=64, vocab_size=100, dtype="float32", device="cpu")
    num_started = 0
    for _ in range(3000):
        params = {name: rng.choice(values) for name in rng.sample(m.Parameters.__struct_fields__, rng.randint(1, 4))}
        text = msgspec.json.encode({"type": "config", "prompt": "p", "parameters": params})
        try:
            msg = codec.decode(text)
        except codec.InvalidMessage:
            continue
        sess = s.GenerateSession(s.Limits(model_name="t", model_info=info))
        actions = sess.receive(msg, now=0.0)
        num_started += isinstance(actions[0], s.Start)
        if not isinstance(actions[0], s.Start):
            error = actions[0].message  # type: ignore[union-attr]
            assert error.error == "invalid_request" and str(error.field).startswith("parameters.")
    assert num_started > 0
