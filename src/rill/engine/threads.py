"""How many intra-op threads the engine may use: never more than the CPUs this process may run on.

torch's default is the machine's core count, which is wrong in two common cases: a process
pinned to a subset of cores (``taskset``, a Kubernetes CPU set) and a container with a CPU
quota (cgroup ``cpu.max``). Threads beyond what the process may actually run oversubscribe the
cores; OpenMP's spinning threads then wait for each other and a step can take many times longer
than with fewer threads (issue "Performance on real weights" measured 5-13x on a loaded
machine). So the default is the smaller of the affinity set and the quota, rounded down, at
least 1, and the choice is logged with its reason.

How OpenMP threads wait between parallel regions is the other half. A decode step is a few
hundred short regions back to back, so a worker that sleeps at once (``OMP_WAIT_POLICY=PASSIVE``)
pays a wake-up per region, and one that spins long (libgomp's default) burns the time slice of
a partner the OS has descheduled when another process holds the second core. Measured on this
2-core machine, SmolLM2-135M bf16 decode steps at B=1 / B=32 (ms, lower is better):

=====================  ===========  ===========  =====================
wait                   quiet B=1    quiet B=32   one ``yes`` hog B=1/32
=====================  ===========  ===========  =====================
PASSIVE                21.5         56           23 / 61
GOMP_SPINCOUNT=2000    17.5         35           37 / 105
GOMP_SPINCOUNT=20000   15.0         35           108 / 300
1 thread (any policy)  --           --           21 / 51
=====================  ===========  ===========  =====================

So rill spins briefly (``apply_wait_policy`` sets ``GOMP_SPINCOUNT``, unless the user chose a
policy; ``rill/__init__.py`` calls it before torch loads its OpenMP runtime) and leaves the
contended case to ``ThreadGovernor``: while other processes keep part of this process's CPUs
busy, the engine runs with fewer threads (one thread beside a hog beats two by 1.1-1.2x, and
beats two spinning threads by 2x), and it returns to all of them when they leave.

"Other processes" leaves out the governor's allies: processes that serve this engine's own
requests, whose CPU use is the same work single-process rill does in its own threads. A cluster
replica (``rill.cluster.replica``) allies the front doors on its machine (they tokenize, stream
and read its outputs), so their CPU counts as the replica's own, not as contention to dodge.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger("rill.engine")

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    """The thread count the engine runs with and why.

    Attributes:
        num_threads: intra-op threads to give torch.
        reason: a short human sentence for the start-up log.
    """

    num_threads: int
    reason: str


def affinity_cpus() -> int | None:
    """CPUs in this process's affinity set, or None where the platform cannot tell."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def cgroup_quota_cpus(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time the cgroup quota grants (e.g. 1.5), or None without a quota.

    Reads cgroup v2's ``cpu.max`` ("max 100000" means no quota) and falls back to cgroup v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1 means no quota).
    """
    v2 = _read(root / "cpu.max")
    if v2 is not None:
        parts = v2.split()
        if len(parts) == 2 and parts[0] != "max":
            return _ratio(parts[0], parts[1])
        return None
    quota = _read(root / "cpu" / "cpu.cfs_quota_us") or _read(root / "cpu.cfs_quota_us")
    period = _read(root / "cpu" / "cpu.cfs_period_us") or _read(root / "cpu.cfs_period_us")
    if quota is None or period is None or quota.strip() == "-1":
        return None
    return _ratio(quota, period)


def choose_num_threads(
    requested: int | None, affinity: int | None, quota: float | None, machine: int | None
) -> ThreadChoice:
    """Pick the engine's thread count.

    Args:
        requested: ``--num-threads`` if given; it wins, but a value above what the process may
            use is reported in the reason (it is the user's call).
        affinity: CPUs in the affinity set (``affinity_cpus``).
        quota: CPUs' worth of cgroup quota (``cgroup_quota_cpus``).
        machine: ``os.cpu_count()``, used only when neither of the above is known.
    """
    limits = [(affinity, "CPUs in this process's affinity set")]
    if quota is not None:
        limits.append((max(1, math.floor(quota)), f"the cgroup CPU quota ({quota:g} CPUs)"))
    known = [(n, why) for n, why in limits if n]
    usable, why = min(known) if known else (machine or 1, "CPUs on the machine")
    if requested:
        note = f"; note: only {usable} usable ({why})" if requested > usable else ""
        return ThreadChoice(requested, f"--num-threads {requested}{note}")
    return ThreadChoice(max(1, usable), f"{usable} = {why}")


WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
"""Variables by which a user already chose how OpenMP threads wait (then rill sets nothing)."""


SPIN_COUNT = 10_000
"""libgomp's spin iterations before a waiting thread sleeps (see the module's table)."""


def apply_wait_policy(environ: MutableMapping[str, str] | None = None) -> str:
    """Make OpenMP threads spin only briefly at barriers, unless the user chose how they wait.

    Returns the policy in force as a short text for the start-up log. It only takes effect
    if torch's OpenMP runtime has not started yet (it reads the variable once).
    """
    env = os.environ if environ is None else environ
    chosen = [f"{name}={env[name]}" for name in WAIT_POLICY_VARS if env.get(name)]
    if chosen:
        return f"{', '.join(chosen)} (set by the environment)"
    env["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return f"GOMP_SPINCOUNT={SPIN_COUNT} (rill's default: waiting threads spin briefly, then sleep)"


def default_choice(requested: int | None) -> ThreadChoice:
    """``choose_num_threads`` with this process's affinity, quota and machine."""
    return choose_num_threads(requested, affinity_cpus(), cgroup_quota_cpus(), os.cpu_count())


def threads_for(usable: int, other_cpus: float, current: int) -> int:
    """Threads to run with while other processes keep ``other_cpus`` CPUs' worth of ours busy.

    Each CPU that others hold by more than half is given up; one that they hold by less than
    0.3 is taken back. Between the two the count stays as it is, so a load near a threshold
    does not flip it every window. Always between 1 and ``usable``.
    """
    fewer = usable - math.ceil(other_cpus - 0.5)
    more = usable - math.ceil(other_cpus - 0.3)
    target = fewer if fewer < current else more if more > current else current
    return max(1, min(usable, target))


def busy_seconds(stat_text: str, cpus: set[int], ticks_per_second: float) -> float:
    """Busy time (all but idle and iowait) summed over ``cpus``, from ``/proc/stat``'s text."""
    total = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not (name.startswith("cpu") and name[3:].isdigit()) or int(name[3:]) not in cpus:
            continue
        fields = [int(field) for field in rest.split()]
        total += sum(fields[:8]) - fields[3] - fields[4]  # user..steal, minus idle and iowait
    return total / ticks_per_second


CLOCK_TICKS = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
"""The unit of ``/proc``'s CPU times, per second."""


def process_cpu_seconds(pid: int, proc: Path = Path("/proc")) -> float:
    """CPU seconds (user and system) process ``pid`` has used, from ``/proc/<pid>/stat``.

    Raises:
        OSError: the process is gone (or ``/proc`` is unreadable).
        ValueError, IndexError: the file is not the format expected.
    """
    fields = proc_stat_fields(pid, proc)
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14 and 15 of the file


def proc_stat_fields(pid: int, proc: Path = Path("/proc")) -> list[str]:
    """``/proc/<pid>/stat``'s fields after the command name (the file's third field first).

    The command name is in parentheses and may itself hold spaces and parentheses, so the
    fields start after the last ``)``.
    """
    return (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()


@dataclass(frozen=True, slots=True)
class _Sample:
    """One end of a governor's window: wall time, busy CPU time of this process's CPUs, and
    CPU time of this process and of the allies read (``allies``: only those, summed in ``own``)."""

    at: float
    busy: float
    own: float
    allies: frozenset[int]


FIRST_WINDOW_S = 0.2
"""The first window after idleness: /proc/stat counts in 10 ms ticks, so 0.2 s over 2 CPUs
still resolves others' use to about 0.05 CPU."""


class ThreadGovernor:
    """Adjusts the engine's thread count to the CPUs other processes leave free (see the module doc).

    Each engine step runs inside ``step()`` in the engine thread (the thread count is that
    thread's OpenMP setting): ``tick()`` before it, ``stepped()`` after. Every ``window``
    seconds it compares the busy time of this process's CPUs with this process's own CPU
    time and its allies'; the difference is what others used.

    Allies (``ally``, ``forget``) are processes whose CPU counts as this process's own: they
    serve the same requests (a cluster replica's front doors on its machine), so their use is
    not contention to dodge. Their CPU is taken to be spent on this process's CPUs, as its own
    threads' is. ``ally``, ``forget`` and ``allies`` may be called from any thread; the rest
    belongs to the engine thread. A window whose two ends read different allies (one joined,
    left or vanished meanwhile) is not judged but restarted: its ends' sums do not compare, and
    a vanished ally's CPU of that window would read as others' load.

    Args:
        usable: the most threads to run with (``default_choice``'s count).
        cpus: the CPU ids this process may run on.
        set_threads: applies a count (``torch.set_num_threads`` or ``LlamaCppRunner.set_num_threads``).
        read_stat: returns ``/proc/stat``'s text.
        own_cpu: this process's CPU seconds (``time.process_time``).
        clock: wall seconds.
        window: seconds between decisions.
        ally_cpu: an ally's CPU seconds by pid (``process_cpu_seconds``); raises ``OSError``
            once the process is gone, which drops it from the allies.
    """

    def __init__(
        self,
        usable: int,
        cpus: set[int],
        set_threads: Callable[[int], None],
        read_stat: Callable[[], str] = lambda: Path("/proc/stat").read_text(),
        own_cpu: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
        window: float = 0.5,
        ally_cpu: Callable[[int], float] = process_cpu_seconds,
    ) -> None:
        self.usable = usable
        self.current = usable
        self._cpus = cpus
        self._set_threads = set_threads
        self._read_stat = read_stat
        self._own_cpu = own_cpu
        self._clock = clock
        self._window = window
        self._ally_cpu = ally_cpu
        self._ticks = CLOCK_TICKS
        self._allies_lock = threading.Lock()
        self._allies: dict[int, int] = {}  # pid -> how many times allied and not yet forgotten
        self._last = self._sample()
        self._last_step_end = self._last.at
        self._span = self._window  # seconds the current window must last before a decision
        self._broken = False

    def ally(self, pid: int) -> None:
        """Count process ``pid``'s CPU as this process's own from the next window on.

        Calls pair with ``forget``: a pid allied twice stays allied until forgotten twice (two
        streams of one front door may overlap while one closes and the next opens)."""
        with self._allies_lock:
            self._allies[pid] = self._allies.get(pid, 0) + 1

    def forget(self, pid: int) -> None:
        """Undo one ``ally(pid)``; a pid no longer allied (or already vanished) is ignored."""
        with self._allies_lock:
            count = self._allies.pop(pid, 0) - 1
            if count > 0:
                self._allies[pid] = count

    def allies(self) -> frozenset[int]:
        """The pids whose CPU counts as this process's own now."""
        with self._allies_lock:
            return frozenset(self._allies)

    def _sample(self) -> _Sample:
        at, busy, own = self._clock(), busy_seconds(self._read_stat(), self._cpus, self._ticks), self._own_cpu()
        read: set[int] = set()
        for pid in self.allies():
            try:
                own += self._ally_cpu(pid)
            except (OSError, ValueError, IndexError):
                with self._allies_lock:  # it ended: forget it for good, whatever its count
                    self._allies.pop(pid, None)
                continue
            read.add(pid)
        return _Sample(at, busy, own, frozenset(read))

    @contextmanager
    def step(self) -> Iterator[None]:
        """One engine step under the governor: re-decide before it, note its end after, also
        when it raises (the engine core wraps every forward in this)."""
        self.tick()
        try:
            yield
        finally:
            self.stepped()

    def judge(self, work: Callable[[], T]) -> T:
        """Run ``work`` as a window of its own and decide on it as soon as it ends; return its result.

        For work outside the engine loop that should set the thread count before the first
        request, such as the start-up warm-up: beside a busy process the first requests then
        start on the count it leaves room for, not on spinning threads for a window of their own.
        The window opens when ``work`` starts, so time before the call (loading weights) is
        never judged. Work shorter than ``FIRST_WINDOW_S`` decides nothing (``/proc/stat``
        counts 10 ms ticks: a shorter window cannot tell others' use from rounding); its
        window then goes on into the engine's steps.
        """
        self._guarded(self._restart)
        with self.step():
            result = work()
        self._guarded(self._decide_if_resolved)
        return result

    def stepped(self) -> None:
        """Note the end of a step (a long step is work, not idleness)."""
        self._last_step_end = self._clock()

    def tick(self) -> None:
        """Re-decide the thread count if a window has passed since the last decision.

        A window in which the engine sat idle (longer than a window between the end of one
        step, ``stepped()``, and this call) is dropped, not judged: what others ran while
        this process had no work says nothing about contention now, and judging it would
        start the next burst of work with too few threads. The first window after idleness
        is short (``FIRST_WINDOW_S``), so a hog that came meanwhile costs little.
        """
        self._guarded(self._decide)

    def _guarded(self, action: Callable[[], None]) -> None:
        if self._broken:
            return
        try:
            action()
        except (OSError, ValueError, IndexError) as exc:  # /proc unreadable or changed: keep the count
            self._broken = True
            log.warning("engine thread governor stopped (%s); keeping %d threads", exc, self.current)

    def _restart(self) -> None:
        self._last = self._sample()
        self._last_step_end = self._last.at
        self._span = self._window

    def _decide(self) -> None:
        now = self._clock()
        if now - self._last_step_end > self._window:
            self._last = self._sample()
            self._span = min(self._window, FIRST_WINDOW_S)
            return
        if now - self._last.at >= self._span:
            self._judge_window()

    def _decide_if_resolved(self) -> None:
        if self._clock() - self._last.at >= FIRST_WINDOW_S:
            self._judge_window()

    def _judge_window(self) -> None:
        then, now = self._last, self._sample()
        self._last = now
        self._span = self._window
        if now.allies != then.allies:
            return  # the allies changed within the window: it starts again from here
        other = max(0.0, (now.busy - then.busy) - (now.own - then.own)) / max(now.at - then.at, 1e-9)
        target = threads_for(self.usable, other, self.current)
        if target != self.current:
            log.warning(
                "engine threads %d -> %d: other processes keep %.2f of this process's %d CPUs busy",
                self.current,
                target,
                other,
                len(self._cpus),
            )
            self.current = target
            self._set_threads(target)


def default_governor(
    choice: ThreadChoice, requested: int | None, set_threads: Callable[[int], None]
) -> ThreadGovernor | None:
    """A ``ThreadGovernor`` for the engine, or None when the user fixed the count, only one
    thread is usable, or this platform has no ``/proc/stat`` or affinity to read."""
    if requested or choice.num_threads < 2 or not Path("/proc/stat").exists():
        return None
    try:
        cpus = set(os.sched_getaffinity(0))
        return ThreadGovernor(choice.num_threads, cpus, set_threads)
    except (AttributeError, OSError, ValueError):
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None
