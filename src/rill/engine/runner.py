"""``TorchModelRunner``: the PyTorch ``ModelRunner`` over a contiguous per-row KV cache.

The cache is one tensor ``[layers, 2, rows, kv_heads, max_len, head_dim]`` in the model dtype;
layer ``l``'s keys are the view ``[l, 0]``. Logical rows (the scheduler's) map to physical
rows. Before each step the rows being decoded are swapped into physical rows ``0..B-1`` so
decode attention reads a strided view ``[:B, :, :len]`` of the cache and never gathers it
(engine-notes §7: this beat paged attention on CPU). Prefill chunks stay where they are.

Each step is one forward: all decode tokens and all prefill chunks are packed into one flat
batch (``rill.models.attention.StepBatch``); the LM head runs only on positions whose logits
are wanted.

The model is any ``rill.models.registry.CausalLM`` (every registered family). Imports torch,
``rill.engine.batch`` and ``rill.models``; nothing of the frontend or protocols.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import sys
import time
from collections.abc import Sequence

import torch

import rill.models.packed as packed
from rill.engine.batch import RowWork, check_work
from rill.models.attention import BY_TOKEN_PREFILL_TOKENS, PrefillLayout, StepBatch
from rill.models.loader import LoadedModel
from rill.models.registry import CausalLM


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor for the KV cache that, on the CPU, takes memory only as rows are written.

    ``torch.zeros`` writes every byte, so a 2 GiB budget was resident from the start whatever
    the load. An anonymous ``mmap`` is zero-filled by the kernel page by page on first touch:
    the cache is still zeros everywhere, and the process holds what its sequences used.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps ``pages`` alive for as long as the tensor (and its views) live.
    return torch.frombuffer(pages, dtype=dtype, count=math.prod(shape)).view(shape)


_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
# Only Linux promises that an anonymous private page given back reads as zeros when touched again.
_madvise = getattr(_libc, "madvise", None) if sys.platform.startswith("linux") else None


def release_pages(address: int, length: int) -> int:
    """Give the whole pages inside ``[address, address + length)`` of an anonymous private
    mapping back to the kernel; they read as zeros when next touched. Returns the bytes
    released (0 where ``madvise`` is missing or refuses)."""
    start = -(-address // _PAGE) * _PAGE
    end = (address + length) // _PAGE * _PAGE
    if _madvise is None or end <= start:
        return 0
    return end - start if _madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) == 0 else 0


def _by_token(prefill: list[RowWork], decode: list[RowWork]) -> bool:
    """Whether a step's chunks may attend token by token (``StepBatch.by_token``): all of them
    speculative drafts, or prompt chunks of at most ``BY_TOKEN_PREFILL_TOKENS`` tokens beside
    decode rows."""
    if not prefill:
        return False
    if all(item.draft for item in prefill):
        return True
    prompt_tokens = sum(len(item.token_ids) for item in prefill if not item.draft)
    return bool(decode) and prompt_tokens <= BY_TOKEN_PREFILL_TOKENS


class TorchModelRunner:
    """Runs steps of a ``LoadedModel`` over ``num_rows`` KV rows of ``max_len`` tokens each.

    Attributes:
        num_rows: logical KV rows.
        max_len: tokens per row.
        kv_bytes_per_token: bytes of keys and values of one token over all layers.
        vocab_size: width of the returned logits.
        packs_rows: False: any rows decode together as fast (decode rows are swapped into
            place, see the module docstring).
        device: the model's device.
        kv_capacity_bytes: size of the whole cache.
        packed_weight_bytes: memory added by packing weights for the CPU's GEMM kernels
            (``rill.models.packed``): the packed copies replace the originals, so only a tied
            LM head's second form counts; 0 where nothing was packed.

    ``pack_weights=False`` keeps the plain weights (a reference for tests).
    """

    packs_rows = False

    def __init__(self, loaded_model: LoadedModel, num_rows: int, max_len: int, pack_weights: bool = True) -> None:
        if num_rows < 1 or max_len < 1:
            raise ValueError(f"num_rows ({num_rows}) and max_len ({max_len}) must be >= 1")
        config = loaded_model.config
        if config.rope_scaling.get("rope_type") == "dynamic" and max_len > config.max_position_embeddings:
            # Past the trained context dynamic NTK RoPE rescales every position with the length.
            raise ValueError(
                f"max_len {max_len} exceeds max_position_embeddings {config.max_position_embeddings} "
                "of a dynamic-RoPE model; use at most that"
            )
        self.model: CausalLM = loaded_model.model
        self.config = config
        self.num_rows = num_rows
        self.max_len = max_len
        self.vocab_size = config.vocab_size
        self.kv_bytes_per_token = config.kv_bytes_per_token()
        self.device = torch.device(config.device)
        shape = (config.num_layers, 2, num_rows, config.num_kv_heads, max_len, config.head_dim)
        # Zeros, not empty: masked-out positions still enter SDPA's matmul (as 0 * value).
        self._kv = zeroed_cache(shape, config.torch_dtype, self.device)
        self._kv_is_mapped = self.device.type == "cpu"  # zeroed_cache's mmap: pages can be given back
        self.kv_capacity_bytes = self._kv.numel() * self._kv.element_size()
        self._caches = [(self._kv[layer, 0], self._kv[layer, 1]) for layer in range(config.num_layers)]
        self._physical = list(range(num_rows))  # logical row -> physical row
        self._logical = list(range(num_rows))  # physical row -> logical row
        self._lengths = [0] * num_rows  # per logical row: positions written (for swap copies)
        self._windows = sorted(self.model.windows, key=lambda w: -1 if w is None else w)
        self._group = config.num_heads // config.num_kv_heads
        self.model.ensure_rope(max_len)
        # Serving never trains: pack the projections for the CPU's GEMM kernels once, here,
        # in place of the originals (one copy of each weight).
        self.packed_weight_bytes = (
            packed.pack_linears(self.model, self.model.lm_weight(), release=True)  # type: ignore[arg-type]
            if pack_weights
            else 0
        )

    @torch.inference_mode()
    def forward(self, work: Sequence[RowWork]) -> torch.Tensor:
        """Run one step; return float32 logits ``[n, vocab_size]``: ``item.num_logits`` rows
        per item (every position of an ``all_logits`` chunk), in the order of ``work``.

        Items with one token are decoded together; longer items are prefill chunks. Every
        item's keys/values are written at positions ``start .. start + len - 1`` of its row.
        """
        if not work:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=self.device)
        self._check(work)
        decode = [item for item in work if len(item.token_ids) == 1]
        self._place_decode_rows([item.row for item in decode])
        batch = self._build_batch(work, decode)
        logits = self.model.forward_step(batch, self._caches)
        for item in work:
            self._lengths[item.row] = item.start + len(item.token_ids)
        return logits

    def warm_up(self, num_tokens: int, max_rows: int | None = None) -> tuple[int, int, float, float]:
        """Run a prefill step of up to ``num_tokens`` tokens and a decode step, then forget them.

        The first step of a new shape class pays for first-touch page faults and the kernels'
        own set-up: a fresh 32 x 128-token prefill of the 100M model took 1.21 s against 0.92 s
        for the next one. Paying that here, before the server reports ready, keeps it off the
        first requests. The prompt is spread over ``max_rows`` rows (default: all; the engine
        passes the most sequences it runs at once), as a wave of requests would be, each row at
        most ``max_len - 1`` tokens and at least two (a prefill, not a decode), then every row
        decodes one token. Afterwards the written cache region is zeroed again and every row is
        empty, as on a fresh runner, so later steps compute exactly what they would have.

        Returns:
            rows and tokens of the prefill, and the prefill's and the decode's seconds (0, 0,
            0.0, 0.0 when the budget or a row holds fewer than two prompt tokens: nothing to warm).

        Raises:
            RuntimeError: a row holds tokens already (only a fresh runner may be warmed).
        """
        if any(self._lengths):
            raise RuntimeError("warm_up needs a fresh runner: its rows would be wiped")
        if num_tokens < 2 or self.max_len < 3:
            return 0, 0, 0.0, 0.0
        rows = min(self.num_rows, max_rows or self.num_rows)
        per_row = min(self.max_len - 1, max(2, num_tokens // rows))
        rows = min(rows, num_tokens // per_row)
        vocab = self.vocab_size
        prefill = [RowWork(row, [(row * 7919 + i * 104729) % vocab for i in range(per_row)], 0) for row in range(rows)]
        decode = [RowWork(row, [(row * 31) % vocab], per_row) for row in range(rows)]
        try:
            started = time.perf_counter()
            self.forward(prefill)
            self._synchronize()
            prefilled = time.perf_counter()
            self.forward(decode)
            self._synchronize()
            decoded = time.perf_counter()
        finally:
            with torch.inference_mode():
                self._kv[:, :, :, :, : per_row + 1].zero_()
            self._lengths = [0] * self.num_rows
        return rows, rows * per_row, prefilled - started, decoded - prefilled

    def _synchronize(self) -> None:
        # Accelerators run asynchronously: wait for the step before reading the clock.
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    def copy_row(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy positions ``[0, num_tokens)`` of logical row ``src`` into logical row ``dst``."""
        if not (0 <= src < self.num_rows and 0 <= dst < self.num_rows):
            raise ValueError(f"row out of range: src={src}, dst={dst}, num_rows={self.num_rows}")
        if not 0 <= num_tokens <= self.max_len:
            raise ValueError(f"num_tokens {num_tokens} outside [0, {self.max_len}]")
        if src != dst and num_tokens:
            with torch.inference_mode():
                cache = self._kv[:, :, :, :, :num_tokens]
                cache[:, :, self._physical[dst]] = cache[:, :, self._physical[src]]
        self._lengths[dst] = num_tokens

    def discard(self, row: int, keep_tokens: int) -> None:
        """Give the memory of logical row ``row``'s positions from ``keep_tokens`` on back to the
        operating system (they read as zeros again, as in a fresh cache).

        The cache takes memory page by page as rows are written, so without this a row that
        once held a long sequence kept its memory after the sequence ended, and the process
        grew with every row any client had filled. No-op off the CPU.
        """
        if not self._kv_is_mapped or not 0 <= keep_tokens < self.max_len:
            return
        physical = self._physical[row]
        item = self._kv.element_size()
        head_dim = self._kv.shape[-1]
        head_bytes = self.max_len * head_dim * item
        skip = keep_tokens * head_dim * item
        for layer in range(self._kv.shape[0]):
            for kind in (0, 1):
                base = self._kv[layer, kind, physical].data_ptr()
                for head in range(self._kv.shape[3]):
                    release_pages(base + head * head_bytes + skip, head_bytes - skip)
        self._lengths[row] = min(self._lengths[row], keep_tokens)

    def _check(self, work: Sequence[RowWork]) -> None:
        check_work(work, self.num_rows, self.max_len)

    def _place_decode_rows(self, rows: list[int]) -> None:
        """Swap rows so the given logical rows occupy physical rows ``0..len(rows)-1``."""
        num_decode = len(rows)
        wanted = set(rows)
        movers = [self._physical[row] for row in rows if self._physical[row] >= num_decode]
        if not movers:
            return
        holes = [p for p in range(num_decode) if self._logical[p] not in wanted]
        with torch.inference_mode():
            for mover, hole in zip(movers, holes):
                moved, evicted = self._logical[mover], self._logical[hole]
                # Each row's own written positions only, by plain strided copies: a row joining
                # the decoding ones with a 3,885-token prompt used to move every involved row's
                # longest length through indexed copies (hundreds of ms beside a stream), and a
                # freed row (nothing written) has nothing to park.
                num_moved, num_evicted = self._lengths[moved], self._lengths[evicted]
                src, dst = self._kv[:, :, mover], self._kv[:, :, hole]
                parked = dst[:, :, :, :num_evicted].clone() if num_evicted else None
                if num_moved:
                    dst[:, :, :, :num_moved].copy_(src[:, :, :, :num_moved])
                if parked is not None:
                    src[:, :, :, :num_evicted].copy_(parked)
                self._logical[hole], self._logical[mover] = moved, evicted
                self._physical[moved], self._physical[evicted] = hole, mover
                if num_moved > num_evicted:
                    # The moved row's positions past the evicted row's own are still written
                    # where it was: give them back, or a freed row keeps a long prompt's pages.
                    self.discard(evicted, num_evicted)

    def _build_batch(self, work: Sequence[RowWork], decode: list[RowWork]) -> StepBatch:
        """Pack the step's tokens (decode rows in physical order, then prefill chunks)."""
        decode.sort(key=lambda item: self._physical[item.row])
        prefill = [item for item in work if len(item.token_ids) > 1]
        ids = [item.token_ids[0] for item in decode]
        positions = [item.start for item in decode]
        rows = list(range(len(decode)))
        last_index = {id(item): i for i, item in enumerate(decode)}
        for item in prefill:
            n = len(item.token_ids)
            ids.extend(item.token_ids)
            positions.extend(range(item.start, item.start + n))
            rows.extend([self._physical[item.row]] * n)
            last_index[id(item)] = len(ids) - 1
        wanted: list[int] = []
        for item in work:
            last = last_index[id(item)]
            if item.all_logits:
                wanted.extend(range(last - len(item.token_ids) + 1, last + 1))
            elif item.need_logits:
                wanted.append(last)
        if wanted == list(range(len(ids))):
            logits_index = None  # every token, in packed order: no gather
        else:
            logits_index = torch.tensor(wanted, dtype=torch.long, device=self.device)
        flat = torch.tensor([ids, positions, rows], dtype=torch.long, device=self.device)
        decode_len = max((item.start + 1 for item in decode), default=0)
        return StepBatch(
            input_ids=flat[0],
            positions=flat[1],
            write_rows=flat[2],
            num_decode=len(decode),
            decode_len=decode_len,
            decode_masks=self._decode_masks(decode, decode_len),
            prefill=self._prefill_layout(prefill) if prefill else None,
            logits_index=logits_index,
            by_token=_by_token(prefill, decode),
        )

    def _decode_masks(self, decode: list[RowWork], decode_len: int) -> dict[int | None, torch.Tensor | None]:
        if not decode:
            return {}
        is_uniform = all(item.start + 1 == decode_len for item in decode)
        lengths = None
        masks: dict[int | None, torch.Tensor | None] = {}
        for window in self._windows:
            is_windowed = window is not None and window < decode_len
            if is_uniform and not is_windowed:
                masks[window] = None
                continue
            if lengths is None:
                lengths = torch.tensor([item.start + 1 for item in decode], device=self.device)[:, None]
                keys = torch.arange(decode_len, device=self.device)[None, :]
                full = keys < lengths
            mask = full & (keys >= lengths - window) if is_windowed else full  # type: ignore[operator]
            masks[window] = mask[:, None, None, :]  # [B, 1, 1, L]
        return masks

    def _prefill_layout(self, prefill: list[RowWork]) -> PrefillLayout:
        sizes = [len(item.token_ids) for item in prefill]
        num_chunks, max_chunk = len(prefill), max(sizes)
        key_len = max(item.start + n for item, n in zip(prefill, sizes))
        physical = [self._physical[item.row] for item in prefill]
        is_consecutive = physical == list(range(physical[0], physical[0] + num_chunks))
        pad_index = unpad_index = None
        if any(n != max_chunk for n in sizes):
            pad: list[int] = []
            unpad: list[int] = []
            offset = 0
            for chunk, n in enumerate(sizes):
                pad.extend(offset + min(t, n - 1) for t in range(max_chunk))
                unpad.extend(chunk * max_chunk + t for t in range(n))
                offset += n
            pad_index = torch.tensor(pad, device=self.device)
            unpad_index = torch.tensor(unpad, device=self.device)
        starts = torch.tensor([item.start for item in prefill], device=self.device)[:, None]
        last = torch.tensor([n - 1 for n in sizes], device=self.device)[:, None]
        # Query position per (chunk, t); padding repeats the chunk's last token.
        query_pos = starts + torch.minimum(torch.arange(max_chunk, device=self.device)[None, :], last)
        keys = torch.arange(key_len, device=self.device)[None, None, :]
        causal = keys <= query_pos[:, :, None]  # [P, T, L]
        masks = {}
        for window in self._windows:
            mask = causal if window is None else causal & (keys > query_pos[:, :, None] - window)
            # Fold the query-head group: query index t * g + j.
            masks[window] = mask[:, None].repeat_interleave(self._group, dim=2)  # [P, 1, T*g, L]
        return PrefillLayout(
            num_chunks=num_chunks,
            max_chunk_len=max_chunk,
            key_len=key_len,
            row_slice=(physical[0], physical[0] + num_chunks) if is_consecutive else None,
            rows=torch.tensor(physical, device=self.device),
            pad_index=pad_index,
            unpad_index=unpad_index,
            masks=masks,
        )
