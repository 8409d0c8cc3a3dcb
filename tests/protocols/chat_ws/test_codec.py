"""chat_ws codec: request decoding (defaults, every error), golden encodings, error table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rill import errors
from rill.protocols.chat_ws import codec, messages
from rill.protocols.chat_ws.messages import AudioPart, ImagePart, TextPart, VideoPart

VECTORS = json.loads((Path(__file__).parent / "vectors" / "codec.json").read_text())


def test_defaults_are_the_spec_defaults() -> None:
    request = codec.decode_request('{"messages": [{"role": "user", "content": "Hello!"}]}')
    assert request.streaming is True and request.omni_mode is False and request.enable_thinking is False
    g = request.generation
    assert (g.max_new_tokens, g.temperature, g.top_p, g.length_penalty) == (512, 0.7, 0.8, 1.0)
    assert request.tts.enabled is True and request.tts.mode == "default" and request.tts.language is None
    assert request.image.max_slice_nums is None and request.image.use_image_id is True


def test_content_list_parts_and_their_defaults() -> None:
    request = codec.decode_request(
        json.dumps(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Describe"},
                            {"type": "image", "data": "aW1n"},
                            {"type": "audio", "data": "AAAAAA=="},
                            {"type": "video", "data": "dmlk"},
                        ],
                    }
                ]
            }
        )
    )
    text, image, audio, video = request.messages[0].content
    assert isinstance(text, TextPart) and text.text == "Describe"
    assert isinstance(image, ImagePart)
    assert isinstance(audio, AudioPart) and audio.sample_rate == 16000
    assert isinstance(video, VideoPart) and video.stack_frames == 1


def test_source_project_extras_are_accepted() -> None:
    request = codec.decode_request(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "u"},
                    {"role": "assistant", "content": "a"},
                ],
                "use_tts_template": True,
                "image": {"max_slice_nums": None},
                "client_build": "x",
            }
        )
    )
    assert request.use_tts_template is True and len(request.messages) == 3


@pytest.mark.parametrize("case", VECTORS["decode_errors"], ids=lambda c: c["error"])
def test_decode_errors(case: dict) -> None:
    with pytest.raises(errors.InvalidRequest) as info:
        codec.decode_request(case["wire"])
    assert case["error"] in str(info.value)


@pytest.mark.parametrize("case", VECTORS["encode"], ids=lambda c: c["wire"]["type"])
def test_encode_golden(case: dict) -> None:
    name, fields = case["message"]
    message = getattr(messages, name)(**fields)
    assert json.loads(codec.encode(message)) == case["wire"]


@pytest.mark.parametrize(
    ("exc", "text", "code"),
    [
        (errors.QueueFull("waiting queue full"), "Queue full", codec.CLOSE_TRY_AGAIN_LATER),
        (errors.InvalidRequest("'top_p' must be in (0, 1]"), "'top_p' must be in (0, 1]", codec.CLOSE_NORMAL),
        (errors.ContextLengthExceeded(2000, 1024), "prompt has 2000 tokens", codec.CLOSE_NORMAL),
        (errors.ModelNotReady(), "Service not ready", codec.CLOSE_TRY_AGAIN_LATER),
        (errors.RateLimited(retry_after_s=2.0), "rate limit reached", codec.CLOSE_TRY_AGAIN_LATER),
        (errors.MemoryPressure("too big"), "too big", codec.CLOSE_NORMAL),
        (errors.RequestTimeout("time limit"), "time limit", codec.CLOSE_NORMAL),
        (errors.GenerationError("cuda oops at 0x7f"), "Generation failed", codec.CLOSE_NORMAL),
        (errors.EngineDead("thread died"), "Engine stopped", codec.CLOSE_INTERNAL_ERROR),
        (errors.RillError("Cancelled"), "Cancelled", codec.CLOSE_NORMAL),
        (KeyError("secret internals"), codec.GENERIC_ERROR, codec.CLOSE_INTERNAL_ERROR),
    ],
)
def test_error_table(exc: BaseException, text: str, code: int) -> None:
    message, close_code = codec.error_for(exc)
    assert text in message.error and close_code == code
    if not isinstance(exc, errors.RillError):
        assert "secret" not in message.error


def test_seeded_mutations_raise_only_invalid_request() -> None:
    """Random byte edits of valid requests decode to a request or raise InvalidRequest, nothing else."""
    import random

    from rill.protocols.chat_ws.messages import ChatRequest

    seeds = [
        json.dumps(
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "hi"},
                            {"type": "audio", "data": "AAAA", "sample_rate": 8000},
                        ],
                    }
                ],
                "generation": {"max_new_tokens": 5, "top_p": 0.5},
                "tts": {"enabled": False, "language": "fr"},
                "streaming": False,
            }
        ).encode(),
        b'{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}',
    ]
    rng = random.Random(1234)
    num_decoded = 0
    for _ in range(3000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            op, i = rng.random(), rng.randrange(len(data))
            if op < 0.4:
                data[i] = rng.randrange(256)
            elif op < 0.7:
                del data[i]
            else:
                data.insert(i, rng.choice(b'{}[]",:0-.e\\u\xff'))
        try:
            assert isinstance(codec.decode_request(bytes(data)), ChatRequest)
            num_decoded += 1
        except errors.InvalidRequest:
            pass
    assert 0 < num_decoded < 3000  # some edits keep the request valid; refusing all must fail
