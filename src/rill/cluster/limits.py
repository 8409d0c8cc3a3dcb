"""The rate limits of a cluster: one ``RateLimiter`` that every front door shares.

With ``--rate-limit-*`` set, a front door counts its principals' requests, tokens and audio
seconds in a Ray actor (``RateLimitStore``, named ``ACTOR_NAME`` in the server's namespace),
not in its own memory: a principal that spreads its requests over several front doors of one
cluster meets the same limits as on one server. The first front door to start makes the actor;
the others find it by name (``launch.deploy``). It is detached, as the replicas are: a front
door that stops takes nothing from the others (a server that started Ray for itself stops it,
actor and all). It takes no CPU of Ray's placement budget, so it fits beside the replicas.

``ClusterLimiter`` is a front door's ``AsyncLimiter`` on the actor:

* a call that may refuse (``admit``, ``check``, ``count_work``, ``count_audio``, ``extend``)
  is awaited; a refusal comes back as a value and is raised as the ``RateLimited`` it is;
* ``release`` and ``charge_audio`` are sent and not awaited: Ray runs one caller's calls to
  an actor in the order they were made, so they never overtake the admission they settle;
* a reservation whose caller left (or gave up waiting) before the answer came is given back
  when the answer comes, so no abandoned call holds tokens;
* the actor is the limits' one place: a call it does not answer within ``CALL_TIMEOUT_S``
  (its node is gone, Ray is restarting it) refuses the request with ``RateLimited`` (retry in
  a second) rather than let it through unlimited. Ray restarts the actor should its process
  die; the counts then start afresh, as a restarted single server's do.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from rill.errors import RateLimited
from rill.frontend.ratelimit import RateLimiter, RateLimits, Reservation

log = logging.getLogger("rill.cluster")

T = TypeVar("T")

ACTOR_NAME = "rill-rate-limits"
"""The name the front doors of a cluster find their shared rate limits under."""

CALL_TIMEOUT_S = 5.0
"""Longest wait for the actor's answer; past it the request is refused (retryable)."""

STORE_START_TIMEOUT_S = 60.0
"""Longest wait for the store to start (or be found) when a front door starts."""

RETRY_AFTER_S = 1.0
"""The retry hint of a request refused because the actor did not answer."""


class RateLimitStore:
    """The cluster's one ``RateLimiter``, as a Ray actor (``actor_options`` says how it runs).

    Its methods are ``RateLimiter``'s; a refusal is returned, not raised, so that it crosses
    as the plain ``RateLimited`` it is (Ray wraps what an actor raises)."""

    def __init__(self, limits: RateLimits) -> None:
        self._limiter = RateLimiter(limits)

    def limits(self) -> RateLimits:
        """The limits this store enforces (those of the front door that made it)."""
        return self._limiter.limits

    def admit(self, principal: str, max_tokens: int) -> Reservation | RateLimited:
        """``RateLimiter.admit``."""
        return _refusal(lambda: self._limiter.admit(principal, max_tokens))

    def check(self, principal: str, max_tokens: int) -> RateLimited | None:
        """``RateLimiter.check``."""
        return _refusal(lambda: self._limiter.check(principal, max_tokens))

    def count_work(self, principal: str) -> RateLimited | None:
        """``RateLimiter.count_work``."""
        return _refusal(lambda: self._limiter.count_work(principal))

    def count_audio(self, principal: str, audio_s: float) -> RateLimited | None:
        """``RateLimiter.count_audio``."""
        return _refusal(lambda: self._limiter.count_audio(principal, audio_s))

    def extend(self, reservation: Reservation, more_tokens: int) -> Reservation | RateLimited:
        """``RateLimiter.extend``."""
        return _refusal(lambda: self._limiter.extend(reservation, more_tokens))

    def charge_audio(self, principal: str, audio_s: float) -> None:
        """``RateLimiter.charge_audio``."""
        self._limiter.charge_audio(principal, audio_s)

    def release(self, reservation: Reservation, num_used: int) -> None:
        """``RateLimiter.release``."""
        self._limiter.release(reservation, num_used)

    def num_principals(self) -> int:
        """How many principals have state now (bounded by ``RateLimits.max_principals``)."""
        return len(self._limiter)


def _refusal(call: Callable[[], T]) -> T | RateLimited:
    """``call``'s result, or the ``RateLimited`` it raised, as a value."""
    try:
        return call()
    except RateLimited as exc:
        return exc


def actor_options(namespace: str) -> dict[str, Any]:
    """How the store runs in Ray: named and detached (the front doors share it and none owns
    it), restarted if its process dies, no CPU of the placement budget, one call at a time
    (``RateLimiter`` is not thread-safe, and calls apply in their order)."""
    return {
        "name": ACTOR_NAME,
        "namespace": namespace,
        "lifetime": "detached",
        "get_if_exists": True,
        "num_cpus": 0,
        "max_restarts": -1,
        "max_concurrency": 1,
    }


def start_store(ray: Any, limits: RateLimits, namespace: str) -> ClusterLimiter:
    """A limiter on the cluster's store, made with ``limits`` unless a front door made it
    before; a store made with other limits is used as it is (one place, one set of limits),
    with a warning. Blocks: call it off the event loop."""
    actor = ray.remote(RateLimitStore).options(**actor_options(namespace)).remote(limits)
    found = ray.get(actor.limits.remote(), timeout=STORE_START_TIMEOUT_S)
    if found != limits:
        log.warning(
            "the cluster's rate limits are those of the front door that started first (%s), "
            "not this server's flags (%s)",
            found,
            limits,
        )
    return ClusterLimiter(actor, found)


class ClusterLimiter:
    """A front door's ``AsyncLimiter`` on the cluster's ``RateLimitStore`` (see the module
    docstring). ``limits`` are the store's."""

    def __init__(self, actor: Any, limits: RateLimits) -> None:
        self._actor = actor
        self.limits = limits

    async def admit(self, principal: str, max_tokens: int) -> Reservation:
        """``RateLimiter.admit`` in the store."""
        return await self._reserve(self._actor.admit.remote(principal, max_tokens), None)

    async def check(self, principal: str, max_tokens: int) -> None:
        """``RateLimiter.check`` in the store."""
        await self._ask(self._actor.check.remote(principal, max_tokens))

    async def count_work(self, principal: str) -> None:
        """``RateLimiter.count_work`` in the store."""
        await self._ask(self._actor.count_work.remote(principal))

    async def count_audio(self, principal: str, audio_s: float) -> None:
        """``RateLimiter.count_audio`` in the store."""
        await self._ask(self._actor.count_audio.remote(principal, audio_s))

    async def extend(self, reservation: Reservation, more_tokens: int) -> Reservation:
        """``RateLimiter.extend`` in the store."""
        return await self._reserve(self._actor.extend.remote(reservation, more_tokens), reservation)

    def charge_audio(self, principal: str, audio_s: float) -> None:
        """``RateLimiter.charge_audio`` in the store (sent, not awaited)."""
        self._actor.charge_audio.remote(principal, audio_s)

    def release(self, reservation: Reservation, num_used: int) -> None:
        """``RateLimiter.release`` in the store (sent, not awaited)."""
        self._actor.release.remote(reservation, num_used)

    async def _reserve(self, ref: Any, before: Reservation | None) -> Reservation:
        """The reservation the store answers ``ref`` with; should the caller stop waiting
        first, what it reserved beyond ``before`` is given back once it comes."""
        answer = asyncio.ensure_future(_value(ref))
        try:
            result = await self._ask(answer)
        except BaseException:
            answer.add_done_callback(lambda done: self._give_back(done, before))
            raise
        assert isinstance(result, Reservation)
        return result

    def _give_back(self, done: asyncio.Future[Any], before: Reservation | None) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        after = done.result()
        if isinstance(after, Reservation):
            held = before.tokens if before is not None else 0.0
            self.release(Reservation(after.principal, after.tokens - held), 0)

    async def _ask(self, call: Any) -> Any:
        """The store's answer to ``call`` (an actor call, or a future of its value): a
        refusal raised; no answer in time is a refusal too."""
        waiting = call if isinstance(call, asyncio.Future) else asyncio.ensure_future(_value(call))
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                answer = await asyncio.shield(waiting)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # whatever Ray raises, the limits did not answer
            log.warning("the cluster's rate limits did not answer: %r", exc)
            raise RateLimited(
                f"the cluster's rate limits did not answer ({type(exc).__name__}); retry in {RETRY_AFTER_S:g} s",
                retry_after_s=RETRY_AFTER_S,
            ) from exc
        if isinstance(answer, RateLimited):
            raise answer
        return answer


async def _value(ref: Any) -> Any:
    """The value of an actor call's object reference."""
    return await ref
