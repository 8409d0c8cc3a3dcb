"""Text in images: Debian's Tesseract through ``OcrService`` reads text rendered into an image
back (character error rate bound, not exact), reads nothing in an image without text, and
refuses an image over the pixel cap or a full queue before any reading starts."""

from __future__ import annotations

import asyncio
import shutil
import threading
from typing import Any

import pytest
from PIL import Image

from rill.errors import InvalidRequest, RequestTimeout, ResourceExhausted
from rill.frontend.ocr import OcrService, TesseractReader
from rill.protocols.chat_ws.session import image_prompt_text
from tests.protocols.chat_ws.media_samples import text_image

needs_tesseract = pytest.mark.skipif(shutil.which("tesseract") is None, reason="tesseract-ocr is not installed")

LINES = ["The meeting moved to Tuesday at 3 pm.", "Room 42, second floor."]


def char_error_rate(reference: str, hypothesis: str) -> float:
    """Levenshtein distance over characters, divided by the reference's length."""
    previous = list(range(len(hypothesis) + 1))
    for i, r in enumerate(reference, 1):
        current = [i]
        for j, h in enumerate(hypothesis, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1] / max(1, len(reference))


class GatedReader:
    """Test double: holds its worker thread until ``gate`` opens; counts readings."""

    name = "gated"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.calls = 0

    def read(self, image: Any, timeout_s: float) -> str:
        self.calls += 1
        self.started.set()
        self.gate.wait(30)
        return "gated"


@needs_tesseract
async def test_text_rendered_in_an_image_is_read_back() -> None:
    ocr = OcrService(TesseractReader())
    found = await ocr.read(text_image(LINES))
    assert char_error_rate("\n".join(LINES), found.text) <= 0.05, found.text
    assert found.text.count("\n") == 1  # one line of text per line written
    assert ocr.counters.num_read_total == 1 and ocr.num_pending == 0
    ocr.shutdown()


@needs_tesseract
async def test_an_image_without_text_reads_as_none() -> None:
    ocr = OcrService(TesseractReader())
    blank = await ocr.read(Image.new("RGB", (640, 480), (250, 250, 250)))
    assert blank.text == "" and (blank.width, blank.height) == (640, 480)
    assert image_prompt_text(blank.text) == "[An image with no readable text]"
    assert image_prompt_text(" Exit \n") == "[Text read from an image: Exit]"
    ocr.shutdown()


async def test_an_image_over_the_pixel_cap_is_refused_before_reading() -> None:
    reader = GatedReader()
    ocr = OcrService(reader, max_pixels=100_000)
    with pytest.raises(InvalidRequest, match=r"messages\[0\].content\[1\] \(image\): 400x300 is more pixels"):
        await ocr.read(Image.new("RGB", (400, 300)), where="messages[0].content[1] (image)")
    assert reader.calls == 0 and ocr.num_pending == 0
    ocr.shutdown()


async def test_a_full_queue_refuses_with_try_again_later() -> None:
    reader = GatedReader()
    ocr = OcrService(reader, workers=1, max_pending=1)
    first = asyncio.create_task(ocr.read(Image.new("RGB", (10, 10))))
    await asyncio.to_thread(reader.started.wait, 30)
    with pytest.raises(ResourceExhausted, match="OCR is busy") as refused:
        await ocr.read(Image.new("RGB", (10, 10)))
    assert refused.value.retryable
    reader.gate.set()
    assert (await first).text == "gated"
    assert reader.calls == 1 and ocr.num_pending == 0
    ocr.shutdown()


@needs_tesseract
async def test_a_reading_past_its_time_limit_fails_with_timeout() -> None:
    # A page Tesseract needs seconds for, against a limit shorter than starting its process.
    page = text_image([f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(20)], font_size=20)
    ocr = OcrService(TesseractReader(), timeout_s=0.001)
    with pytest.raises(RequestTimeout, match=r"page: reading the image's text took longer than 0.001 s"):
        await ocr.read(page, where="page")
    assert ocr.num_pending == 0 and ocr.counters.num_read_total == 0
    ocr.shutdown()
