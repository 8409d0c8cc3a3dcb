"""Speculative decoding: per-request draft tokens, verified by the target model in one forward.

A decoding request normally feeds its last token and samples one new token per step, reading
every weight for it. With speculation the core appends up to ``k`` draft tokens to that
feed; the forward then returns the logits after every fed position, and verification walks
them in order: at depth ``j`` it samples token ``t_j`` from row ``j`` with the request's own
sampler (its penalties, grammar, seed and all), emits it, and goes on to depth ``j + 1`` only
while ``t_j`` equals draft token ``j``. So a step emits between 1 and ``k + 1`` tokens.

Why this is exact: row ``j`` is the target's distribution after the prefix the request has
actually emitted (every earlier draft token was equal to the emitted one), and each emitted
token is drawn from that row exactly as a non-speculative step would draw it, consuming the
same uniform of the same generator. Greedy output is therefore identical token for token and
a seeded sampled request gives the very same text; an unseeded one is drawn from the same
distribution. With a draft that is a single proposal (prompt lookup proposes one token per
position, with certainty), "draw and compare" is the rejection-sampling rule of the
speculative decoding literature for that proposal: draft token ``x`` survives with
probability ``p(x)``, and on rejection the token is drawn from ``p`` with ``x`` removed.

Rejected tokens' keys and values are in the KV row past the request's ``num_computed``; the
next step writes over them, and the prefix cache only ever keeps the first ``num_computed``.

The length of each draft adapts (``Speculator.allocate``): a request's ``j``-th draft token is
accepted with probability ``r^j`` under its running acceptance rate ``r``, and a step of ``M``
rows costs ``step_cost(M - 1)`` one-row steps. Draft tokens are handed out, likeliest first,
while the step's expected tokens per unit of cost grow. One request alone gets the ``k`` with
the best ratio; in a batch every extra row costs more nearly its full share (the weights are
read once for all rows anyway), so speculation turns itself down as the batch grows (at 8
decoding requests only drafts accepted more than ~70 % of the time still pay), and it is off
for steps with more than ``max_batch`` decoding requests. A request whose drafts never pay
probes with one token every ``PROBE_EVERY`` steps per decoding request, so that text turning
repetitive is noticed. Prompt lookup proposes no more tokens than its matched n-gram is long. (Replayed on
Qwen2.5-Coder-1.5B's greedy answers, this policy made 1.43 tokens per unit of step cost on code
edits and 1.16 on chat, against 1.40 / 1.15 for the best fixed ``k``, 3.)

Proposers: ``ngram`` (prompt lookup, ``rill.engine.ngram``: no second model) and ``draft``
(``rill.engine.draft_model.DraftModel``: a smaller model with the same vocabulary, greedy, on its own runner whose KV
row ``i`` sits beside the target's row ``i``). A draft token costs the draft model a step, so
for ``draft`` the length chooser adds the measured ratio of a draft step to a target step to
each token's cost. With a draft model, prompt lookup is still asked first: where the context
predicts the next tokens they cost nothing to draft, and the draft model drafts for the
requests it has no proposal for. Each source keeps its own acceptance rate per request.

Which decoding requests speculate in a step, and with how many tokens, is ``Speculator.add_drafts``.

Imports the proposers (``rill.engine.ngram``, ``rill.engine.draft_model``) and the runner
boundary (``rill.engine.batch``); the core calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rill.engine.batch import ModelRunner, RowWork
from rill.engine.draft_model import DraftModel
from rill.engine.ngram import NgramProposer
from rill.types import MAX_SPECULATIVE_TOKENS

if TYPE_CHECKING:
    from rill.engine.request import Request
    from rill.engine.scheduler import ScheduledRequest

log = logging.getLogger("rill.engine")

METHODS = ("off", "ngram", "draft")

# What a step that verifies k draft tokens costs, in one-token steps, for k = 0, 1, 2, ...:
# the quantized kernel multiplies up to four activation rows per pass over the weights, so
# up to three draft tokens ride on the weight stream almost free (Qwen2.5-Coder-1.5B's matrices
# on this 2-core CPU: 4 rows cost 1.2x one row, 5 rows 1.47x, 8 rows 1.8x); past it each costs
# about 0.17 of a step. Longer drafts continue the last step.
STEP_COST = (1.0, 1.07, 1.14, 1.21, 1.38, 1.55, 1.72, 1.89, 2.06)
STEP_COST_PER_TOKEN = 0.17
PROBE_EVERY = 8  # a request whose drafts do not pay still tries one token every this many steps per decoding request
PRIOR_RATE = 0.5  # acceptance assumed before a request has any history
MAX_CATCH_UP = 64  # in a batch, a request whose draft row lags more than this gets no model draft
MODEL_PROBE_MAX_BATCH = 1  # the draft model is probed only for a request decoding alone
HISTORY = 0.5  # weight of the history in the running acceptance (per verification)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Server-wide speculation settings (``--speculative``, ``--num-speculative-tokens``).

    Attributes:
        method: ``off``, ``ngram`` (prompt lookup in the request's own context) or ``draft``
            (a draft model, given to the ``Speculator``).
        num_tokens: the most draft tokens per request and step (``k``).
        min_n, max_n: n-gram lengths prompt lookup matches, longest first.
        max_batch: speculation runs only in steps with at most this many decoding requests.
        adaptive: choose each request's draft length from its acceptance (else always ``k``).
    """

    method: str = "off"
    num_tokens: int = 4
    min_n: int = 1
    max_n: int = 4
    max_batch: int = 4
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if not 1 <= self.num_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"the number of speculative tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], not {self.num_tokens}"
            )
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, not {self.min_n}, {self.max_n}")
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, not {self.max_batch}")

    @property
    def enabled(self) -> bool:
        """True when the server speculates at all."""
        return self.method != "off"


@dataclass(slots=True)
class Track:
    """The acceptance history of one source of drafts for one request."""

    trials: float = 2.0  # running (decayed) counts; the prior is PRIOR_RATE over two trials
    accepted: float = 2.0 * PRIOR_RATE
    steps_since_probe: int = 0
    history: float = HISTORY

    @property
    def rate(self) -> float:
        """Running share of draft tokens accepted."""
        return self.accepted / self.trials if self.trials > 0 else PRIOR_RATE

    def record(self, proposed: int, accepted: int) -> None:
        """One verification of ``proposed`` tokens from this source, ``accepted`` of them kept."""
        tried = accepted + (1 if accepted < proposed else 0)  # tokens tried until the first miss
        self.trials = self.history * self.trials + tried
        self.accepted = self.history * self.accepted + accepted


@dataclass(slots=True)
class SpeculationState:
    """One request's prompt-lookup index and the acceptance of its drafts, per source."""

    proposer: NgramProposer
    lookup: Track = field(default_factory=Track)
    model: Track = field(default_factory=Track)
    source: str = "lookup"  # of the draft being verified


@dataclass
class SpeculationStats:
    """Server-wide counters (``/metrics``)."""

    draft_tokens_total: int = 0
    accepted_tokens_total: int = 0


def step_cost(k: int) -> float:
    """A step of ``k + 1`` rows (one decode and ``k`` draft tokens, or any ``k + 1`` tokens
    decoded together), in one-row steps (``STEP_COST``)."""
    if k < len(STEP_COST):
        return STEP_COST[k]
    return STEP_COST[-1] + STEP_COST_PER_TOKEN * (k - len(STEP_COST) + 1)


class Speculator:
    """Draft tokens for the core's decoding requests and the bookkeeping of their verification.

    Args:
        config: the server's settings.
        draft_runner: the draft model's runner (``method`` ``draft`` only).
        vocab_size: the target's vocabulary.
    """

    def __init__(self, config: SpeculativeConfig, draft_runner: ModelRunner | None = None, vocab_size: int = 0) -> None:
        if (config.method == "draft") != (draft_runner is not None):
            raise ValueError("a draft model is needed for speculative method 'draft', and only for it")
        self.config = config
        self.stats = SpeculationStats()
        self.draft_model = DraftModel(draft_runner, vocab_size) if draft_runner is not None else None
        self.target_step_s: float | None = None  # the core's plain decode step, for the draft's cost
        # The draft model's acceptance over every request: a new request's model track starts
        # from it, so a draft that agrees well is used from the first tokens on.
        self.model_track = Track(history=0.95)

    def add_drafts(self, scheduled: list[ScheduledRequest], max_len: int) -> int | None:
        """Append draft tokens to the feeds of ``scheduled`` decoding requests that speculate
        this step; return how many were added, or None when the proposer raised (logged).

        Only a plain decode (one row, the request's last token, sampled after) speculates, and
        none does in a step with more decoding requests than ``max_batch``. A proposer that
        raises (a draft model's forward) is the caller's cue to turn speculation off for good;
        the step itself goes on without drafts. ``max_len``: tokens per KV row.
        """
        decoding = [
            item
            for item in scheduled
            if len(item.work) == 1
            and len(item.work[0].token_ids) == 1
            and item.work[0].need_logits
            and not item.work[0].all_logits
        ]
        if len(decoding) > self.config.max_batch:
            return 0
        asking = [(item, limit) for item in decoding if (limit := self.draft_limit(item.request, max_len)) > 0]
        if not asking:
            return 0
        for item, _ in asking:
            if item.request.speculation is None:
                item.request.speculation = self.new_state()
        entries = [
            (item.request.speculation, item.request.row, item.request.num_tokens, item.request.token_at, limit)
            for item, limit in asking
        ]
        try:
            drafts = self.propose(entries, len(decoding))  # type: ignore[arg-type]  # scheduled: each has a row
        except Exception:
            log.exception("the speculative proposer failed; speculative decoding is off from now on")
            return None
        added = 0
        for (item, _), draft in zip(asking, drafts):
            if draft:
                work = item.work[0]
                item.work[0] = RowWork(
                    work.row, work.token_ids + draft, work.start, need_logits=True, all_logits=True, draft=True
                )
                item.draft = draft
                added += len(draft)
        return added

    def draft_limit(self, request: Request, max_len: int) -> int:
        """The most draft tokens ``request`` may have verified this step (0: none)."""
        params = request.params  # beams and prefill-only requests (max_tokens 0) never speculate
        if params.max_tokens == 0 or not self.wants(params, request.is_beam):
            return 0
        return min(
            params.speculative_tokens(self.config.num_tokens),
            params.max_tokens - len(request.output_ids) - 1,  # the last token needs no draft
            max_len - request.num_tokens,
        )  # the fed tokens must fit in the row

    def wants(self, request_params: Any, is_beam: bool) -> bool:
        """True when a request with these parameters speculates (server on, request not opted out)."""
        return self.config.enabled and not is_beam and request_params.speculative_tokens(self.config.num_tokens) > 0

    def new_state(self) -> SpeculationState:
        """A fresh state for a request (its context is given at the first ``propose``)."""
        c = self.config
        shared = self.model_track
        return SpeculationState(
            NgramProposer(c.num_tokens, c.min_n, c.max_n), model=Track(trials=shared.trials, accepted=shared.accepted)
        )

    def draft_cost(self) -> float:
        """What one draft token costs, in target decode steps (0 for prompt lookup)."""
        if self.draft_model is None:
            return 0.0
        draft, target = self.draft_model.step_s, self.target_step_s
        return draft / target if draft is not None and target else 0.5

    def allocate(
        self,
        tracks: Sequence[Track],
        limits: Sequence[int],
        batch: int,
        *,
        rows: int | None = None,
        tokens: float | None = None,
        draft_cost: float = 0.0,
        probe_max_batch: int | None = None,
    ) -> list[int]:
        """How many draft tokens each of a step's speculating requests asks for from one source.

        ``batch`` requests decode in the step (``rows`` rows are in it already, expecting
        ``tokens`` tokens: by default ``batch`` of each); ``tracks[i]`` is request ``i``'s history
        with this source, and it may have at most ``limits[i]``. Draft tokens are handed out
        one at a time to the request whose next one is likeliest to be accepted
        (``rate ** (k + 1)``), while the step's expected tokens per unit of cost grow: the
        step's cost is ``step_cost`` of all its rows plus ``draft_cost`` per draft position, so
        in a large batch, where every extra row costs nearly its full share, only drafts that
        are very likely accepted are taken. A request whose drafts are never worth it still
        gets one token every ``PROBE_EVERY`` steps per decoding request (only in batches of at
        most ``probe_max_batch`` requests, when given).
        """
        ks = [0] * len(tracks)
        if not self.config.adaptive:
            return [max(0, limit) for limit in limits]
        rates = [track.rate for track in tracks]
        rows = batch if rows is None else rows
        tokens = float(batch) if tokens is None else tokens
        cost, longest = step_cost(rows - 1), 0
        while True:
            best, gain = -1, 0.0
            for i, (k, limit) in enumerate(zip(ks, limits)):
                g = rates[i] ** (k + 1) if k < limit else 0.0
                if g > gain:
                    best, gain = i, g
            if best < 0:
                break
            new_cost = step_cost(rows + sum(ks)) + draft_cost * max(longest, ks[best] + 1)
            if (tokens + gain) / new_cost <= tokens / cost + 1e-9:
                break
            ks[best] += 1
            tokens, cost, longest = tokens + gain, new_cost, max(longest, ks[best])
        for i, track in enumerate(tracks):
            if ks[i] or limits[i] <= 0:
                track.steps_since_probe = 0
                continue
            track.steps_since_probe += 1
            if track.steps_since_probe >= PROBE_EVERY * batch and (probe_max_batch is None or batch <= probe_max_batch):
                ks[i], track.steps_since_probe = 1, 0
        return ks

    def propose(
        self, entries: Sequence[tuple[SpeculationState, int, int, Callable[[int, int], list[int]], int]], batch: int
    ) -> list[list[int]]:
        """Drafts for ``(state, row, context length, tokens(start, stop), limit)`` entries of a
        step where ``batch`` requests decode: one list per entry of at most ``limit`` tokens
        (empty: no draft); ``tokens`` reads the request's context.

        Prompt lookup first; with a draft model, the requests lookup has nothing for (or is
        not trusted for) then get the draft model's tokens, sized by its own acceptance and cost.
        """
        states = [entry[0] for entry in entries]
        limits = [entry[4] for entry in entries]
        for state, _, n, tokens, _ in entries:
            proposer = state.proposer
            have = len(proposer.tokens)
            if have > n:
                proposer.truncate(n)
            elif have < n:
                proposer.extend(tokens(have, n))
        ks = self.allocate([state.lookup for state in states], limits, batch)
        drafts = [
            state.proposer.propose(k, at_most_n=self.config.adaptive) if k > 0 else [] for state, k in zip(states, ks)
        ]
        for state in states:
            state.source = "lookup"
        if self.draft_model is None:
            return drafts
        # A request whose draft row lags far behind (it never drafted with the model, or long
        # ago) would first cost the draft model a prefill: in a batch that is not worth it.
        contexts = {i: entries[i][3](0, entries[i][2]) for i, draft in enumerate(drafts) if not draft and limits[i] > 0}
        rest = [
            i
            for i, context in contexts.items()
            if batch == 1 or self.draft_model.lag(entries[i][1], context) <= MAX_CATCH_UP
        ]
        if not rest:
            return drafts
        rows = batch + sum(len(d) for d in drafts)
        expected = batch + sum(states[i].lookup.rate * len(d) for i, d in enumerate(drafts))  # roughly
        model_ks = self.allocate(
            [states[i].model for i in rest],
            [limits[i] for i in rest],
            batch,
            rows=rows,
            tokens=expected,
            draft_cost=self.draft_cost(),
            probe_max_batch=MODEL_PROBE_MAX_BATCH,
        )
        entries_rest = [(entries[i][1], contexts[i] if k > 0 else [], k) for i, k in zip(rest, model_ks)]
        for i, draft in zip(rest, self.draft_model.propose(entries_rest)):
            drafts[i] = draft
            states[i].source = "model"
        return drafts

    def rewind(self, state: SpeculationState, length: int) -> None:
        """Forget the context past ``length`` tokens (a regenerate)."""
        state.proposer.truncate(length)

    def observe(self, state: SpeculationState, proposed: int, accepted: int) -> None:
        """Record one verification: ``accepted`` of ``proposed`` draft tokens were emitted as drafted."""
        if proposed <= 0:
            return
        if state.source == "model":
            state.model.record(proposed, accepted)
            self.model_track.record(proposed, accepted)
        else:
            state.lookup.record(proposed, accepted)
        self.stats.draft_tokens_total += proposed
        self.stats.accepted_tokens_total += accepted
