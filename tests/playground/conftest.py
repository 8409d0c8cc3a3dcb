"""Fixtures of the playground tests: a headless Chromium driven by Selenium.

The browser is Debian's ``chromium`` with its ``chromedriver`` (``.ci/run`` installs both);
both paths are given to Selenium explicitly, so Selenium Manager never runs and nothing is
downloaded. Without them the browser tests skip, saying so.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path(os.environ.get("RILL_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMEDRIVER = Path(os.environ.get("RILL_TEST_CHROMEDRIVER", "/usr/bin/chromedriver"))

# Without the background-networking flags Chromium waits on update and sync services that
# a closed network never answers.
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,900", "--autoplay-policy=no-user-gesture-required",
)

WAIT_S = 60.0
"""Bound of every wait on the page (generous: the machine may be loaded; waits end early)."""


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not (path.is_file() and os.access(path, os.X_OK)):
            return (f"browser tests skipped: {path} not found (install Debian's chromium and chromium-driver: "
                    f"apt-get install -y chromium chromium-driver; .ci/run does this)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "browser tests skipped: selenium is not installed (pip install -e '.[test]')"
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A headless Chromium session with a fresh profile (skips when no browser is installed)."""
    reason = browser_missing()
    if reason is not None:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path_factory.mktemp("chromium-profile")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def wait_for(browser: Any) -> Callable[..., Any]:
    """``wait_for(condition, what)``: poll ``condition(driver)`` until truthy (bounded by ``WAIT_S``)."""
    from selenium.webdriver.support.ui import WebDriverWait

    def wait(condition: Callable[[Any], Any], what: str, timeout_s: float = WAIT_S) -> Any:
        return WebDriverWait(browser, timeout_s, poll_frequency=0.02).until(condition, message=f"waiting for {what}")

    return wait
