"""Starting Ray's local instance: a start whose raylet did not register in time is shut down
and tried once more; any other failure, or a second timeout, is raised."""

from __future__ import annotations

from typing import Any

import pytest

from rill.cluster import launch

TIMEOUT = Exception("The current node timed out during startup. This could happen because ...")


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


def test_a_start_that_timed_out_is_shut_down_and_tried_again() -> None:
    ray = FakeRay(TIMEOUT, None)
    launch._start_local_ray(ray, cpus=2)
    assert ray.calls == ["init", "shutdown", "init"]


def test_a_second_timeout_or_another_failure_is_raised() -> None:
    ray = FakeRay(TIMEOUT, TIMEOUT)
    with pytest.raises(Exception, match="timed out during startup"):
        launch._start_local_ray(ray, cpus=2)
    assert ray.calls == ["init", "shutdown", "init"]
    other = FakeRay(ValueError("bad object store size"))
    with pytest.raises(ValueError, match="object store"):
        launch._start_local_ray(other, cpus=2)
    assert other.calls == ["init"]
