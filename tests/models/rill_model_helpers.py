"""Helpers for model tests: checkpoint cases and a small greedy driver that runs sequences
through ``TorchModelRunner`` the way a scheduler would, plus the transformers reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rill.engine.batch import RowWork

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> make_checkpoint keyword arguments. Sliding windows are smaller than prompt + output
# so the window really cuts; Qwen3 and Gemma 3 have an explicit head_dim != hidden / heads.
CASES: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama"),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama3-rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0),
    "llama-linear-rope": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "llama-dynamic-rope": dict(arch="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "mistral": dict(arch="mistral", sliding_window=24),
    "mistral-tied": dict(arch="mistral", tie_word_embeddings=True),
    "qwen2": dict(arch="qwen2"),
    "qwen2-tied": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen3": dict(arch="qwen3", head_dim=32),
    "qwen3-tied": dict(arch="qwen3", tie_word_embeddings=True, num_kv_heads=4),
    # Local (window 24, base 10k) and global (base 1M) layers, attention scaled by
    # query_pre_attn_scalar != head_dim, final logit soft-capping; tied as Gemma 3 ships.
    "gemma3": dict(
        arch="gemma3",
        num_layers=3,
        sliding_window=24,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        extra_config={
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 30.0,
        },
    ),
    # What a Gemma 3 GGUF file implies: every 6th layer global, attention scaled by head_dim.
    "gemma3-pattern": dict(arch="gemma3", num_layers=6, sliding_window=16, extra_config={"query_pre_attn_scalar": 16}),
    "gemma3-untied": dict(
        arch="gemma3",
        num_layers=2,
        sliding_window=12,
        head_dim=32,
        num_kv_heads=1,
        extra_config={"layer_types": ["full_attention", "sliding_attention"]},
    ),
}


@dataclass
class Sequence:
    """One request for ``run_greedy``: prompt, row, arrival step, prefill chunk size, output length."""

    prompt: list[int]
    row: int
    num_new: int = 64
    arrival: int = 0
    chunk: int | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[torch.Tensor] = field(default_factory=list)
    num_fed: int = 0  # prompt tokens already in the KV cache

    @property
    def is_done(self) -> bool:
        return len(self.tokens) >= self.num_new


def run_greedy(runner, sequences: list[Sequence]) -> None:
    """Drive sequences to completion, one ``runner.forward`` per step (mixed decode + prefill).

    Sequences join at their ``arrival`` step and leave when they have ``num_new`` tokens;
    prompts are fed in chunks of ``chunk`` tokens (whole when None).
    """
    step = 0
    while not all(seq.is_done for seq in sequences):
        work, owners = [], []
        for seq in sequences:
            if seq.arrival > step or seq.is_done:
                continue
            if seq.num_fed < len(seq.prompt):
                size = seq.chunk or len(seq.prompt)
                chunk = seq.prompt[seq.num_fed : seq.num_fed + size]
                is_last = seq.num_fed + len(chunk) == len(seq.prompt)
                work.append(RowWork(row=seq.row, token_ids=chunk, start=seq.num_fed, need_logits=is_last))
                seq.num_fed += len(chunk)
                if is_last:
                    owners.append(seq)
            else:
                start = len(seq.prompt) + len(seq.tokens) - 1
                work.append(RowWork(row=seq.row, token_ids=[seq.tokens[-1]], start=start))
                owners.append(seq)
        if work:
            logits = runner.forward(work)
            assert logits.dtype == torch.float32 and logits.shape[0] == len(owners)
            for seq, row in zip(owners, torch.log_softmax(logits, dim=-1)):
                seq.logprobs.append(row)
                seq.tokens.append(int(row.argmax()))
        step += 1


def hf_greedy(hf_model, prompt: list[int], num_new: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy ``generate`` (eos disabled): tokens and log-softmax per step ``[n, V]``."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        # Explicit: without a mask, generate() masks out every prompt token equal to the pad
        # id (SmolLM2's pad is <|im_end|>, which every ChatML prompt holds).
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=num_new,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.stack([torch.log_softmax(step[0].float(), dim=-1) for step in out.logits])
    return tokens, logprobs


def load_hf(folder: Path):
    """The reference ``transformers`` model in float32, eval mode, eos disabled."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of random non-special token ids."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(8, vocab_size, (n,), generator=generator).tolist() for n in lengths]
