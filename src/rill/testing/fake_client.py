"""An engine and an in-process client over ``FakeRunner``: the real engine code, no model.

``fake_engine()`` builds an ``Engine`` with ``rill.engine.builder.assemble_engine`` around a
``FakeRunner`` and the fake tokenizer; ``fake_client()`` starts a ``FakeClient`` on it: the
real ``InprocClient`` (its engine thread, inbox, streams and submission policy), which is
what protocol tests put behind a protocol instead of a hand-written fake, so it is an
``EngineClient`` by construction. Steer the runner through ``client.runner`` (``script``,
``gate``, ``delay_s``; see ``rill.testing.fake_runner``); ``record_requests`` and
``record_aborts`` keep what a protocol submitted and aborted.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

from rill.config import EngineConfig
from rill.engine.builder import Engine, assemble_engine
from rill.frontend.client import MetricsSink
from rill.frontend.inproc import InprocClient
from rill.frontend.policy import Choice, SubmissionPolicy
from rill.testing.fake_runner import FakeRunner, fake_tokenizer
from rill.types import GenerateRequest

FAKE_MODEL_NAME = "fake-model"
LOADING_PERCENT = 42.0
"""The progress a loading ``fake_client`` reports."""


def fake_engine(
    config: EngineConfig | None = None, runner: FakeRunner | None = None, tokenizer: Any = None, **runner_args: Any
) -> Engine:
    """An ``Engine`` over ``runner`` (default ``FakeRunner(**runner_args)``) and ``tokenizer``
    (default ``fake_tokenizer()``)."""
    config = config or EngineConfig(model=FAKE_MODEL_NAME)
    runner = runner or FakeRunner(**runner_args)
    return assemble_engine(
        config, runner, tokenizer or fake_tokenizer(), name=FAKE_MODEL_NAME, architecture="FakeForCausalLM"
    )


class FakeClient(InprocClient):
    """The in-process client over a ``FakeRunner`` that ``fake_client`` starts."""

    @property
    def runner(self) -> FakeRunner:
        """The engine's ``FakeRunner`` (``script``, ``gate``, ``delay_s``); the model must be loaded."""
        assert self.engine is not None, "the fake model has not loaded"
        runner = self.engine.runner
        assert isinstance(runner, FakeRunner)
        return runner


@contextlib.asynccontextmanager
async def fake_client(
    config: EngineConfig | None = None,
    runner: FakeRunner | None = None,
    *,
    loading: threading.Event | None = None,
    load_error: BaseException | None = None,
    tokenizer: Any = None,
    policy: SubmissionPolicy | None = None,
    metrics: MetricsSink | None = None,
    **runner_args: Any,
) -> AsyncIterator[FakeClient]:
    """A started ``FakeClient`` over ``fake_engine(...)`` with ``policy`` (default: no cap, no
    limits) and ``metrics`` as its sink; shut down on exit.

    Ready on entry, unless ``loading`` is given: then the engine thread reports
    ``LOADING_PERCENT`` and "loads" until the event is set, and then raises ``load_error``
    (a failed load) if given. Must be entered on the event loop the client will serve.
    """
    config = config or EngineConfig(model=FAKE_MODEL_NAME)
    engine = fake_engine(config, runner, tokenizer, **runner_args)

    def build(config: EngineConfig, progress: Callable[[float, str], None]) -> Engine:
        progress(LOADING_PERCENT, "loading weights")
        assert loading is not None
        loading.wait()
        if load_error is not None:
            raise load_error
        return engine

    client = FakeClient.start(
        config,
        policy=policy or SubmissionPolicy(engine=config),
        metrics=metrics,
        engine=None if loading else engine,
        build=build,
    )
    try:
        if loading is None:
            await client.wait_ready()
        yield client
    finally:
        gate = cast(FakeRunner, engine.runner).gate
        if gate is not None:
            gate.set()  # a step held by the test must not outlive it
        if loading is not None:
            loading.set()
        await client.shutdown()


def record_requests(client: Any) -> list[GenerateRequest]:
    """Every request a protocol submits to ``client`` from now on (a list filled as they come;
    the client's own methods still run): each ``GenerateRequest`` ``client.generate``
    receives, accepted or refused, and each choice of a ``client.submit`` its policy planned
    (fitted and validated, so after the refusals of the whole submission), as the
    ``GenerateRequest`` it stands for."""
    requests: list[GenerateRequest] = []
    generate = client.generate
    plan = client.policy.plan

    async def recording(request: GenerateRequest) -> Any:
        requests.append(request)
        return await generate(request)

    async def recording_plan(submission: Any, engine: Any) -> list[Choice]:
        choices: list[Choice] = await plan(submission, engine)
        requests.extend(
            GenerateRequest(
                prompt_token_ids=c.prompt_ids,
                sampling=c.params,
                request_id=c.request_id,
                protocol=c.protocol,
                principal=c.principal,
                deadline_s=c.deadline_s,
            )
            for c in choices
        )
        return choices

    client.generate = recording
    client.policy.plan = recording_plan
    return requests


def record_aborts(client: Any) -> list[str]:
    """Every request id ``client.abort`` receives from now on (a list filled as aborts come;
    the client's own ``abort`` still runs)."""
    aborted: list[str] = []
    abort = client.abort

    def recording(request_id: str) -> None:
        aborted.append(request_id)
        abort(request_id)

    client.abort = recording
    return aborted
