"""Keep freed activation memory in the process instead of handing it back to the OS each step.

A prefill step allocates and frees many activation tensors of a few megabytes each
(``[4096, 576]`` bf16 is 4.7 MB). glibc's malloc serves blocks that large with ``mmap`` and
returns them with ``munmap`` when freed (its mmap threshold starts at 128 KiB and grows only
with what it has seen), and it trims the heap's top above 128 KiB of free space; so the next
tensor of that size is fresh memory again, and every page of it faults and is zeroed by the
kernel before an element is written. Measured on the runner alone, SmolLM2-135M bf16, one
prefill step of 32 prompts × 128 tokens: 1,847 ms with glibc's defaults, 1,353 ms with the
thresholds below (1,361 ms with tcmalloc preloaded, which vLLM's CPU build does); RMS norms
154 → 57 ms and RoPE 92 → 36 ms of it. Decode steps, whose tensors are small, are unchanged.

The cost is resident memory: what a step frees stays in the process for the next step, up to
the largest step's working set. On a CPU without native bf16 rill serves float32: a 4,096-token
step's activations there pass glibc's 32 MiB ceiling for heap blocks, and the GEMM maps scratch
memory of its own on every call, so the thresholds cut such a step's page faults about 3x
(140,555 → 49,158 over ten runs of SmolLM2's MLP on an AVX2 machine), not to nothing.

``tune_allocator()`` applies the thresholds with ``mallopt`` (glibc only; a no-op elsewhere).

The thresholds are process-wide, and glibc gives threads arenas of their own (up to 8 per
core). ``malloc_trim`` empties the free pages of every arena but shrinks only the main one's
top; a thread arena's top is shrunk only on a free within it, and never under thresholds this
high. So every thread that once held a burst (gRPC's threads reading six 60 MB Evergreen
sessions, the worker threads compiling grammars) kept its arena's top resident: +140 MiB after
those sessions ended, against -3 MiB with one arena. ``limit_arenas()`` caps the process at
``MAX_ARENAS`` arenas before the server starts its threads. Measured on SmolLM2 (server
tokens/s at c=1/8/32, ``benchmarks/compare.py``, same hour, the machine noisy): default arenas
94-105 / 331-352 / 391-451 (five runs), one arena 100-105 / 331-356 / 440-442 (three), two
arenas 99-103 / 314-337 / 424-453 (two): no loss beyond the noise. Two rather than one keeps
the engine thread and the event loop from always sharing one lock. The sessions' memory came
back with two arenas as with one (747 → 745 MiB).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Callable
from typing import Any

log = logging.getLogger("rill.engine")

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8

MMAP_THRESHOLD_BYTES = 32 * 2**20
"""Blocks below this come from the heap, not a fresh mapping (glibc's maximum on 64-bit)."""
TRIM_THRESHOLD_BYTES = 1024 * 2**20
"""Free space at the heap's top kept before any is returned to the OS."""
TOP_PAD_BYTES = 64 * 2**20
"""Extra space requested whenever the heap grows, so growth happens rarely."""


MAX_ARENAS = 2
"""Most malloc arenas in the process: the main one and one for other threads (see above)."""


def _libc_function(name: str, argtypes: tuple[Any, ...]) -> Callable[..., int] | None:
    """The C library's ``name`` returning an int, or None off Linux or where the C library has
    none (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def _mallopt() -> Callable[..., int] | None:
    """glibc's ``mallopt``, or None without it."""
    return _libc_function("mallopt", (ctypes.c_int, ctypes.c_int))


def malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)`` (free heap pages back to the OS) as a callable, or None where
    the C library has none."""
    trim = _libc_function("malloc_trim", (ctypes.c_size_t,))
    return None if trim is None else lambda: trim(0)


def limit_arenas() -> bool:
    """Cap malloc's arenas at ``MAX_ARENAS``; True when glibc took it.

    Effective for arenas created from now on, so ``rill serve`` calls it first thing; calling
    it again is harmless.
    """
    mallopt = _mallopt()
    return mallopt is not None and bool(mallopt(_M_ARENA_MAX, MAX_ARENAS))


def tune_allocator() -> str:
    """Set glibc's malloc thresholds for step-sized tensors; return what was done (for the log)."""
    mallopt = _mallopt()
    if mallopt is None:
        return "allocator: left alone (not Linux with glibc)"
    limit_arenas()  # a process that did not start through ``rill serve`` (tests, replicas)
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    trim_ok = mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    pad_ok = mallopt(_M_TOP_PAD, TOP_PAD_BYTES)
    if not (mmap_ok and trim_ok and pad_ok):
        return "allocator: glibc refused some malloc thresholds"
    return "allocator: glibc keeps freed step memory (mmap threshold, trim threshold and top pad raised)"


def release_free_memory() -> bool:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim``); True when it did.

    Loading a quantized checkpoint converts every matrix through float32 copies that are
    freed again; without this they stay resident (the 1.5B GGUF's process held 3.2 GiB for
    1.3 GiB of weights). Called once after loading, before the thresholds above are raised.
    """
    trim = malloc_trim()
    return trim is not None and bool(trim())
