"""OpenAI-compatible HTTP driver: streaming ``POST /v1/completions`` (or chat) over SSE.

Works against rill and against peers (llama.cpp's ``llama-server``, the transformers floor
server in ``benchmarks/``): only standard fields plus ``ignore_eos`` (which rill, vLLM and
llama-server all accept). ``stream_options.include_usage`` asks for the final usage chunk,
whose ``completion_tokens`` is the token count; without one, token-bearing chunks are counted.

The client is aiohttp: on one core shared with the server under test, httpx's streaming
path took 91-102 us of CPU per SSE event against aiohttp's 32-35 us (32 streams of the 100M
model): at 32 streams that is ~3 ms of every ~20 ms engine step taken from the server on a
2-core machine, which the measurement would then charge to the server. Every request
opens its own connection, so its time to first token includes a loopback connect.
"""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp

from rill.bench.drivers import BenchError, Options, Target, Timer
from rill.bench.stats import RequestRecord
from rill.bench.workload import BenchRequest

SERVER_PROTOCOL = "openai_http"


class Driver:
    """One ``aiohttp.ClientSession`` (a new connection per request); one streaming request per ``run``."""

    name = "openai"

    def __init__(self, target: Target, options: Options) -> None:
        self.target = target
        self.options = options
        self.model = target.model
        self._http: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        """Create the client session and find the model name (``GET /v1/models``) if not given."""
        headers = {"Authorization": f"Bearer {self.target.api_key}"} if self.target.api_key else {}
        # No pool limit: the runner bounds concurrency; a pool cap would queue requests
        # inside the client and hide that time from TTFT. A connection per request: servers
        # that close a streamed response's connection (llama-server) would otherwise fail
        # the next request that picks it from the pool ("Server disconnected"). No client
        # timeout: the runner has one.
        self._http = aiohttp.ClientSession(
            base_url=self.target.http_url,
            headers=headers,
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None),
        )
        if self.model is None:
            try:
                async with self._http.get("/v1/models") as response:
                    data = (await response.json(content_type=None)).get("data") or []
                self.model = data[0]["id"] if data else "default"
            except (aiohttp.ClientError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise BenchError("connect_error", f"GET {self.target.http_url}/v1/models failed: {exc}") from exc

    async def close(self) -> None:
        """Close the client session."""
        if self._http is not None:
            await self._http.close()

    def _body(self, request: BenchRequest) -> tuple[str, dict[str, Any]]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "stream": True,
            "temperature": self.options.temperature,
            "stream_options": {"include_usage": True},
        }
        if self.options.ignore_eos:
            body["ignore_eos"] = True
        if self.options.openai_endpoint == "chat":
            body["messages"] = [{"role": "user", "content": request.prompt}]
            return "/v1/chat/completions", body
        body["prompt"] = request.prompt
        return "/v1/completions", body

    async def run(self, request: BenchRequest, timer: Timer) -> RequestRecord:
        """Stream one completion; tokens are counted per content-bearing chunk."""
        assert self._http is not None, "open() first"
        path, body = self._body(request)
        usage: dict[str, Any] | None = None
        try:
            async with self._http.post(path, json=body) as response:
                if response.status != 200:
                    raise BenchError(f"http_{response.status}", (await response.read()).decode("utf-8", "replace"))
                usage = await self._read_events(response, timer)
        except aiohttp.ClientConnectorError as exc:
            raise BenchError("connect_error", str(exc)) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
            raise BenchError("disconnected", str(exc) or type(exc).__name__) from exc
        if usage is not None:
            return timer.done(usage.get("completion_tokens"), usage.get("prompt_tokens"))
        return timer.done()

    @staticmethod
    async def _read_events(response: aiohttp.ClientResponse, timer: Timer) -> dict[str, Any] | None:
        """Read SSE ``data:`` lines up to ``[DONE]``; return the usage chunk's usage, if any.

        Lines end with CRLF, LF or CR (the SSE grammar allows each); a last line without an
        end is still read when the stream closes.
        """
        usage: dict[str, Any] | None = None
        pending = b""
        async for piece in response.content.iter_any():
            pending += piece
            # A CR at the very end may be the first half of a CRLF: keep it for the next piece.
            cut = len(pending) - 1 if pending.endswith(b"\r") else len(pending)
            *lines, rest = _LINE_END.split(pending[:cut])
            pending = rest + pending[cut:]
            for line in lines:
                done, usage = _take_line(line, usage, timer)
                if done:
                    return usage
        for line in _LINE_END.split(pending):
            done, usage = _take_line(line, usage, timer)
            if done:
                break
        return usage


_LINE_END = re.compile(rb"\r\n|\r|\n")


def _take_line(line: bytes, usage: dict[str, Any] | None, timer: Timer) -> tuple[bool, dict[str, Any] | None]:
    """Apply one SSE line: (whether it was ``[DONE]``, the usage seen so far)."""
    if not line.startswith(b"data:"):
        return False, usage  # SSE comments (keep-alives), event names, blank separators
    data = line[5:].strip()
    if data == b"[DONE]":
        return True, usage
    chunk = json.loads(data)
    if "error" in chunk:
        error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
        raise BenchError(str(error.get("code") or error.get("type") or "stream_error"), str(error.get("message", "")))
    if chunk.get("usage"):
        usage = chunk["usage"]
    for choice in chunk.get("choices") or ():
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            timer.tokens()
    return False, usage
