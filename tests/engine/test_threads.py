"""The engine's thread count follows the CPUs the process may use (affinity and cgroup quota) and
the CPUs other processes leave free; OpenMP threads spin only briefly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rill.engine.threads import (
    CLOCK_TICKS,
    SPIN_COUNT,
    ThreadChoice,
    ThreadGovernor,
    apply_wait_policy,
    busy_seconds,
    cgroup_quota_cpus,
    choose_num_threads,
    default_governor,
    proc_stat_fields,
    process_cpu_seconds,
    threads_for,
)


def test_affinity_bounds_the_default() -> None:
    choice = choose_num_threads(None, affinity=2, quota=None, machine=64)
    assert choice.num_threads == 2
    assert "affinity" in choice.reason


def test_quota_below_affinity_wins_rounded_down() -> None:
    choice = choose_num_threads(None, affinity=8, quota=2.5, machine=8)
    assert choice.num_threads == 2
    assert "quota" in choice.reason


def test_a_fractional_quota_under_one_cpu_still_runs_one_thread() -> None:
    assert choose_num_threads(None, affinity=4, quota=0.5, machine=4).num_threads == 1


def test_machine_count_only_when_nothing_else_is_known() -> None:
    assert choose_num_threads(None, affinity=None, quota=None, machine=3).num_threads == 3
    assert choose_num_threads(None, affinity=None, quota=None, machine=None).num_threads == 1


def test_an_explicit_count_wins_and_an_oversubscription_is_reported() -> None:
    choice = choose_num_threads(6, affinity=2, quota=None, machine=2)
    assert choice.num_threads == 6
    assert "only 2 usable" in choice.reason
    assert "only" not in choose_num_threads(1, affinity=2, quota=None, machine=2).reason


@pytest.mark.parametrize(("text", "expected"), [("150000 100000", 1.5), ("max 100000", None), ("0 100000", None)])
def test_cgroup_v2_cpu_max(tmp_path: Path, text: str, expected: float | None) -> None:
    (tmp_path / "cpu.max").write_text(text + "\n")
    assert cgroup_quota_cpus(tmp_path) == expected


def test_cgroup_v1_quota_and_unlimited(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    assert cgroup_quota_cpus(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_quota_cpus(tmp_path) is None


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_quota_cpus(tmp_path) is None


def test_wait_policy_defaults_to_a_brief_spin() -> None:
    env: dict[str, str] = {}
    said = apply_wait_policy(env)
    assert env == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}
    assert f"GOMP_SPINCOUNT={SPIN_COUNT}" in said


@pytest.mark.parametrize(
    "name, value", [("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "300"), ("KMP_BLOCKTIME", "0")]
)
def test_a_wait_policy_the_user_chose_is_kept(name: str, value: str) -> None:
    env = {name: value}
    said = apply_wait_policy(env)
    assert env == {name: value}
    assert f"{name}={value}" in said


def test_importing_rill_sets_the_policy_before_torch_loads() -> None:
    import subprocess
    import sys

    code = "import os; import rill, sys; print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    env = {
        k: v
        for k, v in __import__("os").environ.items()
        if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
    }
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    assert out == [str(SPIN_COUNT), "False"]


@pytest.mark.parametrize(
    ("other", "current", "expected"),
    [
        (0.0, 2, 2),
        (0.45, 2, 2),
        (0.67, 2, 1),  # a hog beside two threads holds ~2/3 of a CPU
        (1.0, 1, 1),
        (0.4, 1, 1),
        (0.1, 1, 2),  # back to two only once others drop under 0.3
        (2.0, 2, 1),
        (1.6, 4, 2),
        (0.2, 2, 2),
    ],
)
def test_threads_for_gives_up_cpus_others_hold_and_takes_them_back(other: float, current: int, expected: int) -> None:
    usable = max(current, 2)
    assert threads_for(usable, other, current) == expected


def test_busy_seconds_counts_only_the_given_cpus_and_not_idle_or_iowait() -> None:
    stat = (
        "cpu  900 0 900 900 900 0 0 0 0 0\n"
        "cpu0 100 5 20 1000 50 1 2 3 0 0\n"
        "cpu1 200 0 0 1000 0 0 0 0 0 0\n"
        "cpu2 7000 0 0 0 0 0 0 0 0 0\n"
        "cpufreq 1 2 3\n"
        "intr 1 2 3\n"
    )
    assert busy_seconds(stat, {0, 1}, 100.0) == pytest.approx((100 + 5 + 20 + 1 + 2 + 3 + 200) / 100)


class _Machine:
    """A fake /proc/stat and process clock: ``run`` advances wall time with given CPU use.

    Other processes' use may be one process's (``by``), whose CPU seconds ``process_cpu``
    reads as ``/proc/<pid>/stat`` would, until ``end`` makes it vanish."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.own = 0.0
        self.busy = [0.0, 0.0]
        self.applied: list[int] = []
        self.processes: dict[int, float] = {}

    def run(
        self,
        seconds: float,
        own_per_cpu: tuple[float, float],
        other_per_cpu: tuple[float, float],
        by: int | None = None,
    ) -> None:
        self.wall += seconds
        for cpu in (0, 1):
            self.busy[cpu] += seconds * (own_per_cpu[cpu] + other_per_cpu[cpu])
        self.own += seconds * sum(own_per_cpu)
        if by is not None:
            self.processes[by] = self.processes.get(by, 0.0) + seconds * sum(other_per_cpu)

    def steps(
        self,
        governor: ThreadGovernor,
        seconds: float,
        own_per_cpu: tuple[float, float],
        other_per_cpu: tuple[float, float],
        by: int | None = None,
    ) -> None:
        """Engine steps of 0.05 s for ``seconds``, the governor ticking before each."""
        for _ in range(round(seconds / 0.05)):
            governor.tick()
            self.run(0.05, own_per_cpu, other_per_cpu, by)
            governor.stepped()

    def stat(self) -> str:
        return "".join(f"cpu{cpu} {round(b * 100)} 0 0 0 0 0 0 0 0 0\n" for cpu, b in enumerate(self.busy))

    def process_cpu(self, pid: int) -> float:
        if pid not in self.processes:
            raise FileNotFoundError(f"/proc/{pid}/stat")
        return round(self.processes[pid] * 100) / 100  # /proc counts 10 ms ticks

    def end(self, pid: int) -> None:
        del self.processes[pid]

    def governor(self, window: float = 1.0) -> ThreadGovernor:
        """A 2-thread governor on this machine's two CPUs."""
        return ThreadGovernor(
            2,
            {0, 1},
            self.applied.append,
            read_stat=self.stat,
            own_cpu=lambda: self.own,
            clock=lambda: self.wall,
            window=window,
            ally_cpu=self.process_cpu,
        )


def test_governor_drops_to_one_thread_beside_a_hog_and_returns_after_it() -> None:
    machine = _Machine()
    governor = ThreadGovernor(
        2,
        {0, 1},
        machine.applied.append,
        read_stat=machine.stat,
        own_cpu=lambda: machine.own,
        clock=lambda: machine.wall,
        window=1.0,
    )
    machine.steps(governor, 3.0, (1.0, 1.0), (0.0, 0.0))
    assert machine.applied == [] and governor.current == 2
    machine.steps(governor, 1.5, (0.67, 0.67), (0.66, 0.0))  # a hog takes its fair share of three threads
    assert machine.applied == [1]
    machine.steps(governor, 3.0, (1.0, 0.05), (0.0, 0.95))  # one thread, the hog keeps its CPU: stay
    assert machine.applied == [1]
    machine.steps(governor, 2.5, (1.0, 0.05), (0.0, 0.0))  # the hog is gone
    assert machine.applied == [1, 2] and governor.current == 2


def test_governor_ignores_a_window_in_which_the_engine_sat_idle() -> None:
    machine = _Machine()
    governor = ThreadGovernor(
        2,
        {0, 1},
        machine.applied.append,
        read_stat=machine.stat,
        own_cpu=lambda: machine.own,
        clock=lambda: machine.wall,
        window=1.0,
    )
    machine.steps(governor, 0.5, (1.0, 1.0), (0.0, 0.0))
    machine.run(30.0, (0.0, 0.0), (1.0, 1.0))  # no steps while others used both CPUs
    machine.steps(governor, 3.0, (1.0, 1.0), (0.0, 0.0))
    assert machine.applied == []
    machine.run(30.0, (0.0, 0.0), (1.0, 1.0))
    machine.steps(governor, 0.3, (0.67, 0.67), (0.66, 0.0))  # contention after the idle spell: a short first window
    assert machine.applied == [1]


def test_a_long_step_is_work_not_idleness() -> None:
    machine = _Machine()
    governor = ThreadGovernor(
        2,
        {0, 1},
        machine.applied.append,
        read_stat=machine.stat,
        own_cpu=lambda: machine.own,
        clock=lambda: machine.wall,
        window=0.5,
    )
    machine.steps(governor, 0.5, (1.0, 1.0), (0.0, 0.0))
    governor.tick()
    machine.run(2.0, (0.67, 0.67), (0.66, 0.0))  # one 2-second prefill step beside a hog
    governor.stepped()
    governor.tick()
    assert machine.applied == [1]


def test_judge_decides_on_the_work_it_ran_and_not_on_the_time_before() -> None:
    """The warm-up's use: loading beside a hog is not judged; a warm-up beside one is, at once."""
    machine = _Machine()
    governor = ThreadGovernor(
        2,
        {0, 1},
        machine.applied.append,
        read_stat=machine.stat,
        own_cpu=lambda: machine.own,
        clock=lambda: machine.wall,
        window=0.5,
    )
    machine.run(5.0, (1.0, 0.0), (0.0, 1.0))  # loading weights on one thread while a hog holds the other CPU

    def quiet_warm_up() -> str:
        machine.run(0.3, (1.0, 1.0), (0.0, 0.0))
        return "warmed"

    assert governor.judge(quiet_warm_up) == "warmed"
    assert machine.applied == [] and governor.current == 2
    machine.run(5.0, (0.0, 0.0), (0.0, 0.0))
    governor.judge(lambda: machine.run(0.3, (0.67, 0.67), (0.66, 0.0)))  # beside a hog
    assert machine.applied == [1] and governor.current == 1


def test_judge_ignores_a_short_load_before_it_and_waits_for_a_window_that_resolves() -> None:
    """Loading shorter than a window, beside a hog, is still not judged; work shorter than the
    smallest window decides nothing, and its window goes on into the engine's steps."""
    machine = _Machine()
    governor = ThreadGovernor(
        2,
        {0, 1},
        machine.applied.append,
        read_stat=machine.stat,
        own_cpu=lambda: machine.own,
        clock=lambda: machine.wall,
        window=0.5,
    )
    machine.run(0.4, (1.0, 0.0), (0.0, 1.0))  # a quick load on one thread while a hog holds the other CPU
    governor.judge(lambda: machine.run(0.3, (1.0, 1.0), (0.0, 0.0)))  # quiet warm-up
    assert machine.applied == [] and governor.current == 2
    governor.judge(lambda: machine.run(0.05, (0.67, 0.67), (0.66, 0.0)))  # too short to tell
    assert machine.applied == []
    machine.steps(governor, 0.6, (0.67, 0.67), (0.66, 0.0))  # the hog stays: the steps' window decides
    assert machine.applied == [1]


def test_a_step_that_raises_still_ends_the_governor_s_step() -> None:
    machine = _Machine()
    governor = ThreadGovernor(
        2,
        {0, 1},
        machine.applied.append,
        read_stat=machine.stat,
        own_cpu=lambda: machine.own,
        clock=lambda: machine.wall,
        window=0.5,
    )
    machine.steps(governor, 0.5, (1.0, 1.0), (0.0, 0.0))
    with pytest.raises(RuntimeError), governor.step():
        machine.run(2.0, (0.67, 0.67), (0.66, 0.0))  # a long failed step beside a hog
        raise RuntimeError("the forward failed")
    governor.tick()  # judged as work: the failed step ended, the engine did not sit idle
    assert machine.applied == [1]


def test_governor_counts_this_process_s_own_threads_as_its_own() -> None:
    machine = _Machine()
    governor = ThreadGovernor(
        2,
        {0, 1},
        machine.applied.append,
        read_stat=machine.stat,
        own_cpu=lambda: machine.own,
        clock=lambda: machine.wall,
    )
    # Both CPUs fully busy, all of it this process (engine, event loop, tokenizer).
    machine.steps(governor, 5.0, (1.0, 1.0), (0.0, 0.0))
    assert machine.applied == []


FRONT_DOOR = 4242
"""The pid of a fake front door process (it tokenizes and streams this engine's requests)."""

FRONT_DOOR_LOAD = ((0.67, 0.67), (0.66, 0.0))
"""Per-CPU use (this process, the other process) of a busy second process beside two threads."""


def test_an_ally_s_cpu_counts_as_the_engine_s_own_and_another_process_s_does_not() -> None:
    machine = _Machine()
    governor = machine.governor()
    governor.ally(FRONT_DOOR)
    machine.steps(governor, 0.5, (1.0, 1.0), (0.0, 0.0))
    machine.steps(governor, 3.0, *FRONT_DOOR_LOAD, by=FRONT_DOOR)  # the allied front door is busy
    assert machine.applied == [] and governor.current == 2
    assert governor.allies() == {FRONT_DOOR}
    machine.steps(governor, 2.5, *FRONT_DOOR_LOAD, by=777)  # the same load from a process not allied
    assert machine.applied == [1]


def test_a_forgotten_ally_is_other_load_again() -> None:
    machine = _Machine()
    governor = machine.governor()
    governor.ally(FRONT_DOOR)
    machine.steps(governor, 2.0, *FRONT_DOOR_LOAD, by=FRONT_DOOR)
    assert machine.applied == []
    governor.forget(FRONT_DOOR)
    assert governor.allies() == frozenset()
    machine.steps(governor, 2.5, *FRONT_DOOR_LOAD, by=FRONT_DOOR)
    assert machine.applied == [1]


def test_an_ally_that_vanishes_mid_window_is_no_false_load() -> None:
    """Its CPU total leaves the sum at once: the window it vanished in is started again rather
    than judged (its start counted that total as this process's own), and the pid is dropped."""
    machine = _Machine()
    governor = machine.governor()
    machine.run(20.0, (0.0, 0.0), (1.0, 1.0), by=FRONT_DOOR)  # a front door with a long past
    governor.ally(FRONT_DOOR)
    machine.steps(governor, 1.6, *FRONT_DOOR_LOAD, by=FRONT_DOOR)
    machine.end(FRONT_DOOR)  # mid-window
    machine.steps(governor, 3.0, (1.0, 1.0), (0.0, 0.0))
    assert machine.applied == [] and governor.current == 2
    assert governor.allies() == frozenset()
    governor.forget(FRONT_DOOR)  # its stream's end, after it vanished: nothing to undo
    machine.steps(governor, 2.5, *FRONT_DOOR_LOAD, by=777)  # the governor still judges windows
    assert machine.applied == [1]


def test_an_ally_that_joins_mid_window_hides_no_other_load() -> None:
    """Its past CPU is not this window's: the window starts again, so a hog that made the engine
    give up a thread is still seen and the thread is not taken back."""
    machine = _Machine()
    machine.run(20.0, (0.0, 0.0), (1.0, 1.0), by=FRONT_DOOR)  # a front door with a long past
    governor = machine.governor()
    machine.steps(governor, 1.5, *FRONT_DOOR_LOAD, by=777)  # a hog: down to one thread
    assert machine.applied == [1]
    one_thread_beside_a_hog = ((1.0, 0.05), (0.0, 0.95))
    machine.steps(governor, 0.2, *one_thread_beside_a_hog, by=777)
    governor.ally(FRONT_DOOR)  # mid-window, with 40 CPU seconds behind it
    machine.steps(governor, 3.0, *one_thread_beside_a_hog, by=777)
    assert machine.applied == [1] and governor.allies() == {FRONT_DOOR}


def test_allies_pair_up_and_may_change_from_another_thread() -> None:
    import threading

    machine = _Machine()
    governor = machine.governor(window=0.1)
    governor.ally(1)
    governor.ally(1)
    governor.forget(1)
    assert governor.allies() == {1}
    governor.forget(1)
    governor.forget(2)  # never allied: ignored
    assert governor.allies() == frozenset()

    # The replica's event loop allies and forgets while the engine thread samples.
    machine.processes = dict.fromkeys(range(10), 0.0)
    stop = threading.Event()

    def event_loop() -> None:
        i = 0
        while i < 1000 or not stop.is_set():
            governor.ally(i % 10)
            governor.forget(i % 10)
            i += 1

    other = threading.Thread(target=event_loop)
    other.start()
    machine.steps(governor, 5.0, (1.0, 1.0), (0.0, 0.0))
    stop.set()
    other.join()
    assert governor.allies() == frozenset() and machine.applied == []


def test_process_cpu_seconds_reads_utime_and_stime_after_the_command_name(tmp_path: Path) -> None:
    (tmp_path / "42").mkdir()
    # The command name may hold spaces and parentheses; utime and stime are fields 14 and 15.
    fields = ["S", "1", "42", "42", "0", "-1", "4194304", "100", "0", "0", "0", "250", "50"] + ["0"] * 6 + ["12345"]
    (tmp_path / "42" / "stat").write_text("42 (rill (serve) x) " + " ".join(fields) + "\n")
    assert process_cpu_seconds(42, tmp_path) == pytest.approx(300 / CLOCK_TICKS)
    assert proc_stat_fields(42, tmp_path)[19] == "12345"  # the start time, field 22
    with pytest.raises(OSError):
        process_cpu_seconds(43, tmp_path)
    assert process_cpu_seconds(os.getpid()) >= 0.0


def test_an_unreadable_proc_stat_stops_the_governor_not_the_engine() -> None:
    machine = _Machine()
    reads = iter([machine.stat()])

    def flaky_stat() -> str:
        text = next(reads, None)
        if text is None:
            raise OSError("gone")
        return text

    governor = ThreadGovernor(
        2, {0, 1}, machine.applied.append, read_stat=flaky_stat, own_cpu=lambda: machine.own, clock=lambda: machine.wall
    )
    machine.steps(governor, 3.0, (0.67, 0.67), (0.66, 0.0))  # no exception escapes a tick
    assert machine.applied == [] and governor.current == 2


def test_no_governor_when_the_user_fixed_the_count_or_one_thread_is_usable() -> None:
    two = ThreadChoice(2, "test")
    assert default_governor(two, 2, lambda n: None) is None
    assert default_governor(ThreadChoice(1, "test"), None, lambda n: None) is None


class _RecordingGovernor(ThreadGovernor):
    """A ``ThreadGovernor`` whose ``tick`` and ``stepped`` record their calls beside the runner's
    forwards (its ``step`` and ``judge`` are the real ones, built on those two)."""

    def __init__(self, calls: list[str]) -> None:
        machine = _Machine()
        super().__init__(
            2,
            {0, 1},
            machine.applied.append,
            read_stat=machine.stat,
            own_cpu=lambda: machine.own,
            clock=lambda: machine.wall,
        )
        self.calls = calls

    def judge(self, work):  # type: ignore[no-untyped-def]
        self.calls.append("judge")
        return super().judge(work)

    def tick(self) -> None:
        self.calls.append("tick")

    def stepped(self) -> None:
        self.calls.append("stepped")


def test_the_engine_asks_the_governor_before_every_forward_and_tells_it_after_even_a_failed_one() -> None:
    from rill.config import EngineConfig
    from rill.engine.builder import assemble_engine
    from rill.engine.request import AddCommand
    from rill.testing.fake_runner import FakeRunner, fake_tokenizer
    from tests.engine.fake_core import make_request

    calls: list[str] = []
    runner = FakeRunner(num_rows=4, max_len=64)
    real_forward = runner.forward
    failing = {"next": False}

    def forward(work):
        calls.append("forward")
        if failing["next"]:
            failing["next"] = False
            raise RuntimeError("the forward failed")
        return real_forward(work)

    runner.forward = forward  # type: ignore[method-assign]
    engine = assemble_engine(
        EngineConfig(model="fake", max_num_seqs=4),
        runner,
        fake_tokenizer(),
        name="fake",
        architecture="FakeForCausalLM",
        warm_grammars=False,
        thread_governor=_RecordingGovernor(calls),
    )
    core = engine.core
    core.apply(AddCommand(make_request(engine, "a", [5, 6, 7], max_tokens=3, ignore_eos=True)))
    while core.has_work():
        core.step()
    assert calls == ["tick", "forward", "stepped"] * 3  # a prefill, then two decode steps
    calls.clear()
    core.apply(AddCommand(make_request(engine, "b", [5, 6, 7], max_tokens=3, ignore_eos=True)))
    failing["next"] = True
    outputs = core.step()
    assert calls == ["tick", "forward", "stepped"]
    assert [output.finish_reason for output in outputs if output.request_id == "b"] == ["error"]


def _build(model_dir: Path, num_threads: int | None):
    from rill.config import EngineConfig
    from rill.engine.builder import build_engine

    return build_engine(
        EngineConfig(
            model=str(model_dir), dtype="float32", kv_cache_memory="8MiB", max_num_seqs=2, num_threads=num_threads
        )
    )


def test_the_torch_engine_gets_a_governor_unless_the_thread_count_is_fixed(tiny_model_dir: Path) -> None:
    from rill.engine.threads import default_choice

    assert _build(tiny_model_dir, 1).core.thread_governor is None
    chosen = _build(tiny_model_dir, None).core.thread_governor
    assert (chosen is not None) == (default_choice(None).num_threads >= 2)


def test_the_warm_up_is_judged_before_the_engine_reports_ready(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window opens before the warm-up and is judged right after it, so a busy machine is
    seen before the first request, and the engine keeps that governor."""
    import rill.engine.runner
    import rill.engine.threads

    calls: list[str] = []
    recording = _RecordingGovernor(calls)
    monkeypatch.setattr(rill.engine.threads, "default_governor", lambda *args: recording)
    real_warm_up = rill.engine.runner.TorchModelRunner.warm_up

    def warm_up(self, *args, **kwargs):
        calls.append("warm-up")
        return real_warm_up(self, *args, **kwargs)

    monkeypatch.setattr(rill.engine.runner.TorchModelRunner, "warm_up", warm_up)
    built = _build(tiny_model_dir, None)
    assert calls == ["judge", "tick", "warm-up", "stepped"]
    assert built.core.thread_governor is recording


def test_the_engine_s_stats_count_its_governor_s_allies() -> None:
    from rill.config import EngineConfig
    from rill.engine.builder import assemble_engine
    from rill.testing.fake_runner import FakeRunner, fake_tokenizer

    def engine(governor: ThreadGovernor | None):  # type: ignore[no-untyped-def]
        return assemble_engine(
            EngineConfig(model="fake", max_num_seqs=4),
            FakeRunner(num_rows=4, max_len=64),
            fake_tokenizer(),
            name="fake",
            architecture="FakeForCausalLM",
            warm_grammars=False,
            thread_governor=governor,
        )

    governor = _Machine().governor()
    governed = engine(governor)
    assert governed.core.stats().allied_processes == 0
    governor.ally(FRONT_DOOR)
    assert governed.core.stats().allied_processes == 1
    assert engine(None).core.stats().allied_processes == 0
