"""Codec of batch /ws: golden decode/encode vectors and the error table."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from rill import errors
from rill.protocols.batch_ws import codec
from rill.protocols.batch_ws.messages import ServerEvent

VECTORS = json.loads((Path(__file__).parent / "vectors" / "codec.json").read_text())


@pytest.mark.parametrize("case", VECTORS["decode"], ids=lambda c: c["name"])
def test_decode_vectors(case: dict) -> None:
    if "error" in case:
        with pytest.raises(errors.InvalidRequest) as info:
            codec.decode(case["input"])
        assert str(info.value).startswith(case["error"])
    else:
        # generation_config omits the fields the client left out (None = server default).
        assert msgspec.to_builtins(codec.decode(case["input"])) == case["expect"]


@pytest.mark.parametrize("case", VECTORS["encode"], ids=lambda c: c["name"])
def test_encode_vectors_round_trip(case: dict) -> None:
    events = msgspec.convert(case["events"], list[ServerEvent])
    text = codec.encode_events(events)
    assert text == case["expect"]
    assert msgspec.json.decode(text, type=list[ServerEvent]) == events


def test_decode_accepts_bytes() -> None:
    assert codec.decode(b'{"prompts":[{"request_id":"a","prompt":""}]}').prompts[0].request_id == "a"


def test_socket_error_is_an_array_with_one_error_object() -> None:
    assert json.loads(codec.encode_socket_error("Invalid JSON received: x")) == [{"error": "Invalid JSON received: x"}]


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (errors.ContextLengthExceeded(300, 256), "prompt has 300 tokens but the model's context holds at most 256"),
        (errors.InvalidRequest("'top_p' must be in (0, 1]"), "'top_p' must be in (0, 1]"),
        (errors.QueueFull(), "the server's waiting queue is full; retry later"),
        (errors.RateLimited(retry_after_s=2.0), "rate limit reached; retry in 2.00 s"),
        (errors.MemoryPressure("x"), "the prompt can never fit in the server's KV cache memory"),
        (errors.ModelNotReady(), "the model is still loading; retry later"),
        (errors.CacheMiss("kept generation evicted"), "kept generation evicted"),
        (errors.RequestTimeout(), "the request ran past the server's time limit"),
        (errors.GenerationError("secret internals"), "generation failed"),
        (errors.EngineDead("secret internals"), "the engine stopped; no generation can run until the server restarts"),
        (errors.RillError("secret"), codec.GENERIC_ERROR),
        (ValueError("secret traceback"), codec.GENERIC_ERROR),
    ],
)
def test_error_table(exc: BaseException, expected: str) -> None:
    assert codec.error_text(exc) == expected


def test_every_error_class_has_a_deliberate_text() -> None:
    # Every request-level class of rill.errors resolves to a table entry of its own or a
    # parent's; none leaks str(exc) unless the table says so.
    request_errors = [
        cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.RillError) and not issubclass(cls, errors.ConfigError)
    ]
    table = dict(codec.ERROR_TABLE)
    for cls in request_errors:
        if cls is errors.RillError or issubclass(cls, errors.RequestNotFound):
            continue
        assert any(base in table for base in cls.__mro__), cls


def test_fuzz_decode_and_receive_raise_only_documented_errors() -> None:
    # Mutated payloads: decode gives a BatchRequest or InvalidRequest, and a decoded batch is
    # either accepted by a session or refused with InvalidRequest; nothing else escapes.
    import random

    from rill.config import SamplingDefaults
    from rill.protocols.batch_ws.messages import BatchRequest, GenerationConfig
    from rill.protocols.batch_ws.session import BatchSession, ContinuationStore, Limits

    defaults = GenerationConfig(**vars(SamplingDefaults()))
    seed = json.loads(VECTORS["decode"][0]["input"])
    seed["prompts"].append({"request_id": "b", "prompt": "x"})
    base = json.dumps(seed).encode()
    alphabet = b'{}[]",:0123456789-.eEtrufalsn \\/abx\x00\xff'
    rng = random.Random(0)
    num_decoded = num_started = 0
    for _ in range(3000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 6)):
            op, at = rng.random(), rng.randrange(len(data))
            if op < 0.4:
                data[at] = rng.choice(alphabet)
            elif op < 0.7:
                del data[at]
            else:
                data.insert(at, rng.choice(alphabet))
        try:
            msg = codec.decode(bytes(data))
        except errors.InvalidRequest:
            continue
        assert isinstance(msg, BatchRequest)
        num_decoded += 1
        session = BatchSession(ContinuationStore(4, 1000, 10.0), defaults, Limits(), "k")
        try:
            num_started += bool(session.receive(msg, 0.0))
        except errors.InvalidRequest:
            pass
    # Some edits keep the batch valid (a digit for a digit, a space): a decoder or session
    # refusing everything must fail here.
    assert 0 < num_started <= num_decoded < 3000
