"""The engine thread's loop: commands in from a thread-safe inbox, one step, outputs out in one hop.

``InprocClient`` (``rill.frontend.inproc``) runs ``run`` in its engine thread once the engine
is built. Each turn applies every command waiting in the inbox (blocking for one only when
the engine has no work), runs one step, and hands the step's outputs to ``hand_over`` once
(the client forwards them to the event loop with one ``call_soon_threadsafe``). ``STOP`` in
the inbox ends the loop.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from rill.engine.core import EngineCore
from rill.types import RequestOutput

STOP = object()
"""Put in the inbox to end the loop (after the commands before it are applied)."""

IDLE_SETTLE_S = 1.0
"""How long the engine stays idle before that trim: what its last outputs become (responses
built and sent by the front end) is freed meanwhile, and the trim returns it too."""

IDLE_TRIM_INTERVAL_S = 2.0
"""When the engine goes idle after steps, it returns the heap's free memory to the OS
(``malloc_trim``), at most once per this many seconds: a step's activations, logits and
prompt-logprob scratch are freed into the C heap, which keeps them unless trimmed."""


def run(
    core: EngineCore,
    inbox: queue.SimpleQueue[Any],
    hand_over: Callable[[list[RequestOutput]], object],
    trim: Callable[[], object] | None,
) -> None:
    """Drive ``core`` from ``inbox`` until ``STOP``; ``trim`` (None: never) gives the C heap's
    free memory back when the engine goes idle after steps."""
    last_trim = -IDLE_TRIM_INTERVAL_S
    has_stepped = False  # since the last trim
    idle_since: float | None = None
    while True:
        if not core.has_work():
            wait_s = None
            if trim is not None and has_stepped:
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                # Not at once: the last outputs' responses are built and freed just after the
                # engine goes idle (a scored prompt's ~16 MB body and its objects).
                wait_s = max(last_trim + IDLE_TRIM_INTERVAL_S, idle_since + IDLE_SETTLE_S) - now
                if wait_s <= 0:
                    # Idle: nobody waits for a step, so give the heap's free memory back now.
                    trim()
                    last_trim, has_stepped, wait_s = now, False, None
            try:
                command = inbox.get(timeout=wait_s)
            except queue.Empty:
                continue  # the trim is due now
            if command is STOP:
                return
            core.apply(command)
        while True:
            try:
                command = inbox.get_nowait()
            except queue.Empty:
                break
            if command is STOP:
                return
            core.apply(command)
        outputs = core.step()
        has_stepped, idle_since = True, None
        if outputs:
            hand_over(outputs)
