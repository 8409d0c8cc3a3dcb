"""``EmbeddingService``: admission bounds, batching of concurrent requests on the worker thread,
cancellation and the load states, over a tiny random-init BERT.

A ``Gate`` holds the worker inside a forward pass until the test releases it, so what is
queued meanwhile is known exactly (no sleeps, no timing)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rill.config import EmbeddingConfig, PolicyConfig
from rill.errors import (
    ContextLengthExceeded,
    EngineDead,
    InvalidRequest,
    ModelLoadError,
    ModelNotReady,
    QueueFull,
    RateLimited,
)
from rill.frontend.client import ModelLoadFailed
from rill.frontend.embeddings import EmbeddingService, EmbeddingSubmission
from rill.frontend.policy import SubmissionPolicy
from rill.models.embedder import Embedder


@pytest.fixture
def bert_dir(tiny_bert_dir: Path) -> Path:
    return tiny_bert_dir


class Gate:
    """Wraps ``embedder.pooled``: records each batch's size and holds the first ``hold`` calls
    until ``release`` is set."""

    def __init__(self, embedder: Embedder, hold: int = 1) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.batches: list[int] = []
        original = embedder.pooled

        def pooled(batch: Any) -> np.ndarray:
            self.batches.append(len(batch))
            if len(self.batches) <= hold:
                self.entered.set()
                assert self.release.wait(30), "the test never released the worker"
            return original(batch)

        embedder.pooled = pooled  # type: ignore[method-assign]

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, 30), "the worker never started a forward pass"


async def start(embedder: Embedder, policy: SubmissionPolicy | None = None, **config: Any) -> EmbeddingService:
    service = EmbeddingService.start(
        EmbeddingConfig(embedding_model="tiny", **config), load=lambda: embedder, policy=policy
    )
    await service.wait_ready()
    return service


async def test_concurrent_requests_share_forward_passes(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir, name="tiny")
    gate = Gate(embedder)
    service = await start(embedder)
    try:
        first = asyncio.create_task(service.embed(EmbeddingSubmission(inputs=["held"])))
        await gate.wait_entered()
        texts = [["Ada found the lantern."], ["the river", "a longer sentence about the old stone bridge"], ["x"]]
        later = [asyncio.create_task(service.embed(EmbeddingSubmission(inputs=t))) for t in texts]
        await asyncio.sleep(0)  # let every request reach the queue
        assert service.num_queued_inputs == 5
        gate.release.set()
        results = await asyncio.gather(first, *later)
        assert gate.batches == [1, 4]  # the three waiting requests went through in one forward
        for result, given in zip(results[1:], texts):
            ids = embedder.prepare(given)
            np.testing.assert_allclose(result.vectors, embedder.embed(ids), atol=1e-5)
            assert result.num_prompt_tokens == sum(map(len, ids))
        assert service.num_queued_inputs == 0
    finally:
        await service.shutdown()


async def test_batches_hold_at_most_the_token_budget(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir)
    gate = Gate(embedder, hold=0)
    service = await start(embedder, embedding_batch_tokens=40)
    try:
        texts = ["river " * 15, "river", "river " * 5, "stone " * 15]  # 17, 3, 7 and 17 tokens
        result = await service.embed(EmbeddingSubmission(inputs=texts))
        assert gate.batches == [2, 2]  # longest first: two of 17 (34 <= 40), then 7 and 3
        np.testing.assert_allclose(result.vectors, embedder.embed(embedder.prepare(texts)), atol=1e-5)
    finally:
        await service.shutdown()


async def test_bounds_are_checked_before_queueing(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir)
    gate = Gate(embedder)
    service = await start(embedder, embedding_max_inputs=3, embedding_max_queued_inputs=4)
    try:
        with pytest.raises(InvalidRequest, match="holds 4 inputs; this server embeds at most 3") as caught:
            await service.embed(EmbeddingSubmission(inputs=["a"] * 4))
        assert caught.value.field == "inputs"
        with pytest.raises(InvalidRequest, match="no input"):
            await service.embed(EmbeddingSubmission(inputs=[]))
        with pytest.raises(InvalidRequest) as caught:
            await service.embed(EmbeddingSubmission(inputs=["a"], dimensions=32))
        assert caught.value.field == "dimensions"
        held = asyncio.create_task(service.embed(EmbeddingSubmission(inputs=["a", "b", "c"])))
        await gate.wait_entered()
        with pytest.raises(QueueFull) as full:
            await service.embed(EmbeddingSubmission(inputs=["d", "e"]))
        assert full.value.retryable and service.num_queued_inputs == 3
        waiting = asyncio.create_task(service.embed(EmbeddingSubmission(inputs=["d"])))  # 4: still fits
        gate.release.set()
        assert len((await held).vectors) == 3 and len((await waiting).vectors) == 1
        assert service.num_queued_inputs == 0
    finally:
        await service.shutdown()


async def test_requests_count_in_the_principals_rate_limit(bert_dir: Path) -> None:
    policy = SubmissionPolicy(PolicyConfig(rate_limit_requests=2))
    service = await start(Embedder.load(bert_dir), policy=policy, embedding_max_inputs=2)
    try:
        with pytest.raises(InvalidRequest):  # refused for another reason: counts for nothing
            await service.embed(EmbeddingSubmission(inputs=["a"] * 3, principal="alice"))
        for _ in range(2):
            await service.embed(EmbeddingSubmission(inputs=["a"], principal="alice"))
        with pytest.raises(RateLimited):
            await service.embed(EmbeddingSubmission(inputs=["a"], principal="alice"))
        await service.embed(EmbeddingSubmission(inputs=["a"], principal="bob"))
    finally:
        await service.shutdown()


async def test_a_bad_input_fails_its_own_request_alone(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir)
    gate = Gate(embedder)
    service = await start(embedder)
    try:
        held = asyncio.create_task(service.embed(EmbeddingSubmission(inputs=["held"])))
        await gate.wait_entered()
        too_long = asyncio.create_task(service.embed(EmbeddingSubmission(inputs=["ok", "river " * 100])))
        bad_id = asyncio.create_task(service.embed(EmbeddingSubmission(inputs=[[1, 10**6]])))
        fine = asyncio.create_task(service.embed(EmbeddingSubmission(inputs=["fine"])))
        await asyncio.sleep(0)
        gate.release.set()
        await held
        with pytest.raises(ContextLengthExceeded):
            await too_long
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            await bad_id
        assert len((await fine).vectors) == 1 and gate.batches == [1, 1]
    finally:
        await service.shutdown()


async def test_a_cancelled_request_is_skipped(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir)
    gate = Gate(embedder)
    service = await start(embedder)
    try:
        held = asyncio.create_task(service.embed(EmbeddingSubmission(inputs=["held"])))
        await gate.wait_entered()
        gone = asyncio.create_task(service.embed(EmbeddingSubmission(inputs=["a", "b"])))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        gate.release.set()
        await held
        after = await service.embed(EmbeddingSubmission(inputs=["after"]))
        assert len(after.vectors) == 1
        assert gate.batches == [1, 1]  # the cancelled request's two inputs were never embedded
        assert service.num_queued_inputs == 0
    finally:
        await service.shutdown()


async def test_load_states() -> None:
    loading = threading.Event()

    def slow_then_fail() -> Embedder:
        assert loading.wait(30)
        raise ModelLoadError("no such model")

    service = EmbeddingService.start(EmbeddingConfig(embedding_model="x"), load=slow_then_fail)
    assert service.state().phase == "loading" and service.served_model_name == "x"
    with pytest.raises(ModelNotReady):
        await service.embed(EmbeddingSubmission(inputs=["a"]))
    loading.set()
    with pytest.raises(ModelLoadFailed) as failed:
        await service.wait_ready()
    assert isinstance(failed.value, EngineDead) and isinstance(failed.value.__cause__, ModelLoadError)
    assert service.state().phase == "failed"
    await service.shutdown()
    assert service.state().phase == "stopped"


async def test_shutdown_answers_waiting_requests(bert_dir: Path) -> None:
    embedder = Embedder.load(bert_dir)
    gate = Gate(embedder)
    service = await start(embedder)
    held = asyncio.create_task(service.embed(EmbeddingSubmission(inputs=["held"])))
    await gate.wait_entered()
    waiting = asyncio.create_task(service.embed(EmbeddingSubmission(inputs=["waiting"])))
    await asyncio.sleep(0)
    stopping = asyncio.create_task(service.shutdown())
    await asyncio.sleep(0)
    gate.release.set()
    await stopping
    assert len((await held).vectors) == 1  # the forward in progress finishes
    with pytest.raises(EngineDead):
        await waiting
    with pytest.raises(EngineDead):
        await service.embed(EmbeddingSubmission(inputs=["late"]))
