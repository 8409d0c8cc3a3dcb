"""The cluster's shared rate limits (``rill.cluster.limits``) against a stand-in for the Ray
actor: the store's own methods, answered when the test says (no Ray, no sleeps)."""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

import pytest

from rill.cluster import limits as cluster_limits
from rill.cluster.limits import ClusterLimiter, RateLimitStore
from rill.errors import RateLimited
from rill.frontend.ratelimit import RateLimits, Reservation, open_account


class _Method:
    """``actor.method`` of the stand-in: ``remote`` runs the store's method once the actor
    is let through, as Ray runs one caller's calls, in their order."""

    def __init__(self, actor: FakeActor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.actor.calls.append((self.name, args, future))
        if not self.actor.held:
            self.actor.run()
        return future


class FakeActor:
    """A ``RateLimitStore`` behind object references; ``held`` keeps its calls waiting."""

    def __init__(self, limits: RateLimits) -> None:
        self.store = RateLimitStore(limits)
        self.calls: list[tuple[str, tuple[Any, ...], asyncio.Future[Any]]] = []
        self.held = False

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)

    async def sent(self, name: str) -> None:
        """Wait until a call of ``name`` is waiting (one the event loop sends on its own)."""
        async with asyncio.timeout(10):
            while not any(call[0] == name for call in self.calls):
                await asyncio.sleep(0)

    def run(self) -> None:
        """Answer every waiting call, in order (pickled both ways, as Ray does)."""
        calls, self.calls = self.calls, []
        for name, args, future in calls:
            answer = getattr(self.store, name)(*pickle.loads(pickle.dumps(args)))
            if not future.done():
                future.set_result(pickle.loads(pickle.dumps(answer)))


LIMITS = RateLimits(requests=3, window_s=3600.0, tokens_per_s=0.001, burst=10)


async def test_refusals_come_back_typed_with_their_retry_hint() -> None:
    actor = FakeActor(LIMITS)
    limiter = ClusterLimiter(actor, LIMITS)
    first = await limiter.admit("p", 6)
    assert first == Reservation("p", 6.0)
    with pytest.raises(RateLimited) as refused:
        await limiter.admit("p", 6)  # 4 of 10 tokens left
    assert refused.value.retry_after_s > 1000  # the bucket refills a token in 1000 s
    await limiter.count_work("p")  # the second request of three in the window
    limiter.release(first, 2)  # 4 unused given back: 8 left
    await limiter.admit("p", 8)  # the third: the window is full now
    with pytest.raises(RateLimited) as full:
        await limiter.count_audio("p", 0.0)
    assert "3 requests per 3600 s" in str(full.value)
    assert await limiter.admit("q", 10) == Reservation("q", 10.0)  # another principal is apart


async def test_a_store_that_does_not_answer_refuses_rather_than_lets_through(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_limits, "CALL_TIMEOUT_S", 0.01)
    actor = FakeActor(LIMITS)
    actor.held = True  # the actor's node is gone: no answer comes
    limiter = ClusterLimiter(actor, LIMITS)
    with pytest.raises(RateLimited) as refused:
        await limiter.admit("p", 4)
    assert refused.value.retry_after_s == cluster_limits.RETRY_AFTER_S
    assert "did not answer" in str(refused.value)
    # The answer comes after all: what it reserved is given back, so the bucket is whole.
    actor.run()
    await actor.sent("release")
    actor.held = False
    actor.run()
    assert await limiter.admit("p", 10) == Reservation("p", 10.0)


async def test_a_caller_that_leaves_before_the_answer_holds_no_tokens() -> None:
    actor = FakeActor(LIMITS)
    actor.held = True
    limiter = ClusterLimiter(actor, LIMITS)
    waiting = asyncio.ensure_future(limiter.admit("p", 7))
    await asyncio.sleep(0)
    assert actor.calls  # the admission was sent
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    actor.run()  # the store admits it after the caller left ...
    await actor.sent("release")
    actor.held = False
    actor.run()  # ... and the release sent on its answer gives the 7 back
    assert await limiter.admit("p", 10) == Reservation("p", 10.0)


async def test_an_extension_answered_after_its_request_ended_is_given_back() -> None:
    """A regenerate's extra reservation asked as its request ends: the account settled first,
    so the extension would otherwise be held for good."""
    actor = FakeActor(LIMITS)
    limiter = ClusterLimiter(actor, LIMITS)
    account = await open_account(limiter, "p", 4)
    account.observe(3, restarted=False)
    actor.held = True
    restart = asyncio.ensure_future(account.restart())  # asks for 3 more
    await asyncio.sleep(0)
    account.settle(3)  # the request ends meanwhile: 1 of its 4 given back
    actor.run()
    await restart
    actor.held = False
    actor.run()
    # 3 tokens spent; the 3 of the extension came back: 7 of 10 are left.
    with pytest.raises(RateLimited):
        await limiter.admit("p", 8)
    assert await limiter.admit("p", 7) == Reservation("p", 7.0)


def test_a_refusal_keeps_its_retry_hint_across_pickling() -> None:
    store = RateLimitStore(RateLimits(tokens_per_s=1.0, burst=2))
    store.admit("p", 2)
    refused = store.admit("p", 2)
    assert isinstance(refused, RateLimited)
    again = pickle.loads(pickle.dumps(refused))
    assert type(again) is RateLimited and again.retry_after_s == refused.retry_after_s
    assert str(again) == str(refused)
