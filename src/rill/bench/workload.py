"""Pure workload description: which prompts, how long the outputs, when requests arrive.

Prompts come from flags (``--prompt-len`` words of a fixed word list, different per request
so a prefix cache cannot answer them) or from a JSONL file with one object per line::

    {"prompt": "Once upon a time", "max_tokens": 64}

(``max_tokens`` optional; ``output_len`` is accepted as its synonym). Arrival times of an
open-loop run are Poisson: exponential gaps with mean 1 / rate, from a seeded generator so
two runs with the same seed send at the same offsets.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec

from rill.errors import ConfigError

WORDS = (
    "the a little old big river town cat dog bird tree stone house road light night morning rain wind "
    "sun moon star boat king queen child friend story song garden forest hill sea sky bread apple door "
    "window book letter lamp fire snow field bridge market clock bell horse mouse fox owl wolf bear "
    "walked found saw heard made took gave told asked ran looked wanted liked kept brought thought "
    "quiet bright dark warm cold happy small green blue red golden silver gentle brave clever tired "
    "and but then so because when while after before under over through into near far away home again"
).split()


class BenchRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request to send: ``prompt`` text and the number of tokens to ask for."""

    index: int
    prompt: str
    max_tokens: int


def synthetic_prompts(num_requests: int, prompt_len_words: int, max_tokens: int, seed: int = 0) -> list[BenchRequest]:
    """``num_requests`` distinct prompts of ``prompt_len_words`` words each."""
    if prompt_len_words < 1 or max_tokens < 1 or num_requests < 1:
        raise ConfigError("--num-requests, --prompt-len and --max-tokens must be >= 1")
    rng = random.Random(seed)
    return [
        BenchRequest(
            index=i, prompt=" ".join(rng.choice(WORDS) for _ in range(prompt_len_words)), max_tokens=max_tokens
        )
        for i in range(num_requests)
    ]


def jsonl_prompts(path: str | Path, num_requests: int, default_max_tokens: int) -> list[BenchRequest]:
    """``num_requests`` requests cycling through the lines of a JSONL file.

    Raises:
        ConfigError: the file cannot be read, has no prompts, or a line is not a valid object.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read prompts file {path}: {exc.strerror}") from exc
    entries: list[tuple[str, int]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not JSON ({exc.msg})") from exc
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str) or not obj["prompt"]:
            raise ConfigError(f'{path}:{number}: each line must be an object with a non-empty "prompt" string')
        max_tokens = obj.get("max_tokens", obj.get("output_len", default_max_tokens))
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ConfigError(f'{path}:{number}: "max_tokens" must be an integer >= 1')
        entries.append((obj["prompt"], max_tokens))
    if not entries:
        raise ConfigError(f"prompts file {path} has no prompts")
    return [
        BenchRequest(index=i, prompt=entries[i % len(entries)][0], max_tokens=entries[i % len(entries)][1])
        for i in range(num_requests)
    ]


def poisson_offsets(num_requests: int, rate_per_s: float, seed: int = 0) -> list[float]:
    """Send times in seconds after the start for a Poisson process of ``rate_per_s``."""
    if rate_per_s <= 0:
        raise ConfigError("--request-rate must be > 0")
    rng = random.Random(seed + 1)
    offsets, now = [], 0.0
    for _ in range(num_requests):
        offsets.append(now)
        now += rng.expovariate(rate_per_s)
    return offsets
