"""Token buckets for the generation rate limit (``--rate-limit-tokens-per-s``, ``--rate-limit-burst``).

A generation reserves its ``max_tokens`` from every bucket that applies (its API key's and
its connection's) before it starts and gives back what it did not use when it ends, so a
client can never have more tokens in flight than the burst, and refills at the set rate.

Pure: the clock is passed in (monotonic seconds); no I/O.
"""

from __future__ import annotations

from rill.errors import RateLimited


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
        """Remove tokens (the level may not go below zero; callers check ``wait_s`` first)."""
        self._refill(now)
        self.level = max(0.0, self.level - num_tokens)

    def give_back(self, num_tokens: float, now: float) -> None:
        """Return unused tokens of a reservation."""
        self._refill(now)
        self.level = min(self.burst, self.level + num_tokens)


def reserve(buckets: list[TokenBucket], num_tokens: int, now: float) -> float:
    """Take ``num_tokens`` (at most each bucket's burst) from all buckets, or none.

    Returns the amount reserved (give it back with ``release``). Raises ``RateLimited`` with
    the longest wait as ``retry_after_s`` when any bucket is short.
    """
    if not buckets:
        return 0.0
    amount = float(min([num_tokens] + [b.burst for b in buckets]))
    wait_s = max(b.wait_s(amount, now) for b in buckets)
    if wait_s > 0:
        raise RateLimited(f"rate limit reached: {amount:.0f} tokens asked; retry in {wait_s:.2f} s "
                          "(or ask for fewer max_tokens)", retry_after_s=wait_s)
    for bucket in buckets:
        bucket.take(amount, now)
    return amount


def release(buckets: list[TokenBucket], reserved: float, num_used: int, now: float) -> None:
    """Give back the unused part of a reservation once the generation has ended."""
    unused = max(0.0, reserved - num_used)
    for bucket in buckets:
        bucket.give_back(unused, now)
