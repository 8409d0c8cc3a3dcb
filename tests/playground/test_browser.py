"""The playground in a real browser (headless Chromium) against a real ``rill serve``.

Every wait polls the page's data attributes (``#app[data-state]``, ``data-tokens``...) with a
bound; gates come from the server (``LiveServer.hold_engine``) and long streams
(``ignore_eos`` with a large ``max_tokens``), never from sleeps that hope for an order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rill.feedback import FeedbackStore
from tests.conftest import LiveServer, start_server
from tests.playground.conftest import browser_missing

pytestmark = pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or "")

LONG_MAX_TOKENS = 2000
"""Longer than any test keeps a reply running (the model's context is 2048)."""

SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "playground.png"


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server of its own (feedback goes to a fresh data dir; long replies fit its context)."""
    data_dir = tmp_path_factory.mktemp("playground-data")
    server = start_server(tiny_model_dir, **{"engine.max_model_len": 2048, "http.data_dir": str(data_dir)})
    yield server
    server.stop()


# ---------------------------------------------------------------------------- page helpers
def data(driver: Any, name: str) -> str:
    """``#app``'s ``data-<name>`` attribute."""
    return driver.find_element("id", "app").get_attribute(f"data-{name}") or ""


def num_tokens(driver: Any) -> int:
    """Tokens shown in the current reply."""
    return int(data(driver, "tokens") or 0)


def click(driver: Any, element_id: str) -> None:
    """Click a control by id."""
    driver.find_element("id", element_id).click()


def set_field(driver: Any, element_id: str, value: str) -> None:
    """Type ``value`` into a field as a user would, then leave it (fires ``change``)."""
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element("id", element_id)
    field.click()
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.DELETE)
    field.send_keys(value, Keys.TAB)


def open_page(driver: Any, server: LiveServer, wait_for: Callable[..., Any]) -> None:
    """Load the playground afresh and wait for its script to start."""
    driver.get(server.url + "/")
    wait_for(lambda d: data(d, "ready") == "true", "the page script")


def send(driver: Any, text: str, *, mode: str = "raw", max_tokens: int = LONG_MAX_TOKENS,
         ignore_eos: bool = True) -> None:
    """Type a message and send it, with settings for a long reply."""
    click(driver, f"mode-{mode}")
    driver.execute_script("document.getElementById('p-max_tokens').value = arguments[0];", str(max_tokens))
    checkbox = driver.find_element("id", "p-ignore_eos")
    if checkbox.is_selected() != ignore_eos:
        checkbox.click()
    driver.find_element("id", "prompt").send_keys(text)
    click(driver, "btn-send")


def wait_state(wait_for: Callable[..., Any], state: str) -> None:
    """Wait until the page reports ``state``."""
    wait_for(lambda d: data(d, "state") == state, f"state {state!r}")


def wait_tokens(wait_for: Callable[..., Any], at_least: int) -> None:
    """Wait until the current reply shows at least ``at_least`` tokens."""
    wait_for(lambda d: num_tokens(d) >= at_least, f"{at_least} tokens")


def pause_for_sure(driver: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    """Pause the running reply while the engine is held, so it cannot end first."""
    with live.hold_engine():
        click(driver, "btn-pause")
        wait_for(lambda d: live.stats().num_paused == 1, "the engine to pause the request")
    wait_state(wait_for, "paused")


def stop_and_settle(driver: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    """Stop the reply and wait until the page and the engine are idle."""
    click(driver, "btn-stop")
    wait_state(wait_for, "done")
    live.wait_idle()


# ---------------------------------------------------------------------------- tests
def test_page_streams_a_reply(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    open_page(browser, live, wait_for)
    assert browser.title == "rill playground"
    send(browser, "Once upon a time")
    wait_tokens(wait_for, 5)
    assert data(browser, "generation") == "1"
    assert browser.find_element("id", "model-name").text.startswith("model: ")
    reply = browser.find_elements("css selector", ".turn.reply .tok")
    assert len(reply) >= 5 and all(span.get_attribute("title").startswith("p=") for span in reply[:5])
    stop_and_settle(browser, live, wait_for)
    assert data(browser, "finish-reason") == "cancelled"


def test_pause_modify_resume_stop(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    open_page(browser, live, wait_for)
    send(browser, "The river")
    wait_tokens(wait_for, 3)
    pause_for_sure(browser, live, wait_for)
    # Paused: no token arrives for a second (the engine holds the request, the page shows none).
    paused_at = num_tokens(browser)
    time.sleep(1.0)
    assert num_tokens(browser) == paused_at
    assert live.stats().num_paused == 1

    # Temperature changed mid-reply: modify goes out, the server's ack places the mark.
    set_field(browser, "p-temperature", "1.7")
    wait_for(lambda d: data(d, "modify-marks") == "1", "the modify ack")
    mark = browser.find_element("css selector", ".turn.reply .mark")
    assert int(mark.get_attribute("data-at-token")) == paused_at
    assert "temperature=1.7" in mark.text

    click(browser, "btn-resume")
    wait_state(wait_for, "generating")
    wait_tokens(wait_for, paused_at + 3)
    # The mark sits right before the first token produced with the new temperature.
    following = browser.execute_script(
        "const m = document.querySelector('.turn.reply .mark');"
        "return m.nextElementSibling && m.nextElementSibling.classList.contains('tok');")
    assert following is True

    # A change while tokens flow is acknowledged and marked too.
    set_field(browser, "p-top_k", "40")
    wait_for(lambda d: data(d, "modify-marks") == "2", "the second modify ack")
    stop_and_settle(browser, live, wait_for)
    assert data(browser, "finish-reason") == "cancelled"


def test_regenerate_and_rate(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    open_page(browser, live, wait_for)
    send(browser, "A story about a fox")
    wait_tokens(wait_for, 3)
    pause_for_sure(browser, live, wait_for)
    click(browser, "btn-regenerate")  # while a reply runs: control regenerate
    wait_for(lambda d: data(d, "generation") == "2", "the regenerated init")
    wait_tokens(wait_for, 2)
    stop_and_settle(browser, live, wait_for)

    click(browser, "btn-regenerate")  # after it ended: the same prompt again
    wait_for(lambda d: data(d, "generation") == "3", "a new generation")
    wait_tokens(wait_for, 2)
    stop_and_settle(browser, live, wait_for)

    browser.find_element("id", "feedback-text").send_keys("lovely <b>fox</b>")
    click(browser, "btn-up")
    wait_for(lambda d: data(d, "feedback-id") != "", "the feedback ack")
    feedback_id = int(data(browser, "feedback-id"))
    store = FeedbackStore(live.config.http.data_dir)
    try:
        record = next(r for r in store.records() if r["id"] == feedback_id)
    finally:
        store.close()
    assert record["rating"] == 1.0 and record["text"] == "lovely <b>fox</b>"
    assert record["prompt"] == "A story about a fox" and record["generated_text"]


def test_injected_markup_stays_text(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    open_page(browser, live, wait_for)
    attack = "<script>window.pwned = 1</script><img src=x onerror=\"window.pwned = 2\">"
    send(browser, attack, max_tokens=3, ignore_eos=True)
    wait_state(wait_for, "done")
    prompt_turn = browser.find_element("css selector", ".turn.user .text")
    assert prompt_turn.text == attack
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.find_elements("css selector", ".conversation script, .conversation img") == []
