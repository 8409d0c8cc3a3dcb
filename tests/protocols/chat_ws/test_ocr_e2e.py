"""/ws/chat reading text in images, end to end: the tiny test model behind a real server with
Tesseract on (``--ocr tesseract``). What was read reaches the client before the first token
and the model's prompt in the image's place: the chat with the image has exactly the prompt
tokens of the same chat written out with the read text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.conftest import LiveServer, start_server
from tests.frontend.test_ocr import char_error_rate, needs_tesseract

from .media_samples import image_b64, text_image

pytestmark = needs_tesseract

TIMEOUT_S = 120
SIGN = ["PLATFORM 9", "Trains to Edinburgh"]


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> LiveServer:
    """The tiny model, OCR on, no speech."""
    server = start_server(tiny_model_dir, **{"engine.num_threads": 1, "speech.asr": "off", "speech.ocr": "tesseract"})
    yield server
    server.stop()


def conversation(live: LiveServer, content: Any) -> list[dict[str, Any]]:
    """Every message of one greedy chat whose user message is ``content``."""
    body = {
        "messages": [{"role": "user", "content": content}],
        "generation": {"max_new_tokens": 4, "do_sample": False},
        "tts": {"enabled": False},
    }
    messages: list[dict[str, Any]] = []
    with connect(f"{live.ws_url}/ws/chat", max_size=None, open_timeout=TIMEOUT_S) as ws:
        ws.send(json.dumps(body))
        try:
            while True:
                messages.append(json.loads(ws.recv(timeout=TIMEOUT_S)))
        except ConnectionClosed:
            return messages


def test_text_read_in_an_image_reaches_the_prompt(live: LiveServer) -> None:
    question = {"type": "text", "text": "Where does this train go?"}
    messages = conversation(live, [question, {"type": "image", "data": image_b64(text_image(SIGN))}])
    kinds = [m["type"] for m in messages]
    assert kinds[0] == "image_text" and kinds[-1] == "done", kinds
    assert kinds.index("image_text") < kinds.index("queue_done") < kinds.index("prefill_done")
    read = messages[0]
    assert char_error_rate("\n".join(SIGN), read["text"]) <= 0.05, read["text"]
    written_out = conversation(live, f"{question['text']}\n{read['prompt_text']}")
    assert messages[-1]["input_tokens"] == written_out[-1]["input_tokens"]
    assert messages[-1]["text"] == written_out[-1]["text"]  # greedy: the same prompt, the same reply
