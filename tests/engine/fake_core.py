"""Helpers for the FakeRunner engine tests: build a small engine, make requests, step to the end.

Every engine here is the real ``EngineCore`` (scheduler, KV manager, sampler, beam search,
detokenizer) over ``rill.testing.FakeRunner``, so a test runs in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rill.config import EngineConfig
from rill.engine.batch import RowWork
from rill.engine.builder import Engine, assemble_engine
from rill.engine.request import AddCommand, Request
from rill.testing.fake_runner import FakeRunner, fake_tokenizer
from rill.types import RequestEvent, SamplingParams

PROMPTS = [
    "once upon a time there was a little fox who lived in the woods",
    "the sun rose over the quiet village and the birds began to sing",
    "mia found a red ball in the garden",
    "tom said let us go to the park",
    "a big dog ran",
    "in the morning the birds sang songs about the sea and the sky and the tall green trees",
]


@dataclass
class Result:
    """Everything one request produced over its outputs."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    events: list[RequestEvent] = field(default_factory=list)
    modified: list[SamplingParams] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: Any = None
    error: Any = None
    usage: Any = None
    logprobs: list = field(default_factory=list)
    num_outputs: int = 0
    num_steps_with_tokens: int = 0


class Clock:
    """A clock the test moves by hand (deadlines)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_engine(
    num_rows: int = 16,
    max_len: int = 256,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 512,
    clock: Callable[[], float] | None = None,
) -> Engine:
    """An engine over a fresh ``FakeRunner``."""
    config = EngineConfig(model="fake", max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)
    runner = FakeRunner(num_rows=num_rows, max_len=max_len)
    return assemble_engine(
        config, runner, fake_tokenizer(), name="fake", architecture="FakeForCausalLM", clock=clock, warm_grammars=False
    )


def make_request(
    engine: Engine,
    request_id: str,
    prompt: str | list[int],
    priority: int = 0,
    deadline: float | None = None,
    **params: Any,
) -> Request:
    """An engine request for ``prompt`` (text or ids); ``params`` are ``SamplingParams`` fields."""
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return Request(
        request_id=request_id,
        prompt_ids=ids,
        params=SamplingParams(**params).validate(),
        eos_token_ids=engine.eos_token_ids,
        arrival_time=0.0,
        seq_no=0,
        priority=priority,
        deadline=deadline,
    )


def step(engine: Engine, results: dict[str, Result]) -> list[Any]:
    """Run one step and fold its outputs into ``results``; return the outputs."""
    outputs = engine.core.step()
    for out in outputs:
        res = results.setdefault(out.request_id, Result())
        res.num_outputs += 1
        res.text += out.text
        res.token_ids += out.token_ids
        res.token_texts += out.token_texts
        res.events += out.events
        res.modified += out.modified
        if out.logprobs:
            res.logprobs += out.logprobs
        if out.token_ids:
            res.num_steps_with_tokens += 1
        if out.finished:
            res.finish_reason, res.stop_reason, res.error, res.usage = (
                out.finish_reason,
                out.stop_reason,
                out.error,
                out.usage,
            )
    return outputs


def step_until_finished(engine: Engine, results: dict[str, Result], request_id: str, max_steps: int = 500) -> None:
    """Step until ``request_id`` has finished (fails the test after ``max_steps`` steps)."""
    for _ in range(max_steps):
        if results.get(request_id, Result()).finish_reason:
            return
        step(engine, results)
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


def run(
    engine: Engine,
    requests: list[Request],
    on_step: Callable[[int, dict[str, Result]], None] | None = None,
    max_steps: int = 20000,
) -> dict[str, Result]:
    """Add ``requests`` and step until the engine has nothing left; return every request's result."""
    results: dict[str, Result] = {r.request_id: Result() for r in requests}
    for request in requests:
        engine.core.apply(AddCommand(request))
    num_steps = 0
    while engine.core.has_work():
        num_steps += 1
        assert num_steps < max_steps, "the engine did not finish"
        step(engine, results)
        if on_step is not None:
            on_step(num_steps, results)
    return results


def solo(request: Request, **engine_args: Any) -> Result:
    """``request`` run alone on a fresh engine (the reference for batch-invariance checks)."""
    engine = make_engine(**engine_args)
    fresh = make_request(
        engine,
        request.request_id,
        request.prompt_ids,
        request.priority,
        **{f: getattr(request.params, f) for f in request.params.__struct_fields__},
    )
    return run(engine, [fresh])[request.request_id]


def record_work(engine: Engine) -> list[list[RowWork]]:
    """Record every step's work items as the runner receives them (a list filled as steps run)."""
    runner = engine.runner
    steps: list[list[RowWork]] = []
    real_forward = runner.forward

    def forward(work: Any) -> Any:
        steps.append([RowWork(w.row, list(w.token_ids), w.start, w.need_logits) for w in work])
        return real_forward(work)

    runner.forward = forward  # type: ignore[method-assign]
    return steps


def assert_idle(engine: Engine) -> None:
    """No request and no live KV row left anywhere in the engine."""
    stats = engine.core.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.num_paused == 0, stats
    assert stats.kv_used_bytes == 0 and stats.kv_used_tokens == 0, stats
    assert engine.core.requests == {}
    assert engine.core.kv.num_live_rows == 0
