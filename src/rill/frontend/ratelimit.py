"""Per-principal rate limits, applied once for every protocol by the admission step.

Two limits, each off unless configured, both keyed by the request's principal
(``GenerateRequest.principal``, see ``rill.auth.principal``):

* a request count (``--rate-limit-requests N``, ``--rate-limit-window SECONDS``): a
  principal's first request opens a window of SECONDS; at most N requests are admitted in
  it; the first request after it ends opens the next window. Fixed windows keep one counter
  per principal (a sliding log would keep N times), at the price of allowing up to 2N
  requests across a window's edge;
  A running request's ``modify`` that compiles a new grammar (``response_format``) counts
  as one more request in the window (``count_work``): a compile costs the server what a new
  constrained request's does;
* a generation-token rate (``--rate-limit-tokens-per-s``, ``--rate-limit-burst``): a token
  bucket. A request reserves its ``max_tokens`` (at most the burst) before it starts and
  gives back what it did not use when it ends, so a principal never has more tokens in
  flight than the burst, and the bucket refills at the set rate. A running request that
  asks for more (``modify`` raising ``max_tokens``, ``regenerate`` discarding what it made)
  reserves the shortfall first (``Account``); whatever it generated past its reservation is
  charged when it ends, as a debt the principal's next requests wait out.

* seconds of audio (``--rate-limit-audio-s``), counted in the same window as requests:
  OpenAI's audio routes charge the audio they transcribe before the work starts
  (``count_audio``) and the speech they synthesize once it is made (``charge_audio``, which
  may overdraw the window: the principal's next audio requests then wait for the next one).

A request refused by one limit takes nothing from the others. Principals are chosen by
clients (a key, an address), so the state is bounded: past ``max_principals`` the least
recently seen principal is forgotten (it starts afresh if it comes back).

``RateLimiter`` is pure: the clock is injected (monotonic seconds); no I/O, no threads.
Callers reach it through the asynchronous face ``AsyncLimiter``, so that the state may live
in this process (``LocalLimiter``: the event loop calls it, and it never waits) or in one
place for several server processes (``rill.cluster.limits``: a Ray actor a cluster's front
doors share). ``Account`` keeps one request's reservation through either.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from rill.errors import RateLimited

DEFAULT_MAX_PRINCIPALS = 65536
"""Principals whose limit state is kept (about 200 bytes each)."""


@dataclass(frozen=True)
class RateLimits:
    """What the limiter enforces (None: that limit is off)."""

    requests: int | None = None
    window_s: float = 60.0
    tokens_per_s: float | None = None
    burst: int = 2048
    audio_s: float | None = None
    max_principals: int = DEFAULT_MAX_PRINCIPALS

    @property
    def is_on(self) -> bool:
        """Whether any limit applies."""
        return self.requests is not None or self.tokens_per_s is not None or self.audio_s is not None


class TokenBucket:
    """A bucket of ``burst`` tokens refilled at ``rate_per_s``."""

    def __init__(self, rate_per_s: float, burst: int, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.burst = float(burst)
        self.level = float(burst)
        self._updated_at = now

    def _refill(self, now: float) -> None:
        elapsed_s = max(0.0, now - self._updated_at)
        self.level = min(self.burst, self.level + elapsed_s * self.rate_per_s)
        self._updated_at = now

    def wait_s(self, num_tokens: float, now: float) -> float:
        """Seconds until ``num_tokens`` are available (0 if they are now)."""
        self._refill(now)
        missing = min(num_tokens, self.burst) - self.level
        return 0.0 if missing <= 0 else missing / self.rate_per_s if self.rate_per_s > 0 else float("inf")

    def take(self, num_tokens: float, now: float) -> None:
        """Remove tokens (never below zero; callers check ``wait_s`` first)."""
        self._refill(now)
        self.level = max(0.0, self.level - num_tokens)

    def charge(self, num_tokens: float, now: float) -> None:
        """Remove tokens already spent, below zero if need be (a debt that refilling repays)."""
        self._refill(now)
        self.level -= num_tokens

    def give_back(self, num_tokens: float, now: float) -> None:
        """Return unused tokens of a reservation."""
        self._refill(now)
        self.level = min(self.burst, self.level + num_tokens)


class _Principal:
    """One principal's window and bucket."""

    __slots__ = ("window_start", "count", "audio_s", "bucket")

    def __init__(self, bucket: TokenBucket | None) -> None:
        self.window_start: float | None = None
        self.count = 0
        self.audio_s = 0.0
        self.bucket = bucket


@dataclass(frozen=True)
class Reservation:
    """What one admitted request holds until it ends (give it to ``RateLimiter.release``)."""

    principal: str
    tokens: float


class RateLimiter:
    """Admits or refuses requests by principal; see the module docstring."""

    def __init__(self, limits: RateLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._principals: OrderedDict[str, _Principal] = OrderedDict()

    def __len__(self) -> int:
        """How many principals have state now (at most ``limits.max_principals``)."""
        return len(self._principals)

    def admit(self, principal: str, max_tokens: int) -> Reservation:
        """Count one request of ``principal`` and reserve its tokens, or raise ``RateLimited``
        (with ``retry_after_s``) and change nothing."""
        now = self._clock()
        state = self._state(principal, now)
        amount = self._check(state, max_tokens, now)
        if state.bucket is not None:
            state.bucket.take(amount, now)
        state.count += 1
        return Reservation(principal, amount)

    def check(self, principal: str, max_tokens: int) -> None:
        """Raise ``RateLimited`` if ``admit`` would now; change nothing (no state is made for a
        new principal). For refusing before costly work (a grammar compile) a request that
        the limits would refuse at its end anyway."""
        state = self._principals.get(principal)
        if state is not None:
            self._check(state, max_tokens, self._clock())

    def count_work(self, principal: str) -> None:
        """Count one request in ``principal``'s window for work a running request asks for
        (a ``modify`` that compiles a new grammar costs what a new request's compile would),
        or raise ``RateLimited`` and change nothing. Reserves no tokens."""
        if self.limits.requests is None:
            return
        now = self._clock()
        state = self._state(principal, now)
        self._check(state, 0, now)
        state.count += 1

    def count_audio(self, principal: str, audio_s: float) -> None:
        """Count one audio request of ``audio_s`` seconds (0: not known yet) in ``principal``'s
        window, or raise ``RateLimited`` and change nothing."""
        now = self._clock()
        state = self._state(principal, now)
        self._check(state, 0, now)
        limit = self.limits.audio_s
        if limit is not None and state.audio_s + audio_s > limit:
            assert state.window_start is not None  # _check opened the window
            wait_s = state.window_start + self.limits.window_s - now
            raise RateLimited(
                f"rate limit reached: {state.audio_s:.1f} s of {limit:g} s of audio used per "
                f"{self.limits.window_s:g} s, {audio_s:.1f} s asked; retry in {wait_s:.2f} s",
                retry_after_s=wait_s,
            )
        state.count += 1
        state.audio_s += audio_s

    def charge_audio(self, principal: str, audio_s: float) -> None:
        """Add ``audio_s`` seconds made for an admitted request to ``principal``'s window (past
        the limit if need be: its next audio requests wait for the next window)."""
        if self.limits.audio_s is None:
            return
        now = self._clock()
        state = self._state(principal, now)
        self._restart_window(state, now)
        state.audio_s += audio_s

    def _restart_window(self, state: _Principal, now: float) -> None:
        if state.window_start is None or now >= state.window_start + self.limits.window_s:
            state.window_start, state.count, state.audio_s = now, 0, 0.0

    def _check(self, state: _Principal, max_tokens: int, now: float) -> float:
        """Raise ``RateLimited`` when ``state`` admits no request of ``max_tokens`` now (a
        window that has ended is restarted: that changes nothing the limits allow); else the
        tokens to reserve."""
        limits = self.limits
        if limits.requests is not None or limits.audio_s is not None:
            self._restart_window(state, now)
        if limits.requests is not None:
            assert state.window_start is not None
            if state.count >= limits.requests:
                wait_s = state.window_start + limits.window_s - now
                raise RateLimited(
                    f"rate limit reached: {limits.requests} requests per {limits.window_s:g} s; "
                    f"retry in {wait_s:.2f} s",
                    retry_after_s=wait_s,
                )
        amount = 0.0
        if state.bucket is not None:
            amount = min(float(max_tokens), state.bucket.burst)
            wait_s = state.bucket.wait_s(amount, now)
            if wait_s > 0:
                raise RateLimited(
                    f"rate limit reached: {amount:.0f} tokens asked; retry in {wait_s:.2f} s "
                    "(or ask for fewer max_tokens)",
                    retry_after_s=wait_s,
                )
        return amount

    def extend(self, reservation: Reservation, more_tokens: int) -> Reservation:
        """Reserve ``more_tokens`` (at most the burst) for a running request; return the larger
        reservation, or raise ``RateLimited`` (with ``retry_after_s``) and change nothing.

        The request count is not touched: it is the same request."""
        state = self._principals.get(reservation.principal)
        if state is None or state.bucket is None or more_tokens <= 0:
            return reservation
        self._principals.move_to_end(reservation.principal)  # a running request keeps its principal recent
        now = self._clock()
        amount = min(float(more_tokens), state.bucket.burst)
        wait_s = state.bucket.wait_s(amount, now)
        if wait_s > 0:
            raise RateLimited(
                f"rate limit reached: {amount:.0f} more tokens asked; retry in {wait_s:.2f} s", retry_after_s=wait_s
            )
        state.bucket.take(amount, now)
        return Reservation(reservation.principal, reservation.tokens + amount)

    def release(self, reservation: Reservation, num_used: int) -> None:
        """Settle ``reservation``'s account (its request has ended, having generated
        ``num_used`` tokens): give back what it did not use, charge what it used beyond it."""
        unused = reservation.tokens - num_used
        state = self._principals.get(reservation.principal)
        if unused == 0 or state is None or state.bucket is None:
            return
        if unused > 0:
            state.bucket.give_back(unused, self._clock())
        else:
            state.bucket.charge(-unused, self._clock())

    def _state(self, principal: str, now: float) -> _Principal:
        state = self._principals.get(principal)
        if state is not None:
            self._principals.move_to_end(principal)
            return state
        while len(self._principals) >= self.limits.max_principals:
            self._principals.popitem(last=False)
        rate = self.limits.tokens_per_s
        state = self._principals[principal] = _Principal(
            None if rate is None else TokenBucket(rate, self.limits.burst, now)
        )
        return state


class AsyncLimiter(Protocol):
    """What the server asks of its rate limits, wherever their state lives: ``RateLimiter``'s
    methods, awaited where they may refuse; those that never refuse (``release``,
    ``charge_audio``) return at once and are applied in the order they were made, after
    every call made before them."""

    limits: RateLimits

    async def admit(self, principal: str, max_tokens: int) -> Reservation:
        """``RateLimiter.admit``."""
        ...

    async def check(self, principal: str, max_tokens: int) -> None:
        """``RateLimiter.check``."""
        ...

    async def count_work(self, principal: str) -> None:
        """``RateLimiter.count_work``."""
        ...

    async def count_audio(self, principal: str, audio_s: float) -> None:
        """``RateLimiter.count_audio``."""
        ...

    async def extend(self, reservation: Reservation, more_tokens: int) -> Reservation:
        """``RateLimiter.extend``."""
        ...

    def charge_audio(self, principal: str, audio_s: float) -> None:
        """``RateLimiter.charge_audio``."""
        ...

    def release(self, reservation: Reservation, num_used: int) -> None:
        """``RateLimiter.release``."""
        ...


class LocalLimiter:
    """``AsyncLimiter`` of one server process: a ``RateLimiter`` on its event loop. No method
    suspends, so each call is applied before the caller goes on, as a plain call would be."""

    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter
        self.limits = limiter.limits

    async def admit(self, principal: str, max_tokens: int) -> Reservation:
        """``RateLimiter.admit``."""
        return self.limiter.admit(principal, max_tokens)

    async def check(self, principal: str, max_tokens: int) -> None:
        """``RateLimiter.check``."""
        self.limiter.check(principal, max_tokens)

    async def count_work(self, principal: str) -> None:
        """``RateLimiter.count_work``."""
        self.limiter.count_work(principal)

    async def count_audio(self, principal: str, audio_s: float) -> None:
        """``RateLimiter.count_audio``."""
        self.limiter.count_audio(principal, audio_s)

    async def extend(self, reservation: Reservation, more_tokens: int) -> Reservation:
        """``RateLimiter.extend``."""
        return self.limiter.extend(reservation, more_tokens)

    def charge_audio(self, principal: str, audio_s: float) -> None:
        """``RateLimiter.charge_audio``."""
        self.limiter.charge_audio(principal, audio_s)

    def release(self, reservation: Reservation, num_used: int) -> None:
        """``RateLimiter.release``."""
        self.limiter.release(reservation, num_used)


async def open_account(limiter: AsyncLimiter, principal: str, max_tokens: int) -> Account:
    """``admit`` a request and return its ``Account`` (``RateLimited``: nothing changed)."""
    return Account(limiter, await limiter.admit(principal, max_tokens), max_tokens)


class Account:
    """One admitted request's rate-limit account, from admission to its end.

    The request may generate its ``max_tokens`` in the current attempt, on top of the tokens of
    the attempts ``regenerate`` discarded; the account keeps that total covered by its
    reservation, so each change reserves only its shortfall (``max_tokens`` 9 -> 5 -> 9 needs
    nothing more) and ``settle`` gives back or charges the difference once. Every method that
    reserves raises ``RateLimited`` and changes nothing when the bucket lacks the tokens.
    The event loop calls it: one method per client call or engine output; the calls that
    reserve are awaited one at a time (a request's controls are).
    """

    def __init__(self, limiter: AsyncLimiter, reservation: Reservation, max_tokens: int) -> None:
        self._limiter = limiter
        self.reservation = reservation
        self._covered = max_tokens  # what the reservation stands for (past the burst, more than it took)
        self._max_tokens = max_tokens
        self._spent = 0  # tokens of the attempts regenerate discarded
        self._seen = 0  # tokens of the current attempt, as of its last output
        self._discarding = 0  # tokens of the current attempt a regenerate will discard (asked, not yet done)
        self._settled = False

    @property
    def used(self) -> int:
        """Tokens generated so far, discarded attempts included."""
        return self._spent + self._seen

    async def set_max_tokens(self, max_tokens: int) -> None:
        """The request's ``max_tokens`` changes (``modify``): reserve what the new total lacks."""
        await self._cover(self._spent + self._discarding + max_tokens)
        self._max_tokens = max_tokens

    async def restart(self) -> None:
        """A ``regenerate`` is about to discard the current attempt: its tokens stay spent and the
        new attempt may make ``max_tokens`` again, so reserve what that total lacks. A second
        restart before the engine has done the first asks for nothing more."""
        discarding = max(self._discarding, self._seen)
        await self._cover(self._spent + discarding + self._max_tokens)
        self._discarding = discarding

    def observe(self, completion_tokens: int, restarted: bool) -> None:
        """An output of the request: ``completion_tokens`` of its current attempt, ``restarted``
        when the engine has just discarded the previous attempt (its last count stays spent)."""
        if restarted:
            self._spent += self._seen
            self._discarding = 0
        self._seen = completion_tokens

    def settle(self, num_used: int | None = None) -> None:
        """The request ended, its last attempt having made ``num_used`` tokens (default: as
        last observed): give back what it did not use, charge what it used beyond. Only once."""
        if self._settled:
            return
        self._settled = True
        self._limiter.release(self.reservation, self._spent + (self._seen if num_used is None else num_used))

    async def _cover(self, need: int) -> None:
        short = need - self._covered
        if short > 0:
            before = self.reservation
            after = await self._limiter.extend(before, short)
            if self._settled:  # the request ended while shared limits answered: give it back
                self._limiter.release(Reservation(after.principal, after.tokens - before.tokens), 0)
                return
            self.reservation = after
            self._covered = need
