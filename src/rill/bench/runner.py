"""The load loop of ``rill bench``: send requests through a driver, closed or open loop.

* Closed loop (no rate): ``concurrency`` requests in flight; each finished one starts the
  next, until ``num_requests`` were sent.
* Open loop (``rate``): requests are released at Poisson arrival times whatever the server
  does; ``concurrency`` (if given) still caps how many are in flight, and a request that
  must wait for a free slot has its clock started at release, so the wait counts in TTFT.

Every run is bounded: each request by ``request_timeout_s`` (kind ``timeout``) and the run
by ``max_duration_s`` (requests still open then are cancelled, kind ``run_deadline``).
"""

from __future__ import annotations

import asyncio
import errno
import sys
import time
from collections.abc import Callable

from rill.bench.drivers import BenchError, Driver, Options, Target, Timer
from rill.bench.stats import RequestRecord, Summary
from rill.bench.workload import BenchRequest, poisson_offsets


class _Progress:
    """A tqdm bar on stderr when asked for (and installed), else nothing."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True, leave=False)
        self.num_errors = 0

    def update(self, record: RequestRecord) -> None:
        if record.error is not None:
            self.num_errors += 1
        if self._bar is not None:
            self._bar.update(1)
            if self.num_errors:
                self._bar.set_postfix(errors=self.num_errors, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


async def _one(
    driver: Driver, request: BenchRequest, run_start: float, timeout_s: float, timer: Timer | None = None
) -> RequestRecord:
    timer = timer or Timer(request.index, driver.name, run_start)
    try:
        async with asyncio.timeout(timeout_s):
            return await driver.run(request, timer)
    except BenchError as exc:
        return timer.failed(exc.kind, exc.message)
    except TimeoutError:
        return timer.failed("timeout", f"no end after {timeout_s:g} s")
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - every failure becomes a record, the run goes on
        return timer.failed(_kind_of(exc), str(exc))


def _kind_of(exc: Exception) -> str:
    name = type(exc).__name__
    if "ConnectionClosed" in name or isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return "disconnected"
    if isinstance(exc, (ConnectionRefusedError, FileNotFoundError)) or "ConnectError" in name:
        return "connect_error"
    if isinstance(exc, OSError):
        return f"os_error_{errno.errorcode.get(exc.errno or 0, exc.errno)}"
    return name


class _LoadRun:
    """One load run in progress: the requests in flight, the records collected and the
    concurrency slots they hold."""

    def __init__(
        self,
        driver: Driver,
        requests: list[BenchRequest],
        concurrency: int | None,
        request_timeout_s: float,
        bar: _Progress,
        on_record: Callable[[RequestRecord], None] | None,
    ) -> None:
        self.driver = driver
        self.requests = requests
        self.request_timeout_s = request_timeout_s
        self.bar = bar
        self.on_record = on_record
        self.records: list[RequestRecord] = []
        self.slots = asyncio.Semaphore(concurrency) if concurrency else None
        self.tasks: set[asyncio.Task] = set()
        self.run_start = time.perf_counter()

    async def release_all(self, rate_per_s: float | None, seed: int) -> None:
        """Release every request (at Poisson arrival times when a rate is given, each once a
        slot is free) and wait until all have finished."""
        offsets = poisson_offsets(len(self.requests), rate_per_s, seed) if rate_per_s else None
        for i, request in enumerate(self.requests):
            timer = None
            if offsets is not None:
                delay = self.run_start + offsets[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # the arrival process itself, not a race workaround
                timer = Timer(request.index, self.driver.name, self.run_start)  # queueing for a slot counts
            if self.slots is not None:
                await self.slots.acquire()
            task = asyncio.create_task(_one(self.driver, request, self.run_start, self.request_timeout_s, timer))
            self.tasks.add(task)
            task.add_done_callback(self._finished)
        while self.tasks:
            await asyncio.wait(set(self.tasks))

    def _finished(self, task: asyncio.Task) -> None:
        """Free the request's slot and collect its record (a cancelled one has none)."""
        self.tasks.discard(task)
        if self.slots is not None:
            self.slots.release()
        if not task.cancelled():
            record = task.result()
            self.records.append(record)
            self.bar.update(record)
            if self.on_record is not None:
                self.on_record(record)

    async def stop_at_deadline(self, max_duration_s: float) -> None:
        """Cancel the requests still in flight; every request without a record gets a
        ``run_deadline`` one."""
        now = time.perf_counter()
        for task in list(self.tasks):
            task.cancel()
        if self.tasks:
            await asyncio.wait(set(self.tasks))
        done = {r.index for r in self.records}
        for request in self.requests:
            if request.index not in done:
                self.records.append(
                    RequestRecord(
                        index=request.index,
                        protocol=self.driver.name,
                        start_s=now - self.run_start,
                        error="run_deadline",
                        error_message=f"run stopped after {max_duration_s:g} s",
                    )
                )


async def run_load(
    driver: Driver,
    requests: list[BenchRequest],
    *,
    concurrency: int | None,
    rate_per_s: float | None = None,
    seed: int = 0,
    request_timeout_s: float = 300.0,
    max_duration_s: float = 600.0,
    progress: bool = False,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` through ``driver`` (already opened); return the records and the wall time.

    Args:
        concurrency: most requests in flight (None: unbounded, open loop only).
        rate_per_s: open-loop Poisson arrival rate; None for a closed loop.
        on_record: called with each record as it completes (the many-connections run).
    """
    if concurrency is None and rate_per_s is None:
        raise ValueError("a closed loop needs a concurrency")
    bar = _Progress(len(requests), driver.name, progress)
    run = _LoadRun(driver, requests, concurrency, request_timeout_s, bar, on_record)
    try:
        async with asyncio.timeout(max_duration_s):
            await run.release_all(rate_per_s, seed)
    except TimeoutError:
        await run.stop_at_deadline(max_duration_s)
    finally:
        bar.close()
    wall_s = time.perf_counter() - run.run_start
    run.records.sort(key=lambda r: r.index)
    return run.records, wall_s


async def measure(
    protocol: str,
    target: Target,
    options: Options,
    requests: list[BenchRequest],
    *,
    concurrency: int | None,
    rate_per_s: float | None = None,
    num_warmup: int = 1,
    seed: int = 0,
    request_timeout_s: float = 300.0,
    max_duration_s: float = 600.0,
    progress: bool = False,
    on_record: Callable[[RequestRecord], None] | None = None,
) -> tuple[Summary, list[RequestRecord]]:
    """Open the driver, send ``num_warmup`` unmeasured requests, run the load, summarize.

    Raises:
        BenchError: the server cannot be reached over this protocol (the driver's ``open``
            failed, or every warm-up request failed to connect).
    """
    from rill.bench.drivers import make_driver
    from rill.bench.stats import summarize

    driver = make_driver(protocol, target, options)
    await driver.open()
    try:
        for request in requests[:num_warmup]:
            # Reversed words: the same length, but no prefix a prefix cache could reuse later.
            warm_request = BenchRequest(
                index=-1, prompt=" ".join(reversed(request.prompt.split())), max_tokens=request.max_tokens
            )
            warm = await _one(driver, warm_request, time.perf_counter(), request_timeout_s)
            if warm.error in ("connect_error", "disconnected") or (warm.error or "").startswith("http_404"):
                raise BenchError(warm.error or "connect_error", warm.error_message or "")
        records, wall_s = await run_load(
            driver,
            requests,
            concurrency=concurrency,
            rate_per_s=rate_per_s,
            seed=seed,
            request_timeout_s=request_timeout_s,
            max_duration_s=max_duration_s,
            progress=progress,
            on_record=on_record,
        )
    finally:
        await driver.close()
    where = {"uds": target.socket, "evergreen": target.grpc_address}.get(protocol, target.http_url)
    summary = summarize(
        records, protocol=protocol, target=where, wall_s=wall_s, concurrency=concurrency, request_rate=rate_per_s
    )
    return summary, records
