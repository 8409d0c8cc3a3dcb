"""The audio routes' pure parts: form and body checks, transcript formats, SSE events, sentence
cuts; and sound files decoded and encoded (``rill.frontend.audio_files``), bad ones refused
with ``InvalidRequest`` naming the field."""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import pytest

from rill.errors import InvalidRequest
from rill.frontend.asr import Segment, Transcript
from rill.frontend.audio_files import decode_audio, encode_compressed, pcm16, wav_header
from rill.protocols.openai_http import audio, codec

TRANSCRIPT = Transcript(
    text="Hello there. How are you?",
    language="en",
    duration_s=3.5,
    speech_s=3.0,
    segments=(Segment(0.0, 1.5, "Hello there."), Segment(1.5, 3.62, "How are you?")),
)


def _form(**fields: str) -> audio.TranscriptionRequest:
    return audio.transcription_request(fields, "transcribe")


def test_transcript_formats() -> None:
    body, media = audio.encode_transcript(TRANSCRIPT, _form())
    assert json.loads(body) == {"text": TRANSCRIPT.text, "usage": {"type": "duration", "seconds": 4}}
    assert media == "application/json"
    assert audio.encode_transcript(TRANSCRIPT, _form(response_format="text"))[0] == b"Hello there. How are you?\n"
    srt = audio.encode_transcript(TRANSCRIPT, _form(response_format="srt"))[0].decode()
    # The last segment ends where the audio does, not at Whisper's 20 ms step past it.
    assert srt == "1\n00:00:00,000 --> 00:00:01,500\nHello there.\n\n2\n00:00:01,500 --> 00:00:03,500\nHow are you?\n"
    vtt = audio.encode_transcript(TRANSCRIPT, _form(response_format="vtt"))[0].decode()
    assert vtt.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:01.500\nHello there.\n")
    verbose = json.loads(audio.encode_transcript(TRANSCRIPT, _form(response_format="verbose_json"))[0])
    assert verbose["task"] == "transcribe" and verbose["duration"] == 3.5 and verbose["language"] == "en"
    assert [(s["id"], s["start"], s["end"], s["text"]) for s in verbose["segments"]] == [
        (0, 0.0, 1.5, " Hello there."),
        (1, 1.5, 3.5, " How are you?"),
    ]
    translated = audio.encode_transcript(TRANSCRIPT, audio.transcription_request({}, "translate"))
    assert json.loads(translated[0])["text"] == TRANSCRIPT.text


def test_streamed_transcript_events() -> None:
    events = [json.loads(e.removeprefix(b"data: ")) for e in audio.transcript_events(TRANSCRIPT)]
    assert events == [
        {"type": "transcript.text.delta", "delta": "Hello there."},
        {"type": "transcript.text.delta", "delta": " How are you?"},
        {"type": "transcript.text.done", "text": TRANSCRIPT.text},
    ]


def test_form_fields() -> None:
    req = audio.transcription_request(
        {"language": " EN ", "stream": "True", "timestamp_granularities[]": "segment"}, "transcribe"
    )
    assert req.language == "en" and req.is_streaming and req.response_format == "json"
    assert audio.transcription_request({"language": "fr"}, "translate").language is None  # English out
    for fields, name in [
        ({"response_format": "xml"}, "response_format"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": "-0.1"}, "temperature"),
        ({"timestamp_granularities": "segment,word"}, "timestamp_granularities"),
        ({"stream": "maybe"}, "stream"),
    ]:
        with pytest.raises(InvalidRequest) as refused:
            audio.transcription_request(fields, "transcribe")
        assert refused.value.field == name


def test_model_names() -> None:
    route = "/v1/audio/transcriptions"
    codec.check_model(None, "whisper-base", audio.TRANSCRIPTION_ALIASES, route)
    codec.check_model("whisper-1", "whisper-base", audio.TRANSCRIPTION_ALIASES, route)
    with pytest.raises(codec.ModelNotFound) as caught:
        codec.check_model("tts-1", "whisper-base", audio.TRANSCRIPTION_ALIASES, route)
    assert caught.value.message == (
        "The model 'tts-1' does not exist for /v1/audio/transcriptions; use 'whisper-base' (or whisper-1, gpt-4o-transcribe, gpt-4o-mini-transcribe)"
    )
    assert caught.value.field == "model"


def test_speech_body_checks() -> None:
    voices = (*audio.OPENAI_VOICES, "en_us-joe-medium")
    req = audio.decode_speech(b'{"input": "Hi.", "voice": "Alloy", "speed": 0.25}', voices)
    assert req.response_format == "mp3" and req.stream_format == "audio" and req.speed == 0.25
    assert audio.decode_speech(b'{"input": "Hi.", "voice": {"id": "en_US-joe-medium"}}', voices).voice
    for body, name in [
        (b'{"voice": "alloy"}', "input"),
        (b'{"input": "   "}', "input"),
        (b'{"input": "Hi.", "voice": "bob"}', "voice"),
        (b'{"input": "Hi.", "response_format": "ogg"}', "response_format"),
        (b'{"input": "Hi.", "speed": 4.01}', "speed"),
        (b'{"input": "Hi.", "stream_format": "chunks"}', "stream_format"),
        (b'{"input": 3}', "input"),
    ]:
        with pytest.raises(InvalidRequest) as refused:
            audio.decode_speech(body, voices)
        assert refused.value.field == name, body


def test_speech_events() -> None:
    delta = json.loads(audio.audio_event(b"\x01\x02").removeprefix(b"data: "))
    assert delta == {"type": "speech.audio.delta", "audio": base64.b64encode(b"\x01\x02").decode()}
    assert json.loads(audio.audio_done().removeprefix(b"data: "))["type"] == "speech.audio.done"


def _wav(frames: bytes, rate_hz: int, width: int, channels: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(width)
        out.setframerate(rate_hz)
        out.writeframes(frames)
    return buffer.getvalue()


def test_wav_widths_channels_and_streamed_headers() -> None:
    tone = (0.5 * np.sin(np.arange(8000) / 8000 * 2 * np.pi * 200)).astype(np.float32)
    ints = (tone * 32767).astype("<i2")
    stereo = np.stack([ints, ints], axis=1).tobytes()
    samples, rate = decode_audio(_wav(stereo, 8000, 2, 2), 10)
    assert rate == 8000 and np.abs(samples - tone).max() < 1e-3
    i24 = (tone.astype(np.float64) * ((1 << 23) - 1)).astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3].tobytes()
    assert np.abs(decode_audio(_wav(i24, 8000, 3, 1), 10)[0] - tone).max() < 1e-3
    u8 = (tone * 127 + 128).astype(np.uint8).tobytes()
    assert np.abs(decode_audio(_wav(u8, 8000, 1, 1), 10)[0] - tone).max() < 0.02
    # A streamed WAV claims the largest size; what is there is read.
    streamed = wav_header(None, 24000) + pcm16(tone)
    assert len(decode_audio(streamed, 10)[0]) == len(tone)
    assert wav_header(len(tone), 24000) + pcm16(tone) == _wav(pcm16(tone), 24000, 2, 1)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "the file is empty"),
        (b"%PDF-1.7 this is not a sound\n" * 30, "not a sound file"),
        (b"RIFF\x00\x00\x00\x00WAVEjunk", "not a sound file"),
        (bytes(range(256)) * 8, "not a sound file"),
    ],
)
def test_bad_files_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as refused:
        decode_audio(data, 10)
    assert refused.value.field == "file"


def test_the_duration_cap_stops_decoding() -> None:
    two_seconds = (0.1 * np.sin(np.arange(48000) / 10)).astype(np.float32)
    for data in (wav_header(None, 24000) + pcm16(two_seconds), encode_compressed(two_seconds, 24000, "flac")):
        with pytest.raises(InvalidRequest, match="longer than"):
            decode_audio(data, 1.5)
        assert len(decode_audio(data, 2.5)[0]) > 0


@pytest.mark.parametrize("audio_format", ["mp3", "flac", "opus", "aac"])
def test_compressed_speech_decodes_back(audio_format: str) -> None:
    tone = (0.3 * np.sin(np.arange(24000) / 24000 * 2 * np.pi * 300)).astype(np.float32)
    samples, rate = decode_audio(encode_compressed(tone, 24000, audio_format), 10)
    assert rate == 16000 and abs(len(samples) / rate - 1.0) < 0.1
    assert 0.15 < float(np.sqrt(np.mean(samples**2))) < 0.25  # the tone's RMS (0.21) survives
