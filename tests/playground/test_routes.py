"""``rill.playground.routes``: the page, its static files and ``POST /playground/prompt``
on a real server (no browser needed)."""

from __future__ import annotations

import hashlib
import re

import httpx
import pytest

from rill.errors import InvalidRequest
from rill.middleware import PAGE_PATHS
from rill.playground import routes
from tests.conftest import LiveServer


def test_page_and_static_files_are_served_with_a_strict_policy(server: LiveServer) -> None:
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "connect-src 'self'" in policy and "default-src 'none'" in policy
    assert "unsafe-inline" not in policy
    assert '<div id="app"' in page.text
    for name, kind in (("playground.js", "javascript"), ("playground.css", "text/css")):
        asset = httpx.get(f"{server.url}/playground/static/{name}")
        assert asset.status_code == 200 and kind in asset.headers["content-type"]
    assert httpx.get(server.url + "/playground/static/../routes.py").status_code == 404
    assert httpx.get(server.url + "/playground/static/nope.js").status_code == 404


def test_script_never_writes_html() -> None:
    # Model output must never be parsed as markup: the page builds every node with textContent.
    script = (routes.STATIC_DIR / "playground.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script, sink


def test_prompt_applies_the_chat_template(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    answer = httpx.post(server.url + "/playground/prompt", json={"messages": messages})
    assert answer.status_code == 200
    expected = server.client.engine.tokenizer.apply_chat_template(messages)
    assert answer.json() == {"prompt": expected}
    assert "hello there" in expected


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages"),
        ({"turns": []}, "messages"),
    ],
)
def test_bad_prompt_bodies_get_a_400_naming_the_field(server: LiveServer, body: dict, field: str) -> None:
    answer = httpx.post(server.url + "/playground/prompt", json=body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "invalid_request" and error["param"] == field and error["message"]


def test_prompt_body_that_is_not_json() -> None:
    with pytest.raises(InvalidRequest) as refused:
        routes.decode_prompt_request(b"{nope")
    assert "not valid JSON" in refused.value.message


def test_icon_is_served_without_a_404(server: LiveServer) -> None:
    for path in ("/favicon.ico", "/playground/static/favicon.svg"):
        icon = httpx.get(server.url + path)
        assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
        assert icon.text.startswith("<svg")
    assert "/favicon.ico" in PAGE_PATHS  # no key needed, like the page


def test_vendored_libraries_are_the_recorded_files(server: LiveServer) -> None:
    # Each vendored file is served, and is byte for byte the one the README's table records.
    vendor = routes.STATIC_DIR / "vendor"
    table = dict(
        re.findall(r"^\| `([\w.]+\.js)` \|.*\| `([0-9a-f]{64})` \|$", (vendor / "README.md").read_text(), re.M)
    )
    assert sorted(table) == sorted(p.name for p in vendor.glob("*.js")) == ["marked.umd.js", "purify.min.js"]
    for name, digest in table.items():
        assert hashlib.sha256((vendor / name).read_bytes()).hexdigest() == digest, name
        served = httpx.get(f"{server.url}/playground/static/vendor/{name}")
        assert served.status_code == 200 and "javascript" in served.headers["content-type"]
    licenses = {p.name for p in vendor.iterdir()}
    assert {"marked.LICENSE", "dompurify.LICENSE", "dompurify.LICENSE-MPL"} <= licenses
