"""The continuation store of batch ``/ws``: kept generations by ``request_id``, bounded.

Pure: no I/O, no clock (``now`` is passed in, monotonic seconds). One store is shared by
every connection of a server (ids are scoped by the API key the client presented). A
generation that ended on ``max_new_tokens`` is kept with its token ids so that a later
prompt with the same id continues it; entries dropped by the bounds or the TTL leave a
tombstone so that the next use of that id can be told, instead of silently starting over.

Kept generations are also charged to the server-wide session-memory budget (a ``Ledger``,
``rill.frontend.budget.MemoryBudget``) under the principal whose prompt made them: one that
does not fit makes room among that principal's own oldest entries when they free enough,
else it is not kept (a tombstone, "evicted") and nothing is dropped; other principals'
entries are never dropped for it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from rill.protocols.batch_ws.messages import GenerationConfig


@dataclass(frozen=True)
class Kept:
    """A generation that ended without eos and may be continued.

    ``token_ids``: prompt plus generated ids (the next request's prompt);
    ``text``: prompt text plus generated text (INITIALIZED text of the continuation);
    ``config``: the generation_config it ran with, used when the next message sends none;
    ``num_cached_tokens``: leading ids the engine's prefix cache should still hold (fewer
    are reported as evicted).
    """

    token_ids: list[int]
    text: str
    config: GenerationConfig | None
    expires_at: float
    num_cached_tokens: int = 0
    owner: str = ""
    """The principal charged for it."""
    num_bytes: int = 0
    """What it is charged (``kept_bytes``)."""


KEPT_COST_BYTES = 512
"""Bytes a kept entry counts besides its ids and text: its objects and the map's slot."""
TOKEN_ID_BYTES = 36
"""Bytes a kept token id counts: a list slot and an int object."""


def kept_bytes(token_ids: list[int], text: str) -> int:
    """What one kept generation is charged to the session-memory budget."""
    return KEPT_COST_BYTES + TOKEN_ID_BYTES * len(token_ids) + len(text.encode("utf-8", "surrogatepass"))


class Ledger(Protocol):
    """The budget the store charges (``rill.frontend.budget.MemoryBudget`` fits)."""

    def room_for(self, principal: str) -> int:
        """Most bytes ``principal`` could be charged now."""

    def try_charge(self, principal: str, num_bytes: int) -> bool:
        """Charge ``num_bytes`` to ``principal`` if the budget allows it."""

    def release(self, principal: str, num_bytes: int) -> None:
        """Give back ``num_bytes`` charged to ``principal``."""


@dataclass(frozen=True)
class Evicted:
    """A kept generation was dropped before it was continued (``reason``: expired or evicted)."""

    reason: str


ScopedId = tuple[str, str]  # (scope, request_id): scope separates API keys


class ContinuationStore:
    """Bounded map ``(scope, request_id) → Kept`` shared by every connection; pure.

    Bounds: ``max_entries`` entries, ``max_tokens`` kept token ids in total, ``ttl_s``
    seconds per entry; the oldest entries go first. Dropped ids are remembered (ids only,
    the newest ``max(1024, 4 * max_entries)``) so their next use can be told what happened. It also tracks which ids are generating
    right now (``is_busy``) so that one id never runs twice at once.
    """

    def __init__(self, max_entries: int, max_tokens: int, ttl_s: float, memory: Ledger | None = None) -> None:
        self.max_entries = max_entries
        self.memory = memory
        self.max_tokens = max_tokens
        self.ttl_s = ttl_s
        self.num_tokens = 0
        self._entries: OrderedDict[ScopedId, Kept] = OrderedDict()
        self._tombstones: OrderedDict[ScopedId, tuple[str, float]] = OrderedDict()
        self._max_tombstones = max(1024, 4 * max_entries)
        self._busy: set[ScopedId] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def is_busy(self, key: ScopedId) -> bool:
        """True while a prompt with this id is generating."""
        return key in self._busy

    def claim(self, key: ScopedId, now: float) -> Kept | Evicted | None:
        """Mark ``key`` busy and take its kept generation, its tombstone, or None."""
        self._busy.add(key)
        self._expire(now)
        kept = self._entries.pop(key, None)
        if kept is not None:
            self._forget(kept)
            return kept
        tomb = self._tombstones.pop(key, None)
        return Evicted(tomb[0]) if tomb is not None else None

    def release(self, key: ScopedId) -> None:
        """The prompt with this id finished (whatever the outcome)."""
        self._busy.discard(key)

    def keep(
        self,
        key: ScopedId,
        token_ids: list[int],
        text: str,
        config: GenerationConfig | None,
        now: float,
        num_cached_tokens: int | None = None,
        owner: str = "",
    ) -> None:
        """Keep a generation for continuation, evicting the oldest entries over the bounds.

        ``num_cached_tokens`` defaults to all but the last id (sampled, never fed back, so it
        has no KV). ``owner``: the principal charged for the entry (see the module docstring).
        """
        self._expire(now)
        self._tombstones.pop(key, None)
        if len(token_ids) > self.max_tokens or self.max_entries < 1:
            self._bury(key, "evicted", now)
            return
        num_bytes = kept_bytes(token_ids, text)
        if not self._charge(owner, num_bytes, now):
            self._bury(key, "evicted", now)
            return
        if num_cached_tokens is None:
            num_cached_tokens = len(token_ids) - 1
        self._entries[key] = Kept(
            list(token_ids),
            text,
            config,
            now + self.ttl_s,
            max(0, num_cached_tokens),
            owner,
            num_bytes if self.memory is not None else 0,
        )
        self.num_tokens += len(token_ids)
        while len(self._entries) > self.max_entries or self.num_tokens > self.max_tokens:
            old_key, old = self._entries.popitem(last=False)
            self._forget(old)
            self._bury(old_key, "evicted", now)

    def _charge(self, owner: str, num_bytes: int, now: float) -> bool:
        """Charge a new entry to ``owner``, first dropping as many of the owner's own oldest
        entries as it takes to make room; False (nothing dropped) when even all of them
        would not."""
        if self.memory is None:
            return True
        missing = num_bytes - self.memory.room_for(owner)
        if missing > 0:
            victims: list[ScopedId] = []
            for key, kept in self._entries.items():
                if missing <= 0:
                    break
                if kept.owner == owner:
                    victims.append(key)
                    missing -= kept.num_bytes
            if missing > 0:
                return False
            for key in victims:
                self._forget(self._entries.pop(key))
                self._bury(key, "evicted", now)
        return self.memory.try_charge(owner, num_bytes)

    def _forget(self, kept: Kept) -> None:
        """``kept`` left the map: uncount its tokens and give its bytes back."""
        self.num_tokens -= len(kept.token_ids)
        if self.memory is not None and kept.num_bytes:
            self.memory.release(kept.owner, kept.num_bytes)

    def expire(self, now: float) -> None:
        """Drop the entries whose TTL has passed (also done by every ``claim`` and ``keep``),
        giving their bytes back to the budget."""
        self._expire(now)

    def _expire(self, now: float) -> None:
        # Entries are in insertion order and share one TTL, so expired ones are at the front.
        while self._entries:
            key, kept = next(iter(self._entries.items()))
            if kept.expires_at > now:
                break
            self._entries.popitem(last=False)
            self._forget(kept)
            self._bury(key, "expired", kept.expires_at)

    def _bury(self, key: ScopedId, reason: str, when: float) -> None:
        self._tombstones[key] = (reason, when)
        self._tombstones.move_to_end(key)
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)
