"""Python client of ``/ws/chat``, and ``rill client chat``.

    result = await chat("ws://127.0.0.1:8000/ws/chat", [{"role": "user", "content": "Hello!"}],
                        say=True, on_text=lambda t: print(t, end=""))
    result.text, result.audio  # the reply and its speech (float32 mono, 24 kHz)

``rill client chat --prompt TEXT [--system TEXT] [--say] [--out reply.wav] [--url URL]``
prints the reply as it streams (queue positions go to stderr) and, with ``--say``, writes
the spoken reply to a WAV file. ``--wav question.wav`` asks with speech instead of (or after)
``--prompt``: the file (any rate, mono or stereo) is sent as an ``audio`` part at 16 kHz, and
what the server heard (its ``transcript`` message) goes to stderr before the reply.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_URL = "ws://127.0.0.1:8000/ws/chat"
SAMPLE_RATE_HZ = 24000
INPUT_SAMPLE_RATE_HZ = 16000
MESSAGE_TOO_BIG = 1009
"""The WebSocket close code of a message over the receiver's size limit."""


class ChatError(Exception):
    """The server answered with an ``error`` message."""


@dataclass
class ChatResult:
    """The reply of one chat: text, speech (float32 mono 24 kHz) and token counts."""

    text: str = ""
    audio: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    input_tokens: int = 0
    generated_tokens: int = 0
    recording_session_id: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)


async def chat(
    url: str,
    messages: list[dict[str, Any]],
    *,
    say: bool = False,
    streaming: bool = True,
    generation: dict[str, Any] | None = None,
    language: str | None = None,
    api_key: str | None = None,
    on_text: Callable[[str], None] | None = None,
    on_queue: Callable[[dict[str, Any]], None] | None = None,
    on_transcript: Callable[[dict[str, Any]], None] | None = None,
) -> ChatResult:
    """Send one chat and collect the reply.

    Args:
        url: the ``/ws/chat`` URL.
        messages: the conversation (``role`` and ``content``).
        say: ask for speech (``tts.enabled``).
        streaming: stream the reply (``False``: everything comes in ``done``).
        generation: sampling fields (``max_new_tokens``, ``temperature``, ...).
        language: speech language hint (``tts.language``).
        api_key: sent as ``Authorization: Bearer``.
        on_text: called with each text delta as it arrives.
        on_queue: called with each ``queued`` / ``queue_update`` message.
        on_transcript: called with each ``transcript`` message (what was heard in an audio part).

    Raises:
        ChatError: the server sent ``error``, or closed before ``done``.
    """
    import websockets

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    request = _request(messages, say=say, streaming=streaming, generation=generation, language=language)
    result = ChatResult()
    pieces: list[np.ndarray] = []
    async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
        await ws.send(json.dumps(request))
        try:
            async for raw in ws:
                msg = json.loads(raw)
                result.messages.append(msg)
                kind = msg.get("type")
                if kind in ("queued", "queue_update") and on_queue is not None:
                    on_queue(msg)
                elif kind == "transcript" and on_transcript is not None:
                    on_transcript(msg)
                elif kind == "chunk":
                    _take_chunk(msg, result, pieces, on_text)
                elif kind == "done":
                    return _take_done(msg, result, pieces, on_text if not streaming else None)
                elif kind == "error":
                    raise ChatError(msg.get("error", "unknown error"))
        except websockets.ConnectionClosedError as exc:
            if exc.rcvd is not None and exc.rcvd.code == MESSAGE_TOO_BIG:
                raise ChatError(
                    "the request is larger than the server takes in one message (its --max-body-bytes)"
                ) from exc
            raise ChatError(f"the server closed the connection before the reply was done ({exc})") from exc
    raise ChatError("the server closed the connection before the reply was done")


def _request(
    messages: list[dict[str, Any]],
    *,
    say: bool,
    streaming: bool,
    generation: dict[str, Any] | None,
    language: str | None,
) -> dict[str, Any]:
    """The ``/ws/chat`` request message."""
    tts: dict[str, Any] = {"enabled": say}
    if language:
        tts["language"] = language
    return {"messages": messages, "streaming": streaming, "generation": generation or {}, "tts": tts}


def _take_chunk(
    msg: dict[str, Any], result: ChatResult, pieces: list[np.ndarray], on_text: Callable[[str], None] | None
) -> None:
    """Add a ``chunk``'s text delta to ``result`` (and pass it to ``on_text``) and keep its audio."""
    if msg.get("text_delta"):
        result.text += msg["text_delta"]
        if on_text is not None:
            on_text(msg["text_delta"])
    if msg.get("audio_data"):
        pieces.append(_audio(msg["audio_data"]))


def _take_done(
    msg: dict[str, Any], result: ChatResult, pieces: list[np.ndarray], on_text: Callable[[str], None] | None
) -> ChatResult:
    """Complete ``result`` from ``done`` (its whole text, passed to ``on_text`` when given: a
    reply that was not streamed) and join the audio."""
    if on_text is not None:
        on_text(msg["text"])
    result.text = msg["text"]
    result.input_tokens = msg["input_tokens"]
    result.generated_tokens = msg["generated_tokens"]
    result.recording_session_id = msg.get("recording_session_id")
    if msg.get("audio_data"):
        pieces.append(_audio(msg["audio_data"]))
    result.audio = np.concatenate(pieces).astype(np.float32) if pieces else result.audio
    return result


def _audio(data: str) -> np.ndarray:
    """Base64 little-endian float32 samples → an array."""
    return np.frombuffer(base64.b64decode(data), dtype="<f4")


def audio_part(path: str) -> dict[str, Any]:
    """An ``audio`` content part holding the sound file at ``path`` (WAV, FLAC, ...: what
    soundfile reads), mixed to mono and resampled to 16 kHz float32."""
    import soundfile
    import soxr

    samples, rate = soundfile.read(path, dtype="float32", always_2d=True)
    mono = samples.mean(axis=1)
    if rate != INPUT_SAMPLE_RATE_HZ:
        mono = soxr.resample(mono, rate, INPUT_SAMPLE_RATE_HZ)
    data = base64.b64encode(np.ascontiguousarray(mono, dtype="<f4").tobytes()).decode("ascii")
    return {"type": "audio", "data": data, "sample_rate": INPUT_SAMPLE_RATE_HZ}


def register(client_subparsers: Any) -> None:
    """Add ``rill client chat``."""
    parser = client_subparsers.add_parser(
        "chat", help="chat over /ws/chat; --say writes the spoken reply to a WAV file"
    )
    parser.add_argument("--prompt", default=None, help="the user message (or its text part, with --wav)")
    parser.add_argument(
        "--wav", default=None, help="a sound file to ask with (sent as audio; the server transcribes it)"
    )
    parser.add_argument("--system", default=None, help="a system message")
    parser.add_argument("--say", action="store_true", help="ask for speech and write it to --out")
    parser.add_argument("--out", default="reply.wav", help="WAV file for the spoken reply (default: reply.wav)")
    parser.add_argument("--language", default=None, help="speech language, e.g. en, fr, cmn")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="most tokens in the reply")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature")
    parser.add_argument("--no-stream", action="store_true", help="get the whole reply at once")
    parser.add_argument("--url", default=DEFAULT_URL, help=f"server URL (default: {DEFAULT_URL})")
    parser.add_argument("--api-key", default=None, help="API key (Authorization: Bearer)")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    if args.prompt is None and args.wav is None:
        print("rill client chat: give --prompt TEXT, --wav FILE or both", file=sys.stderr)
        return 2
    content: str | list[dict[str, Any]] = args.prompt
    if args.wav is not None:
        try:
            audio = audio_part(args.wav)
        except Exception as exc:  # noqa: BLE001 - soundfile raises its own error types
            print(f"rill client chat: cannot read {args.wav}: {exc}", file=sys.stderr)
            return 1
        content = ([{"type": "text", "text": args.prompt}] if args.prompt else []) + [audio]
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": content}
    ]
    generation = {
        k: v for k, v in (("max_new_tokens", args.max_new_tokens), ("temperature", args.temperature)) if v is not None
    }

    def show_text(delta: str) -> None:
        sys.stdout.write(delta)
        sys.stdout.flush()

    def show_transcript(msg: dict[str, Any]) -> None:
        print(f"[heard ({msg['language']}, {msg['duration_s']:.1f} s): {msg['text']}]", file=sys.stderr)

    def show_queue(msg: dict[str, Any]) -> None:
        print(
            f"[queued: position {msg['position']} of {msg['queue_length']}, about {msg['estimated_wait_s']} s]",
            file=sys.stderr,
        )

    try:
        result = asyncio.run(
            chat(
                args.url,
                messages,
                say=args.say,
                streaming=not args.no_stream,
                generation=generation,
                language=args.language,
                api_key=args.api_key,
                on_text=show_text,
                on_queue=show_queue,
                on_transcript=show_transcript,
            )
        )
    except ChatError as exc:
        print(f"\nrill client chat: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"rill client chat: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 1
    print()
    print(f"[{result.input_tokens} tokens in, {result.generated_tokens} out]", file=sys.stderr)
    if args.say:
        import soundfile

        soundfile.write(args.out, result.audio, SAMPLE_RATE_HZ, subtype="FLOAT")
        print(f"[{len(result.audio) / SAMPLE_RATE_HZ:.1f} s of speech written to {args.out}]", file=sys.stderr)
    return 0
