"""``FakeRunner``: a ``ModelRunner`` with deterministic logits and no model, for fast engine tests.

It keeps what a real runner's KV cache would hold, as token ids: row ``r`` holds the tokens
written at positions ``0 .. len - 1`` by ``forward`` or ``copy_row``. The logits after
position ``p`` of a row are a fixed pseudo-random vector seeded by a hash of the row's
tokens ``0 .. p`` as the row holds them. So the same history always gives the same
distribution, different histories give different ones, and a scheduler or KV-manager bug
that leaves a row holding other tokens than the request's (a wrong prefix copy, a stale
row after preemption) changes the logits and so the generated tokens, exactly as
corrupted keys and values would with a real model. Reading a position never written
raises, like an out-of-range cache index would.

Logits favour a small printable alphabet (``fake_tokenizer``'s letters and space) so that
generated text is readable; end of sequence is unlikely unless ``script`` forces it.

Hooks for tests, all set as plain attributes (an engine thread sees them at its next step):

- ``script(tokens)``: called with a row's tokens up to the position whose logits are
  computed; a returned token id gets all the probability mass, ``None`` leaves the
  pseudo-random logits. It may raise to fail the step (the engine fails the step's requests).
  ``reply_script(prompt, reply)`` makes a script that answers one prompt with given tokens
  (for a given text, its ``fake_tokenizer`` encoding).
- ``gate``: anything with ``wait()`` and ``set()``, waited on at the start of every
  ``forward``: a ``threading.Event`` (while clear, the model "prefills" forever) or a
  ``StepGate`` (a test lets steps through one by one). ``set()`` opens it for good.
- ``delay_s``: seconds each ``forward`` takes (a slow model, so streams last).

The ``fake_tokenizer`` is a real ``rill.models.tokenizer.Tokenizer``: a byte-level BPE with
no merges (one token per byte) built in memory, with the demo model's special tokens and
chat template.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Protocol

import numpy as np
import torch

from rill.engine.batch import RowWork, check_work
from rill.models.tokenizer import Tokenizer

MASK64 = (1 << 64) - 1
FORCED_LOGIT = 100.0
OTHER_LOGIT = -30.0  # tokens outside the alphabet: possible (grammar masks may need them), never likely
EOS_LOGIT = -8.0

Script = Callable[[Sequence[int]], "int | None"]
"""Given a row's tokens up to a position, the token to force after it (or None)."""


class Gate(Protocol):
    """What ``FakeRunner.gate`` needs: ``wait`` blocks a step, ``set`` opens the gate for good."""

    def wait(self) -> Any:
        """Block until this step may run."""
        ...

    def set(self) -> None:
        """Let every step through from now on."""
        ...


class StepGate:
    """A gate letting through as many steps as ``allow`` granted (then ``set`` opens it for good)."""

    def __init__(self) -> None:
        self._permits = threading.Semaphore(0)
        self._is_open = False
        self.num_passed = 0
        """Steps let through so far."""
        self.is_waiting = False
        """Whether a step waits at the gate now."""

    def allow(self, num_steps: int = 1) -> None:
        """Let ``num_steps`` more steps run."""
        self._permits.release(num_steps)

    def wait(self) -> None:
        """Block until a step is allowed (or the gate is open)."""
        if not self._is_open:
            self.is_waiting = True
            self._permits.acquire()
            self.is_waiting = False
        self.num_passed += 1

    def set(self) -> None:
        """Open the gate: no step waits any more (teardown)."""
        self._is_open = True
        self._permits.release(1 << 20)


class FakeRunner:
    """A ``ModelRunner`` over ``num_rows`` rows of ``max_len`` tokens; see the module docstring.

    Attributes:
        num_rows: logical KV rows.
        max_len: tokens per row.
        kv_bytes_per_token: pretend KV bytes of one token (for memory gauges).
        vocab_size: width of the returned logits.
        script: see the module docstring.
        gate: see the module docstring.
        delay_s: see the module docstring.
        num_forwards: ``forward`` calls so far.
        num_tokens_fed: tokens fed to ``forward`` so far (prefill and decode).
        copies: every ``copy_row`` as ``(src, dst, num_tokens)``.
        packs_rows: False (a step costs the same over any rows).
        device: ``"cpu"``.
    """

    device = "cpu"
    packs_rows = False

    def __init__(
        self,
        num_rows: int = 16,
        max_len: int = 256,
        vocab_size: int | None = None,
        likely_ids: Sequence[int] | None = None,
        eos_token_id: int | None = None,
        kv_bytes_per_token: int = 64,
    ) -> None:
        """Args:
        num_rows: KV rows (sequences plus prefix-cache entries).
        max_len: tokens per row.
        vocab_size: logits width; default the fake tokenizer's.
        likely_ids: tokens that get ordinary logits; default the fake tokenizer's alphabet.
        eos_token_id: the end-of-sequence id (an unlikely logit); default the fake tokenizer's.
        kv_bytes_per_token: pretend KV size of one token.
        """
        if num_rows < 1 or max_len < 1:
            raise ValueError(f"num_rows ({num_rows}) and max_len ({max_len}) must be >= 1")
        tokenizer = fake_tokenizer()
        self.num_rows = num_rows
        self.max_len = max_len
        self.vocab_size = vocab_size or tokenizer.vocab_size
        self.kv_bytes_per_token = kv_bytes_per_token
        self.script: Script | None = None
        self.gate: Gate | None = None
        self.delay_s = 0.0
        self.num_forwards = 0
        self.num_tokens_fed = 0
        self.copies: list[tuple[int, int, int]] = []
        likely = list(likely_ids) if likely_ids is not None else alphabet_ids()
        eos = tokenizer.eos_token_id if eos_token_id is None else eos_token_id
        self._base = np.full(self.vocab_size, OTHER_LOGIT, dtype=np.float32)
        self._base[eos] = EOS_LOGIT
        self._likely = np.array(likely, dtype=np.int64)
        self._rows: list[list[int]] = [[] for _ in range(num_rows)]
        self._hashes: list[list[int]] = [[] for _ in range(num_rows)]  # hash of tokens 0..p, per p

    # -- ModelRunner -------------------------------------------------------------------------
    def forward(self, work: Sequence[RowWork]) -> torch.Tensor:
        """Write each item's tokens into its row; return float32 logits ``[n, vocab_size]``:
        ``item.num_logits`` rows per item (every position of an ``all_logits`` chunk), in order."""
        if self.gate is not None:
            self.gate.wait()
        if self.delay_s:
            time.sleep(self.delay_s)  # stands for the model's compute time
        self.num_forwards += 1
        self._check(work)
        out = []
        for item in work:
            self._write(item)
            self.num_tokens_fed += len(item.token_ids)
            end = item.start + len(item.token_ids)
            for stop in range(end - item.num_logits + 1, end + 1):
                out.append(self.logits_after(self._rows[item.row][:stop], self._hashes[item.row][stop - 1]))
        if not out:
            return torch.empty((0, self.vocab_size), dtype=torch.float32)
        return torch.from_numpy(np.stack(out))

    def copy_row(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy positions ``[0, num_tokens)`` of row ``src`` into row ``dst``."""
        if not (0 <= src < self.num_rows and 0 <= dst < self.num_rows):
            raise ValueError(f"row out of range: src={src}, dst={dst}, num_rows={self.num_rows}")
        if not 0 <= num_tokens <= len(self._rows[src]):
            raise ValueError(f"row {src} holds {len(self._rows[src])} tokens; cannot copy {num_tokens}")
        self.copies.append((src, dst, num_tokens))
        self._rows[dst] = self._rows[src][:num_tokens]
        self._hashes[dst] = self._hashes[src][:num_tokens]

    def discard(self, row: int, keep_tokens: int) -> None:
        """Nothing to give back: the rows are lists of token ids, and they keep their tokens
        (``row_tokens`` shows what a row last held)."""

    # -- what the rows hold ------------------------------------------------------------------
    def row_tokens(self, row: int) -> list[int]:
        """The tokens row ``row`` holds (what its keys and values would encode)."""
        return list(self._rows[row])

    def logits_after(self, tokens: Sequence[int], digest: int | None = None) -> np.ndarray:
        """The logits this runner gives after ``tokens`` (``digest``: their ``history_hash``)."""
        if self.script is not None:
            forced = self.script(tokens)
            if forced is not None:
                logits = np.full(self.vocab_size, OTHER_LOGIT, dtype=np.float32)
                logits[forced] = FORCED_LOGIT
                return logits
        seed = history_hash(tokens) if digest is None else digest
        logits = self._base.copy()
        noise = np.random.default_rng(seed).standard_normal(len(self._likely)).astype(np.float32)
        logits[self._likely] = 2.0 * noise
        return logits

    def _check(self, work: Sequence[RowWork]) -> None:
        check_work(work, self.num_rows, self.max_len, [len(tokens) for tokens in self._rows])

    def _write(self, item: RowWork) -> None:
        tokens = self._rows[item.row][: item.start]
        hashes = self._hashes[item.row][: item.start]
        digest = hashes[-1] if hashes else 0
        for token in item.token_ids:
            digest = _mix(digest, token)
            tokens.append(token)
            hashes.append(digest)
        self._rows[item.row], self._hashes[item.row] = tokens, hashes


def reply_script(prompt: Sequence[int], reply: Sequence[int], then_eos: bool = True) -> Script:
    """A script answering ``prompt`` (token ids) with ``reply`` (token ids) and then the fake
    tokenizer's end of sequence (the usual logits instead when ``then_eos`` is false). Other
    histories get the usual logits."""
    prompt, reply = list(prompt), list(reply)
    eos = fake_tokenizer().eos_token_id

    def script(tokens: Sequence[int]) -> int | None:
        if list(tokens[: len(prompt)]) != prompt:
            return None
        index = len(tokens) - len(prompt)
        if index < len(reply):
            return reply[index]
        return eos if then_eos else None

    return script


def history_hash(tokens: Sequence[int]) -> int:
    """A 64-bit hash of a token sequence, the same in every process (not Python's ``hash``)."""
    digest = 0
    for token in tokens:
        digest = _mix(digest, token)
    return digest


def _mix(digest: int, token: int) -> int:
    # splitmix64's finaliser over the running digest and the token.
    z = (digest * 0x9E3779B97F4A7C15 + token + 1) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


# -- the fake tokenizer -------------------------------------------------------------------
ALPHABET = "abcdefghijklmnopqrstuvwxyz "
"""The characters ``FakeRunner`` makes likely by default (one token each)."""


@lru_cache(maxsize=4)
def fake_tokenizer(with_chat_template: bool = True, chat_template: str | None = None) -> Tokenizer:
    """A byte-level tokenizer with one token per byte, the demo's special tokens and chat
    template (``chat_template`` instead if given; none when ``with_chat_template`` is false).

    Ids: the eight special tokens of ``rill.demo.tokenizer`` (``<s>`` = 1, ``</s>`` = 2, ...),
    then the 256 byte symbols. Plain prompts get ``<s>`` in front. Built in memory (no
    training), so it costs milliseconds.
    """
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as Backend

    from rill.demo.tokenizer import BOS, SPECIAL_TOKENS, tokenizer_config

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    config = tokenizer_config(max_context_tokens=4096)
    special = {key: config[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return Tokenizer(
        backend,
        special_tokens=special,
        extra_special_tokens=config["additional_special_tokens"],
        chat_templates={"default": chat_template or config["chat_template"]} if with_chat_template else {},
        name="fake",
    )


@lru_cache(maxsize=1)
def alphabet_ids() -> list[int]:
    """Token ids of ``ALPHABET``'s characters in the fake tokenizer."""
    tokenizer = fake_tokenizer()
    return [tokenizer.encode(char, add_special_tokens=False)[0] for char in ALPHABET]
