"""InprocClient: the engine in a dedicated thread of this process, behind ``EngineClient``.

The engine thread builds the engine with ``rill.engine.builder`` (so ``/health`` answers 503
with progress meanwhile), then loops: take commands from a thread-safe inbox (blocking only when idle), apply them,
run one step, and hand the step's outputs to the event loop in ONE
``call_soon_threadsafe`` hop. The event loop routes each output to its ``RequestStream``
and records per-request figures for metrics.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import msgspec

from rill.config import EngineConfig
from rill.engine.builder import Engine, build_engine
from rill.engine.request import (
    AbortCommand,
    AddCommand,
    ModifyCommand,
    PauseCommand,
    RegenerateCommand,
    Request,
    ResumeCommand,
)
from rill.errors import (
    EngineDead,
    InvalidRequest,
    MemoryPressure,
    ModelNotReady,
    QueueFull,
    RequestNotFound,
    RillError,
)
from rill.frontend.admission import Prompt, PromptAdmission
from rill.frontend.budget import MemoryBudget, malloc_trim
from rill.frontend.client import MetricsSink
from rill.frontend.grammars import GrammarAdmission
from rill.frontend.ratelimit import Account, RateLimiter, RateLimits
from rill.frontend.stream import RequestStream
from rill.types import EngineStats, GenerateRequest, ModelInfo, RequestEvent, RequestId, RequestOutput, SamplingParams

log = logging.getLogger("rill.client")
T = TypeVar("T")

QUEUE_POSITIONS_TTL_S = 0.25
"""How long ``InprocClient.queue_position`` reuses one pass over the queued requests."""

IDLE_TRIM_INTERVAL_S = 2.0
"""When the engine goes idle after steps, it returns the heap's free memory to the OS
(``malloc_trim``), at most once per this many seconds: a step's activations, logits and
prompt-logprob scratch are freed into the C heap, which keeps them unless trimmed."""

_STOP = object()
ANONYMOUS_PRINCIPAL = "anonymous"
"""The principal of requests that name none (in-process callers such as benchmarks)."""


@dataclass
class _Track:
    """Per-request timing the client keeps for metrics."""

    protocol: str
    arrival: float
    is_queued: bool = True
    scheduled_at: float | None = None
    last_token_at: float | None = None
    final_token_at: float | None = None
    """When the latest token came (kept across pauses, unlike ``last_token_at``)."""
    inter_token_s: list[float] = field(default_factory=list)
    num_generated: int = 0
    """Tokens generated so far (``usage``: counts a token whose text is still held back)."""


class InprocClient:
    """``EngineClient`` running ``EngineCore`` in one dedicated thread of this process."""

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.loop = loop
        self.model_info: ModelInfo | None = None
        self.engine: Engine | None = None
        self.load_error: BaseException | None = None
        self._progress = 0.0
        self._stage = ""
        self._load_started = time.monotonic()
        self._ready = asyncio.Event()
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[RequestId, RequestStream] = {}
        self._params: dict[RequestId, SamplingParams] = {}
        self._tracks: dict[RequestId, _Track] = {}
        self._num_queued = 0
        self._positions: dict[RequestId, int] = {}  # queue_position's last pass
        self._positions_at: float | None = None
        self._metrics: MetricsSink | None = None
        self._thread: threading.Thread | None = None
        self._build: Callable[[EngineConfig, Callable[[float, str], None]], Engine] = build_engine
        self._is_dead = False
        self._admission = PromptAdmission(max_prompt_chars=config.max_prompt_chars,
                                          num_threads=config.tokenizer_threads)
        self._max_tokens_cap: int | None = None
        self._limiter: RateLimiter | None = None
        self._accounts: dict[RequestId, Account] = {}
        self._grammars = GrammarAdmission(num_threads=config.grammar_threads)
        self._principals: dict[RequestId, str] = {}  # who each running request belongs to
        self._modify_turns: dict[RequestId, asyncio.Lock] = {}  # modifies of one request, in order
        self._memory: MemoryBudget | None = None

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    def start(cls, config: EngineConfig, engine: Engine | None = None,
              build: Callable[[EngineConfig, Callable[[float, str], None]], Engine] | None = None) -> InprocClient:
        """Create the client on the running loop and start the engine thread (which builds the
        engine with ``build``, default ``build_engine``, unless a ready ``engine`` is given)."""
        client = cls(config, asyncio.get_running_loop())
        client._build = build or build_engine
        client._thread = threading.Thread(target=client._thread_main, args=(engine,), name="rill-engine", daemon=True)
        client._thread.start()
        return client

    def set_metrics_sink(self, sink: MetricsSink) -> None:
        """Receive per-request figures when requests end."""
        self._metrics = sink

    def set_max_tokens_cap(self, cap: int | None) -> None:
        """Clamp every request's ``max_tokens`` to ``cap`` (``--max-tokens-cap``), on every
        protocol alike, at submission and on ``modify``; the stream's ``sampling`` and
        ``modify``'s answer carry the clamped value."""
        self._max_tokens_cap = cap

    def set_memory_budget(self, budget: MemoryBudget | None) -> None:
        """Charge every stream's unread output to ``budget`` under the request's principal
        (``RequestStream``): a client that does not read piles up at most its share."""
        self._memory = budget

    def set_rate_limits(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        """Apply ``limits`` per principal to every request from now on, on every protocol alike
        (``rill.frontend.ratelimit``); ``clock`` is for tests."""
        self._limiter = RateLimiter(limits, clock) if limits.is_on else None

    def is_ready(self) -> bool:
        """True once the model is loaded and the engine runs."""
        return self.engine is not None and not self._is_dead

    def load_progress(self) -> tuple[float, float | None]:
        """Loading progress in percent and a rough ETA in seconds."""
        if self.is_ready():
            return 100.0, 0.0
        elapsed = time.monotonic() - self._load_started
        pct = self._progress
        eta = elapsed * (100.0 - pct) / pct if pct > 1.0 else None
        return pct, eta

    async def wait_ready(self) -> None:
        """Return once the model is loaded; raise ``EngineDead`` if loading failed."""
        await self._ready.wait()
        if self.engine is None:
            raise EngineDead("the model failed to load")

    async def shutdown(self) -> None:
        """Cancel every request and stop the engine thread."""
        for request_id in list(self._streams):
            self.abort(request_id)
        self._inbox.put(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        self._admission.close()
        self._grammars.close()

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> RequestStream:
        """Tokenize (off the event loop), validate and submit; see ``EngineClient.generate``."""
        engine = self._require_engine()
        # Prefill-only (max_tokens 0) is the engine's to do; each protocol decides whether it offers it.
        params = self._capped(request.sampling).validate(vocab_size=engine.model_info.vocab_size,
                                                         allow_prefill_only=True)
        principal = request.principal or ANONYMOUS_PRINCIPAL
        [prompt_ids] = await self._admission.token_ids(engine.tokenizer, [request], engine.model_info)
        engine = self._require_engine()  # the engine may have died while the prompt was tokenized
        # A new constraint compiles in milliseconds (more for huge schemas): in the grammar pool
        # (``rill.frontend.grammars``), and before the checks below, so that nothing changes
        # between them and the submit.
        matcher = None
        if params.constraint:
            if self._limiter is not None:
                # The limits would refuse it at the end: refuse it before its compile costs anything.
                self._limiter.check(principal, params.max_tokens)
            matcher = await self._grammars.matcher(engine.grammars, params.constraint, principal)
            engine = self._require_engine()
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", field="prompt")
        limit = self.config.max_prompt_logprobs_tokens
        if params.prompt_logprobs is not None and len(prompt_ids) > limit:
            # Every scored position costs a forward and logits over the vocabulary that the
            # prefix cache cannot serve: bounded per request, on every protocol alike.
            raise InvalidRequest(f"prompt logprobs are computed for prompts of at most {limit} tokens "
                                 f"(--max-prompt-logprobs-tokens); this prompt has {len(prompt_ids)}",
                                 field="prompt_logprobs")
        if params.num_beams > engine.runner.num_rows:
            raise MemoryPressure(f"num_beams={params.num_beams} needs more KV rows than the cache has ({engine.runner.num_rows})")
        if self._num_queued >= self.config.max_queue:
            raise QueueFull(f"the waiting queue is full ({self.config.max_queue} requests); retry later", retry_after_s=1.0)
        request_id = request.request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._streams:
            raise InvalidRequest(f"request_id '{request_id}' is already running", field="request_id")
        # Last of the checks, so that a request refused for another reason counts for nothing.
        if self._limiter is not None:
            self._accounts[request_id] = self._limiter.open(principal, params.max_tokens)
        now = time.monotonic()
        deadline = now + request.deadline_s if request.deadline_s else None
        engine_request = Request(
            request_id=request_id, prompt_ids=prompt_ids, params=params, eos_token_ids=engine.eos_token_ids,
            arrival_time=now, seq_no=0, priority=request.priority, protocol=request.protocol, deadline=deadline,
            require_cached_prefix_tokens=request.require_cached_prefix_tokens,
            matcher=matcher,
        )
        lease = self._memory.lease(principal) if self._memory is not None else None
        stream = RequestStream(self, request_id, prompt_ids, params, on_close=self._forget, lease=lease)
        self._streams[request_id] = stream
        self._params[request_id] = params
        self._principals[request_id] = principal
        self._tracks[request_id] = _Track(protocol=request.protocol, arrival=now)
        self._num_queued += 1
        self._inbox.put(AddCommand(engine_request))
        return stream

    async def tokenize(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Token ids of each prompt, by the same admission step as ``generate``."""
        engine = self._require_engine()
        return await self._admission.token_ids(engine.tokenizer, prompts, engine.model_info)

    async def tokenize_prompt(self, prompt: Prompt, add_special_tokens: bool) -> list[int]:
        """Token ids of one prompt for counting (``/tokenize``); see ``PromptAdmission.tokenize``."""
        engine = self._require_engine()
        return await self._admission.tokenize(engine.tokenizer, prompt, engine.model_info,
                                              add_special_tokens=add_special_tokens)

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (``/detokenize``), decoded off the event loop, size-bounded."""
        engine = self._require_engine()
        return await self._admission.detokenize(engine.tokenizer, token_ids, engine.model_info,
                                                skip_special_tokens=skip_special_tokens)

    def require_model(self) -> ModelInfo:
        """The served model's facts, or the error a request must get now.

        Raises:
            ModelNotReady: the model is still loading (retry later).
            EngineDead: the model failed to load, or the engine has stopped (it never will be ready).
        """
        return self._require_engine().model_info

    def _require_engine(self) -> Engine:
        if self._is_dead:
            raise EngineDead("the engine has stopped; the server needs a restart")
        if self.engine is None:
            if self.load_error is not None:
                raise EngineDead("the model failed to load; see the server log")
            raise ModelNotReady("the model is still loading; retry later")
        return self.engine

    # -- controls ----------------------------------------------------------------------------
    def _live(self, request_id: RequestId) -> RequestStream:
        stream = self._streams.get(request_id)
        if stream is None or stream.is_finished:
            raise RequestNotFound(f"no running request '{request_id}'")
        return stream

    def abort(self, request_id: RequestId) -> None:
        """Cancel a request; no-op when it already finished."""
        if request_id in self._streams:
            self._inbox.put(AbortCommand(request_id))

    def pause(self, request_id: RequestId) -> None:
        """Pause a running request."""
        self._live(request_id)
        self._inbox.put(PauseCommand(request_id))

    def resume(self, request_id: RequestId) -> None:
        """Resume a paused request."""
        self._live(request_id)
        self._inbox.put(ResumeCommand(request_id))

    async def modify(self, request_id: RequestId, patch: dict[str, Any]) -> SamplingParams:
        """Validate ``patch`` against the current parameters and apply it from the next token.

        Modifies of one request are applied one after the other, in the order they were
        called, each patching what the previous one left. A new ``response_format`` is compiled
        as a new request's is (``rill.frontend.grammars``: in the grammar pool, one compile per
        principal at a time) and, one not compiled before, counts as one request in the
        principal's rate-limit window (refused with ``RateLimited`` before compiling when the
        window is full; counted even if the patch is refused after). ``RequestNotFound`` if the
        request ended before its patch could be applied.
        """
        stream = self._live(request_id)
        turn = self._modify_turns.get(request_id)
        if turn is None:
            turn = self._modify_turns[request_id] = asyncio.Lock()
        async with turn:
            return await self._modify(stream, patch)

    def _same(self, stream: RequestStream) -> None:
        """Raise ``RequestNotFound`` unless ``stream``'s request still runs (not ended, nor
        replaced by a new request under the same id)."""
        if self._live(stream.request_id) is not stream:
            raise RequestNotFound(f"no running request '{stream.request_id}'")

    async def _modify(self, stream: RequestStream, patch: dict[str, Any]) -> SamplingParams:
        request_id = stream.request_id
        self._same(stream)  # again: it may have ended while an earlier modify compiled
        engine = self._require_engine()
        old = self._params[request_id]
        params = self._capped(old.updated(patch))
        params.validate(vocab_size=engine.model_info.vocab_size)
        matcher = None
        if params.constraint is not None and (old.constraint is None
                                              or old.constraint.cache_key() != params.constraint.cache_key()):
            principal = self._principals.get(request_id, ANONYMOUS_PRINCIPAL)
            if self._limiter is not None and not engine.grammars.is_cached(params.constraint):
                self._limiter.count_work(principal)
            matcher = await self._grammars.matcher(engine.grammars, params.constraint, principal)
            self._same(stream)  # the request may have ended while its grammar compiled
            engine = self._require_engine()
        account = self._accounts.get(request_id)
        if account is not None:
            account.set_max_tokens(params.max_tokens)  # last of the checks: a refused modify changes nothing more
        self._params[request_id] = params
        self._inbox.put(ModifyCommand(request_id, params, matcher))
        return params

    async def run_compile(self, principal: str | None, work: Callable[[], T]) -> T:
        """``work()`` run as grammar compiles are: in the grammar pool, after ``principal``'s
        earlier compile (``rill.frontend.grammars``); for a protocol's per-request CPU work of
        that kind, such as building JSON Schema validators."""
        return await self._grammars.run(principal or ANONYMOUS_PRINCIPAL, work)

    def _capped(self, params: SamplingParams) -> SamplingParams:
        cap = self._max_tokens_cap
        if cap is None or params.max_tokens <= cap:
            return params
        return msgspec.structs.replace(params, max_tokens=cap, min_tokens=min(params.min_tokens, cap))

    def regenerate(self, request_id: RequestId) -> None:
        """Restart a request from its prompt.

        Under a token rate limit the tokens it discards stay spent: the new attempt first
        reserves as many again (``RateLimited`` if the principal's bucket lacks them)."""
        self._live(request_id)
        account = self._accounts.get(request_id)
        if account is not None:
            account.restart()
        self._inbox.put(RegenerateCommand(request_id))

    def _forget(self, request_id: RequestId) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.is_finished:
            self._streams.pop(request_id, None)

    # -- tokenizer ---------------------------------------------------------------------------
    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` (on the loop: callers pass a token or a few, never a prompt)."""
        return cast(str, self._require_engine().tokenizer.decode(token_ids))

    async def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                          **kwargs: Any) -> str:
        """The prompt the chat template makes of ``messages`` (rendered off the event loop)."""
        return await self._admission.render_chat(self._require_engine().tokenizer, messages,
                                                 add_generation_prompt=add_generation_prompt, chat_template_kwargs=kwargs)

    def queue_position(self, request_id: RequestId) -> tuple[int, int] | None:
        """``(position, num_waiting)``: the request's 1-based place among the submitted requests
        the engine has not scheduled yet (in arrival order), and how many those are; None once
        it runs, ends, or is unknown.

        Positions are computed in one pass for every request and reused for
        ``QUEUE_POSITIONS_TTL_S``, so many waiting clients asking cost one pass, not one each.
        """
        track = self._tracks.get(request_id)
        if track is None or not track.is_queued:
            return None
        now = time.monotonic()
        is_stale = self._positions_at is None or now - self._positions_at > QUEUE_POSITIONS_TTL_S
        if is_stale or request_id not in self._positions:
            queued = [rid for rid, track in self._tracks.items() if track.is_queued]
            self._positions = {rid: index + 1 for index, rid in enumerate(queued)}
            self._positions_at = now
        return self._positions[request_id], len(self._positions)

    def stats(self) -> EngineStats:
        """Engine gauges and counters (a consistent snapshot taken without stopping the engine)."""
        if self.engine is None:
            return EngineStats(num_waiting=self._num_queued)
        return self.engine.core.stats()

    # -- engine thread -----------------------------------------------------------------------
    def _thread_main(self, engine: Engine | None) -> None:
        try:
            if engine is None:
                engine = self._build(self.config, self._set_progress)
        except BaseException as exc:  # reported by /health and generate(); `rill serve` then exits
            if isinstance(exc, RillError):
                log.error("model failed to load: %s", exc)  # a user's mistake: no traceback
            else:
                log.exception("model failed to load")
            self.load_error = exc
            self.loop.call_soon_threadsafe(self._ready.set)
            return
        self.model_info = engine.model_info
        self.engine = engine
        self.loop.call_soon_threadsafe(self._ready.set)
        try:
            self._loop(engine)
        except BaseException:
            log.exception("engine loop crashed")
            self._is_dead = True
            self.loop.call_soon_threadsafe(self._fail_all)

    def _set_progress(self, pct: float, stage: str) -> None:
        if int(pct) != int(self._progress) or stage != self._stage:
            log.info("loading: %.0f%% %s", pct, stage)
        self._progress = pct
        self._stage = stage

    def _loop(self, engine: Engine) -> None:
        core = engine.core
        inbox = self._inbox
        trim = malloc_trim()
        last_trim = -IDLE_TRIM_INTERVAL_S
        has_stepped = False  # since the last trim
        while True:
            if not core.has_work():
                wait_s = None
                if trim is not None and has_stepped:
                    now = time.monotonic()
                    wait_s = last_trim + IDLE_TRIM_INTERVAL_S - now
                    if wait_s <= 0:
                        # Idle: nobody waits for a step, so give the heap's free memory back now.
                        trim()
                        last_trim, has_stepped, wait_s = now, False, None
                try:
                    command = inbox.get(timeout=wait_s)
                except queue.Empty:
                    continue  # the trim is due now
                if command is _STOP:
                    return
                core.apply(command)
            while True:
                try:
                    command = inbox.get_nowait()
                except queue.Empty:
                    break
                if command is _STOP:
                    return
                core.apply(command)
            outputs = core.step()
            has_stepped = True
            if outputs:
                self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Route one step's outputs to their streams (runs on the event loop)."""
        now = time.monotonic()
        for output in outputs:
            track = self._tracks.get(output.request_id)
            if track is not None:
                self._track(track, output, now)
            account = self._accounts.get(output.request_id)
            if account is not None:
                account.observe(output.usage.completion_tokens, RequestEvent.REGENERATING in output.events)
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
            if output.finished:
                # The stream keeps the final output for its reader; controls now raise RequestNotFound.
                self._params.pop(output.request_id, None)
                self._principals.pop(output.request_id, None)
                self._modify_turns.pop(output.request_id, None)  # a modify still holding it then finds no request
                self._streams.pop(output.request_id, None)
                self._release(output.request_id, output.usage.completion_tokens)

    def _release(self, request_id: RequestId, num_used: int) -> None:
        """Settle an ended request's rate-limit account: ``num_used`` tokens in its last
        attempt, plus those of the attempts it regenerated."""
        account = self._accounts.pop(request_id, None)
        if account is not None:
            account.settle(num_used)

    def _track(self, track: _Track, output: RequestOutput, now: float) -> None:
        if track.is_queued and (RequestEvent.SCHEDULED in output.events or output.finished):
            track.is_queued = False
            self._num_queued -= 1
            if RequestEvent.SCHEDULED in output.events:
                # The engine's own time: by the time the loop sees the event, a short prompt's
                # prefill has run already.
                track.scheduled_at = output.scheduled_time if output.scheduled_time is not None else now
        if RequestEvent.REGENERATING in output.events:
            track.num_generated = 0  # usage counts the new run only
        num_new = output.usage.completion_tokens - track.num_generated
        track.num_generated = output.usage.completion_tokens
        if num_new > 0 and output.last_token_time is not None:
            if track.last_token_at is not None:
                gap = (output.last_token_time - track.last_token_at) / num_new
                track.inter_token_s.extend([gap] * num_new)
            track.last_token_at = track.final_token_at = output.last_token_time
        if RequestEvent.REGENERATING in output.events or RequestEvent.PAUSED in output.events:
            track.last_token_at = None  # a pause or restart is not inter-token latency
        if output.finished:
            self._tracks.pop(output.request_id, None)
            if self._metrics is not None:
                first, scheduled, final = output.first_token_time, track.scheduled_at, track.final_token_at
                try:
                    self._metrics.observe_request(
                        protocol=track.protocol,
                        finish_reason=output.finish_reason or "error",
                        queue_s=(track.scheduled_at - track.arrival) if track.scheduled_at else None,
                        ttft_s=(output.first_token_time - track.arrival) if output.first_token_time else None,
                        inter_token_s=track.inter_token_s,
                        e2e_s=now - track.arrival,
                        num_prompt_tokens=output.usage.prompt_tokens,
                        num_generated_tokens=output.usage.completion_tokens,
                        prefill_s=(first - scheduled) if first and scheduled else None,
                        decode_s=(final - first) if first and final else None,
                    )
                except Exception:  # metrics must never break a stream
                    log.exception("metrics sink failed")

    def _fail_all(self) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put(RequestOutput(request_id=request_id, finished=True, finish_reason="error",
                                     error=EngineDead("the engine stopped")))
        self._streams.clear()
        self._principals.clear()
        self._modify_turns.clear()
        for account in self._accounts.values():
            account.settle()  # what the engine made before it stopped stays spent
        self._accounts.clear()

