"""Routes of the browser playground: the page, its static files and the chat-template helper.

* ``GET /``: the page (``static/index.html``);
* ``GET /favicon.ico``: its icon (``static/favicon.svg``, an SVG whatever the name: browsers
  and tools ask for this path when a page names no icon);
* ``GET /playground/static/<file>``: its script, style sheet, icon and the vendored Markdown
  renderer and sanitizer (``static/vendor/``) (no API key needed for any of these: they hold
  no data; ``rill.middleware.PAGE_PATHS``, ``PAGE_PREFIX``);
* ``POST /playground/prompt``: ``{"messages": [{"role", "content"}, ...]}`` →
  ``{"prompt": "..."}``, the model's chat template applied to the turns, so the page's chat
  view can send a conversation over ``/generate`` (which takes a prompt string). Errors use
  the OpenAI error JSON of the HTTP API.

The page gets a strict Content-Security-Policy: scripts, styles and connections from this
origin only, so even a slip in the page's escaping could not run injected script.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from rill.deps import Deps
from rill.errors import InvalidRequest, RillError
from rill.protocols.openai_http import codec as http_codec

STATIC_DIR = Path(__file__).parent / "static"
"""The page's files, shipped as package data."""

MAX_TURNS = 1024
"""Most messages ``/playground/prompt`` renders in one call."""

MAX_TURN_CHARS = 1_000_000
"""Longest message content accepted (the body size limit usually binds first)."""

PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "media-src 'self' blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
"""Headers of the page itself."""


class Turn(msgspec.Struct, forbid_unknown_fields=True):
    """One chat message of ``POST /playground/prompt``."""

    role: str
    content: Annotated[str, Meta(max_length=MAX_TURN_CHARS)]


class PromptRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Body of ``POST /playground/prompt``."""

    messages: Annotated[list[Turn], Meta(min_length=1, max_length=MAX_TURNS)]


class PromptResponse(msgspec.Struct):
    """Answer of ``POST /playground/prompt``: the text to send as ``config.prompt``."""

    prompt: str


_decoder = msgspec.json.Decoder(PromptRequest)


def decode_prompt_request(body: bytes) -> PromptRequest:
    """The typed body, or ``InvalidRequest`` naming what is wrong."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid body: {exc}", field="messages") from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest("the body is not valid JSON", field=None) from exc


async def page(request: Request) -> Response:
    """``GET /``: the playground page."""
    return FileResponse(STATIC_DIR / "index.html", media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)


async def favicon(request: Request) -> Response:
    """``GET /favicon.ico``: the page's icon."""
    return FileResponse(
        STATIC_DIR / "favicon.svg", media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"}
    )


def _error(exc: BaseException) -> Response:
    wire = http_codec.error_for(exc)
    return Response(wire.body, status_code=wire.status, headers=wire.headers, media_type="application/json")


def prompt_endpoint(deps: Deps) -> Any:
    """``POST /playground/prompt`` bound to the server's engine client."""

    async def prompt(request: Request) -> Response:
        try:
            body = decode_prompt_request(await request.body())
            messages = [{"role": turn.role, "content": turn.content} for turn in body.messages]
            text = await deps.client.render_chat(messages)
        except RillError as exc:
            return _error(exc)
        return Response(msgspec.json.encode(PromptResponse(prompt=text)), media_type="application/json")

    return prompt


def routes(deps: Deps) -> list[BaseRoute]:
    """The playground's routes for the server's Starlette app."""
    return [
        Route("/", page, methods=["GET"]),
        Route("/favicon.ico", favicon, methods=["GET"]),
        Route("/playground/prompt", prompt_endpoint(deps), methods=["POST"]),
        Mount("/playground/static", StaticFiles(directory=STATIC_DIR), name="playground_static"),
    ]
