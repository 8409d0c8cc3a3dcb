"""A small scripted ``EngineClient`` for the adapter tests (no model, no engine thread).

Each request produces token ``i`` as text ``" w{i}"`` (id ``100 + i``, or a different id per
temperature so a ``modify`` is visible); one token per loop turn (``asyncio.sleep(0)``), so
tests never depend on wall-clock time. Controls behave like the engine's: events
PAUSED / RESUMED / MODIFIED / REGENERATING, ``cancelled`` on abort.
Prompts starting with a keyword trigger errors: ``mem:`` (MemoryPressure), ``fail:`` (a
GenerationError after 3 tokens), ``boom:`` (an unexpected RuntimeError from generate),
``limited:`` (RateLimited, as the admission step's rate limit refuses, retry in 2.5 s).
"""

from __future__ import annotations

import asyncio
from typing import Any

from rill.errors import ContextLengthExceeded, GenerationError, MemoryPressure, RateLimited, RequestNotFound
from rill.frontend.stream import RequestStream
from rill.types import (
    EngineStats,
    GenerateRequest,
    ModelInfo,
    RequestEvent,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
    TopLogprob,
    Usage,
)

MAX_CONTEXT = 64


class _Req:
    def __init__(self, request: GenerateRequest, stream: RequestStream) -> None:
        self.request = request
        self.stream = stream
        self.sampling = request.sampling
        self.num_generated = 0
        self.is_paused = False
        self.is_aborted = False
        self.events: list[RequestEvent] = []
        self.wake = asyncio.Event()


class FakeClient:
    """Scripted engine client; ``ready`` gates ``is_ready`` to test model loading."""

    load_error: BaseException | None = None  # EngineClient: set when the model failed to load

    def __init__(self, is_ready: bool = True, step_delay_s: float = 0.0) -> None:
        self.model_info = ModelInfo(name="fake-model", architecture="FakeForCausalLM", max_context_tokens=MAX_CONTEXT,
                                    vocab_size=1000, dtype="float32", device="cpu")
        self.ready = asyncio.Event()
        if is_ready:
            self.ready.set()
        self.progress = 0.0
        self.step_delay_s = step_delay_s
        self.live: dict[str, _Req] = {}
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.gate: asyncio.Event | None = None  # when set: one token per gate.set()

    def is_ready(self) -> bool:
        return self.ready.is_set()

    def load_progress(self) -> tuple[float, float | None]:
        return self.progress, 1.5

    async def wait_ready(self) -> None:
        await self.ready.wait()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in token_ids)

    async def generate(self, request: GenerateRequest) -> RequestStream:
        prompt = request.prompt or ""
        if prompt.startswith("boom:"):
            raise RuntimeError("secret internal detail /etc/passwd")
        if prompt.startswith("mem:"):
            raise MemoryPressure("the request can never fit in the KV cache budget")
        if prompt.startswith("limited:"):
            raise RateLimited("rate limit reached: 10 requests per 60 s; retry in 2.50 s", retry_after_s=2.5)
        ids = self.encode(prompt)
        if len(ids) > MAX_CONTEXT:
            raise ContextLengthExceeded(len(ids), MAX_CONTEXT)
        self.requests.append(request)
        stream = RequestStream(self, request.request_id or "r", ids, request.sampling,
                               on_close=lambda rid: self.live.pop(rid, None))
        req = _Req(request, stream)
        self.live[stream.request_id] = req
        asyncio.get_running_loop().create_task(self._drive(req))
        return stream

    def _token(self, req: _Req, i: int) -> int:
        return 100 + i if req.sampling.temperature > 0 else 500 + i

    async def _drive(self, req: _Req) -> None:
        rid = req.stream.request_id
        while True:
            if self.gate is not None:
                await self.gate.wait()
                self.gate.clear()
            else:
                await asyncio.sleep(self.step_delay_s)
            while req.is_paused and not req.is_aborted and not req.events:
                req.wake.clear()
                await req.wake.wait()
            events, req.events = req.events, []
            if RequestEvent.REGENERATING in events:
                req.num_generated = 0
            usage = Usage(prompt_tokens=len(req.stream.prompt_token_ids), completion_tokens=req.num_generated)
            if req.is_aborted:
                req.stream.put(RequestOutput(request_id=rid, events=events, finished=True, finish_reason="cancelled",
                                             usage=usage))
                return
            if req.is_paused:
                req.stream.put(RequestOutput(request_id=rid, events=events, usage=usage))
                continue
            i = req.num_generated
            if (req.request.prompt or "").startswith("fail:") and i == 3:
                req.stream.put(RequestOutput(request_id=rid, events=events, finished=True, finish_reason="error",
                                             error=GenerationError("cuda kernel 0xdead failed"), usage=usage))
                return
            req.num_generated += 1
            usage = Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=req.num_generated)
            token_id = self._token(req, i)
            is_last = req.num_generated >= req.sampling.max_tokens
            logprobs = None
            if req.sampling.logprobs is not None:
                top = [TopLogprob(token_id, -0.5), TopLogprob(token_id + 1, -1.5)][: req.sampling.logprobs + 1]
                logprobs = [TokenLogprob(token_id=token_id, logprob=-0.5, top=top)]
            req.stream.put(RequestOutput(request_id=rid, text=f" w{i}", token_ids=[token_id], token_texts=[f" w{i}"],
                                         logprobs=logprobs, events=events, finished=is_last,
                                         finish_reason="length" if is_last else None, usage=usage))
            if is_last:
                self.live.pop(rid, None)
                return

    def _req(self, request_id: str) -> _Req:
        req = self.live.get(request_id)
        if req is None:
            raise RequestNotFound(f"no running request {request_id}")
        return req

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        req = self.live.get(request_id)
        if req is not None:
            req.is_aborted = True
            req.wake.set()

    def pause(self, request_id: str) -> None:
        req = self._req(request_id)
        req.is_paused = True
        req.events.append(RequestEvent.PAUSED)

    def resume(self, request_id: str) -> None:
        req = self._req(request_id)
        req.is_paused = False
        req.events.append(RequestEvent.RESUMED)
        req.wake.set()

    def modify(self, request_id: str, patch: dict[str, Any]) -> SamplingParams:
        req = self._req(request_id)
        req.sampling = req.sampling.updated(patch)
        req.events.append(RequestEvent.MODIFIED)
        req.wake.set()
        return req.sampling

    def regenerate(self, request_id: str) -> None:
        req = self._req(request_id)
        req.events.append(RequestEvent.REGENERATING)
        req.wake.set()

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        return ""

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.live))

    async def shutdown(self) -> None:
        for rid in list(self.live):
            self.abort(rid)
