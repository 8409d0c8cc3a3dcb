"""KV row bookkeeping with prefix reuse and a fixed memory budget. Pure Python, no torch.

The runner holds ``num_rows`` rows of ``max_len`` tokens each (contiguous per-row caches
measured fastest on this CPU; see engine-notes §7–8). This module decides which row a
sequence uses and what the rows hold:

* a *live* row belongs to one running, prefilling or paused sequence;
* a *cached* row holds the valid tokens of a finished sequence and can be reused by a later
  prompt that starts with the same tokens (prefix cache), or evicted (LRU) when a row is
  needed;
* a *free* row holds nothing.

"Used" memory counts only live rows' valid tokens, so "all KV memory is free" means no live
row, while cached rows stay reusable until evicted.

Memory comes back. On the CPU the runner's cache takes memory page by page as rows are
written (``rill.engine.runner.zeroed_cache``), so every row a sequence once filled would keep
its pages for the life of the process. The manager tells the runner (``discard``) what a row
no longer needs: all of it when the row is freed, its positions past the valid tokens when it
becomes a cache entry. Cache entries are bounded in tokens (``max_cached_tokens``: the oldest
go first past it), so what idle entries hold has a ceiling below the whole cache.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol


class RowHolder(Protocol):
    """What the manager needs to know of a live row's owner."""

    num_computed: int

    def token_at(self, start: int, stop: int) -> list[int]:
        """Tokens ``[start, stop)`` of the holder's sequence."""
        ...


class EmptyRow:
    """Holder of a reserved row that holds nothing yet (e.g. beam rows before the fork)."""

    num_computed = 0

    def token_at(self, start: int, stop: int) -> list[int]:
        """An empty row holds no tokens."""
        return []


@dataclass(slots=True)
class Acquired:
    """Result of ``KVManager.acquire``: the row, how many leading tokens are already valid,
    and a copy the runner must perform first (``(src_row, num_tokens)``) if any."""

    row: int
    num_cached_tokens: int
    copy_from: tuple[int, int] | None = None


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix (slice comparisons run in C; binary search)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class KVManager:
    """Which row holds what; prefix matching; LRU eviction; usage counters.

    ``pack_rows``: a new sequence (with no prefix to take over) gets the lowest row that is
    free or cached, evicting that cached entry even when an older one exists. For runners whose
    steps cost less over consecutive low rows (the llama.cpp runner: a run of consecutive rows
    is one micro-batch), live rows then fill the bottom of the cache without gaps; the price
    is that prefix-cache entries in low rows go first.
    """

    def __init__(
        self,
        num_rows: int,
        max_len: int,
        bytes_per_token: int,
        min_reuse_tokens: int = 1,
        pack_rows: bool = False,
        discard: Callable[[int, int], None] | None = None,
        max_cached_tokens: int | None = None,
    ) -> None:
        """``discard(row, keep_tokens)``: the runner may give back the memory of ``row``'s
        positions from ``keep_tokens`` on (None: it cannot). ``max_cached_tokens``: the most
        tokens cache entries hold together (None: as many as the rows)."""
        self.discard = discard
        self.max_cached_tokens = max_cached_tokens
        self._num_cached_tokens = 0
        self.num_rows = num_rows
        self.pack_rows = pack_rows
        self.max_len = max_len
        self.bytes_per_token = bytes_per_token
        self.min_reuse_tokens = min_reuse_tokens
        self.free_rows: list[int] = list(range(num_rows - 1, -1, -1))  # pop() gives the lowest row
        self.cached: OrderedDict[int, list[int]] = OrderedDict()  # row -> valid tokens; oldest first
        self.live: dict[int, RowHolder] = {}
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # -- capacity ------------------------------------------------------------------------
    @property
    def num_available_rows(self) -> int:
        """Rows a new sequence could get now (free or evictable)."""
        return len(self.free_rows) + len(self.cached)

    @property
    def num_live_rows(self) -> int:
        """Rows owned by live sequences."""
        return len(self.live)

    def used_tokens(self) -> int:
        """Valid tokens held by live rows."""
        return sum(holder.num_computed for holder in self.live.values())

    def cached_tokens(self) -> int:
        """Valid tokens held by cached (evictable) rows."""
        return self._num_cached_tokens

    # -- matching ------------------------------------------------------------------------
    def best_match(self, token_ids: list[int], limit: int) -> tuple[int | None, int, bool]:
        """Longest reusable prefix of ``token_ids`` (at most ``limit`` tokens) over cached and
        live rows: ``(row, length, is_cached_row)``; ``(None, 0, False)`` when none."""
        best_row, best_len, best_cached = None, 0, False
        if not token_ids or limit <= 0:
            return best_row, best_len, best_cached
        first = token_ids[0]
        for row, tokens in self.cached.items():
            if tokens and tokens[0] == first:
                n = min(common_prefix_len(tokens, token_ids), limit)
                if n > best_len:
                    best_row, best_len, best_cached = row, n, True
        for row, holder in self.live.items():
            valid = holder.num_computed
            if valid <= best_len:
                continue
            head = holder.token_at(0, min(valid, limit))
            if head and head[0] == first:
                n = min(common_prefix_len(head, token_ids), limit)
                if n > best_len:
                    best_row, best_len, best_cached = row, n, False
        if best_len < self.min_reuse_tokens:
            return None, 0, False
        return best_row, best_len, best_cached

    def pending_overlap(self, token_ids: list[int], available: int = 0) -> int:
        """Tokens of ``token_ids`` that a live row will hold once its prefill advances, beyond
        what it holds now and beyond the ``available`` leading tokens some row already holds
        (used to wait for a sibling's prefill rather than compute twice)."""
        best = 0
        first = token_ids[0] if token_ids else None
        for holder in self.live.values():
            head = holder.token_at(0, len(token_ids))
            if head and head[0] == first:
                n = common_prefix_len(head, token_ids)
                best = max(best, n - max(holder.num_computed, available))
        return best

    # -- acquire / release ---------------------------------------------------------------
    def acquire(self, holder: RowHolder, token_ids: list[int], max_reuse: int | None = None) -> Acquired | None:
        """Give ``holder`` a row for ``token_ids``, reusing the longest cached prefix, of at most
        ``max_reuse`` tokens when given (0: every token is computed).

        At least one token is always left to compute, because its logits are needed.
        Returns None when no row is free or evictable.
        """
        if self.num_available_rows == 0:
            return None
        src, length, src_is_cached = self.best_match(token_ids, _reuse_limit(token_ids, max_reuse))
        self.num_query_tokens += len(token_ids)
        if src is not None and src_is_cached and (length >= len(self.cached[src]) or not self._spare_row(exclude=src)):
            # The prompt extends the whole cached sequence (or no other row is left): take it over.
            self._num_cached_tokens -= len(self.cached.pop(src))
            self.live[src] = holder
            self.num_hit_tokens += length
            return Acquired(src, length)
        row = self._take_row(exclude=src)
        self.live[row] = holder
        if src is None:
            return Acquired(row, 0)
        self.num_hit_tokens += length
        if src_is_cached:
            self.cached.move_to_end(src)
        return Acquired(row, length, copy_from=(src, length))

    def reusable(self, token_ids: list[int], max_reuse: int | None = None) -> int:
        """Tokens ``acquire(holder, token_ids, max_reuse)`` would reuse now (0: none)."""
        return self.best_match(token_ids, _reuse_limit(token_ids, max_reuse))[1]

    def acquire_empty(self) -> int | None:
        """A reserved row with no reuse (beam forks); None when none is available."""
        if self.num_available_rows == 0:
            return None
        row = self._take_row(exclude=None)
        self.live[row] = EmptyRow()
        return row

    def release(self, row: int, valid_tokens: list[int]) -> None:
        """A live row's owner is done; keep its valid tokens as a cache entry (or free it)."""
        self.live.pop(row, None)
        if not valid_tokens:
            self._free(row)
            return
        self.cached[row] = valid_tokens
        self._num_cached_tokens += len(valid_tokens)
        if self.discard is not None:
            self.discard(row, len(valid_tokens))
        while self.max_cached_tokens is not None and self._num_cached_tokens > self.max_cached_tokens:
            oldest, tokens = self.cached.popitem(last=False)
            self._num_cached_tokens -= len(tokens)
            self._free(oldest)

    def _free(self, row: int) -> None:
        self.free_rows.append(row)
        if self.discard is not None:
            self.discard(row, 0)

    def assign(self, row: int, holder: RowHolder) -> None:
        """A live row changes owner (a beam takes over its parent's row or a forked copy)."""
        if row not in self.live:
            raise ValueError(f"row {row} is not live")
        self.live[row] = holder

    def clear(self, row: int) -> None:
        """A live row stays reserved but holds nothing worth keeping (a beam died in it)."""
        self.assign(row, EmptyRow())

    def is_live(self, row: int) -> bool:
        """True while ``row`` belongs to a live sequence (or is reserved empty)."""
        return row in self.live

    def count_reuse(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count a reuse decided outside ``acquire`` (a regenerate keeps its prompt's row)."""
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    def drop(self, row: int) -> None:
        """A live row's content is worthless (e.g. a dead beam): free it."""
        self.live.pop(row, None)
        self._free(row)

    def _spare_row(self, exclude: int | None) -> bool:
        return bool(self.free_rows) or any(r != exclude for r in self.cached)

    def _take_row(self, exclude: int | None) -> int:
        # Free rows (the last freed first; on a fresh manager the lowest), then cached ones (oldest
        # first); pack_rows takes the lowest of them all.
        order = (r for r in itertools.chain(reversed(self.free_rows), self.cached) if r != exclude)
        row = min(order, default=None) if self.pack_rows else next(order, None)
        if row is None:
            raise RuntimeError("no row available")  # callers check num_available_rows first
        if row in self.cached:
            self._num_cached_tokens -= len(self.cached.pop(row))
        else:
            self.free_rows.remove(row)
        return row


def _reuse_limit(token_ids: list[int], max_reuse: int | None) -> int:
    # At least one token is left to compute: its logits are needed.
    return len(token_ids) - 1 if max_reuse is None else max(0, min(max_reuse, len(token_ids) - 1))
