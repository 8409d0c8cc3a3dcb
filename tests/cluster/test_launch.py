"""Starting Ray's local instance: a start whose raylet did not register in time, or whose GCS
did not write its port file in time, is shut down and tried once more; any other failure, or a
second timeout, is raised."""

from __future__ import annotations

import os
from typing import Any

import pytest

from rill.cluster import launch

TIMEOUT = Exception("The current node timed out during startup. This could happen because ...")
GCS_TIMEOUT = Exception("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_abc")


class FakeRay:
    """``ray``'s ``init`` and ``shutdown``: each init raises the next of ``failures`` (None: starts)."""

    def __init__(self, *failures: Exception | None) -> None:
        self.failures = list(failures)
        self.calls: list[str] = []

    def init(self, **kwargs: Any) -> None:
        self.calls.append("init")
        failure = self.failures.pop(0)
        if failure is not None:
            raise failure

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.mark.parametrize("timeout", (TIMEOUT, GCS_TIMEOUT))
def test_a_start_that_timed_out_is_shut_down_and_tried_again(timeout: Exception) -> None:
    ray = FakeRay(timeout, None)
    launch._start_local_ray(ray, cpus=2)
    assert ray.calls == ["init", "shutdown", "init"]


def test_the_gcs_gets_longer_than_rays_default_to_come_up_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "")  # so that monkeypatch restores it
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s")
    launch._start_local_ray(FakeRay(None), cpus=2)
    assert int(os.environ["RAY_gcs_server_port_wait_time_s"]) > 30
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "12")
    launch._start_local_ray(FakeRay(None), cpus=2)
    assert os.environ["RAY_gcs_server_port_wait_time_s"] == "12"


def test_rays_bookkeeping_runs_at_longer_periods_unless_the_user_chose(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in launch.QUIET_RAY:
        monkeypatch.setenv(name, "")  # so that monkeypatch puts back what was there (or nothing)
        monkeypatch.delenv(name)
    monkeypatch.setenv("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", "0.2")
    launch._start_local_ray(FakeRay(None), cpus=2)
    assert os.environ["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.2"
    # Ray's defaults: the controller's loop 0.1 s, the raylet's resource reports 100 ms.
    assert os.environ["RAY_raylet_report_resources_period_milliseconds"] == "1000"
    assert all(os.environ[name] == value for name, value in launch.QUIET_RAY.items() if "CONTROL_LOOP" not in name)


def test_a_second_timeout_or_another_failure_is_raised() -> None:
    ray = FakeRay(TIMEOUT, TIMEOUT)
    with pytest.raises(Exception, match="timed out during startup"):
        launch._start_local_ray(ray, cpus=2)
    assert ray.calls == ["init", "shutdown", "init"]
    other = FakeRay(ValueError("bad object store size"))
    with pytest.raises(ValueError, match="object store"):
        launch._start_local_ray(other, cpus=2)
    assert other.calls == ["init"]
