"""EngineCore: one step = apply commands → schedule → model forward → sample → outputs.

A plain synchronous object: no threads, no asyncio, no protocol knowledge. The in-process
client drives it from one engine thread (``apply`` commands between steps, then ``step``).
Every command takes effect at the next token, because commands are only applied between
steps. Each request's ``OutputStage`` (detokenization, stop strings, held-back text) runs in
the step, so a stop string ends the request (and frees its row) in the very step that
produced it.

Speculative decoding (``rill.engine.speculative``): before the forward, a decoding request may
get draft tokens appended to its one-token feed; after it, ``_sample_verified`` samples depth
by depth and keeps a request going while its sampled token equals its draft.

Fault isolation: whatever is done for one request alone (applying its commands, sampler
setup, sampling, beam scoring, detokenizing, stop checks) runs under ``_isolated``; if it
raises, that request alone ends with ``GenerationError`` and its KV rows are freed, while every
other request of the step carries on exactly as it would have. Only a failure of what the
requests share (scheduling, the model forward) fails the whole step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from rill.engine.batch import ModelRunner, RowWork
from rill.engine.kv_cache import KVManager
from rill.engine.output import OutputStage
from rill.engine.request import (
    AbortCommand,
    AddCommand,
    Command,
    ModifyCommand,
    PauseCommand,
    RegenerateCommand,
    Request,
    RequestStatus,
    ResumeCommand,
)
from rill.engine.sampler import Sampler
from rill.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from rill.engine.speculative import SpeculativeConfig, Speculator, step_cost
from rill.errors import ConstraintFailed, GenerationError, RequestTimeout
from rill.types import EngineStats, FinishReason, RequestEvent, RequestOutput, TokenLogprob, Usage

if TYPE_CHECKING:
    from rill.engine.threads import ThreadGovernor

log = logging.getLogger("rill.engine")

# A step that also prefills a chunk should cost at most about two decode steps (so running
# streams' inter-token latency at most doubles while a long prompt is prefilled).
ITL_TARGET_HIGH = 1.8
ITL_TARGET_LOW = 1.4

# A prefill chunk of a request asking prompt logprobs returns the logits of every position;
# its length is capped so that they hold at most this many floats (64 MiB).
PROMPT_LOGITS_BUDGET = 2**24


@dataclass(frozen=True)
class CoreConfig:
    """Scheduling limits of one engine."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    min_prefill_chunk_tokens: int = 4
    min_reuse_tokens: int = 8  # shorter shared prefixes (a BOS, a common first word) are not worth a copy
    max_cached_tokens: int | None = None  # tokens finished sequences keep for prefix reuse (None: no bound)
    speculative: SpeculativeConfig = SpeculativeConfig()


class EngineCore:
    """The engine: requests in, ``RequestOutput`` deltas out, one ``step()`` at a time.

    ``thread_governor``, when given, runs every forward inside its ``step()``: asked before
    whether to change the runner's thread count, told when it ended (``rill.engine.threads``); it sets
    the count through the runner's own setter (``torch.set_num_threads``,
    ``LlamaCppRunner.set_num_threads``).
    """

    def __init__(self, runner: ModelRunner, tokenizer: Any, config: CoreConfig = CoreConfig(),
                 clock: Callable[[], float] = time.monotonic,
                 thread_governor: ThreadGovernor | None = None, draft_runner: ModelRunner | None = None) -> None:
        self.runner = runner
        self.thread_governor = thread_governor
        self.tokenizer = tokenizer
        self.config = config
        self.clock = clock
        self.max_len = runner.max_len
        self.kv = KVManager(runner.num_rows, runner.max_len, runner.kv_bytes_per_token, min_reuse_tokens=config.min_reuse_tokens,
                            pack_rows=runner.packs_rows, discard=runner.discard,
                            max_cached_tokens=config.max_cached_tokens)
        self.scheduler = Scheduler(self.kv, runner.copy_row, min(config.max_num_seqs, runner.num_rows), config.max_num_batched_tokens)
        self.scheduler.prefill_chunk_tokens = min(128, config.max_num_batched_tokens)
        self.scheduler.max_logits_chunk_tokens = max(16, PROMPT_LOGITS_BUDGET // max(1, runner.vocab_size))
        num_keys = runner.num_rows + 2 * config.max_num_seqs
        self.sampler = Sampler(runner.vocab_size, num_keys, device=runner.device)
        self.requests: dict[str, Request] = {}
        self.touched: dict[str, Request] = {}
        self.deadlines: dict[str, Request] = {}
        self.speculator = (Speculator(config.speculative, draft_runner, runner.vocab_size)
                           if config.speculative.enabled else None)
        self.stats_counters = EngineStats()
        self._decode_step_s: float | None = None
        self._seq_no = 0

    # -- commands ---------------------------------------------------------------------------
    def apply(self, command: Command) -> None:
        """Apply one command (the client calls this between steps).

        A command that raises fails only the request it names (never the engine loop).
        """
        handler = self._handlers[type(command)]
        request: Request | None
        if isinstance(command, AddCommand):
            request = command.request
        else:
            request = self.requests.get(command.request_id)
        if request is None:
            handler(self, command)
        else:
            self._isolated(request, f"applying {type(command).__name__}", handler, self, command)

    def _add(self, cmd: AddCommand) -> None:
        request = cmd.request
        self._seq_no += 1
        request.seq_no = self._seq_no
        self.requests[request.request_id] = request
        if request.deadline is not None:
            self.deadlines[request.request_id] = request
        request.output = OutputStage(self.tokenizer, request.prompt_ids, request.params.stop)
        if request.params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first token has no context to be predicted from
        request.pending_events.append(RequestEvent.QUEUED)
        self.touched[request.request_id] = request
        self.scheduler.enqueue(request)

    def _abort(self, cmd: AbortCommand) -> None:
        request = self.requests.get(cmd.request_id)
        if request is None or request.is_finished:
            return
        self._finish(request, "cancelled")

    def _pause(self, cmd: PauseCommand) -> None:
        request = self.requests.get(cmd.request_id)
        if request is None or request.is_finished:
            return
        if request.status is not RequestStatus.PAUSED:
            self.scheduler.pause(request)
        self._event(request, RequestEvent.PAUSED)

    def _resume(self, cmd: ResumeCommand) -> None:
        request = self.requests.get(cmd.request_id)
        if request is None or request.is_finished:
            return
        if request.status is RequestStatus.PAUSED:
            self.scheduler.resume(request)
        self._event(request, RequestEvent.RESUMED)

    def _modify(self, cmd: ModifyCommand) -> None:
        request = self.requests.get(cmd.request_id)
        if request is None or request.is_finished:
            return
        old_stop = request.params.stop
        if _constraint_key(cmd.params) != _constraint_key(request.params):
            request.matcher = cmd.matcher  # constrains what is generated from now on
        request.params = cmd.params
        if request.sampler_key is not None and not request.is_beam:
            self.sampler.update(request.sampler_key, cmd.params, matcher=request.matcher)
        if list(cmd.params.stop) != list(old_stop):
            assert request.output is not None  # set when the request was added
            request.output.set_stops(cmd.params.stop)
            self.touched[request.request_id] = request
        if request.beam is not None:
            request.beam.set_max_tokens(cmd.params.max_tokens)
        request.pending_modified.append(cmd.params)
        self._event(request, RequestEvent.MODIFIED)

    def _regenerate(self, cmd: RegenerateCommand) -> None:
        request = self.requests.get(cmd.request_id)
        if request is None or request.is_finished:
            return
        num_prompt = len(request.prompt_ids)
        if request.is_beam:
            self.scheduler.preempt(request)  # beam rows are dropped; the prompt's row stays cached
            request.num_beam_tokens_emitted = 0
        request.output_ids = []
        request.num_output_tokens_counted = 0
        request.cumulative_logprob = 0.0
        request.first_token_time = None
        assert request.output is not None  # set when the request was added
        request.output.reset(request.prompt_ids, request.params.stop)
        if request.sampler_key is not None:
            self.sampler.reset(request.sampler_key, request.prompt_ids)
        if request.speculation is not None and self.speculator is not None:
            self.speculator.rewind(request.speculation, num_prompt)
        if request.row is not None:
            reused = min(request.num_computed, num_prompt - 1)
            request.num_computed = reused
            self.kv.count_reuse(num_prompt, reused)
        if request.status is RequestStatus.PAUSED:
            self.scheduler.resume(request)
        self._event(request, RequestEvent.REGENERATING)

    _handlers: dict[type, Callable[[EngineCore, Any], None]] = {
        AddCommand: _add,
        AbortCommand: _abort,
        PauseCommand: _pause,
        ResumeCommand: _resume,
        ModifyCommand: _modify,
        RegenerateCommand: _regenerate,
    }

    # -- the step ---------------------------------------------------------------------------
    def has_work(self) -> bool:
        """True when a step would compute something or has outputs to deliver."""
        return self.scheduler.num_running > 0 or self.scheduler.num_waiting > 0 or bool(self.touched)

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the outputs it produced."""
        now = self.clock()
        self._check_deadlines(now)
        plan = self.scheduler.schedule()
        for request, error in plan.failed:
            self._isolated(request, "finishing", self._finish, request, "error", None, error)
        for request in plan.preempted:
            self.stats_counters.num_preemptions_total += 1
            self._event(request, RequestEvent.PREEMPTED)
        if not plan.is_empty:
            try:
                self._run(plan)
            except Exception:  # the shared part (the forward) failed: only then fail the whole step
                log.exception("engine step failed; failing the %d requests of the step", len(plan.scheduled))
                for item in plan.scheduled:
                    if not item.request.is_finished:
                        self._fail(item.request, "generating", self._rows_of(item.request),
                                   message="the engine step failed while generating")
        return self._collect_outputs()

    def _run(self, plan: SchedulerOutput) -> None:
        for item in plan.scheduled:
            self._isolated(item.request, "preparing to sample", self._on_scheduled, item.request)
        # A request that failed above is finished and its rows are freed: leave it out.
        scheduled = [item for item in plan.scheduled if not item.request.is_finished]
        if self.speculator is not None:
            self._add_drafts(scheduled, plan)
        work: list[RowWork] = [w for item in scheduled for w in item.work]
        if not work:
            return
        t0 = time.perf_counter()
        with self.thread_governor.step() if self.thread_governor is not None else nullcontext():
            logits = self.runner.forward(work)
        self._sample_and_advance(scheduled, logits)
        self._update_costs(plan, time.perf_counter() - t0)
        self.stats_counters.num_steps_total += 1
        self.stats_counters.last_batch_size = len(scheduled)

    def _on_scheduled(self, request: Request) -> None:
        if request.sampler_key is None and not request.is_beam:
            request.sampler_key = self.sampler.open(request.params, request.prompt_ids, set(request.eos_token_ids),
                                                    matcher=request.matcher)
            for token in request.output_ids:  # recompute after preemption keeps penalty history
                self.sampler.record(request.sampler_key, token)
        if not request.is_scheduled_once:
            request.is_scheduled_once = True
            request.scheduled_time = self.clock()
            self.stats_counters.prompt_tokens_total += len(request.prompt_ids)
            self._event(request, RequestEvent.SCHEDULED)

    def _add_drafts(self, scheduled: list[ScheduledRequest], plan: SchedulerOutput) -> None:
        """Append draft tokens to the feeds of decoding requests that speculate this step.

        Only a plain decode (one row, the request's last token, sampled after) speculates, and
        none does in a step with more decoding requests than ``max_batch``. A proposer that
        raises (a draft model's forward) turns speculation off for the rest of the engine's
        life, logged once; the step itself goes on without drafts.
        """
        speculator = self.speculator
        assert speculator is not None  # called only while speculation is on
        decoding = [item for item in scheduled if len(item.work) == 1 and len(item.work[0].token_ids) == 1
                    and item.work[0].need_logits and not item.work[0].all_logits]
        if len(decoding) > speculator.config.max_batch:
            return
        asking = [(item, limit) for item in decoding if (limit := self._draft_limit(item.request)) > 0]
        if not asking:
            return
        for item, _ in asking:
            if item.request.speculation is None:
                item.request.speculation = speculator.new_state()
        entries = [(item.request.speculation, item.request.row, item.request.num_tokens, item.request.token_at, limit)
                   for item, limit in asking]
        try:
            drafts = speculator.propose(entries, len(decoding))  # type: ignore[arg-type]  # scheduled: each has a row
        except Exception:
            log.exception("the speculative proposer failed; speculative decoding is off from now on")
            self.speculator = None
            return
        for (item, _), draft in zip(asking, drafts):
            if draft:
                work = item.work[0]
                item.work[0] = RowWork(work.row, work.token_ids + draft, work.start, need_logits=True, all_logits=True,
                                       draft=True)
                item.draft = draft
                plan.num_draft_tokens += len(draft)

    def _draft_limit(self, request: Request) -> int:
        """The most draft tokens ``request`` may have verified this step (0: none)."""
        params = request.params  # beams and prefill-only requests (max_tokens 0) never speculate
        assert self.speculator is not None  # called only while speculation is on
        if params.max_tokens == 0 or not self.speculator.wants(params, request.is_beam):
            return 0
        return min(params.speculative_tokens(self.speculator.config.num_tokens),
                   params.max_tokens - len(request.output_ids) - 1,  # the last token needs no draft
                   self.max_len - request.num_tokens)  # the fed tokens must fit in the row

    def _sample_and_advance(self, scheduled: list[ScheduledRequest], logits: torch.Tensor) -> None:
        sample_items: list[tuple[Request, int, list[int]]] = []  # (request, its first logits row, its draft)
        beam_items: list[tuple[Request, int, int]] = []
        prefilled: list[Request] = []
        index = 0
        for item in scheduled:
            request = item.request
            if request.beam is not None and request.beam.is_decoding:
                beam_items.append((request, index, len(item.work)))
                index += len(item.work)
                request.beam.computed()
                continue
            work = item.work[0]
            if item.draft:  # a speculative decode: only its fed token is known to be right yet
                request.num_computed += 1
                sample_items.append((request, index, item.draft))
                index += work.num_logits
                continue
            request.num_computed += len(work.token_ids)
            if work.all_logits:
                self._isolated(request, "computing prompt logprobs", self._on_prompt_logits, request, work.start,
                               logits[index : index + work.num_logits])
            index += work.num_logits
            if not work.need_logits or request.is_finished:
                continue
            last = index - 1
            if request.params.max_tokens == 0:
                prefilled.append(request)
            elif request.is_beam:
                beam_items.append((request, last, 1))
            else:
                sample_items.append((request, last, []))
        for request in prefilled:  # max_tokens 0: the prompt is computed, nothing is generated
            self._isolated(request, "finishing", self._finish_prefilled, request)
        now = self.clock()
        if sample_items:
            self._sample_verified(sample_items, logits, now)
        for request, start, count in beam_items:
            self._isolated(request, "beam search", self._beam_step, request, logits[start : start + count], now,
                           rows=self._rows_of(request))

    def _sample_verified(self, items: list[tuple[Request, int, list[int]]], logits: torch.Tensor, now: float) -> None:
        """Sample every request's next token; a speculating one goes on while it matches its draft.

        Depth ``j`` samples row ``first + j`` of each request still going, in one sampler call:
        the very draw a non-speculative step would make for that position (see
        ``rill.engine.speculative``). A request stops at its first token that differs from its
        draft (that token is still emitted), at the end of its draft (the token after it is
        emitted too), or when a token finishes it. A fed draft token's KV becomes part of the
        request (``num_computed``) only once the token was emitted.
        """
        depth = 0
        while items:
            reqs = [request for request, _, _ in items]
            rows = [first + depth for _, first, _ in items]
            block = logits if rows == list(range(logits.shape[0])) else logits[rows]
            try:
                result = self.sampler.sample(block, cast(list[int], [r.sampler_key for r in reqs]))  # sampled: keyed
            except Exception:  # not one row's fault (the sampler isolates those): fail the sampled rows
                log.exception("sampling failed for the whole batch")
                for request in reqs:
                    self._fail(request, "sampling")
                return
            going = []
            for i, (request, first, draft) in enumerate(items):
                if i in result.errors:
                    self._fail(request, "sampling", exc=result.errors[i])
                    continue
                token = result.token_ids[i]
                self._isolated(request, "processing its new token", self._on_token, request, token,
                               result.logprobs[i], now)
                matched = depth < len(draft) and token == draft[depth]
                if matched and not request.is_finished:
                    request.num_computed += 1
                    going.append((request, first, draft))
                elif draft and request.speculation is not None and self.speculator is not None:
                    self.speculator.observe(request.speculation, len(draft), depth + int(matched))
            items = going
            depth += 1

    def _on_prompt_logits(self, request: Request, start: int, logits: torch.Tensor) -> None:
        """Turn a chunk's logits (row ``i``: after position ``start + i``) into prompt logprobs."""
        done = request.prompt_logprobs
        if done is None:
            return
        prompt = request.prompt_ids
        first = start + 1  # the prompt token that row 0 predicts
        end = min(start + logits.shape[0] + 1, len(prompt))  # exclusive; the last row may predict past the prompt
        low = max(first, len(done))  # positions recomputed after a preemption are not scored twice
        if low >= end:
            return
        if len(done) < first:
            raise RuntimeError(f"prompt logprobs of positions {len(done)}..{first} were skipped")
        num_top = request.params.prompt_logprobs or 0
        done.extend(self.sampler.score(logits[low - first : end - first], prompt[low:end], num_top))

    def _finish_prefilled(self, request: Request) -> None:
        if request.is_finished:
            return
        self._mark_prefill_done(request)
        self._finish(request, "length")

    # -- per-token output stage ------------------------------------------------------------
    def _on_token(self, request: Request, token: int, logprob: Any, now: float) -> None:
        if request.is_finished:
            return
        self._mark_prefill_done(request)
        request.output_ids.append(token)
        request.num_output_tokens_counted += 1
        if logprob is not None:
            request.cumulative_logprob += logprob.logprob
        self.stats_counters.generation_tokens_total += 1
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        params = request.params
        if token in request.eos_token_ids and not params.ignore_eos:
            self._finish(request, "stop")
            return
        if token in params.stop_token_ids:
            self._finish(request, "stop", stop_reason=token)
            return
        assert request.output is not None  # set when the request was added
        matched = request.output.push(token, logprob if params.logprobs is not None else None)
        self.touched[request.request_id] = request
        if matched is not None:
            self._finish(request, "stop", stop_reason=matched, flush=False)
        elif request.sampler_key is not None and self.sampler.is_constraint_complete(request.sampler_key):
            self._finish(request, "stop")  # the grammar allows nothing more (only eos would follow)
        elif len(request.output_ids) >= params.max_tokens or request.num_tokens >= self.max_len:
            self._finish(request, "length")

    def _mark_prefill_done(self, request: Request) -> None:
        if not request.is_prefill_reported:
            request.is_prefill_reported = True
            self._event(request, RequestEvent.PREFILL_DONE)

    def _beam_step(self, request: Request, logits: torch.Tensor, now: float) -> None:
        group = request.beam
        if request.is_finished or group is None:
            return
        self._mark_prefill_done(request)
        if not group.is_decoding:
            assert request.row is not None  # a scheduled request holds a row
            group.start(request.row, request.prompt_ids, request.num_computed)
        result = group.step(logits, self.max_len)
        request.row = group.beams[0].row if group.beams else request.row
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        self.stats_counters.generation_tokens_total += 1
        self._emit_beam_tokens(request, result.agreed)
        if result.best is not None:
            request.output_ids = list(result.best)
            request.num_output_tokens_counted = len(result.best)
            reason: FinishReason = "stop" if result.best and result.best[-1] in group.eos_token_ids else "length"
            self._finish(request, reason)

    def _emit_beam_tokens(self, request: Request, tokens: list[int]) -> None:
        assert request.output is not None  # set when the request was added
        for token in tokens[request.num_beam_tokens_emitted :]:
            request.output.push(token, match_stops=False)
        request.num_beam_tokens_emitted = max(request.num_beam_tokens_emitted, len(tokens))
        self.touched[request.request_id] = request

    # -- fault isolation -----------------------------------------------------------------------
    def _isolated(self, request: Request, stage: str, fn: Callable[..., Any], *args: Any, rows: Iterable[int] = ()) -> None:
        """Call ``fn(*args)``; if it raises, fail ``request`` alone (``rows``: see ``_fail``)."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - any failure fails this request alone
            self._fail(request, stage, rows, exc=exc)

    def _rows_of(self, request: Request) -> list[int]:
        """Every KV row a beam request holds now (empty for other requests: ``_finish`` frees theirs).

        Taken before a beam step, because a step that fails half-way may have moved its beams
        to other rows of the same set.
        """
        if not request.is_beam:
            return []
        rows = set(request.beam.rows()) if request.beam is not None else set()
        if request.row is not None:
            rows.add(request.row)
        return sorted(rows)

    def _fail(self, request: Request, stage: str, rows: Iterable[int] = (), exc: BaseException | None = None,
              message: str | None = None) -> None:
        """End ``request`` with ``GenerationError`` after it raised while ``stage``; free its KV.

        ``rows`` (a beam request's, from ``_rows_of``) are dropped: their content may be half
        updated. The client gets the stage, never the exception text (that goes to the log).
        A ``ConstraintFailed`` (the request's grammar could not be followed) is the client's
        own problem: it ends the request as it is, and the log gets its bounded message on one
        line, no traceback (the grammar module keeps it short: no grammar text in it).
        """
        if isinstance(exc, ConstraintFailed):
            if not request.is_finished:
                log.warning("request %s: %s", request.request_id, exc.message)
                self._drop_rows(request, rows)
                self._finish(request, "error", error=exc, flush=False)
            return
        if exc is not None:
            log.error("request %s failed while %s; the other requests continue", request.request_id, stage, exc_info=exc)
        if request.is_finished:
            return
        self._drop_rows(request, rows)
        error = GenerationError(message or f"the request failed while {stage}; other requests are not affected")
        self._finish(request, "error", error=error, flush=False)

    def _drop_rows(self, request: Request, rows: Iterable[int]) -> None:
        rows = list(rows)
        if rows:
            for row in rows:
                if self.kv.is_live(row):
                    self.kv.drop(row)
            request.beam, request.row = None, None  # its rows are dropped above

    # -- finishing ----------------------------------------------------------------------------
    def _finish(self, request: Request, reason: FinishReason, stop_reason: Any = None, error: Any = None, flush: bool = True) -> None:
        if flush and request.output is not None:
            matched = request.output.flush()
            if matched is not None:
                reason, stop_reason = "stop", matched
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.error = error
        if request.status is not RequestStatus.FINISHED:
            self.scheduler.remove(request)
            self.scheduler.release(request)
        request.status = RequestStatus.FINISHED
        if request.sampler_key is not None:
            self.sampler.remove(request.sampler_key)
            request.sampler_key = None
        finished = self.stats_counters.requests_finished_total
        finished[reason] = finished.get(reason, 0) + 1
        self.touched[request.request_id] = request

    def _check_deadlines(self, now: float) -> None:
        for request in list(self.deadlines.values()):
            if request.is_finished:
                self.deadlines.pop(request.request_id, None)
            elif now >= cast(float, request.deadline):  # self.deadlines holds only requests with one
                self._isolated(request, "finishing", self._finish, request, "error", None,
                               RequestTimeout("the request reached its time limit"))

    def _event(self, request: Request, event: RequestEvent) -> None:
        request.pending_events.append(event)
        self.touched[request.request_id] = request

    def _take_prompt_logprobs(self, request: Request) -> list[TokenLogprob | None] | None:
        """The request's prompt logprobs the first time they are complete, else None."""
        if request.prompt_logprobs is None or request.is_prompt_logprobs_sent or request.needs_prompt_logits:
            return None
        request.is_prompt_logprobs_sent = True
        return request.prompt_logprobs

    def _collect_outputs(self) -> list[RequestOutput]:
        outputs = []
        for request in self.touched.values():
            finished = request.is_finished
            wants_logprobs = request.params.logprobs is not None
            # No stage: its AddCommand failed before making one.
            token_ids, token_texts, logprobs = request.output.take(finished) if request.output else ([], [], [])
            outputs.append(
                RequestOutput(
                    request_id=request.request_id,
                    text="".join(token_texts),
                    token_ids=token_ids,
                    token_texts=token_texts,
                    logprobs=[lp for lp in logprobs if lp is not None] if wants_logprobs else None,
                    prompt_logprobs=self._take_prompt_logprobs(request),
                    cumulative_logprob=request.cumulative_logprob if wants_logprobs else None,
                    events=request.pending_events,
                    modified=request.pending_modified,
                    finished=finished,
                    finish_reason=request.finish_reason if finished else None,
                    stop_reason=request.stop_reason if finished else None,
                    error=request.error if finished else None,
                    usage=Usage(prompt_tokens=len(request.prompt_ids), completion_tokens=request.num_output_tokens_counted,
                                cached_tokens=request.num_cached_prompt_tokens),
                    arrival_time=request.arrival_time,
                    scheduled_time=request.scheduled_time,
                    first_token_time=request.first_token_time,
                    last_token_time=request.last_token_time,
                )
            )
            request.pending_events = []
            request.pending_modified = []
            if finished:
                self.requests.pop(request.request_id, None)
        self.touched = {}
        return outputs

    # -- adaptive prefill chunk ------------------------------------------------------------------
    def _update_costs(self, plan: SchedulerOutput, elapsed_s: float) -> None:
        """Steer the prefill chunk cap so a step with a chunk costs about twice a decode step.

        A feedback loop rather than a cost model: a chunk also has a fixed cost (masks, its own
        attention call), so "decode time / per-token prefill time" measured on small chunks
        overstates the per-token cost and spirals the cap down. Instead the cap shrinks when a
        step with a chunk took more than ``ITL_TARGET_HIGH`` decode steps and grows while it
        took less than ``ITL_TARGET_LOW`` with the cap binding.
        """
        alpha = 0.2
        cap = self.scheduler.prefill_chunk_tokens
        if plan.num_prefill_tokens == 0 and plan.num_decode_tokens:
            plain_s = elapsed_s
            if plan.num_draft_tokens:  # a verification step: what a plain step would have cost
                plain_s = elapsed_s / step_cost(max(len(item.draft) for item in plan.scheduled))
            self._decode_step_s = plain_s if self._decode_step_s is None else (1 - alpha) * self._decode_step_s + alpha * plain_s
            if self.speculator is not None:
                self.speculator.target_step_s = self._decode_step_s
        elif plan.num_prefill_tokens and plan.num_decode_tokens and self._decode_step_s:
            ratio = elapsed_s / self._decode_step_s
            if ratio > ITL_TARGET_HIGH:
                cap = int(cap * 0.7)
            elif ratio < ITL_TARGET_LOW and plan.num_prefill_tokens >= 0.9 * cap:
                cap = int(cap * 1.3) + 1
            self.scheduler.prefill_chunk_tokens = max(self.config.min_prefill_chunk_tokens, min(cap, self.config.max_num_batched_tokens))
        s = self.stats_counters
        s.last_step_ms = elapsed_s * 1000
        s.step_ms_ewma = s.last_step_ms if s.step_ms_ewma == 0 else 0.9 * s.step_ms_ewma + 0.1 * s.last_step_ms

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of gauges and counters (cheap; called by /metrics)."""
        s = self.stats_counters
        bpt = self.kv.bytes_per_token
        used = self.kv.used_tokens()
        cached = self.kv.cached_tokens()
        capacity_tokens = self.kv.num_rows * self.kv.max_len
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_paused=self.scheduler.num_paused,
            kv_capacity_bytes=capacity_tokens * bpt,
            kv_used_bytes=used * bpt,
            kv_cached_bytes=cached * bpt,
            kv_capacity_tokens=capacity_tokens,
            kv_used_tokens=used,
            prefix_cache_queries_tokens=self.kv.num_query_tokens,
            prefix_cache_hits_tokens=self.kv.num_hit_tokens,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            num_steps_total=s.num_steps_total,
            num_preemptions_total=s.num_preemptions_total,
            last_batch_size=s.last_batch_size,
            last_step_ms=s.last_step_ms,
            step_ms_ewma=s.step_ms_ewma,
            requests_finished_total=dict(s.requests_finished_total),
            spec_draft_tokens_total=self.speculator.stats.draft_tokens_total if self.speculator else 0,
            spec_accepted_tokens_total=self.speculator.stats.accepted_tokens_total if self.speculator else 0,
        )


def _constraint_key(params: Any) -> str | None:
    constraint = params.constraint
    return None if constraint is None else constraint.cache_key()
