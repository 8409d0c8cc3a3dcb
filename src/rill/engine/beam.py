"""Beam search for one request, in the engine (vLLM keeps it outside; we stream it).

Semantics follow transformers' classic beam scorer: each step takes the ``2 * num_beams``
best continuations over all beams by cumulative log-probability; an eos among the first
``num_beams`` of them closes a hypothesis scored ``sum_logprobs / len ** length_penalty``;
the first ``num_beams`` non-eos continuations become the next beams. With
``early_stopping`` the search ends once ``num_beams`` hypotheses are closed; without it, once
no running beam can beat the worst kept hypothesis. At ``max_tokens`` the running beams are
closed as they are.

Streaming: ``agreed_len()`` is how many generated tokens every running beam and every kept
hypothesis share, so those tokens are final whatever beam wins.

Each beam owns one KV row; a step's new beams reuse their parent's row (first child) or get
a copy of it in a row whose beam died (``plan_rows``).

``BeamGroup`` is what the engine holds for a beam request: the search and its KV rows, which
it drives through ``KVManager``'s public methods (``acquire_empty``, ``assign``, ``clear``,
``drop``) and the runner's ``copy_row``. The scheduler asks it for the step's work, the core
gives it each step's logits; neither touches a beam or a row of it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rill.engine.batch import RowWork
from rill.engine.kv_cache import KVManager


@dataclass(eq=False)
class Beam:
    """One running beam: its row, generated tokens and cumulative log-probability."""

    row: int
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)
    score: float = 0.0
    num_computed: int = 0

    def token_at(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of prompt + beam tokens (the KV row's content)."""
        return (self.prompt_ids + self.tokens)[start:stop]


class BeamSearch:
    """State of one beam-search request."""

    def __init__(
        self,
        num_beams: int,
        length_penalty: float,
        early_stopping: bool,
        eos_token_ids: frozenset[int],
        max_tokens: int,
    ) -> None:
        self.num_beams = num_beams
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens
        self.beams: list[Beam] = []
        self.hypotheses: list[tuple[float, int, list[int]]] = []  # min-heap of (score, order, tokens incl. eos)
        self._order = 0
        self.is_done = False

    def _norm(self, sum_logprobs: float, length: int) -> float:
        # sum / len ** lp, in log space: ``len ** lp`` overflows (or underflows to a zero
        # divisor) for a large |lp| while the product below stays finite for every length
        # penalty ``SamplingParams.validate`` accepts.
        return sum_logprobs * math.exp(-self.length_penalty * math.log(max(length, 1)))

    def _add_hypothesis(self, tokens: list[int], sum_logprobs: float) -> None:
        score = self._norm(sum_logprobs, len(tokens))
        self._order += 1
        if len(self.hypotheses) < self.num_beams:
            heapq.heappush(self.hypotheses, (score, self._order, tokens))
        elif score > self.hypotheses[0][0]:
            heapq.heapreplace(self.hypotheses, (score, self._order, tokens))

    def step(self, logprobs: torch.Tensor) -> list[tuple[int, int, float]]:
        """Advance with log-probabilities ``[len(self.beams), vocab]`` of the running beams.

        Returns the new beams as ``(parent_index, token_id, cumulative_score)``; sets
        ``is_done`` when the search is over (the caller then calls ``finish``).
        """
        num_beams = self.num_beams
        scores = torch.tensor([b.score for b in self.beams], dtype=torch.float32)
        vocab = logprobs.shape[-1]
        total = (logprobs.float() + scores[:, None]).reshape(-1)
        if len(self.beams) == 1 and not self.beams[0].tokens:
            total = logprobs[0].float()  # first step: one distinct beam only
        top_scores, top_ids = torch.topk(total, min(2 * num_beams, total.numel()))
        new: list[tuple[int, int, float]] = []
        for rank, (score, flat) in enumerate(zip(top_scores.tolist(), top_ids.tolist())):
            parent, token = divmod(flat, vocab)
            if token in self.eos_token_ids:
                if rank < num_beams:
                    self._add_hypothesis(self.beams[parent].tokens + [token], score)
                continue
            new.append((parent, token, score))
            if len(new) == num_beams:
                break
        cur_len = len(self.beams[0].tokens) + 1
        if len(self.hypotheses) >= num_beams:
            if self.early_stopping:
                self.is_done = True
            else:
                best_running = max(s for _, _, s in new) if new else float("-inf")
                self.is_done = self.hypotheses[0][0] >= self._norm(best_running, cur_len)
        if cur_len >= self.max_tokens or not new:
            self.is_done = True
        return new

    def plan_rows(
        self, new: list[tuple[int, int, float]], spare_rows: list[int]
    ) -> tuple[list[Beam], list[tuple[int, int, int]], list[int]]:
        """Apply ``new`` beams: returns (beams, copies ``(src_row, dst_row, num_tokens)``,
        rows left unused).

        A parent's first child keeps the parent's row; further children take ``spare_rows`` or
        rows of parents without children, so no copy ever overwrites a row another copy reads.
        """
        children: dict[int, int] = {}
        for parent, _, _ in new:
            children[parent] = children.get(parent, 0) + 1
        spare = list(spare_rows) + [b.row for i, b in enumerate(self.beams) if i not in children]
        used: set[int] = set()
        beams: list[Beam] = []
        copies: list[tuple[int, int, int]] = []
        for parent, token, score in new:
            p = self.beams[parent]
            if p.row not in used:
                row = p.row
            else:
                row = spare.pop()
                copies.append((p.row, row, p.num_computed))
            used.add(row)
            beams.append(
                Beam(
                    row=row,
                    prompt_ids=p.prompt_ids,
                    tokens=p.tokens + [token],
                    score=score,
                    num_computed=p.num_computed,
                )
            )
        self.beams = beams
        return beams, copies, spare

    def finish(self) -> list[int]:
        """Close running beams if needed and return the best hypothesis' tokens."""
        if len(self.hypotheses) < self.num_beams or not self.early_stopping:
            for beam in self.beams:
                self._add_hypothesis(list(beam.tokens), beam.score)
        best = max(self.hypotheses, key=lambda h: (h[0], -h[1]))
        return best[2]

    def agreed_len(self) -> int:
        """Generated tokens shared by every running beam and kept hypothesis."""
        seqs = [b.tokens for b in self.beams] + [h[2] for h in self.hypotheses]
        if not seqs:
            return 0
        first = seqs[0]
        n = min(len(s) for s in seqs)
        for i in range(n):
            token = first[i]
            if any(s[i] != token for s in seqs):
                return i
        return n


@dataclass(slots=True)
class BeamStep:
    """What one step of a group gives the request: tokens every beam agrees on (final
    whatever wins) and, when the search is over, the best hypothesis (eos included)."""

    agreed: list[int]
    best: list[int] | None = None


class BeamGroup:
    """One beam request's search and KV rows.

    Made when the request gets its row: the prompt's row plus ``num_beams - 1`` spare rows
    reserved empty. The prompt is prefilled in its own row; ``start`` turns that row into
    the first beam. From then on every running beam decodes in its own row.
    """

    def __init__(self, search: BeamSearch, kv: KVManager, copy_row: Callable[[int, int, int], None]) -> None:
        """Reserve the spare rows (as many as are available, up to ``num_beams - 1``)."""
        self.search = search
        self.kv = kv
        self.copy_row = copy_row
        self.spare_rows = [row for _ in range(search.num_beams - 1) if (row := kv.acquire_empty()) is not None]

    @property
    def beams(self) -> list[Beam]:
        """The running beams (empty before ``start`` and once over)."""
        return self.search.beams

    @property
    def is_decoding(self) -> bool:
        """True once the prompt is in and beams run."""
        return bool(self.search.beams)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Tokens that close a hypothesis."""
        return self.search.eos_token_ids

    def set_max_tokens(self, max_tokens: int) -> None:
        """A modify changed ``max_tokens``: the search ends there from now on."""
        self.search.max_tokens = max_tokens

    def rows(self) -> list[int]:
        """Every KV row the group holds now: the beams' rows, then the spare ones."""
        return list(dict.fromkeys([beam.row for beam in self.search.beams] + self.spare_rows))

    def work(self) -> list[RowWork]:
        """This step's decode work: each beam's last token in its row."""
        return [RowWork(b.row, [b.tokens[-1]], b.num_computed) for b in self.search.beams]

    def computed(self) -> None:
        """The step's work ran: every beam's row holds one more token."""
        for beam in self.search.beams:
            beam.num_computed += 1

    def start(self, row: int, prompt_ids: list[int], num_computed: int) -> None:
        """The prompt is prefilled in ``row``: it becomes the first beam."""
        self.search.beams = [Beam(row=row, prompt_ids=prompt_ids, num_computed=num_computed)]

    def step(self, logits: torch.Tensor, max_len: int) -> BeamStep:
        """Advance the search with the beams' logits ``[len(beams), vocab]``; fork and free rows.

        The search ends at its own end, with no beam left, or when a beam would pass
        ``max_len`` tokens of KV.
        """
        search = self.search
        new = search.step(torch.log_softmax(logits.float(), dim=-1))
        beams, copies, unused = search.plan_rows(new, self.spare_rows)
        for src, dst, num_tokens in copies:
            self.copy_row(src, dst, num_tokens)
        for beam in beams:
            self.kv.assign(beam.row, beam)
        for row in unused:
            self.kv.clear(row)
        self.spare_rows = unused
        if search.is_done or not beams or beams[0].num_computed + 1 >= max_len:
            best = search.finish()
            return BeamStep([t for t in best if t not in search.eos_token_ids], best)
        agreed = beams[0].tokens[: search.agreed_len()]
        return BeamStep([t for t in agreed if t not in search.eos_token_ids])

    def release(self) -> None:
        """Free every row of the group (finished, preempted or failed)."""
        for row in self.rows():
            if self.kv.is_live(row):
                self.kv.drop(row)
        self.search.beams = []
        self.spare_rows = []
