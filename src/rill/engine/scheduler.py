"""The scheduler: which requests run this step, with how many tokens each.

vLLM v1's rule at nano-vllm's size: no prefill or decode phase, each request catches
``num_computed`` up to its token count under a per-step token budget. Decodes (one token
each) are scheduled first, so running streams keep producing tokens; prefill chunks fill
what is left. While decodes run, a prefill chunk is capped by ``prefill_chunk_tokens``, which
the core sets from measured costs so that a step with a chunk takes at most about twice a
plain decode step (inter-token latency at most doubles while a long prompt is prefilled).
That protection is for a few new prompts beside many streams: when the requests still
waiting for their first token outnumber the streams decoding (a burst of arrivals, a
batch filling up), holding them to small chunks would keep the batch small for many steps
and starve the queue, so the step takes the whole token budget instead, as when nothing
decodes. One client cannot trigger that exception with many requests of one prompt or with
scoring requests: the count leaves out requests asking prompt logprobs and counts the
requests of one prompt (``n``/``best_of`` candidates) once (``_outnumbers``); and a chunk
whose every position returns logits (prompt logprobs) stays under the protected cap while
anything decodes, whatever the count.

Requests of one prompt share its prefill: a waiting prompt that a live row is still
prefilling waits for it and then copies its keys and values (``MIN_SHARED_PREFILL_TOKENS``),
so only one of them (the one asking prompt logprobs, if any) computes the prompt. A request
asking prompt logprobs computes every position whose logits it still needs, but reuses a
cached prefix for the positions it scored before a preemption (``Request.max_reuse_tokens``).

Admission takes waiting requests by ``(priority, arrival)``. A new request needs a KV row:
a free or cached one (LRU eviction), else a paused request's row (its KV is dropped and
recomputed on resume), else a running request of strictly lower priority is preempted
(recompute). Pure Python: no torch.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from rill.engine.batch import RowWork
from rill.engine.beam import BeamGroup, BeamSearch
from rill.engine.kv_cache import KVManager
from rill.engine.request import Request, RequestStatus

# A waiting prompt sharing at least this many not-yet-computed tokens with a prompt being
# prefilled waits for it (n > 1, identical system prompts) instead of computing them twice.
MIN_SHARED_PREFILL_TOKENS = 16

LONG_REUSE_TOKENS = 256
"""A request that starts from at least this many reused tokens (a cached prompt copied into
its row, or taken over) moves that much KV when it joins the decoding rows; while streams
decode, at most one such request starts per step, so the copies of a ``best_of`` group's
long prompt are spread over steps instead of all landing in one."""


@dataclass(slots=True)
class ScheduledRequest:
    """One request's work in a step (several items for a beam search)."""

    request: Request
    work: list[RowWork]
    draft: list[int] = field(default_factory=list)  # speculative tokens the core appended to a decode


@dataclass(slots=True)
class SchedulerOutput:
    """The plan of one step."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    num_decode_tokens: int = 0
    num_prefill_tokens: int = 0
    num_draft_tokens: int = 0  # speculative tokens the core added to decodes (not counted above)

    @property
    def is_empty(self) -> bool:
        """True when nothing is to be computed."""
        return not self.scheduled


class Scheduler:
    """Waiting queue, running list and paused set over one ``KVManager``."""

    def __init__(
        self,
        kv: KVManager,
        copy_row: Callable[[int, int, int], None],
        max_num_seqs: int,
        max_num_batched_tokens: int,
    ) -> None:
        self.kv = kv
        self.copy_row = copy_row
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_tokens = max_num_batched_tokens
        # A chunk whose every position returns logits (prompt logprobs) holds at most this
        # many tokens, which bounds that step's logits memory (the core sets it from the vocabulary).
        self.max_logits_chunk_tokens = max_num_batched_tokens
        self.waiting: list[tuple[int, int, Request]] = []  # heap; stale entries skipped lazily
        self.running: list[Request] = []
        self.paused: dict[str, Request] = {}

    # -- membership -----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Requests in the running batch."""
        return len(self.running)

    @property
    def num_paused(self) -> int:
        """Paused requests."""
        return len(self.paused)

    @property
    def num_waiting(self) -> int:
        """Requests in the waiting queue."""
        return sum(1 for _, _, r in self.waiting if r.status is RequestStatus.WAITING)

    def enqueue(self, request: Request) -> None:
        """Put a request into the waiting queue (new, preempted or resumed without KV)."""
        request.status = RequestStatus.WAITING
        heapq.heappush(self.waiting, (request.priority, request.seq_no, request))

    def remove(self, request: Request) -> None:
        """Take a request out of every collection (it finished); its row is released by the caller."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        self.paused.pop(request.request_id, None)
        # Waiting entries are dropped lazily when popped (status no longer WAITING).

    def pause(self, request: Request) -> None:
        """Move a running or waiting request to the paused set."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        request.status = RequestStatus.PAUSED
        self.paused[request.request_id] = request

    def resume(self, request: Request) -> None:
        """Move a paused request back: to running if it kept its row, else to waiting."""
        self.paused.pop(request.request_id, None)
        if request.row is not None and len(self.running) >= self.max_num_seqs:
            self._release_rows(request)  # the batch is full: wait like a new request (prefix cache keeps its KV)
            request.num_computed = 0
        if request.row is not None:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        else:
            self.enqueue(request)

    # -- the step plan ----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Plan one step: decodes first, then prefill chunks, then admissions."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefilling: list[Request] = []
        for request in self.running:
            if request.beam is not None and request.beam.is_decoding:
                items = request.beam.work()
                out.scheduled.append(ScheduledRequest(request, items))
                out.num_decode_tokens += len(items)
                budget -= len(items)
            elif request.num_tokens - request.num_computed == 1:
                item = RowWork(
                    request.row,  # type: ignore[arg-type]
                    request.token_at(request.num_computed, request.num_tokens),
                    request.num_computed,
                )
                out.scheduled.append(ScheduledRequest(request, [item]))
                out.num_decode_tokens += 1
                budget -= 1
            else:
                prefilling.append(request)
        free_slots = self.max_num_seqs - len(self.running)
        num_decoding = len(out.scheduled)  # scheduled so far: the decoding ones
        protect = out.num_decode_tokens and not self._outnumbers(prefilling, free_slots, num_decoding)
        chunk_cap = self.prefill_chunk_tokens if protect else self.max_num_batched_tokens
        prefill_budget = max(0, min(budget, chunk_cap))
        # A scoring chunk (all logits) is one request's work whatever the count above says: it
        # never takes more than the protected cap while anything decodes.
        logits_cap = self.max_logits_chunk_tokens
        if out.num_decode_tokens:
            logits_cap = min(logits_cap, self.prefill_chunk_tokens)
        for request in prefilling:
            if prefill_budget <= 0:
                break
            prefill_budget -= self._schedule_chunk(request, prefill_budget, out, logits_cap)
        self._admit(out, prefill_budget, logits_cap)
        return out

    def _outnumbers(self, prefilling: list[Request], free_slots: int, num_decoding: int) -> bool:
        """True when the requests that would start prefilling now outnumber the decoding ones.

        Counted: the running requests still prefilling, then waiting ones up to the free
        slots. Not counted: a request asking prompt logprobs (its chunks stay under the
        protected cap anyway, so a larger budget would not start it sooner), and a request
        whose prompt equals one already counted (candidates of one prompt wait for one
        prefill and copy it, so they do not fill the batch any sooner). Stops as soon as the
        answer is known.
        """
        prompts: set[int] = set()
        for request in prefilling:
            if not request.needs_prompt_logits:
                prompts.add(request.prompt_key)
                if len(prompts) > num_decoding:
                    return True
        num_taken = 0
        for _, _, request in self.waiting:
            if num_taken >= free_slots:
                break
            if request.status is not RequestStatus.WAITING:
                continue
            num_taken += 1
            if not request.needs_prompt_logits:
                prompts.add(request.prompt_key)
                if len(prompts) > num_decoding:
                    return True
        return False

    def _schedule_chunk(self, request: Request, budget: int, out: SchedulerOutput, logits_cap: int) -> int:
        remaining = request.num_tokens - request.num_computed
        all_logits = request.needs_prompt_logits
        n = min(remaining, budget, logits_cap) if all_logits else min(remaining, budget)
        start = request.num_computed
        item = RowWork(
            request.row,  # type: ignore[arg-type]
            request.token_at(start, start + n),
            start,
            need_logits=(n == remaining),
            all_logits=all_logits,
        )
        out.scheduled.append(ScheduledRequest(request, [item]))
        out.num_prefill_tokens += n
        return n

    def _admit(self, out: SchedulerOutput, budget: int, logits_cap: int) -> None:
        deferred: list[tuple[int, int, Request]] = []
        num_long_reuses = 0
        while self.waiting and budget > 0:
            entry = heapq.heappop(self.waiting)
            request = entry[2]
            if request.status is not RequestStatus.WAITING:
                continue  # stale: finished, paused or already running
            tokens = request.all_ids
            if not request.needs_prompt_logits and self._awaits_shared_prefill(tokens):
                deferred.append(entry)
                continue
            if (
                num_long_reuses
                and out.num_decode_tokens
                and self.kv.reusable(tokens, request.max_reuse_tokens) >= LONG_REUSE_TOKENS
            ):
                deferred.append(entry)  # one long copy per step while streams decode
                continue
            error = self._check_cached_prefix(request, tokens)
            if error is not None:
                out.failed.append((request, error))
                continue
            if not self._make_room(request, out):
                heapq.heappush(self.waiting, entry)
                break
            self._place(request, tokens)
            num_long_reuses += request.num_computed >= LONG_REUSE_TOKENS
            budget -= self._schedule_chunk(request, budget, out, logits_cap)
        for entry in deferred:
            heapq.heappush(self.waiting, entry)

    def _awaits_shared_prefill(self, tokens: list[int]) -> bool:
        """True when a live row's prefill will soon hold ``MIN_SHARED_PREFILL_TOKENS`` or more of
        ``tokens`` beyond what any row holds now (else waiting would gain nothing: e.g. a
        request recomputing a cached prompt for its prompt logprobs, while its candidates may
        copy the cached one at once)."""
        if self.kv.pending_overlap(tokens) < MIN_SHARED_PREFILL_TOKENS:
            return False
        _, available, _ = self.kv.best_match(tokens, len(tokens) - 1)
        return self.kv.pending_overlap(tokens, available) >= MIN_SHARED_PREFILL_TOKENS

    def _check_cached_prefix(self, request: Request, tokens: list[int]) -> Exception | None:
        need = request.require_cached_prefix_tokens
        if not need:
            return None
        _, length, _ = self.kv.best_match(tokens, len(tokens) - 1)
        if length >= min(need, len(tokens) - 1):
            return None
        from rill.errors import CacheMiss

        return CacheMiss(f"the cached state of '{request.request_id}' was evicted ({length} of {need} tokens left)")

    def _rows_needed(self, request: Request) -> int:
        return request.params.num_beams if request.is_beam else 1

    def _make_room(self, request: Request, out: SchedulerOutput) -> bool:
        need = self._rows_needed(request)
        while len(self.running) >= self.max_num_seqs:
            victim = self._pick_victim(request, running_only=True)
            if victim is None:
                return False
            self._preempt_in_plan(victim, out)
        while self.kv.num_available_rows < need:
            victim = self._pick_victim(request)
            if victim is None:
                return False
            self._preempt_in_plan(victim, out)
        return True

    def _preempt_in_plan(self, victim: Request, out: SchedulerOutput) -> None:
        """Preempt ``victim`` and drop any work already planned for it in this step."""
        self.preempt(victim)
        out.preempted.append(victim)
        kept = []
        for item in out.scheduled:
            if item.request is victim:
                num = sum(len(w.token_ids) for w in item.work)
                if item.work[0].need_logits and len(item.work[0].token_ids) == 1:
                    out.num_decode_tokens -= num
                else:
                    out.num_prefill_tokens -= num
            else:
                kept.append(item)
        out.scheduled = kept

    def _pick_victim(self, incoming: Request, running_only: bool = False) -> Request | None:
        held = [] if running_only else [r for r in self.paused.values() if r.row is not None]
        if held:
            return min(held, key=lambda r: r.seq_no)  # oldest pause first
        candidates = [r for r in self.running if r.priority > incoming.priority]
        if not candidates:
            return None
        return max(candidates, key=lambda r: (r.priority, r.seq_no))

    def preempt(self, request: Request) -> None:
        """Drop a request's KV (it is recomputed later); running ones go back to waiting."""
        self._release_rows(request)
        request.num_computed = 0
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.enqueue(request)

    def _release_rows(self, request: Request) -> None:
        if request.beam is not None:
            request.beam.release()
            request.output_ids = []
            request.beam = None  # restarts from the prompt after recompute
        if request.row is not None and self.kv.is_live(request.row):
            self.kv.release(request.row, request.token_at(0, request.num_computed))
        request.row = None

    def release(self, request: Request) -> None:
        """Give back a finished request's rows (its valid tokens stay as a cache entry)."""
        self._release_rows(request)

    def _place(self, request: Request, tokens: list[int]) -> None:
        acquired = self.kv.acquire(request, tokens, max_reuse=request.max_reuse_tokens)
        assert acquired is not None  # _make_room guaranteed a row
        if acquired.copy_from is not None:
            src, num_tokens = acquired.copy_from
            self.copy_row(src, acquired.row, num_tokens)
        request.row = acquired.row
        request.num_computed = acquired.num_cached_tokens
        if not request.is_scheduled_once:
            request.num_cached_prompt_tokens = min(acquired.num_cached_tokens, len(request.prompt_ids))
        if request.is_beam:
            params = request.params
            search = BeamSearch(
                params.num_beams,
                params.length_penalty,
                params.early_stopping,
                request.eos_token_ids if not params.ignore_eos else frozenset(),
                params.max_tokens,
            )
            request.beam = BeamGroup(search, self.kv, self.copy_row)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
