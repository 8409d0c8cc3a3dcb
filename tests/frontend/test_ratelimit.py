"""The admission step's per-principal limiter, on an injected clock (no sleeps)."""

from __future__ import annotations

import pytest

from rill.errors import RateLimited
from rill.frontend.ratelimit import LocalLimiter, RateLimiter, RateLimits, open_account


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(clock: Clock, **limits: object) -> RateLimiter:
    return RateLimiter(RateLimits(**limits), clock)  # type: ignore[arg-type]


def test_window_admits_n_then_refuses_until_it_ends() -> None:
    clock = Clock()
    lim = limiter(clock, requests=3, window_s=10.0)
    for _ in range(3):
        lim.admit("a", 100)
    clock.now += 4.0
    with pytest.raises(RateLimited) as info:
        lim.admit("a", 100)
    assert info.value.retry_after_s == pytest.approx(6.0) and "3 requests per 10 s" in str(info.value)
    clock.now += 5.999
    with pytest.raises(RateLimited):
        lim.admit("a", 100)  # still inside the window that opened at the first request
    clock.now += 0.001  # exactly at its end: a new window opens
    for _ in range(3):
        lim.admit("a", 100)
    with pytest.raises(RateLimited) as info:
        lim.admit("a", 100)
    assert info.value.retry_after_s == pytest.approx(10.0)


def test_refused_requests_do_not_count_and_principals_are_apart() -> None:
    clock = Clock()
    lim = limiter(clock, requests=1, window_s=60.0)
    lim.admit("a", 1)
    for _ in range(5):
        with pytest.raises(RateLimited):
            lim.admit("a", 1)
    lim.admit("b", 1)  # another principal has its own window
    clock.now += 60.0
    lim.admit("a", 1)  # the refusals did not extend or fill the next window


def test_tokens_are_reserved_and_the_unused_part_given_back() -> None:
    clock = Clock()
    lim = limiter(clock, tokens_per_s=1.0, burst=100)
    first = lim.admit("a", 80)
    assert first.tokens == 80
    with pytest.raises(RateLimited) as info:
        lim.admit("a", 30)  # 20 left; 10 more come in 10 s
    assert info.value.retry_after_s == pytest.approx(10.0) and "30 tokens asked" in str(info.value)
    lim.release(first, num_used=5)  # 75 come back
    second = lim.admit("a", 90)
    assert second.tokens == 90
    lim.release(second, num_used=90)  # used in full: nothing comes back
    with pytest.raises(RateLimited):
        lim.admit("a", 10)
    clock.now += 5.0  # 5 left + 5 refilled
    lim.admit("a", 10)


def test_a_running_request_extends_its_reservation_or_is_refused_unchanged() -> None:
    clock = Clock()
    lim = limiter(clock, requests=5, tokens_per_s=1.0, burst=100)
    held = lim.admit("a", 60)
    held = lim.extend(held, 30)
    assert held.tokens == 90
    with pytest.raises(RateLimited) as info:
        lim.extend(held, 20)  # 10 left
    assert info.value.retry_after_s == pytest.approx(10.0) and "20 more tokens" in str(info.value)
    lim.admit("a", 10)  # the refusal took nothing; an extension counts no request
    for _ in range(3):
        lim.admit("a", 0)
    with pytest.raises(RateLimited):
        lim.admit("a", 0)  # the window's sixth request
    assert lim.extend(held, 0) is held


def test_tokens_used_beyond_the_reservation_are_a_debt_waited_out() -> None:
    clock = Clock()
    lim = limiter(clock, tokens_per_s=1.0, burst=100)
    held = lim.admit("a", 40)
    lim.release(held, num_used=70)  # 30 more than reserved: the bucket stands at 100 - 70
    with pytest.raises(RateLimited) as info:
        lim.admit("a", 40)
    assert info.value.retry_after_s == pytest.approx(10.0)
    lim.release(lim.admit("a", 30), num_used=130)  # 100 past its reservation: 100 below zero
    with pytest.raises(RateLimited) as info:
        lim.admit("a", 1)
    assert info.value.retry_after_s == pytest.approx(101.0)


def test_an_ask_over_the_burst_reserves_the_burst() -> None:
    clock = Clock()
    lim = limiter(clock, tokens_per_s=1.0, burst=50)
    assert lim.admit("a", 4000).tokens == 50
    with pytest.raises(RateLimited):
        lim.admit("a", 1)


def test_a_token_refusal_does_not_count_a_request() -> None:
    clock = Clock()
    lim = limiter(clock, requests=2, window_s=60.0, tokens_per_s=1.0, burst=10)
    lim.admit("a", 10)
    with pytest.raises(RateLimited):
        lim.admit("a", 10)  # no tokens: refused, not counted
    clock.now += 10.0
    lim.admit("a", 10)  # the second request of the window
    clock.now += 10.0
    with pytest.raises(RateLimited) as info:
        lim.admit("a", 1)  # the window's 2 are used (tokens would be there)
    assert "2 requests per 60 s" in str(info.value)


def test_state_is_bounded_least_recently_seen_first() -> None:
    clock = Clock()
    lim = limiter(clock, requests=1, window_s=60.0, max_principals=3)
    for name in ("a", "b", "c"):
        lim.admit(name, 1)
    with pytest.raises(RateLimited):
        lim.admit("a", 1)  # "a" is now the most recently seen
    lim.admit("d", 1)  # forgets "b", the least recently seen
    assert len(lim) == 3
    lim.admit("b", 1)  # starts afresh (and forgets "c")
    with pytest.raises(RateLimited):
        lim.admit("a", 1)  # kept all along
    lim.admit("c", 1)
    assert len(lim) == 3


def test_release_after_the_principal_was_forgotten_is_harmless() -> None:
    clock = Clock()
    lim = limiter(clock, tokens_per_s=1.0, burst=10, max_principals=1)
    held = lim.admit("a", 10)
    lim.admit("b", 10)  # forgets "a"
    lim.release(held, num_used=0)
    assert len(lim) == 1
    with pytest.raises(RateLimited):
        lim.admit("b", 1)  # "a"'s tokens never reach "b"


def test_no_limits_configured_means_off() -> None:
    assert not RateLimits().is_on
    assert RateLimits(requests=1).is_on and RateLimits(tokens_per_s=1.0).is_on


async def test_an_account_reserves_only_the_shortfall_of_each_change() -> None:
    """``max_tokens`` 9 -> 5 -> 9 needs nothing more (an extension by each raise's difference
    would ask 4 and be refused here); a restart keeps the discarded tokens covered, once."""
    clock = Clock()
    lim = limiter(clock, tokens_per_s=1.0, burst=14)
    account = await open_account(LocalLimiter(lim), "a", 9)
    await account.set_max_tokens(5)
    await account.set_max_tokens(9)
    assert account.reservation.tokens == 9
    account.observe(3, restarted=False)
    await account.restart()  # 3 discarded + 9 again
    await account.restart()  # asked again before the engine restarted: nothing more
    assert account.reservation.tokens == 12
    with pytest.raises(RateLimited) as info:
        await account.set_max_tokens(12)  # 3 + 12 = 15: 3 more asked, 2 left
    assert "3 more tokens" in str(info.value)
    assert account.reservation.tokens == 12  # refused: unchanged
    account.observe(1, restarted=True)  # the engine restarted: 3 spent, 1 in the new attempt
    account.observe(9, restarted=False)
    assert account.used == 12
    account.settle()
    account.settle()  # only once
    with pytest.raises(RateLimited):
        lim.admit("a", 3)  # 12 of 14 spent
    lim.admit("a", 2)


async def test_an_account_charges_what_it_made_past_the_burst() -> None:
    clock = Clock()
    lim = limiter(clock, tokens_per_s=1.0, burst=10)
    account = await open_account(LocalLimiter(lim), "a", 30)  # reserves the burst, stands for 30
    await account.set_max_tokens(25)
    await account.set_max_tokens(30)  # nothing more: still 30 covered
    account.settle(30)  # 20 past the 10 reserved: a debt
    with pytest.raises(RateLimited) as info:
        lim.admit("a", 1)
    assert info.value.retry_after_s == pytest.approx(21.0)


def test_extending_keeps_a_principal_recently_seen() -> None:
    clock = Clock()
    lim = limiter(clock, tokens_per_s=1.0, burst=10, max_principals=2)
    held = lim.admit("a", 1)
    lim.admit("b", 1)
    lim.extend(held, 1)  # "a" is now the most recently seen
    lim.admit("c", 1)  # forgets "b", not "a"
    with pytest.raises(RateLimited):
        lim.admit("a", 9)  # "a" kept its 2 reserved tokens


def test_count_work_takes_a_request_of_the_window_and_no_tokens() -> None:
    clock = Clock()
    lim = limiter(clock, requests=2, window_s=10.0, tokens_per_s=1.0, burst=10)
    lim.admit("a", 10)  # every token held
    lim.count_work("a")  # a compile needs no tokens, only the window's second request
    with pytest.raises(RateLimited):
        lim.count_work("a")
    with pytest.raises(RateLimited):
        lim.admit("a", 0)
    clock.now += 10.0
    lim.count_work("a")  # the next window


def test_count_work_is_free_without_a_request_limit() -> None:
    lim = limiter(Clock(), tokens_per_s=1.0, burst=10)
    for _ in range(100):
        lim.count_work("a")
    assert len(lim) == 0  # no state made for it


def test_check_refuses_as_admit_would_and_changes_nothing() -> None:
    clock = Clock()
    lim = limiter(clock, requests=1, window_s=10.0, tokens_per_s=0.01, burst=10)
    lim.check("new", 10)
    assert len(lim) == 0  # a principal seen by check only has no state
    lim.check("a", 10)
    lim.admit("a", 4)
    with pytest.raises(RateLimited):
        lim.check("a", 1)  # the window's one request is taken
    clock.now += 10.0
    lim.check("a", 6)  # a new window; 6.1 tokens are there
    with pytest.raises(RateLimited):
        lim.check("a", 7)
    lim.admit("a", 6)  # check took nothing


def test_audio_seconds_are_counted_in_the_request_window() -> None:
    clock = Clock()
    lim = limiter(clock, audio_s=60.0, window_s=100.0)
    lim.count_audio("a", 40.0)  # a transcription's seconds, known before the work
    with pytest.raises(RateLimited) as info:
        lim.count_audio("a", 30.0)
    assert "40.0 s of 60 s of audio" in str(info.value) and info.value.retry_after_s == pytest.approx(100.0)
    lim.count_audio("b", 30.0)  # principals are apart
    lim.count_audio("a", 0.0)  # speech: admitted with nothing used yet...
    lim.charge_audio("a", 45.0)  # ...and charged what it made, past the limit
    with pytest.raises(RateLimited):
        lim.count_audio("a", 0.0)
    clock.now += 100.0  # the next window starts afresh
    lim.count_audio("a", 60.0)
    both = limiter(clock, audio_s=60.0, requests=1, window_s=10.0)
    both.count_audio("a", 1.0)
    with pytest.raises(RateLimited, match="1 requests per 10 s"):  # one audio request is a request
        both.count_audio("a", 1.0)
