"""EmbeddingService: the sentence-embedding model beside the chat engine, its queue and its worker.

``rill serve --embedding-model NAME|PATH`` starts one (``rill.server``). Its one worker thread
first loads the model (``rill.models.embedder``; off the event loop, ``/health`` answers 503
meanwhile), then runs every forward pass. One ``/v1/embeddings`` request, in order:

1. admission, on the event loop (``embed``): the model is ready; the request holds at most
   ``--embedding-max-inputs`` inputs (else ``InvalidRequest``, field ``inputs``); the model can
   give the ``dimensions`` asked; the inputs waiting server-wide stay within
   ``--embedding-max-queued-inputs`` (else ``QueueFull``, retryable); last, the submission
   policy counts the request in its principal's rate-limit window (``RateLimited``), so a
   request refused for another reason counts for nothing;
2. the queue: a thread-safe FIFO of jobs that the worker drains whole, so that the inputs of
   concurrent requests share forward passes;
3. the worker tokenizes each drained job (``Embedder.prepare``: an over-long input fails its own
   request alone), sorts all their inputs by length, embeds them in batches of at most
   ``--embedding-batch-tokens`` tokens (padding included) and hands each job its vectors on the
   event loop, one ``call_soon_threadsafe`` per job.

Forward passes never run on the event loop or in the engine thread: the chat engine's steps
and every protocol's writes go on while a batch is embedded (torch releases the GIL inside its
kernels). A client that goes away marks its job cancelled: the worker skips the inputs it has
not embedded yet.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self

import numpy as np

from rill.config import EmbeddingConfig, embedding_model_name
from rill.errors import EngineDead, GenerationError, InvalidRequest, ModelNotReady, QueueFull, RillError
from rill.frontend.client import EngineState, ModelLoadFailed
from rill.frontend.policy import SubmissionPolicy

if TYPE_CHECKING:
    from rill.models.embedder import Embedder

log = logging.getLogger("rill.embeddings")

_STOP = object()
"""Put in the inbox to end the worker thread."""


@dataclass(frozen=True, slots=True)
class EmbeddingSubmission:
    """One request's inputs and options, as a protocol maps them (``EmbeddingService.embed``).

    Attributes:
        inputs: texts, or token-id lists (taken as given: no special tokens are added).
        dimensions: the vector length asked (None: the model's own).
        truncate_to: keep at most this many tokens of each input (-1: the model's limit); None
            refuses an input that is too long.
        principal: who asks (rate limits).
    """

    inputs: Sequence[str] | Sequence[Sequence[int]]
    dimensions: int | None = None
    truncate_to: int | None = None
    principal: str | None = None


@dataclass(frozen=True, slots=True)
class Embeddings:
    """What one request gets back.

    Attributes:
        vectors: float32 ``[len(inputs), dimensions]``, row ``i`` for input ``i``.
        num_prompt_tokens: the tokens of every input, special tokens included.
    """

    vectors: np.ndarray
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class EmbeddingModelInfo:
    """The loaded embedding model's facts for clients (``/v1/models``, the codec's checks)."""

    name: str
    dimensions: int
    max_input_tokens: int


@dataclass(eq=False)
class _Job:
    """One request in the queue. The event loop creates it and settles its future; the worker
    reads ``is_cancelled``, which only the event loop sets."""

    request: EmbeddingSubmission
    future: asyncio.Future[Embeddings]
    is_cancelled: bool = False
    num_inputs: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_inputs = len(self.request.inputs)


class EmbeddingService:
    """The embedding model, loaded and run on one worker thread (see the module docstring).

    Args:
        config: the model and the bounds (``--embedding-*``).
        loop: the event loop the service answers on.
        load: builds the ``Embedder`` (on the worker thread); default: the configured model
            on ``device``, in float32.
        policy: counts each request in its principal's rate-limit window (None: no limits).
        device: where the default ``load`` puts the model.
    """

    def __init__(
        self,
        config: EmbeddingConfig,
        loop: asyncio.AbstractEventLoop,
        *,
        load: Callable[[], Embedder] | None = None,
        policy: SubmissionPolicy | None = None,
        device: str = "cpu",
    ) -> None:
        self.config = config
        self.loop = loop
        self.policy = policy
        self.device = device
        self._load = load or self._load_configured
        self.embedder: Embedder | None = None
        self.load_error: BaseException | None = None
        self.num_queued_inputs = 0
        """Inputs of admitted requests not yet answered (only the event loop writes it)."""
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._jobs: set[_Job] = set()
        self._ready = asyncio.Event()
        self._is_stopped = False
        self._thread: threading.Thread | None = None

    @classmethod
    def start(
        cls,
        config: EmbeddingConfig,
        *,
        load: Callable[[], Embedder] | None = None,
        policy: SubmissionPolicy | None = None,
        device: str = "cpu",
    ) -> Self:
        """Create the service on the running loop and start its worker thread, which loads the
        model first.

        Call it before any other thread imports model code (``rill.server`` starts it before
        the engine): the model modules are imported here, on the calling thread, because two
        threads importing the same modules at once can each get the other's half-initialised
        module (the engine thread imports ``rill.models.loader`` too).
        """
        import rill.models.embedder
        import rill.models.embedding_source  # noqa: F401 - imported for the reason above

        service = cls(config, asyncio.get_running_loop(), load=load, policy=policy, device=device)
        service._thread = threading.Thread(target=service._thread_main, name="rill-embeddings", daemon=True)
        service._thread.start()
        return service

    # -- state -------------------------------------------------------------------------------
    @property
    def served_model_name(self) -> str:
        """The model's name for clients, also before it has loaded."""
        if self.embedder is not None:
            return self.embedder.name
        return embedding_model_name(self.config) or "embeddings"

    def state(self) -> EngineState:
        """The model's phase (``loading``, ``ready``, ``failed``, ``stopped``) and the error a
        request gets in it."""
        if self._is_stopped:
            return EngineState(phase="stopped", error=EngineDead("the embedding model has stopped"))
        if self.embedder is not None:
            return EngineState(phase="ready")
        if self.load_error is not None:
            failed = ModelLoadFailed("the embedding model failed to load; see the server log")
            failed.__cause__ = self.load_error
            return EngineState(phase="failed", error=failed)
        return EngineState(phase="loading", error=ModelNotReady("the embedding model is still loading; retry later"))

    def require_model(self) -> EmbeddingModelInfo:
        """The loaded model's facts, or raise ``state().error``."""
        error = self.state().error
        if error is not None:
            raise error
        assert self.embedder is not None  # ready
        embedder = self.embedder
        return EmbeddingModelInfo(
            name=embedder.name, dimensions=embedder.dimensions, max_input_tokens=embedder.max_input_tokens
        )

    async def wait_ready(self) -> None:
        """Return once the model is loaded; raise ``state().error`` if it failed or stopped."""
        await self._ready.wait()
        self.require_model()

    # -- requests ----------------------------------------------------------------------------
    def _check_room(self, num_inputs: int) -> None:
        """``QueueFull`` unless the queue of inputs has room for ``num_inputs`` more."""
        if self.num_queued_inputs + num_inputs > self.config.embedding_max_queued_inputs:
            raise QueueFull(
                f"the embedding queue is full ({self.num_queued_inputs} inputs waiting, at most "
                f"{self.config.embedding_max_queued_inputs}); retry later",
                retry_after_s=1.0,
            )

    async def embed(self, request: EmbeddingSubmission) -> Embeddings:
        """Admit ``request``, wait for its turn on the worker and return its vectors.

        Raises:
            InvalidRequest: no inputs, more than ``--embedding-max-inputs``, a ``dimensions``
                the model cannot give, a bad token id or ``truncate_to``. Each names the
                submission's field (``inputs``, ``dimensions``, ``truncate_to``): a protocol
                names its own.
            ContextLengthExceeded: an input over the model's limit (field ``inputs``).
            QueueFull: the server-wide queue of inputs is full (retryable).
            RateLimited: the principal's request window is full.
            ModelNotReady, ModelLoadFailed, EngineDead: as ``state()`` says.
        """
        self.require_model()
        assert self.embedder is not None
        num_inputs = len(request.inputs)
        if not num_inputs:
            raise InvalidRequest("the request holds no input to embed", field="inputs")
        if num_inputs > self.config.embedding_max_inputs:
            raise InvalidRequest(
                f"the request holds {num_inputs} inputs; this server embeds at most "
                f"{self.config.embedding_max_inputs} per request (--embedding-max-inputs)",
                field="inputs",
            )
        self.embedder.check_dimensions(request.dimensions)
        self._check_room(num_inputs)
        if self.policy is not None:
            await self.policy.count_request(request.principal)  # last: a refusal above counts for nothing
            self._check_room(num_inputs)  # again: a cluster's rate limits answer from another process
        job = _Job(request, self.loop.create_future())
        self.num_queued_inputs += job.num_inputs
        self._jobs.add(job)
        self._inbox.put(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            job.is_cancelled = True  # the worker skips what it has not embedded yet
            raise

    async def shutdown(self) -> None:
        """Stop the worker thread; requests still waiting get ``EngineDead``."""
        if self._is_stopped:
            return
        self._is_stopped = True
        self._inbox.put(_STOP)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)
        for job in list(self._jobs):
            self._settle(job, None, EngineDead("the server is shutting down"))
        self._ready.set()

    # -- the worker thread -------------------------------------------------------------------
    def _load_configured(self) -> Embedder:
        from rill.models.embedder import Embedder
        from rill.models.embedding_source import embedding_folder

        model = self.config.embedding_model
        if not model:
            raise RillError("no --embedding-model configured")
        folder, name = embedding_folder(model)
        return Embedder.load(
            folder, name=self.config.embedding_served_model_name or name, device=self.device, dtype="float32"
        )

    def _thread_main(self) -> None:
        try:
            embedder = self._load()
        except BaseException as exc:  # noqa: BLE001 - reported on the loop: the server exits with it
            self.loop.call_soon_threadsafe(self._loaded, None, exc)
            return
        self.loop.call_soon_threadsafe(self._loaded, embedder, None)
        while True:
            jobs = [self._inbox.get()]
            while True:
                try:
                    jobs.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if any(job is _STOP for job in jobs):
                return
            try:
                self._run(embedder, jobs)
            except Exception as exc:  # the worker must outlive a bug: its requests get an error, not a hang
                log.error("embedding worker failed", exc_info=exc)
                for job in jobs:
                    self._hand_over(job, None, GenerationError("the embedding model failed on this request"))

    def _loaded(self, embedder: Embedder | None, error: BaseException | None) -> None:
        if self._is_stopped:
            return
        self.embedder, self.load_error = embedder, error
        self._ready.set()

    def _run(self, embedder: Embedder, jobs: list[_Job]) -> None:
        """Embed every input of ``jobs`` in length-sorted batches and settle each job."""
        prepared: list[tuple[_Job, list[list[int]]]] = []
        for job in jobs:
            if job.is_cancelled:
                self._hand_over(job, None, None)
                continue
            try:
                ids = embedder.prepare(job.request.inputs, job.request.truncate_to)
            except Exception as exc:  # noqa: BLE001 - the request's own error, answered to it alone
                self._hand_over(job, None, exc)
                continue
            prepared.append((job, ids))
        try:
            pooled = self._embed_all(embedder, prepared)
        except Exception as exc:  # logged; the requests of the failed drain get a generic error
            log.error("embedding forward failed", exc_info=exc)
            for job, _ in prepared:
                self._hand_over(job, None, GenerationError("the embedding model failed on this request"))
            return
        for (job, ids), vectors in zip(prepared, pooled):
            if job.is_cancelled:
                self._hand_over(job, None, None)
                continue
            result = Embeddings(
                vectors=embedder.finish(vectors, job.request.dimensions),
                num_prompt_tokens=sum(len(one) for one in ids),
            )
            self._hand_over(job, result, None)

    def _embed_all(self, embedder: Embedder, prepared: list[tuple[_Job, list[list[int]]]]) -> list[np.ndarray]:
        """The pooled vectors of every job's inputs (one array per job, input order), computed
        longest first in batches of at most ``embedding_batch_tokens`` padded tokens."""
        out = [np.zeros((len(ids), embedder.dimensions), np.float32) for _, ids in prepared]
        items = [(j, i, one) for j, (_, ids) in enumerate(prepared) for i, one in enumerate(ids)]
        items.sort(key=lambda item: -len(item[2]))  # like lengths together: little padding
        budget = self.config.embedding_batch_tokens
        start = 0
        while start < len(items):
            end = start + max(1, budget // len(items[start][2]))  # the first of a batch is its longest
            batch = [item for item in items[start:end] if not prepared[item[0]][0].is_cancelled]
            start = end
            if batch:
                vectors = embedder.pooled([one for _, _, one in batch])
                for row, (j, i, _) in enumerate(batch):
                    out[j][i] = vectors[row]
        return out

    def _hand_over(self, job: _Job, result: Embeddings | None, error: BaseException | None) -> None:
        self.loop.call_soon_threadsafe(self._settle, job, result, error)

    def _settle(self, job: _Job, result: Embeddings | None, error: BaseException | None) -> None:
        """On the loop: the job leaves the queue's count and its waiter gets the answer."""
        if job not in self._jobs:
            return  # settled already (by shutdown)
        self._jobs.discard(job)
        self.num_queued_inputs -= job.num_inputs
        if job.future.done():
            return  # the waiter went away
        if error is not None:
            job.future.set_exception(error)
        elif result is not None:
            job.future.set_result(result)
        else:
            job.future.cancel()
