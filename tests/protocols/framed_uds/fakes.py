"""A small scripted ``EngineClient`` for adapter tests that need no model.

Requests wait in a queue ordered by (priority, arrival); at most ``max_num_seqs`` run; each
engine "step" gives every running request one token (``tok{n}``, id ``100 + n``). The step
loop is driven by the event loop (``step_s`` per step), like the real engine thread's cadence.
KV use is tracked per running request so tests can check that aborts free it.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rill.errors import ContextLengthExceeded, GenerationError
from rill.frontend.stream import RequestStream
from rill.types import EngineStats, GenerateRequest, ModelInfo, RequestOutput, SamplingParams

KV_BYTES_PER_TOKEN = 1024


@dataclass
class _Req:
    request: GenerateRequest
    stream: RequestStream
    arrival: int
    num_prompt_tokens: int
    num_generated: int = 0
    is_aborted: bool = False
    first_token_step: int | None = None


@dataclass
class FakeEngineClient:
    """Scripted engine: see the module docstring. ``fail_at`` makes a request fail after N tokens."""

    max_num_seqs: int = 4
    step_s: float = 0.002
    max_context_tokens: int = 64
    max_tokens_cap: int | None = None  # what InprocClient.set_max_tokens_cap does, for this fake
    fail_prompt: str = "FAIL"
    model_info: ModelInfo | None = None
    waiting: list[_Req] = field(default_factory=list)
    running: list[_Req] = field(default_factory=list)
    requests: list[GenerateRequest] = field(default_factory=list)
    stats_: EngineStats = field(default_factory=EngineStats)
    steps: int = 0
    first_token_order: list[str] = field(default_factory=list)
    _ids: Any = field(default_factory=lambda: itertools.count())
    _task: asyncio.Task | None = None
    _wake: asyncio.Event | None = None

    def is_ready(self) -> bool:
        return True

    def load_progress(self) -> tuple[float, float | None]:
        return 100.0, None

    async def wait_ready(self) -> None:
        return None

    async def generate(self, request: GenerateRequest) -> RequestStream:
        num_prompt_tokens = len((request.prompt or "").split())
        if num_prompt_tokens > self.max_context_tokens:
            raise ContextLengthExceeded(num_prompt_tokens, self.max_context_tokens)
        if self.max_tokens_cap is not None and request.sampling.max_tokens > self.max_tokens_cap:
            request.sampling = msgspec.structs.replace(request.sampling, max_tokens=self.max_tokens_cap)
        self.requests.append(request)
        request_id = request.request_id or f"fake-{next(self._ids)}"
        stream = RequestStream(self, request_id, list(range(num_prompt_tokens)), request.sampling)
        self.waiting.append(_Req(request, stream, len(self.requests), num_prompt_tokens))
        self._ensure_loop()
        return stream

    def abort(self, request_id: str) -> None:
        for req in self.waiting + self.running:
            if req.stream.request_id == request_id:
                req.is_aborted = True
        self._ensure_loop()

    def stats(self) -> EngineStats:
        used = sum((r.num_prompt_tokens + r.num_generated) * KV_BYTES_PER_TOKEN for r in self.running)
        self.stats_.num_running = len(self.running)
        self.stats_.num_waiting = len(self.waiting)
        self.stats_.kv_used_bytes = used
        return self.stats_

    def pause(self, request_id: str) -> None:  # pragma: no cover - not used by this protocol
        raise NotImplementedError

    resume = regenerate = pause

    def modify(self, request_id: str, patch: dict[str, Any]) -> SamplingParams:  # pragma: no cover
        raise NotImplementedError

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(len(text.split())))

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(f"tok{t}" for t in token_ids)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        raise NotImplementedError  # pragma: no cover

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # -- the scripted engine loop ------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while self.waiting or self.running:
            self._step()
            await asyncio.sleep(self.step_s)

    def _step(self) -> None:
        self.steps += 1
        for req in [r for r in self.waiting if r.is_aborted]:
            self.waiting.remove(req)
            self._finish(req, "cancelled")
        self.waiting.sort(key=lambda r: (r.request.priority, r.arrival))
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        for req in list(self.running):
            if req.is_aborted:
                self._finish(req, "cancelled")
                continue
            if req.request.prompt == self.fail_prompt and req.num_generated == 2:
                self._finish(req, "error", GenerationError("decode failed"))
                continue
            n = req.num_generated
            req.num_generated += 1
            if req.first_token_step is None:
                req.first_token_step = self.steps
                self.first_token_order.append(req.request.prompt or "")
            self.stats_.generation_tokens_total += 1
            is_last = req.num_generated >= req.request.sampling.max_tokens
            out = RequestOutput(request_id=req.stream.request_id, text=f"tok{n} ", token_ids=[100 + n],
                                token_texts=[f"tok{n} "], finished=is_last, finish_reason="length" if is_last else None)
            if is_last:
                self.running.remove(req)
            req.stream.put(out)
        self.stats_.num_steps_total += 1
        self.stats_.last_batch_size = len(self.running)

    def _finish(self, req: _Req, reason: str, error: Any = None) -> None:
        if req in self.running:
            self.running.remove(req)
        req.stream.put(RequestOutput(request_id=req.stream.request_id, finished=True, finish_reason=reason,
                                     error=error))  # type: ignore[arg-type]
