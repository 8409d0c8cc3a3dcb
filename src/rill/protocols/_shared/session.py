"""What a pure session answers to, so that one driver (``driver.py``) can run any protocol (pure).

A protocol's session subclasses ``Session`` (or ``StepSession``) and inherits the defaults of
the hooks its wire has no use for. This module holds the session's side of the contract and
nothing that does I/O, so a session imports it without importing the driver, the engine
client or asyncio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from rill.errors import RillError
from rill.types import RequestOutput, SamplingParams

Key = str | None
"""Names one request of a connection; None where a connection runs one at a time."""


@dataclass(frozen=True, slots=True)
class Started:
    """What a session learns when its request was accepted by the engine."""

    key: Key
    prompt_token_ids: Sequence[int]
    sampling: SamplingParams


class Session(Protocol):
    """What a pure session answers to, so that one driver can run any protocol.

    Every method returns the actions to perform. A session class subclasses this protocol
    and inherits the defaults of the hooks its wire has no use for.
    """

    def on_started(self, started: Started) -> list[Any]:
        """The engine accepted the request of ``started.key``."""
        return []

    def on_output(self, key: Key, output: RequestOutput, now: float) -> list[Any]:
        """A request produced ``output`` (the last one has ``finished`` set)."""
        ...

    def on_start_failed(self, key: Key, exc: BaseException, now: float) -> list[Any]:
        """The request of ``key`` never started: refused, or the model could not load."""
        ...

    def on_starts_failed(self, failures: list[tuple[Key, BaseException]], now: float) -> list[Any]:
        """Requests started together (``Driver(submits_together=True)``) never started, in
        their order; by default each is reported on its own (``on_start_failed``)."""
        return [action for key, exc in failures for action in self.on_start_failed(key, exc, now)]

    def on_error(self, exc: BaseException) -> list[Any]:
        """The connection failed (a bug, a broken peer): what to say, if anything, before closing."""
        return []

    def on_disconnect(self) -> list[Any]:
        """The peer left: the running requests are aborted."""
        return []

    def on_loading(self, progress: float, eta_s: float | None) -> list[Any]:
        """A start waits for the model (only for ``Driver(waits_for_model=True)``)."""
        return []

    def on_queued(self, key: Key, position: int, queue_length: int) -> list[Any]:
        """A submitted request waits in the engine's queue (only for ``Driver(reports_queue=True)``)."""
        return []

    def refusal_code(self, exc: BaseException) -> str:
        """The code a refused start is counted under in the rejection metric: the error's
        wire-neutral code, unless the protocol counts its own refusals under its wire's codes."""
        return exc.code if isinstance(exc, RillError) else RillError.code


class StepSession(Session, Protocol):
    """A session that takes one engine step's outputs of all its requests at once
    (``Driver(groups_steps=True)``: batch ``/ws``'s PROGRESS arrays)."""

    def on_outputs(self, outputs: list[tuple[Key, RequestOutput]], now: float) -> list[Any]:
        """The outputs of every request that produced something since the last call."""
        ...


def split_by_token(output: RequestOutput) -> list[RequestOutput]:
    """``output`` as one output per new token, for a wire that promises an event per token.

    A request stream folds outputs together when its reader lags; this undoes the fold: each
    piece carries one token, its text (``token_texts`` concatenate to ``text``) and its
    logprob; the first carries the prompt logprobs, the last the events, the finish and the
    error. An output with at most one token is returned as it is.
    """
    n = len(output.token_ids)
    if n <= 1 or len(output.token_texts) != n:
        return [output]
    pieces = []
    for i in range(n):
        last = i == n - 1
        pieces.append(
            msgspec.structs.replace(
                output,
                text=output.token_texts[i],
                token_ids=output.token_ids[i : i + 1],
                token_texts=output.token_texts[i : i + 1],
                logprobs=output.logprobs[i : i + 1] if output.logprobs is not None else None,
                prompt_logprobs=output.prompt_logprobs if i == 0 else None,
                events=output.events if last else [],
                modified=output.modified if last else [],
                finished=output.finished and last,
                finish_reason=output.finish_reason if last else None,
                stop_reason=output.stop_reason if last else None,
                error=output.error if last else None,
            )
        )
    return pieces
