"""RayClient: the ``EngineClient`` of a cluster, its engines in Ray Serve replicas.

It is ``InprocClient`` with another transport. Everything the server process did for one
engine it still does, once, for all replicas: the submission policy (keys, caps, rate limits,
the queue bound, tokenizing with the model's tokenizer, fetched from a replica), the streams,
the per-request figures and the rate-limit accounts. What crosses to a replica is the planned
``Choice``; what comes back is its outputs. The rate limits' state is not this process's: it
is the cluster's one store (``rill.cluster.limits``), which every front door shares.

* A new request is a call ``start`` on the deployment handle; Ray Serve's router
  (``rill.cluster.router``) picks its replica, whose answer says it took the request (or why
  it refused: the error keeps its type).
* Outputs come back in one stream per replica (``outputs``, opened with the first request
  there), one batch per engine step, routed to each request's ``RequestStream`` as the
  in-process engine thread's are; a replica on this machine writes them to a socket this
  process listens on instead, the Ray stream staying open beside it (``rill.cluster.link``).
  The stream names this process (``Origin``): a replica on the same machine counts its CPU as
  the engine's own while the stream is open.
* A control (stop, pause, resume, regenerate, a parameter change) is a call naming that
  replica, which the router sends there and nowhere else. The controls of one request go in
  the order they were made, one at a time; one made before the replica has answered ``start``
  waits for that answer (it then goes there, or fails with the start).
* When a replica dies, its outputs stream fails: each of its requests' streams ends with
  ``ReplicaLost`` (retryable) at once; other replicas' streams go on, and new requests go to
  the replicas Ray still lists while it starts a new one.
* Each replica's gauges are read every ``STATS_INTERVAL_S`` for ``/metrics`` (summed, and
  per replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Self, cast

import msgspec

from rill.cluster import launch, link, registry
from rill.cluster.replica import Accepted, Description, Origin, Refused
from rill.cluster.router import prefix_keys
from rill.config import ClusterConfig, EngineConfig
from rill.engine.builder import Engine
from rill.errors import ModelNotReady, ReplicaLost, RequestNotFound
from rill.frontend.client import EngineState, MetricsSink
from rill.frontend.inproc import InprocClient
from rill.frontend.policy import Choice, SubmissionPolicy
from rill.frontend.stream import RequestStream
from rill.types import EngineStats, RequestId, RequestOutput, SamplingParams

log = logging.getLogger("rill.cluster")

STATS_INTERVAL_S = 1.0
"""How often each replica's gauges are read."""

CONTROL_TIMEOUT_S = 10.0
"""Longest wait for a replica to apply a control (past it the control fails with
``RequestNotFound``) or to open its outputs stream (past it the replica's requests end with
``ReplicaLost``)."""

START_TIMEOUT_S = 120.0
"""Longest wait for a replica to take a new request (its grammar compiled first): past it the
request fails with ``ReplicaLost`` and is stopped should it start after all."""

SUM_FIELDS = tuple(name for name in EngineStats.__struct_fields__ if name not in ("last_step_ms", "step_ms_ewma"))
"""The gauges and counters that add up across replicas (step times do not: the slowest is shown)."""

COUNTER_FIELDS = tuple(name for name in SUM_FIELDS if name.endswith("_total") or name.startswith("prefix_cache_"))
"""The counters among them: a replica that leaves keeps its share of their sums, which never go down."""


def _reinstall_signal_handlers() -> None:
    """Put the stop signals back in Python's hands (from the main thread only): Ray's core
    worker installs fatal-signal handlers of its own, SIGTERM's among them, which abort the
    process, while Python still lists the server's own (uvicorn's graceful stop)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(number)
        if handler is not None:
            signal.signal(number, handler)


async def _answer(response: Any, timeout_s: float) -> Any:
    """A deployment call's answer within ``timeout_s``; past it (or cancelled) the call is
    cancelled in Ray too, so that no call to a replica that is gone stays queued."""
    try:
        # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancellation that comes
        # as the call completes, and a control lane cancelled at shutdown then waited for ever.
        async with asyncio.timeout(timeout_s):
            return await response
    except BaseException:
        response.cancel()
        raise


def _add(total: EngineStats, stats: EngineStats, fields: tuple[str, ...]) -> None:
    """Add ``stats``' ``fields`` to ``total`` (``requests_finished_total`` by reason)."""
    for name in fields:
        if name == "requests_finished_total":
            for reason, count in stats.requests_finished_total.items():
                total.requests_finished_total[reason] = total.requests_finished_total.get(reason, 0) + count
        else:
            setattr(total, name, getattr(total, name) + getattr(stats, name))


@dataclass
class _RemoteEngine:
    """What the policy reads of an engine, for a model that runs elsewhere: its tokenizer, its
    facts, its end tokens and its KV rows (each replica's; they are alike)."""

    tokenizer: Any
    model_info: Any
    eos_token_ids: frozenset[int]
    generation_defaults: dict[str, Any]
    runner: Any
    grammars: None = None  # grammars compile in the replica that runs the request


@dataclass
class _Rows:
    num_rows: int


@dataclass
class _Lane:
    """The controls of one request, applied one after the other once its replica is known."""

    replica: str | None = None  # None until the replica's answer to ``start`` names it
    placed: asyncio.Event = field(default_factory=asyncio.Event)
    queue: asyncio.Queue[tuple[Callable[[str], Any], asyncio.Future[Any]]] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None

    def place(self, replica: str) -> None:
        """The request runs on ``replica``: the controls made so far go there now."""
        self.replica = replica
        self.placed.set()

    def close(self) -> None:
        """The request ended: stop applying controls; those still waiting find no request."""
        if self.task is not None:
            self.task.cancel()
        while not self.queue.empty():
            _, future = self.queue.get_nowait()
            if not future.done():
                future.set_exception(RequestNotFound("the request ended"))


class RayClient(InprocClient):
    """``EngineClient`` whose engines are Ray Serve replicas (see the module docstring).

    Args:
        config: the engine's settings, the same for every replica.
        cluster: how many replicas, where, and how requests are routed.
        loop, policy, metrics: as ``InprocClient``'s.
    """

    def __init__(
        self,
        config: EngineConfig,
        cluster: ClusterConfig,
        loop: asyncio.AbstractEventLoop,
        policy: SubmissionPolicy | None = None,
        metrics: MetricsSink | None = None,
    ) -> None:
        super().__init__(config, loop, policy, metrics)
        self.cluster = cluster
        self._deployed: launch.Deployed | None = None
        self._lanes: dict[RequestId, _Lane] = {}
        self._frontend = uuid.uuid4().hex  # names this process's outputs stream on each replica
        self._origin = Origin.here()  # lets a replica on this machine count our CPU as its own
        self._listener: link.Listener | None = None  # where replicas on this machine hand outputs over
        self._linked: set[str] = set()  # the replicas whose outputs come over that socket now
        self._readers: dict[str, asyncio.Task[None]] = {}  # replica -> its outputs stream's reader
        self._on_replica: dict[str, set[RequestId]] = {}  # replica -> the requests running there
        self._replica_stats: dict[str, EngineStats] = {}
        self._departed = EngineStats()  # the counters of replicas that left
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def start_cluster(
        cls,
        config: EngineConfig,
        cluster: ClusterConfig,
        *,
        policy: SubmissionPolicy | None = None,
        metrics: MetricsSink | None = None,
    ) -> Self:
        """Create the client on the running loop and deploy (or join) the replicas in the
        background; ``state()`` says ``loading`` until one has loaded its model."""
        client = cls(config, cluster, asyncio.get_running_loop(), policy, metrics)
        client._tasks.append(asyncio.create_task(client._connect(), name="rill-cluster-connect"))
        return client

    async def _connect(self) -> None:
        limits = self.policy.limiter.limits if self.policy.limiter is not None else None
        deploying = asyncio.ensure_future(asyncio.to_thread(launch.deploy, self.config, self.cluster, limits))
        try:
            try:
                self._deployed = await asyncio.shield(deploying)
            except asyncio.CancelledError:
                # Stopped while Ray deploys: the thread goes on; what it deploys is removed
                # once it is done (``shutdown`` waits for this task).
                with contextlib.suppress(Exception):
                    await asyncio.to_thread((await deploying).close)
                raise
            _reinstall_signal_handlers()  # a stop must stay the server's graceful one
            if self._origin is not None:
                self._listener = await link.Listener.start()
                if self._listener is not None:
                    self._origin = msgspec.structs.replace(self._origin, outputs_address=self._listener.address)
            if self._deployed.limiter is not None:
                # From now on every front door of the cluster counts in the same place.
                self.policy.limiter = self._deployed.limiter
            description: Description = await self._deployed.handle.describe.remote()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported by /health and generate(); `rill serve` then exits
            log.error("the engine replicas failed to start: %s", exc)
            self.load_error = exc
            self._ready.set()
            return
        self.model_info = description.model_info
        remote = _RemoteEngine(
            tokenizer=description.tokenizer,
            model_info=description.model_info,
            eos_token_ids=description.eos_token_ids,
            generation_defaults=description.generation_defaults,
            runner=_Rows(description.num_rows),
        )
        # The policy reads only these members of an engine (tokenizer, facts, rows).
        self.engine = cast(Engine, remote)
        self._progress = 100.0
        self._ready.set()
        self._tasks.append(asyncio.create_task(self._poll_stats(), name="rill-cluster-stats"))

    def replicas(self) -> frozenset[str]:
        """The ids of the replicas requests can go to now."""
        return registry.live_replicas(launch.DEPLOYMENT)

    def state(self) -> EngineState:
        """As ``InprocClient.state``; once deployed, ``ready`` while at least one replica is,
        else ``loading`` (Ray is starting replicas) with ``ModelNotReady``."""
        state = super().state()
        if state.phase == "ready" and not self.replicas():
            return EngineState(
                phase="loading",
                error=ModelNotReady("no engine replica is ready (Ray is starting one); retry later"),
            )
        return state

    def load_progress(self) -> tuple[float, float | None]:
        """100 % once deployed, else 0 (Ray reports no progress of a replica's loading)."""
        return (100.0, 0.0) if self.engine is not None else (0.0, None)

    async def shutdown(self) -> None:
        """Cancel every request, then remove the deployment (and stop Ray if this server
        started it)."""
        self._is_shut_down = True
        # Closing the outputs streams cancels their requests on the replicas (``outputs``).
        lanes = [lane.task for lane in self._lanes.values() if lane.task is not None]
        for task in [*self._tasks, *self._readers.values(), *lanes]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._readers.values(), *lanes, return_exceptions=True)
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self._fail_all()  # the readers are gone: every stream still open ends here
        if self._listener is not None:
            await self._listener.close()
        if self._deployed is not None:
            await asyncio.to_thread(self._deployed.close)
        self.policy.close()

    # -- requests ----------------------------------------------------------------------------
    async def start_choice(self, choice: Choice) -> RequestStream:
        """Make the policy's last checks of ``choice`` here, then start it on the replica the
        router picks; raise the replica's refusal as the in-process engine would."""
        engine = self._require_engine()
        await self.policy.check_constrained(choice)
        stream, _ = await self._open(choice, engine)
        request_id = choice.request_id
        # Controls made from now on wait for the replica's answer, then go in their order.
        lane = self._lanes[request_id] = _Lane()
        # A continuation of a kept generation goes to the replica that made it, whose prefix
        # cache holds its KV; should that replica be gone (or the entry evicted), the prompt is
        # recomputed where it lands: the same tokens, the same result, not a cache-miss error.
        pinned = choice.require_cached_prefix_tokens is not None
        if pinned:
            choice = dataclasses.replace(choice, require_cached_prefix_tokens=None)
        call = asyncio.ensure_future(
            self._handle().start.remote(
                choice, prefix_keys=prefix_keys(choice.prompt_ids), pinned=pinned, frontend=self._frontend
            )
        )
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                answer = await asyncio.shield(call)
        except (asyncio.CancelledError, TimeoutError) as exc:
            # The caller left (or no replica answered in time): stop it should it start after all.
            call.add_done_callback(lambda done: self._abandon(request_id, done))
            await self._withdraw(stream, lane)
            if isinstance(exc, TimeoutError):
                raise ReplicaLost("no engine replica took the request in time; retry") from exc
            raise
        except Exception as exc:
            await self._withdraw(stream, lane)
            raise ReplicaLost("the engine replica went away before the request started; retry") from exc
        if isinstance(answer, Refused):
            await self._withdraw(stream, lane)
            raise answer.error
        replica = answer.replica
        if self._streams.get(request_id) is not stream:
            return stream  # it ended already (its outputs came in before this answer), its lane with it
        lane.place(replica)
        self._on_replica.setdefault(replica, set()).add(request_id)
        registry.count(launch.DEPLOYMENT, replica, +1)
        if replica not in self._readers:
            if replica not in self.replicas():
                # It died after answering: no outputs stream would ever open (the router offers
                # no replica for it), so its request ends here as its reader would end it.
                self._lose(replica, "it left before its outputs stream opened")
                return stream
            self._readers[replica] = asyncio.create_task(self._read(replica), name=f"rill-outputs-{replica}")
        if stream.is_closed:
            self.abort(request_id)  # its reader left while it was starting (its abort found no replica then)
        return stream

    def _abandon(self, request_id: RequestId, call: asyncio.Future[Any]) -> None:
        """Abort a request whose caller left before its replica's answer came (within the time
        a control gets; past it the replica's end of its outputs stream cancels it anyway)."""
        if call.cancelled() or call.exception() is not None:
            return
        answer = call.result()
        if isinstance(answer, Accepted):
            abort = self._handle().control.remote("abort", request_id, replica=answer.replica)
            task = asyncio.ensure_future(_answer(abort, CONTROL_TIMEOUT_S))
            task.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def _withdraw(self, stream: RequestStream, lane: _Lane | None = None) -> None:
        """Undo ``_open`` for a request no replica runs, and close its stream; the controls
        waiting in its ``lane`` fail."""
        if lane is not None:
            if self._lanes.get(stream.request_id) is lane:
                del self._lanes[stream.request_id]
            lane.close()
        await super()._withdraw(stream)

    async def _read(self, replica: str) -> None:
        """Route a replica's outputs to their streams, a step's batch at a time, from its Ray
        stream or, for a replica on this machine, its socket (``rill.cluster.link``); when they
        end (the replica died), end every request still running there with ``ReplicaLost``."""
        listener = self._listener
        secret, linked = listener.expect() if listener is not None else (None, None)
        call = (
            self._handle()
            .options(stream=True)
            .outputs.remote(self._frontend, replica=replica, origin=self._origin, secret=secret)
        )
        reason = "its outputs stream ended"
        connection: link.Link | None = None
        try:
            batches = aiter(call)
            # The replica opens the stream with an item at once: without it in time, the replica
            # is gone (a call naming a replica that died is offered none and waits for ever).
            async with asyncio.timeout(CONTROL_TIMEOUT_S):
                opening = await anext(batches)
                if isinstance(opening, link.Linked):
                    assert linked is not None  # a replica links only when given a secret
                    connection = await linked  # it connected before it answered
                    opening = []
            self._dispatch(opening)
            if connection is None:
                async for batch in batches:
                    self._dispatch(batch)
            else:
                self._linked.add(replica)
                await self._read_linked(batches, connection)
                call.cancel()  # the socket ended: the replica let go of it (or died)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - whatever Ray raises, the replica is gone for these requests
            call.cancel()
            reason = type(exc).__name__
        finally:
            self._readers.pop(replica, None)
            self._linked.discard(replica)
            if listener is not None:
                assert secret is not None and linked is not None
                listener.release(secret, linked)  # a connection that came too late closes too
        self._lose(replica, reason)

    async def _read_linked(self, batches: AsyncIterator[Any], connection: link.Link) -> None:
        """Route the batches of a replica's socket until it ends; its Ray stream, which carries
        nothing more, ends too when the replica dies or lets go."""

        async def over_socket() -> None:
            with contextlib.suppress(asyncio.IncompleteReadError):  # its end
                while True:
                    self._dispatch(await link.read_batch(connection.reader))

        async def over_ray() -> None:
            async for batch in batches:
                self._dispatch(batch)

        local = asyncio.ensure_future(over_socket())
        watch = asyncio.ensure_future(over_ray())
        try:
            await asyncio.wait((local, watch), return_when=asyncio.FIRST_COMPLETED)
            if not local.done():
                # The Ray stream ended first: what the replica wrote before it closed the socket
                # is still to be read (a replica that died closed it with nothing more).
                await asyncio.wait((local,), timeout=CONTROL_TIMEOUT_S)
        finally:
            for task in (local, watch):
                task.cancel()
            await asyncio.gather(local, watch, return_exceptions=True)
        for task in (local, watch):  # the socket's error first, else the Ray stream's
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise cast(BaseException, task.exception())

    def _lose(self, replica: str, reason: str) -> None:
        """End every request still running on ``replica`` with ``ReplicaLost``."""
        lost = [request_id for request_id in self._on_replica.pop(replica, set()) if request_id in self._streams]
        if lost:
            log.warning("replica %s lost (%s): %d request(s) end with replica_lost", replica, reason, len(lost))
        error = ReplicaLost("the engine replica running this request stopped; retry the request")
        self._dispatch(
            [RequestOutput(request_id=rid, finished=True, finish_reason="error", error=error) for rid in lost]
        )

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Route outputs to their streams (``InprocClient._dispatch``), and forget where each
        ended request ran."""
        super()._dispatch(outputs)
        for output in outputs:
            if not output.finished:
                continue
            lane = self._lanes.pop(output.request_id, None)
            if lane is None:
                continue
            if lane.replica is not None:  # else it ended before its start was answered: never counted
                self._on_replica.get(lane.replica, set()).discard(output.request_id)
                registry.count(launch.DEPLOYMENT, lane.replica, -1)
            lane.close()

    # -- controls ----------------------------------------------------------------------------
    def _send(self, request_id: RequestId, make_call: Callable[[str], Any]) -> asyncio.Future[Any]:
        """Queue a call to the replica running ``request_id`` behind its earlier controls; the
        future has the replica's answer (``Refused`` raised as its error)."""
        lane = self._lanes.get(request_id)
        future: asyncio.Future[Any] = self.loop.create_future()
        if lane is None:
            future.set_exception(RequestNotFound(f"no running request '{request_id}'"))
            return future
        lane.queue.put_nowait((make_call, future))
        if lane.task is None:
            lane.task = asyncio.create_task(self._drain(lane), name=f"rill-controls-{request_id}")
        return future

    async def _drain(self, lane: _Lane) -> None:
        await lane.placed.wait()
        assert lane.replica is not None
        while True:
            make_call, future = await lane.queue.get()
            try:
                answer = await _answer(make_call(lane.replica), CONTROL_TIMEOUT_S)
            except asyncio.CancelledError:
                if not future.done():
                    future.set_exception(RequestNotFound("the request ended"))
                raise
            except Exception as exc:  # noqa: BLE001 - a dead or stuck replica: the request is gone
                if not future.done():
                    future.set_exception(RequestNotFound(f"the request's engine replica did not answer ({exc!r})"))
                continue
            if future.done():
                continue
            if isinstance(answer, Refused):
                future.set_exception(answer.error)
            else:
                future.set_result(answer)

    def _control(self, op: str, request_id: RequestId) -> None:
        future = self._send(request_id, lambda replica: self._handle().control.remote(op, request_id, replica=replica))
        # Fire and forget, as the in-process client's inbox: a late refusal (the request
        # ended meanwhile) is what the final output tells anyway.
        future.add_done_callback(lambda f: f.cancelled() or f.exception())

    def _handle(self) -> Any:
        assert self._deployed is not None
        return self._deployed.handle

    def abort(self, request_id: RequestId) -> None:
        """Cancel a request on its replica; no-op when it already finished."""
        if request_id in self._streams and request_id in self._lanes:
            self._control("abort", request_id)

    def pause(self, request_id: RequestId) -> None:
        """Pause a running request on its replica."""
        self._live(request_id)
        self._control("pause", request_id)

    def resume(self, request_id: RequestId) -> None:
        """Resume a paused request on its replica."""
        self._live(request_id)
        self._control("resume", request_id)

    async def regenerate(self, request_id: RequestId) -> None:
        """Restart a request from its prompt on its replica (its account as in-process)."""
        await self._restart_account(request_id)
        self._control("regenerate", request_id)

    async def set_sampling(self, stream: RequestStream, params: SamplingParams) -> None:
        """Put ``params`` in force on the request's replica, which compiles a new constraint.
        A changed constraint counts as one request in the principal's window (the replica's
        grammar cache is not known here)."""
        request_id = stream.request_id
        old = stream.sampling
        await self.policy.charge_modify(old, params, self._principals[request_id])
        self._same(stream)
        account = self._accounts.get(request_id)
        if account is not None:
            await account.set_max_tokens(params.max_tokens)
        try:
            await self._send(
                request_id,
                lambda replica: self._handle().set_sampling.remote(request_id, params, replica=replica),
            )
            self._same(stream)
        except BaseException:
            if account is not None:
                await account.set_max_tokens(old.max_tokens)  # lower: it reserves nothing, never refused
            raise
        stream.sampling = params

    # -- gauges ------------------------------------------------------------------------------
    async def _poll_stats(self) -> None:
        while True:
            await self._read_stats()
            await asyncio.sleep(STATS_INTERVAL_S)

    async def _read_stats(self) -> None:
        """Read every live replica's gauges and counters once."""
        live = self.replicas()
        reads = {
            replica: _answer(self._handle().stats.remote(replica=replica), STATS_INTERVAL_S * 2) for replica in live
        }
        answers = await asyncio.gather(*reads.values(), return_exceptions=True)
        fresh = {}
        for replica, answer in zip(reads, answers, strict=True):
            if isinstance(answer, EngineStats):
                fresh[replica] = answer
            elif replica in self._replica_stats:
                fresh[replica] = self._replica_stats[replica]  # a missed read: its last figures
        for replica, last in self._replica_stats.items():
            if replica not in fresh:
                _add(self._departed, last, COUNTER_FIELDS)  # it left: its counts stay counted
        self._replica_stats = fresh

    def linked_replicas(self) -> frozenset[str]:
        """The replicas whose outputs come over a socket on this machine (``rill.cluster.link``)
        rather than over Ray."""
        return frozenset(self._linked)

    def replica_stats(self) -> dict[str, EngineStats]:
        """Each live replica's gauges and counters, as last read (at most ``STATS_INTERVAL_S`` old)."""
        return dict(self._replica_stats)

    def stats(self) -> EngineStats:
        """The replicas' gauges and counters summed (step times: the slowest replica's)."""
        per_replica = list(self._replica_stats.values())
        total = EngineStats(num_waiting=self._tracks.num_queued if not per_replica else 0)
        _add(total, self._departed, COUNTER_FIELDS)
        for stats in per_replica:
            _add(total, stats, SUM_FIELDS)
            total.last_step_ms = max(total.last_step_ms, stats.last_step_ms)
            total.step_ms_ewma = max(total.step_ms_ewma, stats.step_ms_ewma)
        return total
