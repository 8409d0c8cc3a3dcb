"""Voice chat costs: speech recognition, speech synthesis, spoken replies end to end, and what
voice chats take from a text stream.

    .venv/bin/python benchmarks/voice.py [--rounds 5] [--chats 1,4] [--clips 5,30,120]
        [--asr-threads 2] [--max-tokens 48] [--itl-tokens 128] [--quick]

Four parts, one table each, every figure beside its goal (met / not met):

1. ASR: Whisper base's real-time factor (seconds of work per second of audio) on clips of
   about 5, 30 and 120 s, each Piper-spoken sentences put end to end (``PiperSynth(varied=False)``,
   the same samples every run), through ``AsrService`` in this process (no server), with the
   word error rate of what came back. Goal: at most 0.3x real time with ``--asr-threads`` 2.
2. TTS: Piper (the server's voice, one ONNX thread) against espeak-ng on a few short
   paragraphs spoken sentence by sentence as a chat reply is: real-time factor, and
   first-audio latency (the paragraph's first sentence, which is when the server can send the
   reply's first ``audio`` chunk). Goal: RTF at most 0.3.
3. End to end on a ``rill serve`` subprocess (the default SmolLM2, Piper, Whisper): a
   Piper-spoken question goes to ``/ws/chat`` as an ``audio`` part with ``tts.enabled``,
   greedy; the clock starts once the request's last byte is sent (the audio is pre-recorded,
   so that is the end of the user's audio) and stops at the first ``chunk`` carrying
   ``audio_data``. At 1 and 4 concurrent chats, ``--rounds`` rounds: median and p90, and the
   transcript's and first token's times beside it. Goal at 1 chat: first reply audio within
   1.5 s. The ASR clips also go through ``POST /v1/audio/transcriptions`` there (WAV).
4. Interference: one streaming ``/v1/chat/completions`` text request (``--itl-tokens``
   tokens, ``ignore_eos``, greedy); its inter-token latency p50/p90 alone, then while 4 voice
   chats loop (transcription and speech running), and the ratio. Goal: at most 1.3x.

``--quick`` checks the script works: one short clip, one sentence per synthesizer, one chat
of a few tokens, one short interference pair. Its figures mean nothing. On a shared or
loaded machine every figure is noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compare import Server, free_port

SENTENCES = [
    "The capital of France is Paris.",
    "It is famous for the Eiffel Tower and its museums.",
    "Rivers carry water from the mountains down to the sea.",
    "A good cup of coffee starts with freshly ground beans.",
    "The library opens at nine in the morning and closes at six.",
    "Most birds build their nests in the spring.",
    "The train to the airport leaves every fifteen minutes.",
    "She planted tomatoes, beans and lettuce in her garden.",
    "Computers store numbers as patterns of ones and zeros.",
    "The moon takes about a month to circle the earth.",
    "Please remember to close the window before you leave.",
    "The old bridge was rebuilt after the flood.",
]
"""What the ASR clips say (in this order, repeated as needed)."""

QUESTIONS = [
    "What is the capital of France?",
    "How many days are there in a week?",
    "What color is the sky on a clear day?",
    "Can you name a large animal that lives in Africa?",
]
"""The voice chats' spoken questions (chat i asks question i mod 4)."""

PARAGRAPHS = [
    ["The capital of France is Paris.", "It is famous for the Eiffel Tower.", "Many people visit it every year."],
    ["Water boils at one hundred degrees.", "At the top of a mountain it boils a little sooner."],
    ["Sure, here is a short answer.", "A week has seven days, from Monday to Sunday."],
]
"""Replies the TTS part speaks, sentence by sentence (as the chat reply's segments)."""

GAP_S = 0.3
"""Silence between the clip's sentences."""


def goal(value: float, limit: float) -> str:
    """``met`` when ``value`` is at most ``limit``."""
    return "met" if value <= limit else "NOT met"


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def make_clip(seconds: float) -> tuple[np.ndarray, str]:
    """Piper-spoken sentences end to end (16 kHz float32) until ``seconds`` are reached, and their text."""
    from rill.testing.speech import spoken

    pieces: list[np.ndarray] = []
    said: list[str] = []
    total = 0
    i = 0
    while total < seconds * 16000:
        sentence = SENTENCES[i % len(SENTENCES)]
        pieces += [spoken(sentence), np.zeros(int(GAP_S * 16000), np.float32)]
        said.append(sentence)
        total += len(pieces[-2]) + len(pieces[-1])
        i += 1
    return np.concatenate(pieces), " ".join(said)


def part_asr(clips: list[tuple[np.ndarray, str]], threads: int) -> None:
    """Part 1: Whisper's RTF through ``AsrService`` in this process."""
    from rill.frontend.asr import AsrService, WhisperRecognizer
    from rill.testing.speech import word_error_rate

    service = AsrService(WhisperRecognizer(threads=threads), max_audio_s=3600)
    try:
        asyncio.run(service.transcribe(clips[0][0][: 16000 * 2]))  # loads the model: not timed
        print(f"\n## 1. ASR (whisper-base, int8, {threads} thread(s), in process)  goal: RTF <= 0.3", flush=True)
        print(f"{'audio s':>8} {'work s':>7} {'RTF':>6} {'WER':>6}  goal", flush=True)
        for audio, text in clips:
            started = time.perf_counter()
            heard = asyncio.run(service.transcribe(audio))
            elapsed = time.perf_counter() - started
            rtf = elapsed / (len(audio) / 16000)
            wer = word_error_rate(text, heard.text)
            print(f"{len(audio) / 16000:>8.1f} {elapsed:>7.2f} {rtf:>6.3f} {wer:>6.3f}  {goal(rtf, 0.3)}", flush=True)
    finally:
        service.shutdown()


def part_tts(paragraphs: list[list[str]]) -> None:
    """Part 2: Piper against espeak-ng, sentence by sentence."""
    from rill.frontend.speech import SAMPLE_RATE_HZ, EspeakSynth, PiperSynth

    print("\n## 2. TTS (sentence by sentence, as a reply)  goal: RTF <= 0.3", flush=True)
    print(f"{'synth':>9} {'audio s':>8} {'work s':>7} {'RTF':>6} {'first p50 s':>12} {'first max s':>12}  goal")
    for synth in (PiperSynth(), EspeakSynth()):
        cancel = threading.Event()
        synth.synthesize("Hello.", None, cancel)  # loads the voice: not timed
        work = audio_s = 0.0
        firsts: list[float] = []
        for paragraph in paragraphs:
            for i, sentence in enumerate(paragraph):
                started = time.perf_counter()
                pcm = synth.synthesize(sentence, None, cancel)
                elapsed = time.perf_counter() - started
                if i == 0:
                    firsts.append(elapsed)
                work += elapsed
                audio_s += len(pcm) / SAMPLE_RATE_HZ
        rtf = work / audio_s
        print(
            f"{synth.name:>9} {audio_s:>8.1f} {work:>7.2f} {rtf:>6.3f} {statistics.median(firsts):>12.3f} "
            f"{max(firsts):>12.3f}  {goal(rtf, 0.3) if synth.name == 'piper' else '(peer)'}",
            flush=True,
        )


@dataclass
class Chat:
    """One voice chat's times, in seconds after its request's last byte was sent."""

    transcript_s: float
    first_token_s: float
    first_audio_s: float
    done_s: float
    text: str


async def voice_chat(url: str, question: np.ndarray, max_tokens: int) -> Chat:
    """Ask ``question`` (16 kHz float32) on ``/ws/chat`` with spoken replies; time the messages."""
    import websockets

    body = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "audio", "data": base64.b64encode(question.astype("<f4").tobytes()).decode()}],
            }
        ],
        "generation": {"do_sample": False, "max_new_tokens": max_tokens},
        "tts": {"enabled": True},
    }
    marks: dict[str, float] = {}
    async with websockets.connect(f"{url}/ws/chat", max_size=None, open_timeout=120) as ws:
        await ws.send(json.dumps(body))
        sent = time.perf_counter()
        async for raw in ws:
            now = time.perf_counter() - sent
            message = json.loads(raw)
            kind = message["type"]
            if kind == "transcript":
                marks.setdefault("transcript", now)
            elif kind == "chunk":
                if message.get("text_delta"):
                    marks.setdefault("token", now)
                if message.get("audio_data"):
                    marks.setdefault("audio", now)
            elif kind == "done":
                marks["done"] = now
                text = message.get("text", "")
                break
            elif kind == "error":
                raise RuntimeError(f"chat error: {message}")
    nan = float("nan")
    return Chat(
        marks.get("transcript", nan), marks.get("token", nan), marks.get("audio", nan), marks.get("done", nan), text
    )


def part_e2e(url: str, questions: list[np.ndarray], levels: list[int], rounds: int, max_tokens: int) -> None:
    """Part 3: end of the user's audio to the first reply audio, at each concurrency."""
    print("\n## 3. End to end: /ws/chat, audio in, tts.enabled, greedy  goal: first audio <= 1.5 s at 1 chat")
    print(
        f"{'chats':>5} {'n':>3} {'heard p50':>10} {'token p50':>10} {'audio p50':>10} {'audio p90':>10} "
        f"{'done p50':>9}  goal",
        flush=True,
    )
    for level in levels:
        chats: list[Chat] = []
        for _ in range(rounds):

            async def wave(level: int = level) -> list[Chat]:
                jobs = [voice_chat(url, questions[i % len(questions)], max_tokens) for i in range(level)]
                return await asyncio.gather(*jobs)

            chats += asyncio.run(wave())
        audio = [c.first_audio_s for c in chats]
        verdict = goal(statistics.median(audio), 1.5) if level == 1 else "(no goal)"
        print(
            f"{level:>5} {len(chats):>3} {statistics.median(c.transcript_s for c in chats):>10.3f} "
            f"{statistics.median(c.first_token_s for c in chats):>10.3f} {statistics.median(audio):>10.3f} "
            f"{pct(audio, 0.9):>10.3f} {statistics.median(c.done_s for c in chats):>9.3f}  {verdict}",
            flush=True,
        )
    print(f"   a reply: {chats[0].text[:100]!r}", flush=True)


def part_asr_http(url: str, clips: list[tuple[np.ndarray, str]]) -> None:
    """Part 1 again through ``POST /v1/audio/transcriptions`` (a WAV file per clip)."""
    import soundfile

    from rill.testing.speech import word_error_rate

    print("\n## 1b. ASR through POST /v1/audio/transcriptions (WAV, 16-bit)  goal: RTF <= 0.3", flush=True)
    print(f"{'audio s':>8} {'work s':>7} {'RTF':>6} {'WER':>6}  goal", flush=True)
    with httpx.Client(base_url=url, timeout=600) as client:
        for audio, text in clips:
            wav = io.BytesIO()
            soundfile.write(wav, audio, 16000, format="WAV", subtype="PCM_16")
            started = time.perf_counter()
            reply = client.post(
                "/v1/audio/transcriptions",
                files={"file": ("clip.wav", wav.getvalue(), "audio/wav")},
                data={"model": "whisper-base", "language": "en"},
            )
            elapsed = time.perf_counter() - started
            reply.raise_for_status()
            rtf = elapsed / (len(audio) / 16000)
            wer = word_error_rate(text, reply.json()["text"])
            print(f"{len(audio) / 16000:>8.1f} {elapsed:>7.2f} {rtf:>6.3f} {wer:>6.3f}  {goal(rtf, 0.3)}", flush=True)


async def text_stream(url: str, tokens: int) -> list[float]:
    """Gaps (s) between the content-bearing SSE events of one streamed chat completion."""
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times: list[float] = []
    async with (
        httpx.AsyncClient(base_url=url, timeout=600) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as reply,
    ):
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
    return [b - a for a, b in zip(times, times[1:], strict=False)]


async def under_voice_load(
    url: str, questions: list[np.ndarray], voices: int, tokens: int, max_tokens: int
) -> tuple[list[float], int]:
    """The text stream's gaps while ``voices`` voice chats run back to back, and how many chats ran."""
    stop = asyncio.Event()
    started = [asyncio.Event() for _ in range(voices)]
    done = 0

    ws_url = url.replace("http://", "ws://", 1)

    async def loop(i: int) -> None:
        nonlocal done
        while not stop.is_set():
            task = asyncio.ensure_future(voice_chat(ws_url, questions[i % len(questions)], max_tokens))
            started[i].set()
            await task
            done += 1

    loops = [asyncio.ensure_future(loop(i)) for i in range(voices)]
    for event in started:
        await event.wait()
    try:
        gaps = await text_stream(url, tokens)
    finally:
        stop.set()
        await asyncio.gather(*loops)
    return gaps, done


def part_itl(url: str, questions: list[np.ndarray], rounds: int, tokens: int, max_tokens: int, voices: int) -> None:
    """Part 4: one text stream's ITL alone against under ``voices`` voice chats."""
    alone: list[float] = []
    loaded: list[float] = []
    num_chats = 0
    for _ in range(rounds):  # alternate, so load that comes and goes hits both sides
        alone += asyncio.run(text_stream(url, tokens))
        gaps, chats = asyncio.run(under_voice_load(url, questions, voices, tokens, max_tokens))
        loaded += gaps
        num_chats += chats
    print(f"\n## 4. Interference: one /v1/chat/completions stream ({tokens} tokens) alone vs {voices} voice chats")
    print(f"{'':>12} {'ITL p50 ms':>11} {'ITL p90 ms':>11}", flush=True)
    p50a, p90a, p50l, p90l = pct(alone, 0.5), pct(alone, 0.9), pct(loaded, 0.5), pct(loaded, 0.9)
    print(f"{'alone':>12} {p50a * 1e3:>11.1f} {p90a * 1e3:>11.1f}")
    print(f"{'voice load':>12} {p50l * 1e3:>11.1f} {p90l * 1e3:>11.1f}   ({num_chats} voice chats ran)")
    print(
        f"{'ratio':>12} {p50l / p50a:>11.2f} {p90l / p90a:>11.2f}   goal <= 1.3: p50 {goal(p50l / p50a, 1.3)}, "
        f"p90 {goal(p90l / p90a, 1.3)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clips", default="5,30,120", help="ASR clip lengths (s)")
    parser.add_argument("--asr-threads", type=int, default=2, help="threads of one transcription (both sides)")
    parser.add_argument("--chats", default="1,4", help="concurrent voice chats of part 3")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per concurrency (3) and per side (4)")
    parser.add_argument("--max-tokens", type=int, default=48, help="reply tokens of a voice chat")
    parser.add_argument("--itl-tokens", type=int, default=128, help="tokens of the text stream of part 4")
    parser.add_argument("--voices", type=int, default=4, help="voice chats running during part 4")
    parser.add_argument("--parts", default="asr,tts,e2e,itl", help="which parts to run")
    parser.add_argument("--serve-arg", action="append", default=[], help="extra `rill serve` argument (repeatable)")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "rill-voice")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, figures meaningless")
    args = parser.parse_args()
    if args.quick:
        args.clips, args.chats, args.rounds, args.max_tokens, args.itl_tokens, args.voices = "3", "1", 1, 8, 12, 1
    parts = set(args.parts.split(","))
    levels = [int(c) for c in args.chats.split(",")]
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs", flush=True)

    from rill.testing.speech import spoken

    clips = [make_clip(float(s)) for s in args.clips.split(",")] if parts & {"asr", "e2e"} else []
    if "asr" in parts:
        part_asr(clips, args.asr_threads)
    if "tts" in parts:
        part_tts(PARAGRAPHS[:1] if args.quick else PARAGRAPHS)
    if not parts & {"e2e", "itl"}:
        return
    questions = [spoken(q) for q in QUESTIONS]
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "rill",
        "serve",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--no-socket",
        "--grpc-port",
        "0",
        "--tts",
        "piper",
        "--asr",
        "whisper",
        "--asr-threads",
        str(args.asr_threads),
        "--asr-max-audio-s",
        "3600",
        "--max-body-bytes",
        str(64 << 20),
        "--log-level",
        "warning",
        *args.serve_arg,
    ]
    url = f"http://127.0.0.1:{port}"
    print(f"\nserver: {' '.join(cmd[1:])}", flush=True)
    with Server("rill", cmd, port, args.out / "server.log", "/health") as server:
        server.wait_ready(600)
        asyncio.run(voice_chat(f"ws://127.0.0.1:{port}", questions[0], 4))  # loads Whisper and Piper: not timed
        if "e2e" in parts:
            part_e2e(f"ws://127.0.0.1:{port}", questions, levels, args.rounds, args.max_tokens)
            part_asr_http(url, clips)
        if "itl" in parts:
            part_itl(url, questions, args.rounds, args.itl_tokens, args.max_tokens, args.voices)
    print(f"\nload average {os.getloadavg()[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
