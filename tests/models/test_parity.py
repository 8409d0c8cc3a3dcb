"""Greedy decoding through ``TorchModelRunner`` equals transformers' ``generate``, token for
token, with log-softmax within 1e-3 at every step (float32), for every supported architecture.
"""

from __future__ import annotations

import pytest
import torch
from rill_model_helpers import CASES, Sequence, hf_greedy, load_hf, random_prompts, run_greedy

from rill.engine.runner import TorchModelRunner
from rill.models import load_model

TOLERANCE = 1e-3


def _check_against_reference(hf_model, sequences: list[Sequence]) -> None:
    for i, seq in enumerate(sequences):
        ref_tokens, ref_logprobs = hf_greedy(hf_model, seq.prompt, seq.num_new)
        ours = torch.stack(seq.logprobs)
        error = (ours - ref_logprobs).abs().max().item()
        assert seq.tokens == ref_tokens, f"sequence {i} parted at {_first_diff(seq.tokens, ref_tokens)}"
        assert error < TOLERANCE, f"sequence {i}: log-softmax differs by {error:.2e}"


def _first_diff(a: list[int], b: list[int]) -> int | None:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _runner(folder, num_rows: int = 8, max_len: int = 160) -> TorchModelRunner:
    return TorchModelRunner(load_model(folder, dtype="float32"), num_rows=num_rows, max_len=max_len)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_matches_transformers(checkpoint, case: str) -> None:
    """Three prompts of different lengths prefilled in one step, then 64 batched decode steps."""
    folder = checkpoint(case)
    runner = _runner(folder)
    prompts = random_prompts([5, 17, 30], runner.vocab_size)
    # Rows out of order so the first decode step must swap rows into 0..2.
    sequences = [Sequence(prompt, row) for prompt, row in zip(prompts, [5, 0, 3])]
    run_greedy(runner, sequences)
    _check_against_reference(load_hf(folder), sequences)


@pytest.mark.parametrize("case", ["llama", "qwen3", "mistral", "gemma3"])
def test_chunked_prefill_while_others_decode(checkpoint, case: str) -> None:
    """Prompts fed in chunks of 7 while another sequence decodes: mixed steps, several starts."""
    folder = checkpoint(case)
    runner = _runner(folder)
    prompts = random_prompts([12, 40, 23], runner.vocab_size, seed=1)
    sequences = [
        Sequence(prompts[0], row=2, num_new=40),
        Sequence(prompts[1], row=4, num_new=24, arrival=2, chunk=7),
        Sequence(prompts[2], row=1, num_new=24, arrival=3, chunk=7),
    ]
    run_greedy(runner, sequences)
    _check_against_reference(load_hf(folder), sequences)


@pytest.mark.parametrize("case", ["llama", "mistral", "qwen2-tied"])
def test_rows_join_and_leave(checkpoint, case: str) -> None:
    """Sequences arrive and finish at different steps, so the decode set changes and rows swap."""
    folder = checkpoint(case)
    runner = _runner(folder)
    prompts = random_prompts([9, 3, 21, 14, 6, 30], runner.vocab_size, seed=2)
    plan = [  # (row, arrival, num_new, chunk)
        (6, 0, 30, None),
        (2, 0, 8, None),
        (7, 4, 40, None),
        (0, 5, 12, 5),
        (4, 12, 30, None),
        (1, 20, 16, 11),
    ]
    sequences = [
        Sequence(prompt, row=row, arrival=arrival, num_new=num_new, chunk=chunk)
        for prompt, (row, arrival, num_new, chunk) in zip(prompts, plan)
    ]
    run_greedy(runner, sequences)
    _check_against_reference(load_hf(folder), sequences)


def test_row_reuse_after_finish(checkpoint) -> None:
    """A row freed by a finished sequence serves a new prompt (its stale KV must not leak in)."""
    folder = checkpoint("llama")
    runner = _runner(folder, num_rows=2)
    prompts = random_prompts([25, 4, 9], runner.vocab_size, seed=3)
    first = [Sequence(prompts[0], row=0, num_new=20), Sequence(prompts[1], row=1, num_new=10)]
    run_greedy(runner, first)
    second = [Sequence(prompts[2], row=0, num_new=16)]
    run_greedy(runner, second)
    _check_against_reference(load_hf(folder), first + second)


def test_cache_free_forward_matches_transformers(checkpoint) -> None:
    """``model(input_ids)`` (the training path) equals transformers' forward on a padded-free batch."""
    folder = checkpoint("qwen3")
    loaded = load_model(folder, dtype="float32")
    ids = torch.tensor(random_prompts([20, 20], loaded.config.vocab_size, seed=4))
    with torch.no_grad():
        ours = loaded.model(ids)
        ref = load_hf(folder)(ids).logits
    assert (ours - ref).abs().max().item() < 1e-4


def test_dynamic_rope_context_is_capped(checkpoint) -> None:
    """Past max_position_embeddings dynamic RoPE changes every frequency: the runner refuses."""
    loaded = load_model(checkpoint("llama-dynamic-rope"), dtype="float32")
    assert loaded.config.max_context_tokens == 512
    with pytest.raises(ValueError, match="dynamic-RoPE"):
        TorchModelRunner(loaded, num_rows=1, max_len=513)
