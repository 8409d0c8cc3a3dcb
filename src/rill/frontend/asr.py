"""Speech in: a ``SpeechRecognizer`` protocol, Whisper through faster-whisper, and the
server-wide ``AsrService`` every protocol transcribes through.

``AsrService.transcribe(samples, sample_rate_hz=16000, language=None)`` checks the audio
(finite samples, at least one, a sample rate in 8..192 kHz, at most ``max_audio_s`` seconds:
``InvalidRequest`` otherwise), resamples it to 16 kHz, and runs the recognizer in a pool of
``workers`` threads, never on the event loop. At most ``max_pending`` transcriptions wait or
run at once, server-wide; past that ``ResourceExhausted`` (retryable). A caller that is
cancelled (its client left) leaves the line at once; a transcription already running stops at
its next 30-second window, and its worker place is only given back when the thread is free,
so the bound holds for the threads' real work and the audio they hold.

``WhisperRecognizer`` runs OpenAI's Whisper base (CTranslate2, CPU int8) on the file
``rill.models.speech`` prepares from pinned packages: voice-activity trimming (Silero VAD, as
faster-whisper ships it), language detected unless given, greedy decoding. The model loads on
the first transcription, in the worker thread.

Nothing here knows a wire protocol: ``/ws/chat`` uses it, and so can any other front end.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rill.errors import ConfigError, InvalidRequest
from rill.frontend.workers import PoolCounters, WorkerPool
from rill.types import Segment, Transcript

if TYPE_CHECKING:
    from rill.config import SpeechConfig

log = logging.getLogger("rill.frontend.asr")

SAMPLE_RATE_HZ = 16000
"""Sample rate a ``SpeechRecognizer`` receives."""

MIN_RATE_HZ, MAX_RATE_HZ = 8000, 192000
"""Sample rates ``AsrService`` accepts (anything else is resampled to ``SAMPLE_RATE_HZ``)."""


class SpeechRecognizer(Protocol):
    """A speech-to-text engine taking float32 mono PCM at ``SAMPLE_RATE_HZ``."""

    name: str

    def transcribe(
        self, samples: np.ndarray, language: str | None, cancel: threading.Event, task: str = "transcribe"
    ) -> Transcript:
        """What is said in ``samples``; stop early (returning what was heard) once ``cancel`` is set.
        ``task`` ``translate`` gives the words in English instead of the spoken language.

        Blocking: call it from a worker thread.

        Raises:
            InvalidRequest: ``language`` is not one the recognizer knows (the message lists some).
        """
        ...


class WhisperRecognizer:
    """Whisper base through faster-whisper (CTranslate2 on the CPU, int8 weights).

    Args:
        threads: CPU threads one transcription uses.
        workers: transcriptions that may run in parallel (the pool's size).
        model_dir: the prepared model folder (default: ``rill.models.speech.ensure_whisper_model()``).
    """

    name = "whisper-base"

    def __init__(self, threads: int, workers: int = 1, model_dir: str | None = None) -> None:
        self.threads = threads
        self.workers = workers
        self.model_dir = model_dir
        self.load_s: float | None = None
        """Seconds the first load took (preparing the file included), once loaded."""
        self._model: Any = None
        self._lock = threading.Lock()

    def load(self) -> Any:
        """The faster-whisper model, prepared and loaded on first call (blocking, thread-safe)."""
        with self._lock:
            if self._model is None:
                from faster_whisper import WhisperModel

                from rill.models.speech import ensure_whisper_model

                # faster-whisper logs three INFO lines per transcription: a busy server's log would drown.
                logging.getLogger("faster_whisper").setLevel(logging.WARNING)
                started = time.perf_counter()
                folder = self.model_dir or str(ensure_whisper_model())
                self._model = _reusing_first_window(WhisperModel)(
                    folder, device="cpu", compute_type="int8", cpu_threads=self.threads, num_workers=self.workers
                )
                self.load_s = time.perf_counter() - started
                log.info("speech recognition: %s loaded in %.2f s from %s", self.name, self.load_s, folder)
            return self._model

    def transcribe(
        self, samples: np.ndarray, language: str | None, cancel: threading.Event, task: str = "transcribe"
    ) -> Transcript:
        """See ``SpeechRecognizer.transcribe``."""
        model = self.load()
        if language is not None and language not in model.supported_languages:
            raise InvalidRequest(
                f"language '{language}' is not one {self.name} knows; use a code such as en, fr, de, es, zh, ja "
                f"({len(model.supported_languages)} known)",
                field="language",
            )
        # Greedy decoding without the previous window as a prompt: a loop of repeated text
        # in one window then cannot carry into the next (the fallback temperatures remain).
        pieces, info = model.transcribe(
            samples,
            language=language,
            task=task,
            beam_size=1,
            vad_filter=True,
            condition_on_previous_text=False,
        )
        segments: list[Segment] = []
        for piece in pieces:  # one 30-second window at a time: the place to notice a cancel
            if piece.text.strip():
                segments.append(Segment(round(piece.start, 3), round(piece.end, 3), piece.text.strip()))
            if cancel.is_set():
                break
        return Transcript(
            text=" ".join(s.text for s in segments),
            language=info.language,
            duration_s=float(info.duration),
            speech_s=float(info.duration_after_vad),
            segments=tuple(segments),
            language_probability=float(info.language_probability),
        )


def _reusing_first_window(whisper_model: type) -> type:
    """faster-whisper's ``WhisperModel`` that encodes the first 30-second window once, not twice.

    faster-whisper 1.2.1 detects the language on the first window's encoder output, then
    encodes that window again to decode it, although its ``generate_segments`` takes a first
    window's encoder output (and earlier versions passed it). The encoder is most of the cost
    of a short utterance: measured here on a 1.7 s question, 1.95 s with detection and 0.88 s
    with the language given, before; 0.71 s either way with this. It keeps the detection's
    output, per thread, and hands it to the decoding of the same transcription (the
    detection's window holds one more mel frame at its end than the decoder's, as it did in
    those versions).
    """
    from faster_whisper.audio import pad_or_trim

    class FirstWindow(threading.local):
        encoded: Any = None

    class ReusingWhisperModel(whisper_model):
        _first = FirstWindow()

        def transcribe(self, *args: Any, **kwargs: Any) -> Any:
            self._first.encoded = None  # never one left over from a transcription that failed
            return super().transcribe(*args, **kwargs)

        def detect_language(
            self,
            audio: np.ndarray | None = None,
            features: np.ndarray | None = None,
            vad_filter: bool = False,
            vad_parameters: Any = None,
            language_detection_segments: int = 1,
            language_detection_threshold: float = 0.5,
        ) -> tuple[str, float, list[tuple[str, float]]]:
            if audio is not None or features is None or language_detection_segments != 1:
                return super().detect_language(  # type: ignore[no-any-return]
                    audio,
                    features,
                    vad_filter,
                    vad_parameters,
                    language_detection_segments,
                    language_detection_threshold,
                )
            encoded = self.encode(pad_or_trim(features[..., : self.feature_extractor.nb_max_frames]))
            probabilities = [(token[2:-2], p) for token, p in self.model.detect_language(encoded)[0]]
            self._first.encoded = encoded
            return probabilities[0][0], probabilities[0][1], probabilities

        def generate_segments(
            self, features: np.ndarray, tokenizer: Any, options: Any, log_progress: Any, encoder_output: Any = None
        ) -> Any:
            encoded, self._first.encoded = self._first.encoded, None
            reuse = encoder_output if encoder_output is not None else encoded
            return super().generate_segments(features, tokenizer, options, log_progress, reuse)

    return ReusingWhisperModel


@dataclass
class AsrCounters(PoolCounters):
    """What tests and metrics read: the pool's counts (running, waiting, cancelled, busy
    seconds), and the finished transcriptions with the audio they took, by language."""

    num_transcribed_total: int = 0
    audio_s_total: float = 0.0
    by_language: dict[str, int] = field(default_factory=dict)


class AsrService:
    """The server's speech recognition: a bounded pool of worker threads around a recognizer.

    Args:
        recognizer: what transcribes (``WhisperRecognizer`` in a server; tests give doubles).
        workers: transcriptions running at once.
        max_pending: transcriptions waiting or running at once, server-wide (past it:
            ``ResourceExhausted``).
        max_audio_s: the longest audio one call takes (past it: ``InvalidRequest``).
    """

    def __init__(
        self, recognizer: SpeechRecognizer, *, workers: int = 1, max_pending: int = 16, max_audio_s: float = 120.0
    ) -> None:
        self.recognizer = recognizer
        self.max_audio_s = max_audio_s
        self.counters = AsrCounters()
        self.pool = WorkerPool(
            name="rill-asr",
            workers=workers,
            max_pending=max_pending,
            busy="speech recognition is busy",
            what="transcriptions",
            setting="--asr-max-queue",
            counters=self.counters,
        )
        self._counters_lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        """Transcriptions waiting for a worker or running (what ``max_pending`` bounds)."""
        return self.pool.num_pending

    def check(self, num_samples: int, sample_rate_hz: int, where: str = "audio") -> float:
        """The audio's duration in seconds, once its shape passes the checks ``transcribe`` makes
        first (use it to refuse a request before any work starts).

        Raises:
            InvalidRequest: no samples, a sample rate outside 8000..192000 Hz, or longer than
                ``max_audio_s`` (``where`` names the audio in the message).
        """
        if not MIN_RATE_HZ <= sample_rate_hz <= MAX_RATE_HZ:
            raise InvalidRequest(
                f"{where}: sample_rate {sample_rate_hz} is outside {MIN_RATE_HZ}..{MAX_RATE_HZ} Hz", field=where
            )
        if num_samples == 0:
            raise InvalidRequest(f"{where}: the audio has no samples", field=where)
        duration_s = num_samples / sample_rate_hz
        if duration_s > self.max_audio_s:
            raise InvalidRequest(
                f"{where}: {duration_s:.1f} s of audio is more than speech recognition takes "
                f"({self.max_audio_s:g} s, --asr-max-audio-s)",
                field=where,
            )
        return duration_s

    def check_room(self) -> None:
        """Raise ``ResourceExhausted`` when ``max_pending`` transcriptions wait or run (what
        ``transcribe`` checks; call it first to refuse before decoding a file).

        Raises:
            ResourceExhausted: the pool is full (retryable).
        """
        self.pool.check_room()

    async def transcribe(
        self,
        samples: np.ndarray,
        *,
        sample_rate_hz: int = SAMPLE_RATE_HZ,
        language: str | None = None,
        where: str = "audio",
        task: str = "transcribe",
    ) -> Transcript:
        """What is said in ``samples`` (float32 mono at ``sample_rate_hz``).

        Args:
            samples: the audio.
            sample_rate_hz: its sample rate (resampled to 16 kHz when another).
            language: the spoken language's code, or None to detect it.
            where: names the audio in error messages (``messages[1].content[0]``).
            task: ``transcribe`` (the spoken language's words) or ``translate`` (English words).

        Raises:
            InvalidRequest: bad audio (see ``check``; NaN or infinite samples too) or an unknown language.
            ResourceExhausted: ``max_pending`` transcriptions are already waiting or running.
        """
        self.check(len(samples), sample_rate_hz, where)
        audio = np.asarray(samples, dtype=np.float32).reshape(-1)
        if not np.isfinite(audio).all():
            raise InvalidRequest(f"{where}: the audio has NaN or infinite samples", field=where)
        cancel = threading.Event()
        try:
            return await self.pool.run(self._work, audio, sample_rate_hz, language, cancel, task, on_cancel=cancel.set)
        except InvalidRequest as exc:  # the recognizer's refusal (a language), placed
            raise InvalidRequest(f"{where}: {exc}", field=exc.field) from exc

    def _work(
        self, audio: np.ndarray, sample_rate_hz: int, language: str | None, cancel: threading.Event, task: str
    ) -> Transcript:
        transcript: Transcript | None = None
        try:
            if sample_rate_hz != SAMPLE_RATE_HZ:
                import soxr

                audio = soxr.resample(audio, sample_rate_hz, SAMPLE_RATE_HZ).astype(np.float32)
            transcript = self.recognizer.transcribe(audio, language, cancel, task)
            return transcript
        finally:
            if transcript is not None:
                with self._counters_lock:  # workers may be several threads
                    c = self.counters
                    c.num_transcribed_total += 1
                    c.audio_s_total += transcript.duration_s
                    c.by_language[transcript.language] = c.by_language.get(transcript.language, 0) + 1

    def shutdown(self) -> None:
        """Stop the worker threads (a running transcription ends at its next window; nothing waits)."""
        self.pool.shutdown()


ASR_CHOICES = ("auto", "whisper", "off")
"""Values of ``--asr``."""


def make_asr(config: SpeechConfig) -> AsrService | None:
    """The server's ``AsrService`` for ``config`` (``--asr`` and the ``--asr-*`` bounds), or None
    when speech recognition is off (``off``, or ``auto`` without the Whisper packages).

    Raises:
        ConfigError: ``--asr whisper`` but faster-whisper or the model packages are not installed.
    """
    from rill.models.speech import WHISPER_PACKAGES, whisper_installed

    if config.asr == "off" or (config.asr == "auto" and not whisper_installed()):
        return None
    if not whisper_installed():
        raise ConfigError(
            f"--asr whisper needs faster-whisper and the {' and '.join(WHISPER_PACKAGES)} packages "
            "(installed with rill; reinstall it), or --asr off"
        )
    from rill.engine.threads import default_choice

    threads = default_choice(config.asr_threads).num_threads
    recognizer = WhisperRecognizer(threads=threads, workers=config.asr_workers)
    return AsrService(
        recognizer, workers=config.asr_workers, max_pending=config.asr_max_queue, max_audio_s=config.asr_max_audio_s
    )
