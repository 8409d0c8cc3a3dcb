"""``TorchModelRunner``: row copies, mixed decode + prefill steps, logits selection, row swaps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rill.engine.batch import RowWork
from rill.engine.runner import TorchModelRunner
from rill.models import load_model

ATOL = 1e-5


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread, and the CPU is shared; restore afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 (q/k/v biases, GQA) checkpoint."""
    from rill.testing.checkpoints import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("runner"), "qwen2")


@pytest.fixture(scope="module")
def loaded(model_dir: Path):
    return load_model(model_dir, dtype="float32")


def _runner(loaded, num_rows: int = 8, max_len: int = 64) -> TorchModelRunner:
    return TorchModelRunner(loaded, num_rows=num_rows, max_len=max_len)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(8, 800, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_attributes(loaded) -> None:
    runner = _runner(loaded, num_rows=3, max_len=32)
    config = loaded.config
    assert (runner.num_rows, runner.max_len, runner.vocab_size) == (3, 32, config.vocab_size)
    assert runner.kv_bytes_per_token == 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    assert runner.kv_capacity_bytes == 3 * 32 * runner.kv_bytes_per_token


def test_copy_row_then_fork(loaded) -> None:
    """A copied prefix continues exactly like the source, and forks diverge independently."""
    prompt = _prompt(11, seed=0)
    runner = _runner(loaded)
    runner.forward([RowWork(row=0, token_ids=prompt, start=0)])
    runner.copy_row(0, 5, len(prompt))
    same = runner.forward([RowWork(row=0, token_ids=[42], start=11), RowWork(row=5, token_ids=[42], start=11)])
    torch.testing.assert_close(same[0], same[1], atol=ATOL, rtol=0)
    runner.copy_row(5, 2, 12)
    forks = runner.forward([RowWork(row=2, token_ids=[7], start=12), RowWork(row=5, token_ids=[9], start=12)])
    fresh = _runner(loaded)
    expected = fresh.forward(
        [
            RowWork(row=0, token_ids=prompt + [42, 7], start=0),
            RowWork(row=1, token_ids=prompt + [42, 9], start=0),
        ]
    )
    torch.testing.assert_close(forks, expected, atol=ATOL, rtol=0)


def _prime(runner: TorchModelRunner) -> None:
    # Rows 0 and 1 hold prompts; row 2 holds the first chunk of a prompt.
    runner.forward(
        [
            RowWork(row=0, token_ids=_prompt(13, 1), start=0),
            RowWork(row=1, token_ids=_prompt(4, 2), start=0),
            RowWork(row=2, token_ids=_prompt(6, 3), start=0, need_logits=False),
        ]
    )


def test_mixed_step_equals_separate_runs(loaded) -> None:
    """Decodes and prefill chunks with different starts in one step = each item run alone."""
    step = [
        RowWork(row=1, token_ids=[11], start=4),
        RowWork(row=2, token_ids=_prompt(9, 4), start=6),
        RowWork(row=0, token_ids=[12], start=13),
        RowWork(row=4, token_ids=_prompt(5, 5), start=0),
        RowWork(row=6, token_ids=_prompt(3, 6), start=0, need_logits=False),
    ]
    together = _runner(loaded)
    _prime(together)
    mixed = together.forward(step)
    alone = _runner(loaded)
    _prime(alone)
    separate = [alone.forward([item]) for item in step]
    assert mixed.shape == (4, loaded.config.vocab_size)
    torch.testing.assert_close(mixed, torch.cat(separate), atol=ATOL, rtol=0)
    # The next step sees the same caches: decode every row once more.
    follow = [RowWork(row=r, token_ids=[3], start=s) for r, s in [(0, 14), (1, 5), (2, 15), (4, 5), (6, 3)]]
    torch.testing.assert_close(together.forward(follow), alone.forward(follow), atol=ATOL, rtol=0)


def test_logits_only_where_needed(loaded) -> None:
    runner = _runner(loaded)
    none = runner.forward([RowWork(row=3, token_ids=_prompt(5, 7), start=0, need_logits=False)])
    assert none.shape == (0, loaded.config.vocab_size) and none.dtype == torch.float32
    assert runner.forward([]).shape == (0, loaded.config.vocab_size)


def test_decode_set_changes_swap_rows_without_loss(loaded) -> None:
    """Rows join and leave the decode set in every step; each row's logits match a solo run."""
    prompts = {row: _prompt(3 + 2 * row, 10 + row) for row in (1, 3, 6, 7)}
    shared, solo = _runner(loaded), _runner(loaded)
    for runner in (shared, solo):
        runner.forward([RowWork(row=row, token_ids=p, start=0, need_logits=False) for row, p in prompts.items()])
    lengths = {row: len(p) for row, p in prompts.items()}
    schedule = [[7], [3, 7], [1, 6], [6, 3, 1, 7], [1], [7, 6]]
    for rows in schedule:
        work = [RowWork(row=row, token_ids=[row + 20], start=lengths[row]) for row in rows]
        got = shared.forward(work)
        expected = torch.cat([solo.forward([item]) for item in work])
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        for row in rows:
            lengths[row] += 1


@pytest.mark.parametrize(
    ("budget", "max_rows", "rows", "per_row"),
    [
        (40, None, 8, 5),  # spread over every row
        (40, 3, 3, 13),  # over at most the engine's sequences
        (8192, None, 8, 63),  # each row at most max_len - 1, so the decode fits
        (5, None, 2, 2),  # a prefill is at least two tokens per row
    ],
)
def test_warm_up_runs_a_prefill_and_a_decode_then_leaves_the_runner_as_new(
    loaded, budget: int, max_rows: int | None, rows: int, per_row: int
) -> None:
    """The warm-up's two steps really run, with the shapes promised; afterwards the cache is
    zero and every row empty again, and later steps compute exactly what a fresh runner's do."""
    warmed, fresh = _runner(loaded), _runner(loaded)
    steps: list[tuple[int, bool]] = []  # (tokens of the step, cache written after it)
    real_step = warmed.model.forward_step

    def recording_step(batch, caches):
        logits = real_step(batch, caches)
        steps.append((batch.input_ids.numel(), bool(warmed._kv.any())))
        return logits

    warmed.model.forward_step = recording_step  # type: ignore[method-assign]
    assert warmed.warm_up(budget, max_rows=max_rows)[:2] == (rows, rows * per_row)
    del warmed.model.forward_step
    assert steps == [(rows * per_row, True), (rows, True)]
    assert not bool(warmed._kv.any()) and not any(warmed._lengths)
    for runner in (warmed, fresh):
        _prime(runner)
        runner.copy_row(0, 5, 13)
    later = [
        [RowWork(row=5, token_ids=[11], start=13), RowWork(row=1, token_ids=[12], start=4)],
        [RowWork(row=2, token_ids=_prompt(9, 4), start=6), RowWork(row=0, token_ids=[3], start=13)],
        [RowWork(row=r, token_ids=[r + 1], start=s) for r, s in [(0, 14), (1, 5), (2, 15), (5, 14)]],
    ]
    for step in later:
        assert torch.equal(warmed.forward(step), fresh.forward(step))


def test_warm_up_refuses_a_used_runner_and_skips_what_cannot_be_a_prefill(loaded) -> None:
    used = _runner(loaded)
    _prime(used)
    with pytest.raises(RuntimeError, match="fresh runner"):
        used.warm_up(64)
    assert used._lengths[0] == 13  # nothing was wiped
    assert _runner(loaded).warm_up(1) == (0, 0, 0.0, 0.0)
    assert _runner(loaded, max_len=2).warm_up(64) == (0, 0, 0.0, 0.0)


def test_invalid_work_is_refused(loaded) -> None:
    runner = _runner(loaded, num_rows=2, max_len=8)
    with pytest.raises(ValueError, match="scheduled twice"):
        runner.forward([RowWork(row=0, token_ids=[1], start=0), RowWork(row=0, token_ids=[2], start=1)])
    with pytest.raises(ValueError, match="do not fit"):
        runner.forward([RowWork(row=1, token_ids=[1, 2, 3], start=6)])
    with pytest.raises(ValueError, match="out of range"):
        runner.copy_row(0, 2, 1)


def test_bfloat16_runner_tracks_the_reference(model_dir: Path) -> None:
    """bf16 through the runner stays close to the bf16 cache-free forward (smoke test)."""
    loaded = load_model(model_dir, dtype="bfloat16")
    runner = _runner(loaded)
    prompt = _prompt(20, 11)
    logits = runner.forward([RowWork(row=4, token_ids=prompt[:12], start=0, need_logits=False)])
    steps = [runner.forward([RowWork(row=4, token_ids=[token], start=12 + i)]) for i, token in enumerate(prompt[12:])]
    with torch.no_grad():
        reference = loaded.model(torch.tensor([prompt])).float()[0, 12:]
    ours = torch.cat(steps)
    assert logits.shape[0] == 0
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.75
    assert (torch.log_softmax(ours, -1) - torch.log_softmax(reference, -1)).abs().max() < 0.5


def _resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc to read resident memory")
def test_the_kv_cache_is_zeros_and_resident_only_where_written() -> None:
    """A 512 MiB cache adds (almost) nothing to resident memory until rows are written, and
    reads as zeros everywhere: a sequence's memory follows its use, not the budget."""
    from rill.engine.runner import zeroed_cache

    before = _resident_mib()
    cache = zeroed_cache((4, 2, 16, 2, 4096, 256), torch.bfloat16, torch.device("cpu"))  # 512 MiB
    allocated = _resident_mib()
    assert cache.shape == (4, 2, 16, 2, 4096, 256) and cache.dtype == torch.bfloat16
    assert allocated - before < 64
    assert not bool(cache[:, :, 15].any())  # reading untouched pages maps the shared zero page
    cache[:, :, 3] = 1.0  # one row of 16: 32 MiB
    written = _resident_mib()
    assert 24 < written - allocated < 96
    assert float(cache[:, :, 3].float().mean()) == 1.0 and not bool(cache[:, :, 4].any())


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc to read resident memory")
def test_released_pages_leave_resident_memory_and_read_as_zeros() -> None:
    """``release_pages`` gives a written stretch of the cache back: resident memory drops by
    about its size and the stretch reads as zeros, as in a fresh cache."""
    from rill.engine.runner import release_pages, zeroed_cache

    cache = zeroed_cache((2, 2, 4, 2, 4096, 256), torch.bfloat16, torch.device("cpu"))  # 64 MiB
    cache[:, :, 1] = 1.0  # one row of 4: 16 MiB
    written = _resident_mib()
    row = cache[0, 0, 1]  # 4 MiB, contiguous
    assert release_pages(row.data_ptr(), row.numel() * row.element_size()) == 4 * 2**20
    assert 2 < written - _resident_mib() < 6
    assert not bool(row.any()) and float(cache[1, 0, 1].float().mean()) == 1.0


def test_a_long_row_moved_among_the_decoding_rows_leaves_no_written_pages_behind(loaded) -> None:
    """Decoding rows are placed first: a long row moved into a freed row's place leaves its old
    place as the freed row had it (zeros past what that row holds), so a finished long prompt
    keeps no memory wherever its row went (a 3,885-token scoring prompt kept ~170 MB)."""
    runner = _runner(loaded, num_rows=3, max_len=2048)
    runner.forward([RowWork(2, _prompt(1500, 7), 0)])  # logical row 2, physical row 2
    runner.discard(0, 0)
    old_place = runner._physical[2]
    runner.forward([RowWork(2, [5], 1500)])  # row 2 decodes: it moves to physical row 0
    assert runner._physical[2] == 0 and runner._physical[0] == old_place
    # Whole pages of the old place read as zeros again (the kernel gave them back).
    assert not bool(runner._kv[:, :, old_place, :, 64:].any())
    assert bool(runner._kv[:, :, 0, :, 64:1500].any())


def test_discard_zeroes_a_row_past_the_kept_tokens_and_nothing_else(loaded) -> None:
    """What a finished row no longer needs goes back: positions from ``keep_tokens`` on read as
    zeros; its kept positions and every other row are untouched, and later steps agree with a
    fresh runner's."""
    runner = _runner(loaded, num_rows=3, max_len=2048)
    prompts = [_prompt(600, seed) for seed in range(3)]
    runner.forward([RowWork(row, prompts[row], 0) for row in range(3)])
    before = runner._kv.clone()
    runner.discard(1, 100)
    after = runner._kv
    physical = runner._physical[1]
    assert torch.equal(after[:, :, physical, :, :100], before[:, :, physical, :, :100])
    # Whole pages past position 100 are zero (the page holding position 100 may keep a tail).
    assert not bool(after[:, :, physical, :, 1024:].any()) and bool(before[:, :, physical, :, 128:600].any())
    others = [p for p in range(3) if p != physical]
    assert torch.equal(after[:, :, others], before[:, :, others])
    # A row cut back to 100 tokens goes on from there exactly as a row that only ever held them.
    fresh = _runner(loaded, num_rows=3, max_len=2048)
    fresh.forward([RowWork(1, prompts[1][:100], 0)])
    step = [RowWork(1, prompts[1][100:110], 100)]
    assert torch.allclose(runner.forward(step), fresh.forward(step), atol=1e-5)
