"""Fault injection for tests: make chosen requests raise inside the engine's sampler
(``fail_sampling``) or its output stage (``fail_requests``).

The production sampler has no hook and pays nothing for this: ``fail_sampling`` shadows one
method of a single ``Sampler`` instance while its ``with`` block runs, and removes it after.
Used by the fault-isolation tests to prove that a request whose sampling raises fails alone
while the other rows of the same batch get the tokens they would have got.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from rill.engine.sampler import Sampler
from rill.types import SamplingParams


class InjectedFault(RuntimeError):
    """The exception ``fail_sampling`` raises (tests can tell it from a real failure)."""


@contextlib.contextmanager
def fail_sampling(sampler: Sampler, when: Callable[[SamplingParams], bool]) -> Iterator[None]:
    """Within the block, sampling any row whose parameters satisfy ``when`` raises ``InjectedFault``.

    The fault is raised where the sampler computes a batch, so a batch holding such a row
    fails as a whole first, as a real bug in one row's parameters would make it; the sampler
    must then isolate the row. The patch lives on ``sampler`` only (set and read by plain
    attribute access, so an engine thread picks it up at its next step).
    """
    original = sampler._sample_rows

    def faulty(raw: Any, key_arr: Any, slots: list[Any], plan: Any, uniforms: Any) -> Any:
        if any(when(slot.params) for slot in slots):
            raise InjectedFault("fault injected into sampling by a test")
        return original(raw, key_arr, slots, plan, uniforms)

    sampler._sample_rows = faulty  # type: ignore[method-assign]
    try:
        yield
    finally:
        del sampler._sample_rows  # the class's method again


@contextlib.contextmanager
def fail_requests(core: Any, when: Callable[[Any], bool]) -> Iterator[None]:
    """Within the block, the engine raises ``InjectedFault`` while taking a new token of any
    request (a ``rill.engine.request.Request``) that satisfies ``when``.

    The fault is raised where the core takes a sampled token into a request (its output
    stage), one request at a time, so the core must fail that request alone and carry on
    with the others. The patch lives on ``core`` only, like ``fail_sampling``'s.
    """
    original = core._on_token

    def faulty(request: Any, *args: Any) -> Any:
        if when(request):
            raise InjectedFault("fault injected into a request by a test")
        return original(request, *args)

    core._on_token = faulty
    try:
        yield
    finally:
        del core._on_token  # the class's method again
