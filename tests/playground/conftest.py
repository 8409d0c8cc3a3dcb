"""Fixtures of the playground tests: a headless Chromium driven by Selenium.

The browser is Debian's ``chromium`` with its ``chromedriver`` (``.ci/run`` installs both);
both paths are given to Selenium explicitly, so Selenium Manager never runs and nothing is
downloaded. Without them the browser tests skip, saying so.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path(os.environ.get("RILL_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("RILL_TEST_CHROMEDRIVER", "/usr/bin/chromedriver"))

# Without the background-networking flags Chromium waits on update and sync services that
# a closed network never answers.
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
    "--autoplay-policy=no-user-gesture-required",
)

WAIT_S = 60.0
"""Bound of every wait on the page (generous: the machine may be loaded; waits end early)."""


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    for path, _package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (path.is_file() and os.access(path, os.X_OK)):
            return (
                f"browser tests skipped: {path} not found (install Debian's chromium and chromium-driver: "
                f"apt-get install -y chromium chromium-driver; .ci/run does this)"
            )
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "browser tests skipped: selenium is not installed (pip install -e '.[test]')"
    return None


@contextlib.contextmanager
def launch_browser(profile: Path, extra_flags: tuple[str, ...] = ()) -> Iterator[Any]:
    """A headless Chromium session on the profile folder ``profile`` (removed afterwards), with
    ``extra_flags`` after the usual ones (skips when no browser is installed)."""
    reason = browser_missing()
    if reason is not None:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, *extra_flags):
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A headless Chromium session with a fresh profile (skips when no browser is installed)."""
    with launch_browser(tmp_path_factory.mktemp("chromium-profile")) as driver:
        yield driver


@pytest.fixture
def wait_for(browser: Any) -> Callable[..., Any]:
    """``wait_for(condition, what)``: poll ``condition(driver)`` until truthy (bounded by ``WAIT_S``)."""
    from selenium.webdriver.support.ui import WebDriverWait

    def wait(condition: Callable[[Any], Any], what: str, timeout_s: float = WAIT_S) -> Any:
        return WebDriverWait(browser, timeout_s, poll_frequency=0.02).until(condition, message=f"waiting for {what}")

    return wait


class StepMeter:
    """How many engine steps may run: a number the test grants, or unlimited.

    While the budget is zero the engine loop still applies commands (pause, modify, stop)
    but produces nothing, so a reply cannot end, and no token can arrive, until the test
    says so: the browser tests gate on this instead of hoping a stream outlasts them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._budget: int | None = 0
        self._granted = threading.Event()

    def allow(self, num_steps: int) -> None:
        """Let ``num_steps`` more steps run."""
        with self._lock:
            if self._budget is not None:
                self._budget += num_steps
        self._granted.set()

    def nudge(self) -> bool:
        """Let one step run unless one is already allowed (at most one pending: waits that
        nudge on every poll cannot pile steps up). Returns False, for wait conditions."""
        with self._lock:
            if self._budget == 0:
                self._budget = 1
        self._granted.set()
        return False

    def unlimited(self) -> None:
        """Let the engine run freely."""
        with self._lock:
            self._budget = None
        self._granted.set()

    def hold(self) -> None:
        """Run no further step until ``allow`` or ``unlimited``."""
        with self._lock:
            self._budget = 0

    def take(self) -> bool:
        """One step may run now (called by the engine thread)."""
        with self._lock:
            if self._budget is None:
                return True
            if self._budget > 0:
                self._budget -= 1
                return True
            self._granted.clear()
        self._granted.wait(0.005)  # like LiveServer.hold_engine: commands keep being applied
        return False


@contextlib.contextmanager
def metered_engine(live: Any) -> Iterator[StepMeter]:
    """Run the server's engine only as far as the returned ``StepMeter`` allows (zero at first)."""
    core = live.client.engine.core
    step = type(core).step
    meter = StepMeter()

    def metered_step() -> list:
        return step(core) if meter.take() else []

    core.step = metered_step
    try:
        yield meter
    finally:
        del core.step  # the class's method again
        meter.unlimited()
