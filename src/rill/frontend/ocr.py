"""Text in images: an ``ImageReader`` protocol, Tesseract OCR through pytesseract, and the
server-wide ``OcrService`` every protocol reads images through.

This is OCR, not vision: the printed or rendered text of an image (a screenshot, a scanned
page, a sign) is read; what the image shows is not described. An image with no text that
Tesseract is confident of reads as empty text.

``OcrService.read(image)`` checks the image's size (at most ``max_pixels``: ``InvalidRequest``
otherwise) and runs the reader in a pool of ``workers`` threads, never on the event loop. At
most ``max_pending`` readings wait or run at once, server-wide; past that
``ResourceExhausted`` (retryable). A reading that takes longer than ``timeout_s`` ends with
``RequestTimeout``. A caller that is cancelled leaves the line at once; a reading already
running finishes in its thread (a Tesseract process cannot be stopped halfway through a
page cleanly), and its worker place is only given back then, so the bound holds for the
real work.

Nothing here knows a wire protocol: ``/ws/chat`` uses it, and so can any other front end.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rill.errors import ConfigError, InvalidRequest, RequestTimeout, RillError
from rill.frontend.workers import PoolCounters, WorkerPool

if TYPE_CHECKING:
    from rill.config import SpeechConfig

log = logging.getLogger("rill.frontend.ocr")

MIN_CONFIDENCE = 50.0
"""Words Tesseract is less confident of (0..100) are dropped: on a photo with no text it
otherwise 'reads' stray marks as short words."""


@dataclass(frozen=True)
class ImageText:
    """What a reader found in one image: ``text`` (lines joined with newlines, empty when no
    text was read), the image's ``width`` and ``height``, and the seconds the reading took."""

    text: str
    width: int
    height: int
    seconds: float = 0.0


class ImageReader(Protocol):
    """An OCR engine taking a Pillow image."""

    name: str

    def read(self, image: Any, timeout_s: float) -> str:
        """The text in ``image`` (empty when none). Blocking: call it from a worker thread.

        Raises:
            RequestTimeout: reading took longer than ``timeout_s``.
            RillError: the engine failed.
        """
        ...


class TesseractReader:
    """Tesseract (the Debian ``tesseract-ocr`` binary) through pytesseract.

    Args:
        language: Tesseract's language code(s), e.g. ``eng`` or ``eng+deu``.
    """

    name = "tesseract"

    def __init__(self, language: str = "eng") -> None:
        self.language = language

    def read(self, image: Any, timeout_s: float) -> str:
        """See ``ImageReader.read``: words at least ``MIN_CONFIDENCE`` confident, in reading order."""
        import pytesseract

        gray = image.convert("L")
        try:
            data = pytesseract.image_to_data(
                gray, lang=self.language, output_type=pytesseract.Output.DICT, timeout=timeout_s
            )
        except RuntimeError as exc:  # pytesseract's only signal of its timeout
            if "timeout" in str(exc).lower():
                raise RequestTimeout(f"reading the image's text took longer than {timeout_s:g} s") from exc
            raise RillError(f"the OCR engine failed: {exc}") from exc
        except pytesseract.TesseractError as exc:
            raise RillError(f"the OCR engine failed: {exc.message}") from exc
        return _lines(data)


def _lines(data: dict[str, list[Any]]) -> str:
    """Confident words of Tesseract's word table, grouped into its lines, in order."""
    lines: dict[tuple[int, int, int, int], list[str]] = {}
    for i, word in enumerate(data["text"]):
        word = str(word).strip()
        if not word or float(data["conf"][i]) < MIN_CONFIDENCE:
            continue
        key = (data["page_num"][i], data["block_num"][i], data["par_num"][i], data["line_num"][i])
        lines.setdefault(key, []).append(word)
    return "\n".join(" ".join(words) for _, words in sorted(lines.items()))


@dataclass
class OcrCounters(PoolCounters):
    """What tests and metrics read: the pool's counts (running, waiting, cancelled, busy
    seconds) and the finished readings."""

    num_read_total: int = 0


class OcrService:
    """The server's OCR: a bounded pool of worker threads around a reader.

    Args:
        reader: what reads (``TesseractReader`` in a server; tests may give doubles).
        workers: readings running at once.
        max_pending: readings waiting or running at once, server-wide (past it: ``ResourceExhausted``).
        max_pixels: the largest image one call takes, in pixels (past it: ``InvalidRequest``).
        timeout_s: the longest one reading may take (past it: ``RequestTimeout``).
    """

    def __init__(
        self,
        reader: ImageReader,
        *,
        workers: int = 1,
        max_pending: int = 16,
        max_pixels: int = 16_000_000,
        timeout_s: float = 30.0,
    ) -> None:
        self.reader = reader
        self.max_pixels = max_pixels
        self.timeout_s = timeout_s
        self.counters = OcrCounters()
        self.pool = WorkerPool(
            name="rill-ocr",
            workers=workers,
            max_pending=max_pending,
            busy="OCR is busy",
            what="images",
            setting="--ocr-max-queue",
            counters=self.counters,
        )
        self._counters_lock = threading.Lock()

    @property
    def num_pending(self) -> int:
        """Readings waiting for a worker or running (what ``max_pending`` bounds)."""
        return self.pool.num_pending

    def check(self, width: int, height: int, where: str = "image") -> None:
        """Refuse an image too large to read, before any work starts.

        Raises:
            InvalidRequest: more than ``max_pixels`` pixels, or an empty image (``where`` names it).
        """
        if width <= 0 or height <= 0:
            raise InvalidRequest(f"{where}: the image has no pixels", field=where)
        if width * height > self.max_pixels:
            raise InvalidRequest(
                f"{where}: {width}x{height} is more pixels than text is read from "
                f"({self.max_pixels}, --ocr-max-pixels)",
                field=where,
            )

    async def read(self, image: Any, *, where: str = "image") -> ImageText:
        """The text in ``image`` (a Pillow image).

        Raises:
            InvalidRequest: the image is too large (see ``check``).
            ResourceExhausted: ``max_pending`` readings are already waiting or running.
            RequestTimeout: the reading took longer than ``timeout_s``.
        """
        width, height = image.size
        self.check(width, height, where)
        try:
            return await self.pool.run(self._work, image)
        except RequestTimeout as exc:
            raise RequestTimeout(f"{where}: {exc}") from exc

    def _work(self, image: Any) -> ImageText:
        started = time.perf_counter()
        text = self.reader.read(image, self.timeout_s)
        with self._counters_lock:  # workers may be several threads
            self.counters.num_read_total += 1
        return ImageText(text.strip(), image.width, image.height, time.perf_counter() - started)

    def shutdown(self) -> None:
        """Stop the worker threads (a reading already running finishes; nothing waits)."""
        self.pool.shutdown()


OCR_CHOICES = ("auto", "tesseract", "off")
"""Values of ``--ocr``."""


def tesseract_installed() -> bool:
    """Whether the ``tesseract`` binary and pytesseract are both there."""
    if shutil.which("tesseract") is None:
        return False
    try:
        import pytesseract  # noqa: F401
    except ImportError:
        return False
    return True


def make_ocr(config: SpeechConfig) -> OcrService | None:
    """The server's ``OcrService`` for ``config`` (``--ocr`` and the ``--ocr-*`` bounds), or None
    when OCR is off (``off``, or ``auto`` without the tesseract binary).

    Raises:
        ConfigError: ``--ocr tesseract`` but the binary or pytesseract is missing.
    """
    if config.ocr == "off" or (config.ocr == "auto" and not tesseract_installed()):
        return None
    if not tesseract_installed():
        raise ConfigError(
            "--ocr tesseract needs the tesseract binary (Debian: apt-get install tesseract-ocr "
            "tesseract-ocr-eng) and pytesseract (installed with rill), or --ocr off"
        )
    return OcrService(
        TesseractReader(config.ocr_language),
        workers=config.ocr_workers,
        max_pending=config.ocr_max_queue,
        max_pixels=config.ocr_max_pixels,
        timeout_s=config.ocr_timeout_s,
    )
