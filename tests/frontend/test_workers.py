"""WorkerPool's threads yield to the engine: they run at a lower scheduling priority, and the
threads and processes they start inherit it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from rill.frontend.workers import BACKGROUND_NICE, WorkerPool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread priorities are Linux's")


def own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def child_nice() -> int:
    """The nice value of a process this thread starts (Tesseract is one)."""
    command = [sys.executable, "-c", "import os; print(os.nice(0))"]
    return int(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def test_worker_threads_and_what_they_start_run_below_the_engine() -> None:
    pool = WorkerPool(name="test", workers=1, max_pending=2, busy="busy", what="calls", setting="--x")
    try:
        engine = own_nice()

        async def run() -> tuple[int, int, int]:
            worker = await pool.run(own_nice)
            started = await pool.run(_in_new_thread)
            child = await pool.run(child_nice)
            return worker, started, child

        worker, started, child = asyncio.run(run())
    finally:
        pool.shutdown()
    assert own_nice() == engine  # the caller's own priority is untouched
    assert worker == started == child == min(19, engine + BACKGROUND_NICE)


def _in_new_thread() -> int:
    found: list[int] = []
    thread = threading.Thread(target=lambda: found.append(own_nice()))
    thread.start()
    thread.join()
    return found[0]
