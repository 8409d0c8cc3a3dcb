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
setup, sampling, beam scoring, detokenizing, stop checks) runs under the ledger's
``isolated`` (``rill.engine.lifecycle``); if it raises, that request alone ends with
``GenerationError`` and its KV rows are freed, while every other request of the step carries
on exactly as it would have. Only a failure of what the requests share (scheduling, the
model forward) fails the whole step.

Collaborators: ``RequestLedger`` (the live requests, their events, endings and outputs),
``PrefillChunkTuner`` (``rill.engine.chunking``: the adaptive prefill chunk), ``Speculator``
(which requests draft, and verification bookkeeping).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from rill.engine.batch import ModelRunner, RowWork
from rill.engine.chunking import PrefillChunkTuner
from rill.engine.kv_cache import KVManager
from rill.engine.lifecycle import RequestLedger
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
from rill.engine.speculative import SpeculativeConfig, Speculator
from rill.types import EngineStats, FinishReason, RequestEvent, RequestOutput

if TYPE_CHECKING:
    from rill.engine.threads import ThreadGovernor

log = logging.getLogger("rill.engine")

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

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        config: CoreConfig = CoreConfig(),
        clock: Callable[[], float] = time.monotonic,
        thread_governor: ThreadGovernor | None = None,
        draft_runner: ModelRunner | None = None,
    ) -> None:
        self.runner = runner
        self.thread_governor = thread_governor
        self.tokenizer = tokenizer
        self.config = config
        self.clock = clock
        self.max_len = runner.max_len
        self.kv = KVManager(
            runner.num_rows,
            runner.max_len,
            runner.kv_bytes_per_token,
            min_reuse_tokens=config.min_reuse_tokens,
            pack_rows=runner.packs_rows,
            discard=runner.discard,
            max_cached_tokens=config.max_cached_tokens,
        )
        self.scheduler = Scheduler(
            self.kv, runner.copy_row, min(config.max_num_seqs, runner.num_rows), config.max_num_batched_tokens
        )
        self.scheduler.prefill_chunk_tokens = min(128, config.max_num_batched_tokens)
        self.scheduler.max_logits_chunk_tokens = max(16, PROMPT_LOGITS_BUDGET // max(1, runner.vocab_size))
        num_keys = runner.num_rows + 2 * config.max_num_seqs
        self.sampler = Sampler(runner.vocab_size, num_keys, device=runner.device)
        self.speculator = (
            Speculator(config.speculative, draft_runner, runner.vocab_size) if config.speculative.enabled else None
        )
        self.stats_counters = EngineStats()
        self.ledger = RequestLedger(self.scheduler, self.sampler, self.kv, self.stats_counters)
        self.chunk_tuner = PrefillChunkTuner(config.min_prefill_chunk_tokens, config.max_num_batched_tokens)
        self._seq_no = 0

    @property
    def requests(self) -> dict[str, Request]:
        """The live requests by id (``RequestLedger.requests``)."""
        return self.ledger.requests

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
            request = self.ledger.requests.get(command.request_id)
        if request is None:
            handler(self, command)
        else:
            self.ledger.isolated(request, f"applying {type(command).__name__}", handler, self, command)

    def _add(self, cmd: AddCommand) -> None:
        request = cmd.request
        self._seq_no += 1
        request.seq_no = self._seq_no
        self.ledger.requests[request.request_id] = request
        if request.deadline is not None:
            self.ledger.deadlines[request.request_id] = request
        request.output = OutputStage(self.tokenizer, request.prompt_ids, request.params.stop)
        if request.params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first token has no context to be predicted from
        request.pending_events.append(RequestEvent.QUEUED)
        self.ledger.touched[request.request_id] = request
        self.scheduler.enqueue(request)

    def _abort(self, cmd: AbortCommand) -> None:
        request = self.ledger.requests.get(cmd.request_id)
        if request is None or request.is_finished:
            return
        self.ledger.finish(request, "cancelled")

    def _pause(self, cmd: PauseCommand) -> None:
        request = self.ledger.requests.get(cmd.request_id)
        if request is None or request.is_finished:
            return
        if request.status is not RequestStatus.PAUSED:
            self.scheduler.pause(request)
        self.ledger.event(request, RequestEvent.PAUSED)

    def _resume(self, cmd: ResumeCommand) -> None:
        request = self.ledger.requests.get(cmd.request_id)
        if request is None or request.is_finished:
            return
        if request.status is RequestStatus.PAUSED:
            self.scheduler.resume(request)
        self.ledger.event(request, RequestEvent.RESUMED)

    def _modify(self, cmd: ModifyCommand) -> None:
        request = self.ledger.requests.get(cmd.request_id)
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
            self.ledger.touched[request.request_id] = request
        if request.beam is not None:
            request.beam.set_max_tokens(cmd.params.max_tokens)
        request.pending_modified.append(cmd.params)
        self.ledger.event(request, RequestEvent.MODIFIED)

    def _regenerate(self, cmd: RegenerateCommand) -> None:
        request = self.ledger.requests.get(cmd.request_id)
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
        self.ledger.event(request, RequestEvent.REGENERATING)

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
        return self.scheduler.num_running > 0 or self.scheduler.num_waiting > 0 or bool(self.ledger.touched)

    def step(self) -> list[RequestOutput]:
        """Run one engine step and return the outputs it produced."""
        now = self.clock()
        self.ledger.check_deadlines(now)
        plan = self.scheduler.schedule()
        for request, error in plan.failed:
            self.ledger.isolated(request, "finishing", self.ledger.finish, request, "error", None, error)
        for request in plan.preempted:
            self.stats_counters.num_preemptions_total += 1
            self.ledger.event(request, RequestEvent.PREEMPTED)
        if not plan.is_empty:
            try:
                self._run(plan)
            except Exception:  # the shared part (the forward) failed: only then fail the whole step
                log.exception("engine step failed; failing the %d requests of the step", len(plan.scheduled))
                for item in plan.scheduled:
                    if not item.request.is_finished:
                        self.ledger.fail(
                            item.request,
                            "generating",
                            self.ledger.rows_of(item.request),
                            message="the engine step failed while generating",
                        )
        return self.ledger.take_outputs()

    def _run(self, plan: SchedulerOutput) -> None:
        for item in plan.scheduled:
            self.ledger.isolated(item.request, "preparing to sample", self._on_scheduled, item.request)
        # A request that failed above is finished and its rows are freed: leave it out.
        scheduled = [item for item in plan.scheduled if not item.request.is_finished]
        if self.speculator is not None:
            added = self.speculator.add_drafts(scheduled, self.max_len)
            if added is None:
                self.speculator = None  # its proposer failed: no more speculation, this step goes on without
            else:
                plan.num_draft_tokens += added
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
            request.sampler_key = self.sampler.open(
                request.params, request.prompt_ids, set(request.eos_token_ids), matcher=request.matcher
            )
            for token in request.output_ids:  # recompute after preemption keeps penalty history
                self.sampler.record(request.sampler_key, token)
        if not request.is_scheduled_once:
            request.is_scheduled_once = True
            request.scheduled_time = self.clock()
            self.stats_counters.prompt_tokens_total += len(request.prompt_ids)
            self.ledger.event(request, RequestEvent.SCHEDULED)

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
                self.ledger.isolated(
                    request,
                    "computing prompt logprobs",
                    self._on_prompt_logits,
                    request,
                    work.start,
                    logits[index : index + work.num_logits],
                )
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
            self.ledger.isolated(request, "finishing", self._finish_prefilled, request)
        now = self.clock()
        if sample_items:
            self._sample_verified(sample_items, logits, now)
        for request, start, count in beam_items:
            self.ledger.isolated(
                request,
                "beam search",
                self._beam_step,
                request,
                logits[start : start + count],
                now,
                rows=self.ledger.rows_of(request),
            )

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
                    self.ledger.fail(request, "sampling")
                return
            going = []
            for i, (request, first, draft) in enumerate(items):
                if i in result.errors:
                    self.ledger.fail(request, "sampling", exc=result.errors[i])
                    continue
                token = result.token_ids[i]
                self.ledger.isolated(
                    request, "processing its new token", self._on_token, request, token, result.logprobs[i], now
                )
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
        self.ledger.finish(request, "length")

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
            self.ledger.finish(request, "stop")
            return
        if token in params.stop_token_ids:
            self.ledger.finish(request, "stop", stop_reason=token)
            return
        assert request.output is not None  # set when the request was added
        matched = request.output.push(token, logprob if params.logprobs is not None else None)
        self.ledger.touched[request.request_id] = request
        if matched is not None:
            self.ledger.finish(request, "stop", stop_reason=matched, flush=False)
        elif request.sampler_key is not None and self.sampler.is_constraint_complete(request.sampler_key):
            self.ledger.finish(request, "stop")  # the grammar allows nothing more (only eos would follow)
        elif len(request.output_ids) >= params.max_tokens or request.num_tokens >= self.max_len:
            self.ledger.finish(request, "length")

    def _mark_prefill_done(self, request: Request) -> None:
        if not request.is_prefill_reported:
            request.is_prefill_reported = True
            self.ledger.event(request, RequestEvent.PREFILL_DONE)

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
            self.ledger.finish(request, reason)

    def _emit_beam_tokens(self, request: Request, tokens: list[int]) -> None:
        assert request.output is not None  # set when the request was added
        for token in tokens[request.num_beam_tokens_emitted :]:
            request.output.push(token, match_stops=False)
        request.num_beam_tokens_emitted = max(request.num_beam_tokens_emitted, len(tokens))
        self.ledger.touched[request.request_id] = request

    # -- step timing -----------------------------------------------------------------------------
    def _update_costs(self, plan: SchedulerOutput, elapsed_s: float) -> None:
        """Feed one step's time to the prefill chunk cap (``PrefillChunkTuner``), the
        speculator's cost of a decode step and the step-time gauges."""
        scheduler = self.scheduler
        scheduler.prefill_chunk_tokens = self.chunk_tuner.observe(plan, elapsed_s, scheduler.prefill_chunk_tokens)
        if self.speculator is not None:
            self.speculator.target_step_s = self.chunk_tuner.decode_step_s
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
            allied_processes=len(self.thread_governor.allies()) if self.thread_governor is not None else 0,
        )


def _constraint_key(params: Any) -> str | None:
    constraint = params.constraint
    return None if constraint is None else constraint.cache_key()
