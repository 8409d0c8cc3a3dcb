"""Tests of rill.protocols.framed_uds.codec, driven by the golden vectors in vectors/."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from rill import errors
from rill.errors import InvalidRequest
from rill.protocols.framed_uds import codec, messages
from rill.protocols.framed_uds.framing import FrameDecoder, FrameTooLarge, InvalidFrameLength
from rill.types import EngineStats

VECTORS = Path(__file__).parent / "vectors"
DECODE = json.loads((VECTORS / "decode.json").read_text())
ENCODE = json.loads((VECTORS / "encode.json").read_text())


def _payload(case: dict[str, Any]) -> bytes:
    if "raw_hex" in case:
        return bytes.fromhex(case["raw_hex"])
    if "raw" in case:
        return case["raw"].encode()
    return json.dumps(case["payload"]).encode()


@pytest.mark.parametrize("case", DECODE, ids=[c["name"] for c in DECODE])
def test_decode_vectors(case: dict[str, Any]) -> None:
    payload = _payload(case)
    if "error" in case:
        with pytest.raises(errors.RillError) as info:
            codec.decode(payload)
        assert codec.error_code(info.value) == case["error"]
        if "field" in case:
            assert isinstance(info.value, InvalidRequest)
            assert info.value.field == case["field"]
            if case["field"]:
                assert case["field"] in codec.error_message(info.value)  # the message names the field
        return
    message = codec.decode(payload)
    expected = dict(case["message"])
    assert type(message).__name__ == expected.pop("kind")
    assert msgspec.to_builtins(message) == {k: v for k, v in expected.items() if v is not None} | (
        {} if not isinstance(message, messages.Request) else dict(expected)
    )


@pytest.mark.parametrize("case", ENCODE, ids=[c["name"] for c in ENCODE])
def test_encode_vectors(case: dict[str, Any]) -> None:
    fields = dict(case["message"])
    message = msgspec.convert(fields, getattr(messages, fields.pop("kind")))
    frame = codec.encode(message)
    body = case["json"].encode()
    assert frame[:4] == len(body).to_bytes(4, "little")
    assert frame[4:] == body
    assert FrameDecoder(1024).feed(frame) == [body]


def test_error_table_covers_every_code_of_the_issue() -> None:
    cases = {
        FrameTooLarge(10, 5): "E_PROTO_FRAME_TOO_LARGE",
        InvalidFrameLength("zero"): "E_PROTO_INVALID_LEN",
        codec.InvalidJson("x"): "E_PROTO_INVALID_JSON",
        InvalidRequest("x", field="prompt"): "E_PROTO_BAD_REQUEST",
        codec.Busy("x"): "E_PROTO_BUSY",
        errors.ContextLengthExceeded(5000, 4096): "E_LIMIT_PROMPT_TOO_LARGE",
        errors.MemoryPressure("x"): "E_LIMIT_PROMPT_TOO_LARGE",
        errors.GenerationError("x"): "E_RUNTIME_DECODE",
        errors.QueueFull(): "E_LIMIT_QUEUE_FULL",
        errors.RateLimited(): "E_LIMIT_RATE_LIMITED",
        errors.ModelNotReady("x"): "E_RUNTIME_NOT_READY",
        errors.RequestTimeout("x"): "E_RUNTIME_TIMEOUT",
        errors.EngineDead("x"): "E_RUNTIME_UNAVAILABLE",
        errors.CacheMiss("x"): "E_RUNTIME_INTERNAL",
    }
    for exc, code in cases.items():
        assert codec.error_code(exc) == code, exc


def test_unexpected_exceptions_never_leak_their_text() -> None:
    exc = KeyError("/secret/path")
    assert codec.error_code(exc) == "E_RUNTIME_INTERNAL"
    assert codec.error_message(exc) == "internal server error"


def test_prompt_too_large_message_keeps_the_source_wording() -> None:
    message = codec.error_message(errors.ContextLengthExceeded(5000, 4096))
    assert message.startswith("prompt too large: ") and "5000" in message


def test_wire_id_of_a_bad_frame() -> None:
    assert codec.wire_id(b'{"id": "r9"}') == "r9"
    assert codec.wire_id(b'{"id": 9}') is None
    assert codec.wire_id(b"not json") is None
    assert codec.wire_id(b"[1]") is None


def test_build_request_defaults_follow_the_spec() -> None:
    request = codec.build_request(messages.Request(id="r", prompt="Hello"))
    assert request.prompt == "Hello"
    assert request.protocol == "framed_uds"
    assert request.priority == 0
    assert request.sampling.temperature == 0.0
    assert request.sampling.top_p == 1.0 and request.sampling.top_k == 0
    assert request.sampling.max_tokens == codec.DEFAULT_MAX_TOKENS


def test_build_request_honours_every_field() -> None:
    wire = messages.Request(
        id="r", prompt="Hi", max_tokens=7, temperature=0.7, top_p=0.9, top_k=40, slo=messages.Slo(target_ttft_ms=150)
    )
    request = codec.build_request(wire)
    assert (request.sampling.max_tokens, request.sampling.temperature) == (7, 0.7)
    assert (request.sampling.top_p, request.sampling.top_k) == (0.9, 40)
    assert request.priority < 0


def test_max_tokens_default_and_pass_through() -> None:
    # --max-tokens-cap is applied at admission for every protocol (tests/test_policy_e2e.py).
    assert codec.build_request(messages.Request(id="r", prompt="Hi", max_tokens=500)).sampling.max_tokens == 500
    assert codec.build_request(messages.Request(id="r", prompt="Hi")).sampling.max_tokens == codec.DEFAULT_MAX_TOKENS
    assert codec.build_request(messages.Request(id="r", prompt="Hi"), 9.0).deadline_s == 9.0


@pytest.mark.parametrize(
    "field, value", [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("max_tokens", 0), ("top_k", -3)]
)
def test_build_request_names_the_bad_sampling_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        codec.build_request(messages.Request(id="r", prompt="Hi", **{field: value}))
    assert info.value.field == field
    assert codec.error_code(info.value) == "E_PROTO_BAD_REQUEST"


def test_slo_priority_orders_tighter_targets_first() -> None:
    Slo = messages.Slo  # noqa: N806 - the class, under its own name
    none, tbt_only = codec.slo_priority(None), codec.slo_priority(Slo(target_tbt_ms=50))
    loose, tight, tighter = (codec.slo_priority(Slo(target_ttft_ms=t)) for t in (5000, 150, 20))
    very_loose = codec.slo_priority(Slo(target_ttft_ms=10 * codec.SLO_HORIZON_MS))
    assert none == 0 == codec.slo_priority(Slo())
    assert tighter < tight < loose < very_loose <= tbt_only == -1 < none
    assert all(isinstance(p, int) for p in (tight, loose))


def test_metrics_snapshot_uses_the_source_key_names() -> None:
    stats = EngineStats(
        num_running=2,
        num_waiting=1,
        generation_tokens_total=42,
        num_steps_total=17,
        last_batch_size=2,
        last_step_ms=12.34567,
        step_ms_ewma=11.1111,
        prompt_tokens_total=90,
        kv_used_bytes=4096,
        requests_finished_total={"stop": 3},
    )
    snapshot = codec.metrics_snapshot(stats, num_active_sessions=3)
    source_keys = [
        "tokens_generated_total",
        "batch_calls_total",
        "last_batch_size",
        "decode_ms_last",
        "decode_ms_ewma",
        "prefill_tokens_total",
        "active_sessions",
    ]
    assert list(snapshot)[: len(source_keys)] == source_keys
    assert snapshot["tokens_generated_total"] == 42 and snapshot["batch_calls_total"] == 17
    assert snapshot["decode_ms_last"] == 12.346 and snapshot["decode_ms_ewma"] == 11.111
    assert snapshot["prefill_tokens_total"] == 90 and snapshot["active_sessions"] == 3
    assert snapshot["num_running"] == 2 and snapshot["kv_used_bytes"] == 4096
    assert snapshot["requests_finished_total"] == {"stop": 3}
    msgspec.json.encode(snapshot)  # JSON-serialisable as is


def _mutations(seed: int, count: int) -> list[bytes]:
    import random

    rng = random.Random(seed)
    bases = [_payload(c) for c in DECODE]
    out = []
    for _ in range(count):
        data = bytearray(rng.choice(bases))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(3)
            pos = rng.randrange(len(data) + 1)
            if op == 0:
                data.insert(pos, rng.randrange(256))
            elif op == 1 and data:
                del data[min(pos, len(data) - 1)]
            elif data:
                data[min(pos, len(data) - 1)] = rng.randrange(256)
        out.append(bytes(data))
    return out


def test_decode_raises_only_documented_errors_on_mutated_input() -> None:
    # A small deterministic fuzz: decode returns a message or raises InvalidJson / InvalidRequest.
    num_decoded = 0
    for payload in _mutations(seed=6, count=3000):
        try:
            codec.decode(payload)
            num_decoded += 1
        except (codec.InvalidJson, InvalidRequest):
            pass
        codec.wire_id(payload)  # never raises
    assert 0 < num_decoded < 3000  # some edits keep the frame valid; refusing all must fail
