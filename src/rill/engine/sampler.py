"""Logits → token ids for every running sequence, with per-request parameters, in one call per step.

Owns the per-sequence sampling state, keyed by small ints the engine picks (vLLM ``InputBatch``
style): a row of parameters per key in one preallocated table, output-token counts and prompt
masks for the penalties, per-request seeded ``torch.Generator``s. ``Sampler.sample`` turns one
step's logits into tokens (and logprobs) with no per-row Python work over the vocabulary; the
numpy kernels live in ``rill.engine.sampler_kernels``, the per-key state and the per-step plan
in ``rill.engine.sampler_state``, logprobs of chosen and given tokens in ``rill.engine.logprobs``.
Imports numpy, torch, llguidance (masks), ``rill.types``, those modules and
``rill.engine.grammar`` (for its errors) only; knows nothing of requests, scheduling or protocols.

Processing order (vLLM / OpenAI semantics): repetition penalty (HF, prompt + output tokens) →
presence / frequency penalties (OpenAI, output tokens) → logit_bias → bans (eos and stop ids while
fewer than min_tokens outputs; eos always under ignore_eos) → allowed_token_ids (vLLM's: -inf on
every other token; if the bans leave none of the allowed tokens, the list wins and the row is
redone with it alone, as a grammar is) → temperature (below
``GREEDY_TEMPERATURE``, or top_k == 1, is greedy: argmax of the processed logits) → top_k →
top_p (on the top-k-renormalised mass) → min_p (relative to the top probability) → one uniform
per row, inverse CDF. A row whose processed logits are all -inf falls back to the raw argmax.
Logprobs are always of the raw distribution, ``log_softmax(logits)``.

Constrained decoding (``SamplingParams.response_format``): a row with a grammar matcher
(``rill.engine.grammar``) gets the matcher's token bitmask applied after the bans, as -inf on
every token the grammar forbids, so temperature, top-k/p and min-p work within the allowed set;
the chosen token then advances the matcher. If the bans leave none of the allowed tokens
(eos banned by min_tokens when only eos may follow), the grammar wins: the row is redone with
the mask alone. A matcher that is in error (a grammar over llguidance's per-step limits, or a
tokenizer mismatch) fails its row alone, with ``ConstraintFailed``. The masks of all constrained rows are filled in one
call that runs across llguidance's threads without the GIL.

Seeds: a seeded row draws exactly one uniform per sampled step from its own generator, and its
kept set and draw depend only on its own logits (see ``sampler_kernels``), so it gives the same
tokens alone or in any batch. Unseeded rows share one randomly seeded generator.

Fault isolation: the uniforms are drawn before any processing, and a batch that raises is
redone row by row with the same uniforms; rows that still raise are reported in
``SampleOutput.errors`` and leave no trace, every other row gets the token the batch would have
given it (the engine then fails only the requests whose rows raised).

Cost per step, on this 2-core box (``benchmarks/sampler.py``): a greedy batch is one numpy argmax
(~0.1 ms for 32 x 16k); 32 rows with 32 different settings take ~2-4 ms at vocab 16k.
An allowed_token_ids row (100 ids) adds ~0.015-0.03 ms per row at vocab 16k, ~0.03-0.06 ms at
32k, greedy or sampled (``benchmarks/sampler.py --scenario allowed``).
Masks cost llguidance ~0.1-0.2 ms per row on average (``rill.engine.grammar``) plus ~0.5 ms
per 32 rows x 16k to unpack and apply them (``benchmarks/structured.py`` measures a server).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from llguidance import LLExecutor
from llguidance.numpy import fill_next_token_bitmask_par

from rill.engine.grammar import constraint_failed
from rill.engine.logprobs import chosen_logprobs, score_block
from rill.engine.sampler_kernels import BLOCK, apply_penalties, inverse_cdf, keep_thresholds
from rill.engine.sampler_state import Plan, Slot, Workspace
from rill.types import SamplingParams, TokenLogprob

SCORE_BLOCK_ROWS = 32
"""Rows of logits ``Sampler.score`` works on at once (bounds its scratch memory per vocabulary)."""

GREEDY_TEMPERATURE = 1e-5  # below this a row is greedy (x / T would overflow float32)
# Columns of the persistent per-key parameter table.
_TEMP, _TOP_K, _TOP_P, _MIN_P, _REP, _PRES, _FREQ = range(7)


@dataclass
class SampleOutput:
    """One step's result, row-aligned with the ``keys`` passed to ``Sampler.sample``.

    Attributes:
        token_ids: the chosen token of each row.
        logprobs: per row, the chosen token's logprob under the raw model distribution and, as
            ``TokenLogprob.top``, the ``params.logprobs`` most likely *other* tokens of that
            distribution, most likely first (the chosen token is not repeated, per
            ``rill.types``; a protocol wanting OpenAI's ``top_logprobs`` merges the chosen token
            in and keeps N). None for rows whose ``params.logprobs`` is None.
        errors: row index -> the exception sampling that row raised; such a row's token is -1,
            its logprob None, and its history is unchanged.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    errors: dict[int, Exception] = field(default_factory=dict)


class Sampler:
    """Vectorised per-request sampler with persistent per-key state (vLLM ``InputBatch`` style).

    The sampler owns its keys and each key's state (parameters, history, seeded generator):
    ``open`` picks a free key. Calling order per sequence: ``open`` (or ``add`` with a key of
    the caller's) once, then ``sample`` (or ``record`` for tokens chosen
    elsewhere) every step, ``update`` / ``reset`` at any time between steps, ``remove`` at the end.
    Params must already be validated (``SamplingParams.validate``); out-of-vocabulary ids in
    logit_bias / stop_token_ids / eos ids are ignored. Not thread-safe: one engine thread owns it.

    Args:
        vocab_size: width of the logits rows.
        max_rows: keys are ints in ``[0, max_rows)``.
        device: where logits may arrive from; the sampler computes on the CPU and copies logits
            from another device once per step.
        num_candidates: how many of the largest weights a top-p row is cut from before it falls
            back to a full sort (``sampler_kernels.keep_thresholds``).
    """

    def __init__(self, vocab_size: int, max_rows: int, device="cpu", *, num_candidates: int = 1024) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.device = torch.device(device)
        self.num_candidates = max(1, num_candidates)
        self._width = -(-vocab_size // BLOCK) * BLOCK  # padded vocab; pad columns weigh 0
        # Persistent per-key parameters, written on add/update only; one gather per step.
        self._table = np.zeros((max_rows, 7), dtype=np.float32)
        self._slots: list[Slot | None] = [None] * max_rows
        self._free_keys = list(range(max_rows - 1, -1, -1))  # open() takes the lowest free key
        self._generator = torch.Generator()
        self._generator.seed()  # unseeded rows share this one, randomly seeded
        # Output-token counts and prompt-token masks, [max_rows, vocab]; allocated the first time
        # any key uses a penalty (they cost 5 bytes per key and token), then kept for every key.
        self._counts: np.ndarray | None = None
        self._prompt_mask: np.ndarray | None = None
        self._ws = Workspace()
        self._executor: Any = None  # llguidance's thread pool, made on the first constrained row

    # ----- per-key state -------------------------------------------------------------------

    def add(
        self, key: int, params: SamplingParams, prompt_ids: list[int], eos_token_ids: set[int], matcher: Any = None
    ) -> None:
        """Start tracking a sequence under ``key`` (which must be free) with an empty history.

        ``prompt_ids`` feed the repetition penalty; ``eos_token_ids`` are the ids banned by
        min_tokens (with ``params.stop_token_ids``) and by ignore_eos. ``matcher`` (a fresh
        grammar matcher) constrains every token of the row.
        """
        if self._slots[key] is not None:
            raise ValueError(f"sampler key {key} is already in use")
        slot = Slot(params=params, eos_ids=set(eos_token_ids), prompt=list(prompt_ids), matcher=matcher)
        self._slots[key] = slot
        self._configure(key, slot, params, reseed=True)
        self._clear_penalty_rows(key, slot)

    def open(self, params: SamplingParams, prompt_ids: list[int], eos_token_ids: set[int], matcher: Any = None) -> int:
        """``add`` under a key the sampler picks, and return it (``remove`` gives it back).

        Raises ``RuntimeError`` when every key is in use.
        """
        while self._free_keys:
            key = self._free_keys.pop()
            if self._slots[key] is None:  # a key taken by an explicit ``add`` stays listed
                self.add(key, params, prompt_ids, eos_token_ids, matcher=matcher)
                return key
        raise RuntimeError("no sampler key left")

    def update(self, key: int, params: SamplingParams, matcher: Any = None) -> None:
        """Replace the key's params from its next sampled token on; history and counts are kept.

        The seeded generator keeps its position unless the seed changed (then it restarts).
        ``matcher`` replaces the row's grammar matcher (None: unconstrained from now on).
        """
        slot = self._slot(key)
        slot.matcher = matcher
        reseed = params.seed != slot.params.seed
        slot.params = params
        self._configure(key, slot, params, reseed=reseed)

    def reset(self, key: int, prompt_ids: list[int]) -> None:
        """Regenerate: forget the outputs, take ``prompt_ids`` as the prompt, re-seed the generator."""
        slot = self._slot(key)
        slot.prompt = list(prompt_ids)
        slot.outputs.clear()
        if slot.matcher is not None:
            slot.matcher.reset()
        if slot.params.seed is not None:
            slot.generator = torch.Generator().manual_seed(slot.params.seed)
        self._clear_penalty_rows(key, slot)

    def remove(self, key: int) -> None:
        """Stop tracking ``key``; it may be reused by ``add`` or ``open``."""
        self._slot(key)
        self._slots[key] = None
        if key not in self._free_keys:
            self._free_keys.append(key)

    def record(self, key: int, token_id: int) -> None:
        """Append a token chosen outside ``sample`` (e.g. by beam search) to the key's history."""
        self._slot(key).outputs.append(token_id)
        if self._counts is not None:
            self._counts[key, token_id] += 1

    def is_constraint_complete(self, key: int) -> bool:
        """True when the key's grammar is complete and allows no token but end-of-sequence."""
        matcher = self._slot(key).matcher
        return matcher is not None and matcher.is_stopped() and not matcher.is_error()

    def _slot(self, key: int) -> Slot:
        slot = self._slots[key]
        if slot is None:
            raise KeyError(f"sampler key {key} is not in use")
        return slot

    def _configure(self, key: int, slot: Slot, p: SamplingParams, reseed: bool) -> None:
        vocab = self.vocab_size
        top_k = p.top_k if 0 < p.top_k < vocab else 0
        self._table[key] = (
            p.temperature,
            top_k,
            p.top_p,
            p.min_p,
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        )
        slot.is_greedy = p.temperature < GREEDY_TEMPERATURE or top_k == 1
        slot.is_filtered = top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
        slot.is_penalized = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        bias = {t: b for t, b in p.logit_bias.items() if 0 <= t < vocab and b != 0.0}
        slot.bias_ids = np.fromiter(bias.keys(), np.int64, len(bias)) if bias else None
        slot.bias_values = np.fromiter(bias.values(), np.float32, len(bias)) if bias else None
        eos = sorted(t for t in slot.eos_ids if 0 <= t < vocab)
        early = sorted(set(eos) | {t for t in p.stop_token_ids if 0 <= t < vocab})
        slot.ban_always = np.array(eos, np.int64) if p.ignore_eos and eos else None
        slot.ban_early = np.array(early, np.int64) if p.min_tokens > 0 and early else None
        allowed = None if p.allowed_token_ids is None else np.asarray(p.allowed_token_ids, np.int64)
        slot.allow_ids = None if allowed is None else allowed[(allowed >= 0) & (allowed < vocab)]
        if reseed:
            slot.generator = None if p.seed is None else torch.Generator().manual_seed(p.seed)
        if slot.is_penalized and self._counts is None:
            self._allocate_penalty_state()

    def _allocate_penalty_state(self) -> None:
        self._counts = np.zeros((self.max_rows, self.vocab_size), dtype=np.float32)
        self._prompt_mask = np.zeros((self.max_rows, self.vocab_size), dtype=bool)
        for key, slot in enumerate(self._slots):
            if slot is not None:
                self._clear_penalty_rows(key, slot)
                np.add.at(self._counts[key], np.asarray(slot.outputs, np.int64), 1)

    def _clear_penalty_rows(self, key: int, slot: Slot) -> None:
        if self._counts is None:
            return
        self._counts[key] = 0
        self._prompt_mask[key] = False  # type: ignore[index]
        prompt = np.asarray(slot.prompt, np.int64)
        self._prompt_mask[key, prompt[(prompt >= 0) & (prompt < self.vocab_size)]] = True  # type: ignore[index]

    # ----- one step ------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, keys: list[int]) -> SampleOutput:
        """Choose one token per row and append it to that key's history.

        Args:
            logits: float32 ``[n, vocab]`` (other float dtypes / devices are converted).
            keys: ``keys[i]`` is row i's key; distinct, each added before.
        Returns:
            the tokens and, for rows that asked, logprobs of the raw distribution; rows whose
            sampling raised are in ``errors`` (the other rows are unaffected).
        """
        n = len(keys)
        if n == 0:
            return SampleOutput([], [])
        raw = np.ascontiguousarray(logits.detach().to("cpu", torch.float32).numpy())  # no copy: CPU f32
        if raw.shape != (n, self.vocab_size):
            raise ValueError(f"logits {tuple(raw.shape)} do not match {n} keys x vocab {self.vocab_size}")
        slots = [self._slot(k) for k in keys]
        key_arr = np.asarray(keys, np.int64)
        plan = Plan.build(slots)
        # Drawn first, so that a batch redone row by row uses the very same numbers.
        uniforms = np.full(n, np.nan)
        uniforms[plan.sampled_rows] = self._uniforms([slots[i] for i in plan.sampled_rows])
        errors: dict[int, Exception] = {}
        try:
            tokens, logprobs = self._sample_rows(raw, key_arr, slots, plan, uniforms)
        except Exception as exc:  # noqa: BLE001 - retried row by row, so only the faulty rows fail
            if n == 1:
                tokens, logprobs, errors = np.full(1, -1, np.int64), [None], {0: exc}
            else:
                tokens, logprobs, errors = self._sample_each(raw, key_arr, slots, uniforms)
        token_list = tokens.tolist()
        for i in plan.mask_rows:  # advance the grammars before any history is written
            if i not in errors and not slots[i].matcher.consume_token(token_list[i]):
                errors[i] = constraint_failed(slots[i].matcher, f"it refused token {token_list[i]}")
                logprobs[i] = None
        ok = [i for i in range(n) if i not in errors]
        for i in ok:
            slots[i].outputs.append(token_list[i])
        if self._counts is not None and ok:
            self._counts[key_arr[ok], tokens[ok]] += 1  # keys are distinct, so no index repeats
        return SampleOutput(token_list, logprobs, errors)

    def _sample_rows(
        self, raw: np.ndarray, key_arr: np.ndarray, slots: list[Slot], plan: Plan, uniforms: np.ndarray
    ) -> tuple[np.ndarray, list[TokenLogprob | None]]:
        """Tokens and logprobs of every row (no history is written here)."""
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            if plan.is_plain_greedy:
                tokens = raw.argmax(axis=1)
            else:
                tokens = self._choose(raw, key_arr, slots, plan, uniforms)
            logprobs = chosen_logprobs(raw, tokens, slots, plan.logprob_rows, self._ws)
        return tokens, logprobs

    def score(self, logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprob]:
        """How likely each given token was: ``token_ids[i]`` under row ``i`` of ``logits`` (prompt logprobs).

        Logprobs are of the raw distribution, as for sampled tokens; ``TokenLogprob.top`` holds the
        ``num_top`` most likely other tokens and ``rank`` is 1 + the number of tokens more likely
        than the given one. No per-key state is read or written. Cost per row: the log-sum-exp and
        one comparison pass over the vocabulary, plus ``top_n``. Measured on this 2-core box with
        another test run beside it: 128 rows x 16k take ~3 ms (~8 ms with 5 alternatives); 110
        rows x 152k (a prompt-logprobs chunk at Qwen's vocabulary) ~40 ms (~65 ms with 5), well
        under the LM head's cost for those rows.
        """
        raw = np.ascontiguousarray(logits.detach().to("cpu", torch.float32).numpy())
        l = raw.shape[0]
        if l != len(token_ids):
            raise ValueError(f"{l} rows of logits for {len(token_ids)} tokens")
        # Rows are independent: scoring them a block at a time keeps the scratch arrays at
        # SCORE_BLOCK_ROWS x vocab whatever the chunk's length (two such arrays and a few
        # boolean ones per block, rather than several copies of the whole chunk's logits).
        out: list[TokenLogprob] = []
        for start in range(0, l, SCORE_BLOCK_ROWS):
            out += score_block(
                raw[start : start + SCORE_BLOCK_ROWS], token_ids[start : start + SCORE_BLOCK_ROWS], num_top, self._ws
            )
        return out

    def _sample_each(
        self, raw: np.ndarray, key_arr: np.ndarray, slots: list[Slot], uniforms: np.ndarray
    ) -> tuple[np.ndarray, list[TokenLogprob | None], dict[int, Exception]]:
        """The batch raised: sample row by row and report the rows that raise on their own."""
        n = len(slots)
        tokens = np.full(n, -1, np.int64)
        logprobs: list[TokenLogprob | None] = [None] * n
        errors: dict[int, Exception] = {}
        for i in range(n):
            one = slice(i, i + 1)
            try:
                tok, lps = self._sample_rows(raw[one], key_arr[one], slots[one], Plan.build(slots[one]), uniforms[one])
            except Exception as exc:  # noqa: BLE001 - this row alone fails; the caller fails its request
                errors[i] = exc
                continue
            tokens[i], logprobs[i] = tok[0], lps[0]
        return tokens, logprobs, errors

    def _processed_logits(self, logits: torch.Tensor, keys: list[int]) -> np.ndarray:
        # For tests: the logits after penalties, bias and bans, before temperature.
        raw = np.ascontiguousarray(logits.detach().to("cpu", torch.float32).numpy())
        slots = [self._slot(k) for k in keys]
        return self._process(raw, np.asarray(keys, np.int64), slots, Plan.build(slots)).copy()

    def _choose(
        self, raw: np.ndarray, key_arr: np.ndarray, slots: list[Slot], plan: Plan, uniforms: np.ndarray
    ) -> np.ndarray:
        x = self._process(raw, key_arr, slots, plan)
        tokens = np.empty(len(slots), np.int64)
        if plan.greedy_rows:
            rows = np.asarray(plan.greedy_rows)
            best = x.argmax(axis=1)[rows]  # all rows: one cheap pass, no gather
            tokens[rows] = best
            # A row with every token banned has nothing to choose from: fall back to raw argmax.
            dead = ~np.isfinite(x[rows, best])
            if dead.any():
                tokens[rows[dead]] = raw[rows[dead]].argmax(axis=1)
        if plan.sampled_rows:
            rows = np.asarray(plan.sampled_rows)
            drawn = self._draw(x, rows, key_arr[rows], [slots[i] for i in plan.sampled_rows], uniforms[rows])
            dead = drawn < 0
            if dead.any():
                drawn[dead] = raw[rows[dead]].argmax(axis=1)
            tokens[rows] = drawn
        return tokens

    def _process(self, raw: np.ndarray, key_arr: np.ndarray, slots: list[Slot], plan: Plan) -> np.ndarray:
        """Penalties, logit_bias and bans applied to a copy of ``raw`` (``raw`` if none apply)."""
        if not (plan.penalty_rows or plan.bias_rows or plan.ban_rows or plan.allow_rows or plan.mask_rows):
            return raw
        n, vocab = raw.shape
        x = self._ws.get("x", (n, vocab), np.float32)
        np.copyto(x, raw)
        if plan.penalty_rows:
            rows = np.asarray(plan.penalty_rows)
            keys = key_arr[rows]
            prm = self._table[keys]
            counts = np.take(self._counts, keys, axis=0, out=self._ws.get("scratch", (len(keys), vocab), np.float32))  # type: ignore[arg-type]
            prompt = np.take(self._prompt_mask, keys, axis=0, out=self._ws.get("flags", (len(keys), vocab), bool))  # type: ignore[arg-type]
            apply_penalties(x, rows, counts, prompt, prm[:, _REP], prm[:, _PRES], prm[:, _FREQ])
        if plan.bias_rows:
            ids = [slots[i].bias_ids for i in plan.bias_rows]
            rows = np.repeat(plan.bias_rows, [len(a) for a in ids])  # type: ignore[arg-type]
            x[rows, np.concatenate(ids)] += np.concatenate([slots[i].bias_values for i in plan.bias_rows])  # type: ignore[arg-type]
        if plan.ban_rows:
            rows = np.repeat([i for i, _ in plan.ban_rows], [len(a) for _, a in plan.ban_rows])
            x[rows, np.concatenate([a for _, a in plan.ban_rows])] = -np.inf
        if plan.allow_rows:
            ids = [slots[i].allow_ids for i in plan.allow_rows]
            allowed = np.zeros((len(ids), raw.shape[1]), bool)
            allowed[np.repeat(np.arange(len(ids)), [len(a) for a in ids]), np.concatenate(ids)] = True  # type: ignore[arg-type]
            self._restrict(x, raw, np.asarray(plan.allow_rows), allowed)
        if plan.mask_rows:
            self._apply_masks(x, raw, [slots[i].matcher for i in plan.mask_rows], plan.mask_rows)
        return x

    def _apply_masks(self, x: np.ndarray, raw: np.ndarray, matchers: list[Any], rows: list[int]) -> None:
        """-inf on every token a row's grammar forbids (all rows' masks filled in one call)."""
        for matcher in matchers:
            if matcher.is_error():
                raise constraint_failed(matcher, "no token is allowed")
        vocab = self.vocab_size
        words = -(-vocab // 32)
        bitmask = self._ws.get("bitmask", (len(rows), words), np.int32)
        fill_next_token_bitmask_par(self._grammar_executor(), [(m, j) for j, m in enumerate(matchers)], bitmask)
        allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little").view(bool)
        self._restrict(x, raw, np.asarray(rows), allowed)

    @staticmethod
    def _restrict(x: np.ndarray, raw: np.ndarray, rows: np.ndarray, allowed: np.ndarray) -> None:
        """-inf on every token ``allowed`` (one boolean row per row of ``rows``) forbids. The
        restriction wins over bans: a row left with nothing takes ``raw`` under it alone."""
        masked = np.where(allowed, x[rows], np.float32(-np.inf))
        dead = ~np.isfinite(masked.max(axis=1))
        if dead.any():
            masked[dead] = np.where(allowed[dead], raw[rows[dead]], np.float32(-np.inf))
        x[rows] = masked

    def _grammar_executor(self) -> Any:
        if self._executor is None:
            self._executor = LLExecutor()
        return self._executor

    def _draw(
        self, x: np.ndarray, rows: np.ndarray, keys: np.ndarray, slots: list[Slot], uniforms: np.ndarray
    ) -> np.ndarray:
        """Temperature, top-k/top-p/min-p and one inverse-CDF draw per row; -1 marks dead rows."""
        s, vocab, width = len(rows), self.vocab_size, self._width
        w = self._ws.get("w", (s, width), np.float32)
        w[:, vocab:] = -np.inf
        if s == len(x):  # every row is sampled: read x in place
            src = x
        else:
            src = np.take(x, rows, axis=0, out=w[:, :vocab], mode="clip")
        peak = src.max(axis=1)
        dead = ~np.isfinite(peak)  # all banned, or inf/nan logits
        np.subtract(src, peak[:, None], out=w[:, :vocab])
        prm = self._table[keys]  # [s, 7]
        w /= prm[:, _TEMP, None]  # (x - max) / T: the row maximum becomes exactly 0
        if dead.any():  # draw a placeholder; the caller replaces it
            w[dead] = -np.inf
            w[dead, 0] = 0.0
        np.exp(w, out=w)  # weights in [0, 1], the row maximum is 1
        if any(sl.is_filtered for sl in slots):
            # Unfiltered rows carry neutral values (top_k 0, top_p 1, min_p 0): threshold 0.
            scratch = self._ws.get("scratch", (s, width), np.float32)
            thr = keep_thresholds(
                w, prm[:, _TOP_K].astype(np.int64), prm[:, _TOP_P], prm[:, _MIN_P], self.num_candidates, scratch=scratch
            )
            keep = np.greater_equal(w, thr[:, None], out=self._ws.get("flags", (s, width), bool))
            np.multiply(w, keep, out=w)
        tokens = inverse_cdf(w, uniforms)
        tokens[dead] = -1
        return tokens

    def _uniforms(self, slots: list[Slot]) -> np.ndarray:
        # Seeded rows draw from their own generator, exactly one value per sampled step, so their
        # stream does not depend on the batch; unseeded rows share one draw.
        shared = [i for i, sl in enumerate(slots) if sl.generator is None]
        u = np.empty(len(slots), dtype=np.float64)
        if shared:
            u[shared] = torch.rand(len(shared), generator=self._generator, dtype=torch.float64).numpy()
        for i, sl in enumerate(slots):
            if sl.generator is not None:
                u[i] = torch.rand(1, generator=sl.generator, dtype=torch.float64).item()
        return u
