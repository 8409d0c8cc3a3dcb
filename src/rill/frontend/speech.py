"""Speech out for chat replies: a ``SpeechSynth`` protocol, an espeak-ng synthesizer, and
per-reply ``SpeechStream``s that run synthesis off the event loop.

Audio everywhere here is float32 mono PCM at 24 kHz (``SAMPLE_RATE_HZ``), the chat wire
format. ``EspeakSynth`` drives libespeak-ng through ctypes; the library and its voice data
ship inside the ``espeakng-loader`` wheel, so speech works offline with nothing but the
project's own dependencies. espeak-ng speaks at 22 050 Hz; ``soxr`` resamples to 24 kHz.

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
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Protocol, cast

import numpy as np

from rill.errors import InvalidRequest

SAMPLE_RATE_HZ = 24000
"""Sample rate of every PCM array a ``SpeechSynth`` returns."""


class SpeechSynth(Protocol):
    """A text-to-speech engine producing float32 mono PCM at ``SAMPLE_RATE_HZ``."""

    name: str

    def check(self, *, language: str | None, mode: str, has_ref_audio: bool) -> None:
        """Raise ``InvalidRequest`` naming what is supported if a setting cannot be honoured."""
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

    def check(self, *, language: str | None, mode: str, has_ref_audio: bool) -> None:
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
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rill-speech")
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

    def open(self, language: str | None, max_pending: int = 8) -> SpeechStream:
        """A stream for one reply; close it with ``aclose()`` (or ``async with``)."""
        return SpeechStream(self, language, max_pending)

    def _run(self, text: str, language: str | None, cancel: threading.Event) -> np.ndarray:
        self.num_running_jobs += 1  # only touched from the single worker thread
        try:
            if cancel.is_set():
                return np.zeros(0, np.float32)
            return self.synth.synthesize(text, language, cancel)
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

    def __init__(self, service: SpeechService, language: str | None, max_pending: int) -> None:
        self._service = service
        self._language = language
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
                    self._service._executor, self._service._run, text, self._language, self._cancel
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
