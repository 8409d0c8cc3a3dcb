"""Host and Origin checks on a real ``rill serve`` (issue 12 item 9): a web page elsewhere, or
a DNS-rebinding name pointed at loopback, cannot drive the server; curl-like clients can."""

from __future__ import annotations

import httpx
import pytest
import websockets

from tests.conftest import LiveServer


@pytest.mark.parametrize("path", ["/ws/chat", "/generate", "/ws", "/evergreen"])
async def test_websockets_from_a_foreign_page_or_name_are_refused(server: LiveServer, path: str) -> None:
    for url, headers in (
        (f"{server.ws_url}{path}", {"Origin": "http://evil.example"}),
        (f"ws://evil.example:{server.port}{path}", None),
    ):
        with pytest.raises(websockets.exceptions.InvalidStatus) as refused:
            async with websockets.connect(url, additional_headers=headers, host="127.0.0.1", port=server.port):
                pass
        assert refused.value.response.status_code == 403
        assert b'"code":"forbidden"' in refused.value.response.body


async def test_text_plain_post_through_a_foreign_host_is_refused(server: LiveServer) -> None:
    body = b'{"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}'
    async with httpx.AsyncClient(base_url=server.url) as http:
        rebinding = await http.post(
            "/v1/chat/completions",
            content=body,
            headers={"Host": f"evil.example:{server.port}", "Content-Type": "text/plain"},
        )
        assert rebinding.status_code == 403 and rebinding.json()["error"]["code"] == "forbidden"
        cross_site = await http.post(
            "/v1/generate", content=body, headers={"Origin": "http://evil.example", "Content-Type": "text/plain"}
        )
        assert cross_site.status_code == 403
        models = await http.get("/v1/models", headers={"Origin": server.url})  # same origin: a page rill serves
        assert models.status_code == 200
