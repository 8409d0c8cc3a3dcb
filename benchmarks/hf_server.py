"""The transformers floor: a minimal OpenAI-compatible server around ``model.generate``.

    python benchmarks/hf_server.py --model DIR --port 8100 [--dtype bfloat16] [--threads 2]

What users get from "just call transformers": one ``generate`` at a time (requests wait
for a lock, in arrival order), streamed token by token. Serves ``GET /v1/models``,
``GET /health`` and ``POST /v1/completions`` with ``stream`` (SSE chunks, one per token,
``stream_options.include_usage``), ``max_tokens``, ``temperature`` (0 = greedy) and
``ignore_eos`` (as ``min_new_tokens``). Only for ``benchmarks/compare.py``: no auth, no
validation beyond what the benchmark sends, binds 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class _QueueStreamer:
    """A transformers streamer that hands each new token id to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue
        self._skip_prompt = True  # generate() first puts the prompt ids

    def put(self, value: Any) -> None:
        if self._skip_prompt:
            self._skip_prompt = False
            return
        for token_id in value.reshape(-1).tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token_id)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def build_app(model_dir: str, dtype: str) -> Any:
    """The Starlette app serving ``model_dir`` with transformers."""
    import torch
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    name = os.path.basename(os.path.normpath(model_dir))
    lock = asyncio.Lock()  # sequential: one generate at a time, FIFO

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "transformers"}]})

    async def health(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def completions(request: Request) -> Any:
        body = await request.json()
        ids = tokenizer(body["prompt"], return_tensors="pt").input_ids
        max_tokens = int(body.get("max_tokens") or 16)
        temperature = float(body.get("temperature", 1.0))
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_tokens,
            "do_sample": temperature > 0,
            "pad_token_id": tokenizer.pad_token_id or tokenizer.eos_token_id or 0,
        }
        if temperature > 0:
            kwargs["temperature"] = temperature
        if body.get("ignore_eos"):
            kwargs["min_new_tokens"] = max_tokens
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        completion_id = f"cmpl-{uuid.uuid4().hex[:16]}"

        async def tokens() -> AsyncIterator[int]:
            async with lock:
                loop = asyncio.get_running_loop()
                queue: asyncio.Queue = asyncio.Queue()
                streamer = _QueueStreamer(loop, queue)

                def work() -> None:
                    try:
                        with torch.inference_mode():
                            model.generate(ids, attention_mask=torch.ones_like(ids), streamer=streamer, **kwargs)
                    finally:
                        streamer.end()

                thread = threading.Thread(target=work, daemon=True)
                thread.start()
                while (token_id := await queue.get()) is not None:
                    yield token_id
                await asyncio.to_thread(thread.join)

        def chunk(text: str, finish: str | None) -> str:
            return (
                "data: "
                + json.dumps(
                    {
                        "id": completion_id,
                        "object": "text_completion",
                        "created": int(time.time()),
                        "model": name,
                        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
                    }
                )
                + "\n\n"
            )

        async def stream() -> AsyncIterator[str]:
            generated: list[int] = []
            shown = ""
            async for token_id in tokens():
                generated.append(token_id)
                text = tokenizer.decode(generated, skip_special_tokens=True)
                delta, shown = text[len(shown) :], text
                yield chunk(delta, None)  # one chunk per token (empty while a character is incomplete)
            yield chunk("", "length" if len(generated) >= max_tokens else "stop")
            if include_usage:
                yield (
                    "data: "
                    + json.dumps(
                        {
                            "id": completion_id,
                            "object": "text_completion",
                            "choices": [],
                            "usage": {
                                "prompt_tokens": ids.shape[1],
                                "completion_tokens": len(generated),
                                "total_tokens": ids.shape[1] + len(generated),
                            },
                        }
                    )
                    + "\n\n"
                )
            yield "data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")
        generated = [t async for t in tokens()]
        return JSONResponse(
            {
                "id": completion_id,
                "object": "text_completion",
                "model": name,
                "choices": [
                    {
                        "index": 0,
                        "text": tokenizer.decode(generated, skip_special_tokens=True),
                        "finish_reason": "length",
                    }
                ],
                "usage": {"prompt_tokens": ids.shape[1], "completion_tokens": len(generated)},
            }
        )

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/health", health),
            Route("/v1/completions", completions, methods=["POST"]),
        ]
    )


def main() -> None:
    """Parse flags and serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch
    import uvicorn

    torch.set_num_threads(args.threads)
    uvicorn.run(build_app(args.model, args.dtype), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
