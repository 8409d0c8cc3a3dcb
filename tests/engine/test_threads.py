"""The engine's thread count follows the CPUs the process may use (affinity and cgroup quota)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rill.engine.threads import apply_wait_policy, cgroup_quota_cpus, choose_num_threads


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


def test_wait_policy_defaults_to_passive() -> None:
    env: dict[str, str] = {}
    said = apply_wait_policy(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert "PASSIVE" in said


@pytest.mark.parametrize("name, value", [("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "10000"), ("KMP_BLOCKTIME", "0")])
def test_a_wait_policy_the_user_chose_is_kept(name: str, value: str) -> None:
    env = {name: value}
    said = apply_wait_policy(env)
    assert env == {name: value}
    assert f"{name}={value}" in said


def test_importing_rill_sets_the_policy_before_torch_loads() -> None:
    import subprocess
    import sys

    code = ("import os; os.environ.pop('OMP_WAIT_POLICY', None); import rill, sys; "
            "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.split()
    assert out == ["PASSIVE", "False"]
