"""InprocClient: the engine in a dedicated thread of this process, behind ``EngineClient``.

The engine thread builds the engine with ``rill.engine.builder`` (so ``/health`` answers 503
with progress meanwhile), then loops (``rill.frontend.engine_loop``): take commands from a
thread-safe inbox (blocking only when idle), apply them, run one step, and hand the step's
outputs to the event loop in ONE ``call_soon_threadsafe`` hop. The event loop routes each
output to its ``RequestStream`` and records per-request figures for metrics
(``rill.frontend.timings``).

What gets in, and with which parameters, is the client's ``SubmissionPolicy``'s to decide
(``rill.frontend.policy``); the client keeps the bookkeeping: streams, timings, accounts.
A running request's parameters live in one place on this side of the engine: its
``RequestStream.sampling``, which only the client writes (at submission and on ``modify``).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Self, cast

from rill.config import EngineConfig, served_model_name
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
from rill.errors import EngineDead, ModelNotReady, RequestNotFound, RillError
from rill.frontend.admission import Prompt
from rill.frontend.budget import malloc_trim
from rill.frontend.client import EngineState, MetricsSink, ModelLoadFailed, Submission
from rill.frontend.engine_loop import STOP, run
from rill.frontend.policy import Choice, SubmissionPolicy
from rill.frontend.ratelimit import Account
from rill.frontend.stream import RequestStream
from rill.frontend.timings import RequestTracks
from rill.types import EngineStats, GenerateRequest, ModelInfo, RequestEvent, RequestId, RequestOutput, SamplingParams

log = logging.getLogger("rill.client")

_READY = EngineState(phase="ready")


class InprocClient:
    """``EngineClient`` running ``EngineCore`` in one dedicated thread of this process.

    Args:
        config: the engine's settings.
        loop: the event loop the client serves.
        policy: what admits requests (default: ``SubmissionPolicy`` with no cap, no limits).
        metrics: receives each finished request's figures (None: none kept).
    """

    def __init__(
        self,
        config: EngineConfig,
        loop: asyncio.AbstractEventLoop,
        policy: SubmissionPolicy | None = None,
        metrics: MetricsSink | None = None,
    ) -> None:
        self.config = config
        self.loop = loop
        self.policy = policy or SubmissionPolicy(engine=config)
        self.metrics = metrics
        self.model_info: ModelInfo | None = None
        self.engine: Engine | None = None
        self.load_error: BaseException | None = None
        """Why the model failed to load (the engine is then dead); None while loading or loaded."""
        self._progress = 0.0
        self._stage = ""
        self._load_started = time.monotonic()
        self._ready = asyncio.Event()
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[RequestId, RequestStream] = {}
        self._tracks = RequestTracks()
        self._thread: threading.Thread | None = None
        self._build: Callable[[EngineConfig, Callable[[float, str], None]], Engine] = build_engine
        self._is_dead = False
        self._is_shut_down = False
        self._accounts: dict[RequestId, Account] = {}
        self._principals: dict[RequestId, str] = {}  # who each running request belongs to
        self._modify_turns: dict[RequestId, asyncio.Lock] = {}  # modifies of one request, in order

    # -- lifecycle -------------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        config: EngineConfig,
        *,
        policy: SubmissionPolicy | None = None,
        metrics: MetricsSink | None = None,
        engine: Engine | None = None,
        build: Callable[[EngineConfig, Callable[[float, str], None]], Engine] | None = None,
    ) -> Self:
        """Create the client on the running loop with its ``policy`` and ``metrics`` sink and
        start the engine thread (which builds the engine with ``build``, default
        ``build_engine``, unless a ready ``engine`` is given)."""
        client = cls(config, asyncio.get_running_loop(), policy, metrics)
        client._build = build or build_engine
        client._thread = threading.Thread(target=client._thread_main, args=(engine,), name="rill-engine", daemon=True)
        client._thread.start()
        return client

    @property
    def served_model_name(self) -> str:
        """The model's name for clients and metrics (``rill.config.served_model_name``)."""
        return served_model_name(self.config, self.model_info)

    def state(self) -> EngineState:
        """The engine's phase, and the error a request gets in it; see ``EngineState``."""
        if self._is_dead or self._is_shut_down:
            return EngineState(phase="stopped", error=EngineDead("the engine has stopped; the server needs a restart"))
        if self.engine is not None:
            return _READY
        if self.load_error is not None:
            failed = ModelLoadFailed("the model failed to load; see the server log")
            failed.__cause__ = self.load_error  # for the server's log and exit status, never a client
            return EngineState(phase="failed", error=failed)
        progress, eta_s = self.load_progress()
        return EngineState(
            phase="loading",
            progress=progress,
            eta_s=eta_s,
            error=ModelNotReady("the model is still loading; retry later"),
        )

    def is_ready(self) -> bool:
        """True once the model is loaded and the engine runs (``state().phase == "ready"``)."""
        return self.state() is _READY

    def load_progress(self) -> tuple[float, float | None]:
        """Loading progress in percent and a rough ETA in seconds (100 and 0 once loaded)."""
        if self.engine is not None:
            return 100.0, 0.0
        elapsed = time.monotonic() - self._load_started
        pct = self._progress
        eta = elapsed * (100.0 - pct) / pct if pct > 1.0 else None
        return pct, eta

    async def wait_ready(self) -> None:
        """Return once the model is loaded; raise ``state().error`` if it failed to load or the
        engine has stopped."""
        await self._ready.wait()
        self._require_engine()

    async def shutdown(self) -> None:
        """Cancel every request and stop the engine thread."""
        for request_id in list(self._streams):
            self.abort(request_id)
        self._inbox.put(STOP)
        self._is_shut_down = True
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        self.policy.close()

    def require_model(self) -> ModelInfo:
        """The served model's facts, or raise ``state().error``: ``ModelNotReady`` while the
        model loads (retry later), ``ModelLoadFailed`` or ``EngineDead`` once it never will be
        ready (a failed load, a stopped engine)."""
        return self._require_engine().model_info

    def _require_engine(self) -> Engine:
        state = self.state()
        if state.error is not None:
            raise state.error
        assert self.engine is not None  # ready
        return self.engine

    # -- requests ----------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> RequestStream:
        """Admit one request through the policy and start it; see ``EngineClient.generate``."""
        choice = await self.policy.plan_one(request, self._require_engine)
        return await self.start_choice(choice)

    async def submit(self, submission: Submission) -> list[RequestStream]:
        """Admit the choices of one request and start them, all or none; see ``EngineClient.submit``."""
        choices = await self.policy.plan(submission, self._require_engine)
        streams: list[RequestStream] = []
        try:
            for choice in choices:
                streams.append(await self.start_choice(choice))
        except BaseException:
            for stream in streams:
                await stream.aclose()  # a refused choice leaves nothing of its request behind
            raise
        return streams

    async def start_choice(self, choice: Choice) -> RequestStream:
        """Compile the choice's grammar, make its last checks and put it in the engine (a choice
        the policy planned: here, or in the server process of a cluster for its replica)."""
        # A new constraint compiles in milliseconds (more for huge schemas): in the grammar pool,
        # and before the checks below, so that nothing changes between them and the submit.
        matcher = await self.policy.matcher(choice, self._require_engine)
        engine = self._require_engine()
        stream, now = await self._open(choice, engine)
        engine_request = Request(
            request_id=choice.request_id,
            prompt_ids=choice.prompt_ids,
            params=choice.params,
            eos_token_ids=engine.eos_token_ids,
            arrival_time=now,
            seq_no=0,
            priority=choice.priority,
            protocol=choice.protocol,
            deadline=now + choice.deadline_s if choice.deadline_s else None,
            require_cached_prefix_tokens=choice.require_cached_prefix_tokens,
            matcher=matcher,
        )
        self._inbox.put(AddCommand(engine_request))
        return stream

    async def _open(self, choice: Choice, engine: Engine) -> tuple[RequestStream, float]:
        """The policy's last checks of ``choice``, then its stream, track and rate-limit account:
        the bookkeeping of a request this side of the engine. Returns the stream and its arrival.

        The stream is listed before the rate limits are asked (the last check), so that no
        other request takes its id meanwhile: a cluster's limits answer from another process."""
        request_id = choice.request_id
        self.policy.admit(choice, engine, self._tracks.num_queued, self._streams.__contains__)
        now = time.monotonic()
        memory = self.policy.memory
        lease = memory.lease(choice.principal) if memory is not None else None
        stream = RequestStream(self, request_id, choice.prompt_ids, choice.params, on_close=self._forget, lease=lease)
        self._streams[request_id] = stream
        self._principals[request_id] = choice.principal
        self._tracks.open(request_id, choice.protocol, now)
        try:
            account = await self.policy.open_account(choice)
        except BaseException:
            await self._withdraw(stream)
            raise
        if account is not None:
            self._accounts[request_id] = account
        return stream, now

    async def _withdraw(self, stream: RequestStream) -> None:
        """Undo ``_open`` for a request the engine never took, and close its stream."""
        self._unopen(stream.request_id)
        await stream.aclose()

    def _unopen(self, request_id: RequestId) -> None:
        """Undo ``_open`` for a request the engine never took: its stream, track and principal
        are forgotten and its rate-limit account settles at nothing spent."""
        self._streams.pop(request_id, None)
        self._principals.pop(request_id, None)
        self._tracks.drop(request_id)
        self._release(request_id, 0)

    async def tokenize(self, prompts: Sequence[Prompt]) -> list[list[int]]:
        """Token ids of each prompt, by the same admission step as ``generate``."""
        engine = self._require_engine()
        return await self.policy.admission.token_ids(engine.tokenizer, prompts, engine.model_info)

    async def tokenize_prompt(self, prompt: Prompt, add_special_tokens: bool) -> list[int]:
        """Token ids of one prompt for counting (``/tokenize``); see ``PromptAdmission.tokenize``."""
        engine = self._require_engine()
        return await self.policy.admission.tokenize(
            engine.tokenizer, prompt, engine.model_info, add_special_tokens=add_special_tokens
        )

    async def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (``/detokenize``), decoded off the event loop, size-bounded."""
        engine = self._require_engine()
        return await self.policy.admission.detokenize(
            engine.tokenizer, token_ids, engine.model_info, skip_special_tokens=skip_special_tokens
        )

    # -- controls ----------------------------------------------------------------------------
    def running(self, request_id: RequestId) -> RequestStream:
        """The stream of a request that runs; ``RequestNotFound`` if it is unknown or ended."""
        return self._live(request_id)

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
        """Patch the request's parameters through the policy and apply them from the next token.

        Modifies of one request are applied one after the other, in the order they were
        called, each patching what the previous one left. A new ``response_format`` is compiled
        as a new request's is (``SubmissionPolicy.new_matcher``). ``RequestNotFound`` if the
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
        self._same(stream)  # again: it may have ended while an earlier modify compiled
        params = self.policy.modified(stream.sampling, patch, self._require_engine().model_info.vocab_size)
        await self.set_sampling(stream, params)
        return params

    async def set_sampling(self, stream: RequestStream, params: SamplingParams) -> None:
        """Put the validated ``params`` in force for ``stream``'s request from its next token:
        a new constraint compiled first, then the rate-limit account's last check. Raises
        ``RequestNotFound`` if the request ended meanwhile, ``RateLimited`` (and nothing
        changes) as ``modify``."""
        request_id = stream.request_id
        principal = self._principals[request_id]
        matcher = await self.policy.new_matcher(stream.sampling, params, principal, self._require_engine)
        self._same(stream)  # the request may have ended while its grammar compiled
        account = self._accounts.get(request_id)
        if account is not None:
            await account.set_max_tokens(params.max_tokens)  # last of the checks: a refused modify changes nothing more
            self._same(stream)  # (a cluster's limits answer from another process)
        stream.sampling = params
        self._inbox.put(ModifyCommand(request_id, params, matcher))

    async def regenerate(self, request_id: RequestId) -> None:
        """Restart a request from its prompt.

        Under a token rate limit the tokens it discards stay spent: the new attempt first
        reserves as many again (``RateLimited`` if the principal's bucket lacks them)."""
        await self._restart_account(request_id)
        self._inbox.put(RegenerateCommand(request_id))

    async def _restart_account(self, request_id: RequestId) -> None:
        """Check that ``request_id`` runs, and have its rate-limit account (if any) reserve a
        new attempt's tokens (``RateLimited`` if its principal's bucket lacks them)."""
        self._live(request_id)
        account = self._accounts.get(request_id)
        if account is not None:
            await account.restart()
            self._live(request_id)  # (a cluster's limits answer from another process)

    def _forget(self, request_id: RequestId) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and stream.is_finished:
            self._streams.pop(request_id, None)

    # -- tokenizer ---------------------------------------------------------------------------
    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` (on the loop: callers pass a token or a few, never a prompt)."""
        return cast(str, self._require_engine().tokenizer.decode(token_ids))

    async def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt the chat template makes of ``messages`` (rendered off the event loop)."""
        return await self.policy.admission.render_chat(
            self._require_engine().tokenizer,
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=kwargs,
        )

    def queue_position(self, request_id: RequestId) -> tuple[int, int] | None:
        """``(position, num_waiting)``: the request's 1-based place among the submitted requests
        the engine has not scheduled yet (in arrival order), and how many those are; None once
        it runs, ends, or is unknown (``RequestTracks.queue_position``)."""
        return self._tracks.queue_position(request_id, time.monotonic())

    def stats(self) -> EngineStats:
        """Engine gauges and counters (a consistent snapshot taken without stopping the engine)."""
        if self.engine is None:
            return EngineStats(num_waiting=self._tracks.num_queued)
        return self.engine.core.stats()

    def replica_stats(self) -> dict[str, EngineStats]:
        """Per-replica gauges: none, the one engine is in this process (``stats``)."""
        return {}

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
            run(engine.core, self._inbox, self._hand_over, malloc_trim())
        except BaseException:
            log.exception("engine loop crashed")
            self._is_dead = True
            self.loop.call_soon_threadsafe(self._fail_all)

    def _set_progress(self, pct: float, stage: str) -> None:
        if int(pct) != int(self._progress) or stage != self._stage:
            log.info("loading: %.0f%% %s", pct, stage)
        self._progress = pct
        self._stage = stage

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs to the event loop, in one hop (runs on the engine thread)."""
        self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Route one step's outputs to their streams (runs on the event loop)."""
        now = time.monotonic()
        for output in outputs:
            self._tracks.observe(output, now, self.metrics)
            account = self._accounts.get(output.request_id)
            if account is not None:
                account.observe(output.usage.completion_tokens, RequestEvent.REGENERATING in output.events)
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put(output)
            if output.finished:
                # The stream keeps the final output for its reader; controls now raise RequestNotFound.
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

    def _fail_all(self) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.put(
                RequestOutput(
                    request_id=request_id, finished=True, finish_reason="error", error=EngineDead("the engine stopped")
                )
            )
        self._streams.clear()
        self._principals.clear()
        self._modify_turns.clear()
        for account in self._accounts.values():
            account.settle()  # what the engine made before it stopped stays spent
        self._accounts.clear()
