"""The KV manager: allocation, release within a step, prefix reuse and copies (FakeRunner, no model)."""

from __future__ import annotations

from rill.engine.kv_cache import EmptyRow, KVManager
from rill.engine.request import AbortCommand, AddCommand
from rill.types import RequestEvent
from tests.engine.fake_core import (
    PROMPTS,
    Result,
    assert_idle,
    make_engine,
    make_request,
    run,
    solo,
    step,
    step_until_finished,
)


class Holder:
    """A live row's owner holding ``tokens``, all computed."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.num_computed = len(tokens)

    def token_at(self, start: int, stop: int) -> list[int]:
        return self.tokens[start:stop]


def test_rows_are_handed_out_lowest_first_until_none_is_left() -> None:
    kv = KVManager(num_rows=3, max_len=64, bytes_per_token=8)
    rows = [kv.acquire(Holder([]), [i, 1, 2]) for i in range(3)]
    assert [a.row for a in rows if a] == [0, 1, 2]
    assert kv.acquire(Holder([]), [9, 9]) is None and kv.acquire_empty() is None
    assert kv.num_live_rows == 3 and kv.num_available_rows == 0


def test_release_keeps_a_cache_entry_drop_frees_and_eviction_is_lru() -> None:
    kv = KVManager(num_rows=2, max_len=64, bytes_per_token=8)
    a = kv.acquire(Holder([]), [1, 2, 3, 4])
    b = kv.acquire(Holder([]), [5, 6, 7, 8])
    assert a is not None and b is not None
    kv.release(a.row, [1, 2, 3, 4])
    kv.release(b.row, [5, 6, 7, 8])
    assert kv.num_live_rows == 0 and kv.cached_tokens() == 8 and kv.num_available_rows == 2
    # A new prompt matching neither evicts the oldest entry (row a) first.
    c = kv.acquire(Holder([]), [9, 9, 9])
    assert c is not None and c.row == a.row and c.num_cached_tokens == 0
    assert list(kv.cached) == [b.row]
    kv.drop(c.row)
    assert c.row in kv.free_rows and kv.cached_tokens() == 4


def test_packed_rows_give_a_new_sequence_the_lowest_row_free_or_cached() -> None:
    """After a wave in rows 0..3 (cached) with rows 4..5 free, the next wave takes 0..3 again,
    not 4, 5 and the two oldest entries: live rows stay consecutive (one llama.cpp micro-batch)."""
    kv = KVManager(num_rows=6, max_len=64, bytes_per_token=8, pack_rows=True)
    first = [kv.acquire(Holder([]), [i, 7, 7]) for i in range(4)]
    assert [a.row for a in first if a] == [0, 1, 2, 3]
    for a, i in zip(reversed(first), (3, 2, 1, 0)):  # released last first: row 3 is the oldest entry
        assert a is not None
        kv.release(a.row, [i, 7, 7])
    second = [kv.acquire(Holder([]), [10 + i, 8, 8]) for i in range(4)]
    assert [a.row for a in second if a] == [0, 1, 2, 3]
    hit = kv.acquire(Holder([]), [0, 7, 7, 9])  # its entry went with row 0: a miss, in the lowest free row
    assert hit is not None and hit.row == 4 and hit.num_cached_tokens == 0
    kv.drop(second[1].row)  # type: ignore[union-attr]
    assert kv.acquire_empty() == 1  # the gap is filled first
    plain = KVManager(num_rows=6, max_len=64, bytes_per_token=8)
    rows = [plain.acquire(Holder([]), [i, 7, 7]) for i in range(4)]
    for a, i in zip(reversed(rows), (3, 2, 1, 0)):
        plain.release(a.row, [i, 7, 7])  # type: ignore[union-attr]
    assert [plain.acquire(Holder([]), [10 + i, 8, 8]).row for i in range(4)] == [4, 5, 3, 2]  # type: ignore[union-attr]


def test_prefix_hit_takes_over_a_cached_row_and_a_miss_does_not() -> None:
    kv = KVManager(num_rows=2, max_len=64, bytes_per_token=8, min_reuse_tokens=3)
    first = kv.acquire(Holder([]), [1, 2, 3, 4, 5])
    assert first is not None
    kv.release(first.row, [1, 2, 3, 4, 5])
    hit = kv.acquire(Holder([]), [1, 2, 3, 4, 5, 6, 7])
    assert hit is not None and (hit.row, hit.num_cached_tokens, hit.copy_from) == (first.row, 5, None)
    miss = kv.acquire(Holder([]), [1, 2, 8, 8])  # shares 2 tokens: under min_reuse_tokens
    assert miss is not None and miss.num_cached_tokens == 0 and miss.row != first.row
    assert kv.num_hit_tokens == 5 and kv.num_query_tokens == 16


def test_a_prefix_shared_with_a_live_row_is_copied_not_taken() -> None:
    kv = KVManager(num_rows=3, max_len=64, bytes_per_token=8, min_reuse_tokens=2)
    live = Holder([1, 2, 3, 4, 5, 6])
    kv.live[0] = live
    kv.free_rows.remove(0)
    got = kv.acquire(Holder([]), [1, 2, 3, 4, 9, 9])
    assert got is not None and got.row != 0 and got.copy_from == (0, 4) and got.num_cached_tokens == 4
    assert kv.live[0] is live
    assert isinstance(kv.live[kv.acquire_empty() or 0], EmptyRow)


def test_max_reuse_bounds_the_prefix_taken_from_the_cache() -> None:
    """``max_reuse`` (a request needing prompt logits): 0 computes everything; N takes at most N."""
    kv = KVManager(num_rows=3, max_len=64, bytes_per_token=8, min_reuse_tokens=2)
    first = kv.acquire(Holder([]), list(range(1, 11)))
    assert first is not None
    kv.release(first.row, list(range(1, 11)))
    none = kv.acquire(Holder([]), list(range(1, 11)), max_reuse=0)
    assert none is not None and none.num_cached_tokens == 0 and none.copy_from is None
    part = kv.acquire(Holder([]), list(range(1, 11)), max_reuse=6)
    assert part is not None and part.num_cached_tokens == 6


class Prefilling(Holder):
    """A live row's owner that has computed only the first ``num_computed`` of its tokens."""

    def __init__(self, tokens: list[int], num_computed: int) -> None:
        super().__init__(tokens)
        self.num_computed = num_computed


def test_pending_overlap_counts_only_what_no_row_holds_yet() -> None:
    kv = KVManager(num_rows=3, max_len=64, bytes_per_token=8)
    prompt = list(range(1, 41))
    kv.live[0] = Prefilling(prompt, 8)
    kv.free_rows.remove(0)
    assert kv.pending_overlap(prompt) == 32  # the live prefill will add 32 more tokens of it
    assert kv.pending_overlap(prompt, available=39) == 1  # but another row already holds 39


def test_rows_are_freed_in_the_step_that_finishes_or_aborts_a_request() -> None:
    engine = make_engine()
    core = engine.core
    results: dict[str, Result] = {}
    core.apply(AddCommand(make_request(engine, "done", PROMPTS[0], temperature=0.0, max_tokens=3, ignore_eos=True)))
    core.apply(AddCommand(make_request(engine, "gone", PROMPTS[1], temperature=0.0, max_tokens=50, ignore_eos=True)))
    step_until_finished(engine, results, "done")
    # The step that produced "done"'s last token released its row: only "gone" holds one.
    assert core.kv.num_live_rows == 1 and core.stats().num_running == 1
    core.apply(AbortCommand("gone"))
    outputs = step(engine, results)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("gone", "cancelled")]
    assert_idle(engine)
    # Both rows' valid tokens stay as reusable cache entries.
    assert (
        core.kv.cached_tokens()
        == len(engine.tokenizer.encode(PROMPTS[0]))
        + 2
        + len(results["gone"].token_ids)
        + len(engine.tokenizer.encode(PROMPTS[1]))
        - 1
    )


def test_a_follow_up_prompt_reuses_the_cached_turn_and_gives_the_tokens_of_a_cold_run() -> None:
    engine = make_engine()
    first = make_request(engine, "t1", PROMPTS[5], temperature=0.0, max_tokens=8, ignore_eos=True)
    turn = run(engine, [first])["t1"]
    follow = first.prompt_ids + turn.token_ids + engine.tokenizer.encode(" and then", add_special_tokens=False)
    fed_before = engine.runner.num_tokens_fed
    second = make_request(engine, "t2", follow, temperature=0.7, seed=3, max_tokens=6, ignore_eos=True)
    warm = run(engine, [second])["t2"]
    # Turn one's tokens but its last (never fed) came from the cache; only the rest was computed.
    reused = len(first.prompt_ids) + len(turn.token_ids) - 1
    assert warm.usage.cached_tokens == reused
    assert engine.runner.num_tokens_fed - fed_before == len(follow) - reused + 5
    assert warm.token_ids == solo(second).token_ids  # the reused KV is the KV a cold run computes
    assert_idle(engine)


def test_a_prompt_sharing_only_a_short_prefix_is_a_miss() -> None:
    engine = make_engine()
    run(engine, [make_request(engine, "a", PROMPTS[0], temperature=0.0, max_tokens=2)])
    other = run(engine, [make_request(engine, "b", "on a hill", temperature=0.0, max_tokens=2)])["b"]
    assert other.usage.cached_tokens == 0  # "<s>on" is shorter than min_reuse_tokens
    assert_idle(engine)


def test_a_sibling_sharing_a_live_prefix_gets_a_copy_and_leaves_the_source_intact() -> None:
    engine = make_engine()
    runner = engine.runner
    core = engine.core
    results: dict[str, Result] = {}
    parent = make_request(engine, "parent", PROMPTS[1], temperature=0.0, max_tokens=30, ignore_eos=True)
    core.apply(AddCommand(parent))
    for _ in range(3):
        step(engine, results)
    parent_row = parent.row
    held = runner.row_tokens(parent_row)
    fork = make_request(
        engine,
        "fork",
        parent.prompt_ids + engine.tokenizer.encode(" yes", add_special_tokens=False),
        temperature=0.0,
        max_tokens=5,
        ignore_eos=True,
    )
    core.apply(AddCommand(fork))
    step(engine, results)
    assert runner.copies and runner.copies[-1][0] == parent_row and runner.copies[-1][1] == fork.row != parent_row
    assert runner.copies[-1][2] == len(parent.prompt_ids)
    assert runner.row_tokens(parent_row)[: len(held)] == held  # the fork wrote into its own row only
    while core.has_work():
        step(engine, results)
    assert RequestEvent.SCHEDULED in results["fork"].events
    assert results["fork"].usage.cached_tokens == len(parent.prompt_ids)
    assert results["fork"].token_ids == solo(fork).token_ids
    assert results["parent"].token_ids == solo(parent).token_ids
    assert_idle(engine)


def test_the_runner_is_told_what_a_row_no_longer_needs() -> None:
    """A freed row is discarded whole; a row kept as a cache entry past its valid tokens; a
    dropped one whole (the runner gives that memory back to the operating system)."""
    told: list[tuple[int, int]] = []
    kv = KVManager(num_rows=3, max_len=64, bytes_per_token=8, discard=lambda row, keep: told.append((row, keep)))
    a, b, c = (kv.acquire(Holder([]), [i, 1, 2, 3]) for i in (1, 2, 3))
    assert a is not None and b is not None and c is not None
    kv.release(a.row, [1, 1, 2, 3, 4])
    kv.release(b.row, [])
    kv.drop(c.row)
    assert told == [(a.row, 5), (b.row, 0), (c.row, 0)]


def test_cache_entries_past_their_token_bound_go_oldest_first_and_are_discarded() -> None:
    told: list[tuple[int, int]] = []
    kv = KVManager(
        num_rows=4,
        max_len=64,
        bytes_per_token=8,
        max_cached_tokens=10,
        discard=lambda row, keep: told.append((row, keep)),
    )
    rows = [kv.acquire(Holder([]), [i, 1, 2, 3]) for i in range(4)]
    assert all(rows)
    for i, acquired in enumerate(rows[:3]):
        assert acquired is not None
        kv.release(acquired.row, [i] * 4)  # 4, 8, then 12 tokens: the oldest entry goes
    assert kv.cached_tokens() == 8 and list(kv.cached) == [rows[1].row, rows[2].row]  # type: ignore[union-attr]
    assert told[-1] == (rows[0].row, 0)  # type: ignore[union-attr]
    assert rows[0].row in kv.free_rows  # type: ignore[union-attr]
    # Taking an entry over or evicting it keeps the count right.
    taken = kv.acquire(Holder([]), [1, 1, 1, 1, 9])
    assert taken is not None and taken.row == rows[1].row and kv.cached_tokens() == 4  # type: ignore[union-attr]
