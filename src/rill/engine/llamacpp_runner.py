"""``LlamaCppRunner``: a ``ModelRunner`` over a llama.cpp context, for GGUF files (``--runner llamacpp``).

llama.cpp computes the forward with its own kernels on the file's quantized weights (Q4_K,
Q8_0, ...); everything else stays rill's: the scheduler decides the work, rill's sampler draws
from the returned logits, rill's tokenizer (built from the same GGUF) encodes and decodes. So
every control, sampling feature and protocol works unchanged.

Mapping of the ``ModelRunner`` contract onto llama.cpp:

* one llama.cpp sequence id per logical KV row (``n_seq_max`` = the engine's rows), each in its
  own KV stream of ``max_len`` cells (``kv_unified`` off). A row's cells then sit in position
  order whatever the other rows do, and flash attention sums them in that order, so a request's
  tokens do not depend on what it is batched with (in one unified cache they do, in the last
  bits: a row's cells land wherever free cells are, and greedy choices flipped at near-ties).
  A prefix copy (``copy_row``) is ``llama_memory_seq_cp``: across streams llama.cpp copies the
  whole stream (at the next decode), then the copy's tail past the prefix is removed;
* one engine step is one ``llama_batch``: every decode token and prefill chunk of the step,
  with logits requested exactly where the engine wants them (the last token of a chunk, every
  token of an ``all_logits`` chunk). A step larger than the context's ``n_batch`` is decoded in
  several calls, in order. The batch lists the items by row: with one KV stream per sequence,
  llama.cpp puts only a run of consecutive sequence ids, in batch order, into one micro-batch
  (each micro-batch reads every weight once), so rows 2, 0, 1 in that order took two
  micro-batches where 0, 1, 2 take one. Measured on SmolLM2 f32, 32 decode rows: 127.5 ms per
  step on rows 0..31, 494.8 ms on 32 rows spread over 0..46 in runs of one or two; the logits
  go back to the order of the work;
* the contract says positions past ``start`` of a row are garbage; llama.cpp needs them gone
  (it requires each sequence's positions to continue its last one), so work at ``start`` first
  removes the row's cells at positions ``>= start`` (``llama_memory_seq_rm``). That is also how
  a row freed by the engine is reused: its stale cells go when it is next written or copied to.

The ``llama_cpp`` package (``pip install 'rill[llamacpp]'``, built from the llama-cpp-python
source distribution) is imported when a runner is created, never at module import. Imports
numpy, torch and ``rill.engine.batch``; nothing of the frontend or protocols.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rill.engine.batch import RowWork, check_work
from rill.errors import ModelLoadError

log = logging.getLogger("rill.engine.llamacpp")

EXTRA_HINT = "install the llamacpp extra: pip install 'rill[llamacpp]' (it builds llama-cpp-python==0.3.36)"
"""What to do when ``llama_cpp`` is missing (said in every error about it)."""

MAX_SEQUENCES = 256
"""llama.cpp's limit on sequence ids in one context (``LLAMA_MAX_SEQ``): the most rows a runner has."""

DEFAULT_BATCH_TOKENS = 2048
"""Tokens of one ``llama_decode`` call; a larger step is decoded in several calls."""

_LOG_LEVELS = {3: logging.WARNING, 4: logging.ERROR}  # ggml_log_level WARN, ERROR; the rest is debug chatter
_LOG_CONTINUE = 5  # ggml_log_level CONT: the rest of the previous line


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module, or ``ModelLoadError`` saying how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ModelLoadError(f"--runner llamacpp needs the llama_cpp package ({exc}); {EXTRA_HINT}") from exc
    _route_logs(llama_cpp)
    return llama_cpp


_log_callback: Any = None  # kept referenced: llama.cpp calls it from C for the process's lifetime


def _route_logs(llama_cpp: Any) -> None:
    """Send llama.cpp's log lines to rill's logger instead of stderr (its warnings stay visible)."""
    global _log_callback
    if _log_callback is not None:
        return

    last = [logging.DEBUG]

    def forward(level: int, text: bytes, user_data: Any) -> None:
        if level != _LOG_CONTINUE:
            last[0] = _LOG_LEVELS.get(level, logging.DEBUG)
        message = text.decode("utf-8", "replace").rstrip()
        if message:
            log.log(last[0], "%s", message)

    _log_callback = llama_cpp.llama_log_callback(forward)
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


class _Batch:
    """A ``llama_batch`` whose arrays are numpy buffers owned here (filled by slices, not per token).

    Each token belongs to one sequence: ``seq_id[i]`` points at ``seq_ids[i]``.
    """

    def __init__(self, llama_cpp: Any, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = np.zeros(capacity, dtype=np.int32)
        self.positions = np.zeros(capacity, dtype=np.int32)
        self.num_seq_ids = np.ones(capacity, dtype=np.int32)
        self.seq_ids = np.zeros(capacity, dtype=np.int32)
        self.logits = np.zeros(capacity, dtype=np.int8)
        base = self.seq_ids.ctypes.data
        self._seq_id_ptrs = (ctypes.POINTER(ctypes.c_int32) * capacity)(
            *[ctypes.cast(base + 4 * i, ctypes.POINTER(ctypes.c_int32)) for i in range(capacity)]
        )
        self.struct = llama_cpp.llama_batch()
        self.struct.token = self.tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.embd = ctypes.POINTER(ctypes.c_float)()
        self.struct.pos = self.positions.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.n_seq_id = self.num_seq_ids.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.struct.seq_id = ctypes.cast(self._seq_id_ptrs, type(self.struct.seq_id))
        self.struct.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))


class LlamaCppRunner:
    """Runs engine steps on a GGUF file with llama.cpp over ``num_rows`` rows of ``max_len`` tokens.

    Attributes:
        num_rows: logical KV rows (llama.cpp sequence ids ``0 .. num_rows - 1``).
        max_len: tokens per row.
        kv_bytes_per_token: bytes of keys and values of one token over all layers (F16 cache).
        vocab_size: width of the returned logits.
        kv_capacity_bytes: size of the whole cache.
        num_threads: llama.cpp threads for decode and prompt work (as created; the engine's
            thread governor may run fewer, see ``set_num_threads``: llama.cpp's workers poll
            at every barrier, so beside a busy process two of them on two CPUs ran 16x slower
            than one, SmolLM2 Q4_1 at c=1 5.4 against 90 tok/s).
        device: always ``"cpu"`` (the extra is built for the CPU).
        packs_rows: True: with one KV stream per row, a step costs a micro-batch per run of
            consecutive rows (see the module docstring), so the engine keeps live rows low
            and together. False with ``unified`` (any rows share a micro-batch there).
    """

    device = "cpu"

    def __init__(
        self,
        path: str | Path,
        num_rows: int,
        max_len: int,
        num_threads: int,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        unified: bool = False,
    ) -> None:
        """Load ``path`` and create a context for ``num_rows`` sequences of ``max_len`` tokens.

        ``unified``: one KV cell pool shared by all rows (prefix copies share cells instead of
        copying them; batch invariance only up to near-ties, see the module docstring).

        Raises:
            ValueError: rows, length, threads or batch size out of range.
            ModelLoadError: ``llama_cpp`` is not installed, or llama.cpp cannot load the file.
        """
        if not 1 <= num_rows <= MAX_SEQUENCES:
            raise ValueError(f"num_rows must be in 1..{MAX_SEQUENCES} (llama.cpp's sequence limit), not {num_rows}")
        if max_len < 1 or num_threads < 1 or batch_tokens < 1:
            raise ValueError(
                f"max_len ({max_len}), num_threads ({num_threads}) and batch_tokens ({batch_tokens}) must be >= 1"
            )
        self._ll = llama = import_llama_cpp()
        self.num_rows = num_rows
        self.max_len = max_len
        self.num_threads = num_threads
        self._model = self._ctx = None
        self.unified = unified
        self.packs_rows = not unified
        self._load(path, batch_tokens)
        self._batch_tokens = int(llama.llama_n_batch(self._ctx))  # llama.cpp caps it at the context size
        self._memory = llama.llama_get_memory(self._ctx)
        self.vocab_size = int(llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self._model)))
        self.kv_bytes_per_token = self._kv_bytes_per_token()
        self.kv_capacity_bytes = self.kv_bytes_per_token * num_rows * max_len
        self._batch = _Batch(llama, self._batch_tokens)
        self._lengths = [0] * num_rows  # per row: positions llama.cpp holds (0 .. length - 1)

    def _load(self, path: str | Path, batch_tokens: int) -> None:
        """Load the model's weights and create its context (``self._model``, ``self._ctx``).

        Raises:
            ValueError: ``max_len`` exceeds the model's training context.
            ModelLoadError: llama.cpp cannot load the file or create the context.
        """
        llama, num_rows, max_len = self._ll, self.num_rows, self.max_len
        llama.llama_backend_init()
        model_params = llama.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = llama.llama_model_load_from_file(str(path).encode(), model_params)
        if not self._model:
            raise ModelLoadError(f"llama.cpp cannot load {path} (see the rill.engine.llamacpp log for why)")
        train_len = llama.llama_model_n_ctx_train(self._model)
        if max_len > train_len:
            self.close()
            raise ValueError(f"max_len {max_len} exceeds the model's training context {train_len}")
        params = llama.llama_context_default_params()
        params.n_ctx = num_rows * max_len
        params.n_batch = batch_tokens
        params.n_ubatch = min(512, batch_tokens)
        params.n_seq_max = num_rows
        params.n_threads = params.n_threads_batch = self.num_threads
        params.kv_unified = self.unified
        params.no_perf = True
        self._ctx = llama.llama_init_from_model(self._model, params)
        if not self._ctx:
            self.close()
            raise ModelLoadError(f"llama.cpp cannot create a context of {num_rows} x {max_len} tokens for {path}")

    def _kv_bytes_per_token(self) -> int:
        """Keys and values of one token over all layers in the F16 cache.

        A head's width is the file's ``key_length`` / ``value_length`` where it gives them:
        Gemma 3's and Qwen3's heads are not ``n_embd / n_head`` wide (Gemma 3 270M: 256, not 160).
        """
        llama, model = self._ll, self._model
        plain = llama.llama_model_n_embd(model) // llama.llama_model_n_head(model)
        arch = self._metadata("general.architecture")
        key = int(self._metadata(f"{arch}.attention.key_length") or plain)
        value = int(self._metadata(f"{arch}.attention.value_length") or plain)
        return int(llama.llama_model_n_layer(model) * llama.llama_model_n_head_kv(model) * (key + value) * 2)

    def _metadata(self, key: str) -> str | None:
        """A GGUF metadata value as llama.cpp read it, or None when the file has no such key."""
        buffer = ctypes.create_string_buffer(256)
        size = self._ll.llama_model_meta_val_str(self._model, key.encode(), buffer, len(buffer))
        return buffer.value.decode() if size >= 0 else None

    # -- ModelRunner -------------------------------------------------------------------------
    def forward(self, work: Sequence[RowWork]) -> torch.Tensor:
        """Run one step; return float32 logits ``[n, vocab_size]``: ``item.num_logits`` rows per
        item (every position of an ``all_logits`` chunk), in the order of ``work``."""
        self._check(work)
        for item in work:
            if self._lengths[item.row] > item.start:
                self._ll.llama_memory_seq_rm(self._memory, item.row, item.start, -1)
            self._lengths[item.row] = item.start
        num_out = sum(item.num_logits for item in work)
        out = np.empty((num_out, self.vocab_size), dtype=np.float32)
        try:
            done = self._fill_and_decode(work, out)
        except Exception:
            # A failed decode may leave some of the step's tokens in the cache: drop them all,
            # so each row holds exactly what it held before the step.
            for item in work:
                self._ll.llama_memory_seq_rm(self._memory, item.row, item.start, -1)
                self._lengths[item.row] = item.start
            raise
        if done != num_out:
            raise RuntimeError(f"llama.cpp returned {done} rows of logits, {num_out} expected")
        return torch.from_numpy(out)

    def set_num_threads(self, num_threads: int) -> None:
        """Run the following steps on ``num_threads`` llama.cpp threads (decode and prompt work)."""
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, not {num_threads}")
        self._ll.llama_set_n_threads(self._ctx, num_threads, num_threads)

    @property
    def threads_in_use(self) -> int:
        """The threads llama.cpp runs the next step on."""
        return int(self._ll.llama_n_threads(self._ctx))

    def _fill_and_decode(self, work: Sequence[RowWork], out: np.ndarray) -> int:
        """Pack the step into the batch by row, decoding whenever it is full; return the logits
        rows written (each at its place in ``work``'s order)."""
        batch, cap = self._batch, self._batch_tokens
        first_out = list(
            itertools.accumulate((item.num_logits for item in work), initial=0)
        )  # each item's first out row
        filled = done = 0
        dest: list[int] = []  # out rows of the batch's logits so far, in batch order
        for k in sorted(range(len(work)), key=lambda k: work[k].row):
            item = work[k]
            ids, start, n = item.token_ids, item.start, len(item.token_ids)
            first_wanted = n - item.num_logits  # tokens of the item from this index on get logits
            offset = 0
            while offset < n:
                take = min(n - offset, cap - filled)
                end = filled + take
                batch.tokens[filled:end] = ids[offset : offset + take]
                batch.positions[filled:end] = np.arange(start + offset, start + offset + take, dtype=np.int32)
                batch.seq_ids[filled:end] = item.row
                lo = max(first_wanted - offset, 0)
                batch.logits[filled:end] = 0
                if lo < take:
                    batch.logits[filled + lo : end] = 1
                    base = first_out[k] + offset - first_wanted
                    dest.extend(range(base + lo, base + take))
                filled, offset = end, offset + take
                if filled == cap:
                    done += self._decode(filled, out, dest)
                    filled, dest = 0, []
            self._lengths[item.row] = start + n
        if filled:
            done += self._decode(filled, out, dest)
        return done

    def discard(self, row: int, keep_tokens: int) -> None:
        """Nothing to give back: llama.cpp's cache is one buffer allocated with the context, and
        a row's stale positions are removed when the row is next written (``forward``)."""

    def copy_row(self, src: int, dst: int, num_tokens: int) -> None:
        """Make row ``dst`` hold positions ``[0, num_tokens)`` of row ``src``."""
        if not (0 <= src < self.num_rows and 0 <= dst < self.num_rows):
            raise ValueError(f"row out of range: src={src}, dst={dst}, num_rows={self.num_rows}")
        if not 0 <= num_tokens <= self._lengths[src]:
            raise ValueError(f"row {src} holds {self._lengths[src]} tokens; cannot copy {num_tokens}")
        if src == dst:
            self._ll.llama_memory_seq_rm(self._memory, dst, num_tokens, -1)
        elif self.unified:
            self._ll.llama_memory_seq_rm(self._memory, dst, -1, -1)
            if num_tokens:
                self._ll.llama_memory_seq_cp(self._memory, src, dst, 0, num_tokens)
        else:
            # Across streams llama.cpp copies whole buffers only; the tail is dropped after.
            self._ll.llama_memory_seq_rm(self._memory, dst, -1, -1)
            if num_tokens:
                self._ll.llama_memory_seq_cp(self._memory, src, dst, -1, -1)
                self._ll.llama_memory_seq_rm(self._memory, dst, num_tokens, -1)
        self._lengths[dst] = num_tokens

    # -- other ---------------------------------------------------------------------------------
    def row_length(self, row: int) -> int:
        """Positions llama.cpp holds for ``row`` (one past its last position; 0 when empty)."""
        return int(self._ll.llama_memory_seq_pos_max(self._memory, row)) + 1

    def close(self) -> None:
        """Free the llama.cpp context and model (the runner is unusable afterwards)."""
        if self._ctx:
            self._ll.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            self._ll.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn llama_cpp down already
            pass

    def _decode(self, num_tokens: int, out: np.ndarray, dest: list[int]) -> int:
        """Decode the first ``num_tokens`` of the batch; copy its logits rows to ``out[dest]``
        (``dest``: one out row per token with logits, in batch order); return how many."""
        batch = self._batch
        batch.struct.n_tokens = num_tokens
        wanted = len(dest)  # one per token whose logits flag _fill_and_decode set
        status = self._ll.llama_decode(self._ctx, batch.struct)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status} on a batch of {num_tokens} tokens")
        if wanted:
            pointer = self._ll.llama_get_logits(self._ctx)
            out[dest] = np.ctypeslib.as_array(pointer, shape=(wanted * self.vocab_size,)).reshape(
                wanted, self.vocab_size
            )
        return wanted

    def _check(self, work: Sequence[RowWork]) -> None:
        check_work(work, self.num_rows, self.max_len, self._lengths)
