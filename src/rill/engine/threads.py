"""How many intra-op threads the engine may use: never more than the CPUs this process may run on.

torch's default is the machine's core count, which is wrong in two common cases: a process
pinned to a subset of cores (``taskset``, a Kubernetes CPU set) and a container with a CPU
quota (cgroup ``cpu.max``). Threads beyond what the process may actually run oversubscribe the
cores; OpenMP's spinning threads then wait for each other and a step can take many times longer
than with fewer threads (issue "Performance on real weights" measured 5-13x on a loaded
machine). So the default is the smaller of the affinity set and the quota, rounded down, at
least 1, and the choice is logged with its reason.

The count alone does not protect a shared machine: OpenMP's default wait policy lets a
thread that reaches a barrier spin for a while before it sleeps, and with another process on
the second core every parallel region waits for a thread the OS has descheduled while its
partner burns the time slice spinning. ``apply_wait_policy`` sets ``OMP_WAIT_POLICY=PASSIVE``
(waiting threads sleep at once) before torch loads its OpenMP runtime, unless the user chose
a policy; ``rill/__init__.py`` calls it, so it takes effect in every process that imports rill
before torch.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import MutableMapping

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


def choose_num_threads(requested: int | None, affinity: int | None, quota: float | None,
                       machine: int | None) -> ThreadChoice:
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


def apply_wait_policy(environ: MutableMapping[str, str] | None = None) -> str:
    """Make OpenMP threads sleep instead of spinning at barriers, unless the user chose.

    Returns the policy in force as a short text for the start-up log. It only takes effect
    if torch's OpenMP runtime has not started yet (it reads the variable once).
    """
    env = os.environ if environ is None else environ
    chosen = [f"{name}={env[name]}" for name in WAIT_POLICY_VARS if env.get(name)]
    if chosen:
        return f"{', '.join(chosen)} (set by the environment)"
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return "OMP_WAIT_POLICY=PASSIVE (rill's default: waiting threads sleep, they do not spin)"


def default_choice(requested: int | None) -> ThreadChoice:
    """``choose_num_threads`` with this process's affinity, quota and machine."""
    return choose_num_threads(requested, affinity_cpus(), cgroup_quota_cpus(), os.cpu_count())


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
