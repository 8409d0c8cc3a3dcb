"""A scripted ``EngineClient`` and an in-process uvicorn server for the OpenAI API tests.

``FakeClient`` produces token ``i`` of a request as text ``" w{i}"`` (id ``100 + i``, shifted
by the seed) one per loop turn, so tests depend on event order, never on wall-clock time.
``hold`` (an ``asyncio.Event``) stands for a long prefill: while it is clear no request gets
its first token. The word ``FAIL`` in a prompt makes the request fail after two tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, AsyncIterator

from starlette.applications import Starlette

from rill import config as config_mod
from rill import middleware
from rill.errors import ContextLengthExceeded, GenerationError, InvalidRequest, ModelNotReady, QueueFull
from rill.frontend.stream import RequestStream
from rill.protocols.openai_http import adapter
from rill import observability
from rill.server import make_deps
from rill.types import EngineStats, GenerateRequest, ModelInfo, RequestEvent, RequestOutput, TokenLogprob, TopLogprob, Usage
from tests.helpers import serving

MAX_CONTEXT = 64
FAIL_ID = 7
KV_BYTES_PER_REQUEST = 4096


class FakeClient:
    """Scripted engine client (see the module docstring)."""

    load_error: BaseException | None = None  # EngineClient: set when the model failed to load

    def __init__(self, is_ready: bool = True, has_chat_template: bool = True) -> None:
        self.model_info: ModelInfo | None = ModelInfo(
            name="fake-model", architecture="FakeForCausalLM", max_context_tokens=MAX_CONTEXT, vocab_size=1000,
            dtype="float32", device="cpu", has_chat_template=has_chat_template)
        self.ready = is_ready
        self.has_template = has_chat_template
        self.hold = asyncio.Event()
        self.hold.set()
        self.max_live: int | None = None  # QueueFull beyond this many live requests
        self.live: dict[str, asyncio.Event] = {}  # request id -> abort flag
        self.idle = asyncio.Event()
        self.idle.set()
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.sink: Any = None

    # -- EngineClient -----------------------------------------------------------------
    def set_metrics_sink(self, sink: Any) -> None:
        self.sink = sink

    def is_ready(self) -> bool:
        return self.ready

    def load_progress(self) -> tuple[float, float | None]:
        return (40.0, 3.0)

    async def wait_ready(self) -> None:
        return None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [FAIL_ID if word == "FAIL" else 10 + sum(map(ord, word)) % 900 for word in text.split()]
        return ([1] if add_special_tokens else []) + ids

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f"<{t}>" for t in token_ids)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if not self.has_template:
            raise InvalidRequest("the model has no chat template")
        text = "<s> " + " ".join(f"{m['role']}: {m.get('content') or ''}" for m in messages)
        return text + (" assistant:" if add_generation_prompt else "")

    async def tokenize(self, prompts: list[Any]) -> list[list[int]]:
        out = []
        for p in prompts:
            if isinstance(p, (str, list)):
                out.append(self.encode(p) if isinstance(p, str) else list(p))
            elif p.prompt_token_ids is not None:
                out.append(list(p.prompt_token_ids))
            elif p.messages is not None:
                messages = [{"role": m.role, "content": m.content} for m in p.messages]
                text = self.render_chat(messages, p.add_generation_prompt, **p.chat_template_kwargs)
                out.append(self.encode(text, add_special_tokens=False))
            else:
                out.append(self.encode(p.prompt or ""))
        return out

    async def generate(self, request: GenerateRequest) -> RequestStream:
        if not self.ready:
            raise ModelNotReady()
        ids = request.prompt_token_ids if request.prompt_token_ids is not None else self.encode(request.prompt or "")
        if len(ids) >= MAX_CONTEXT:
            raise ContextLengthExceeded(len(ids), MAX_CONTEXT)
        if self.max_live is not None and len(self.live) >= self.max_live:
            raise QueueFull(retry_after_s=2.5)
        request_id = request.request_id or uuid.uuid4().hex
        self.requests.append(request)
        stream = RequestStream(self, request_id, list(ids), request.sampling)
        self.live[request_id] = asyncio.Event()
        self.idle.clear()
        asyncio.get_running_loop().create_task(self._produce(request_id, stream, request, list(ids)))
        return stream

    def abort(self, request_id: str) -> None:
        if request_id in self.live:
            self.aborted.append(request_id)
            self.live[request_id].set()

    def pause(self, request_id: str) -> None: ...
    def resume(self, request_id: str) -> None: ...
    def regenerate(self, request_id: str) -> None: ...

    def modify(self, request_id: str, patch: dict[str, Any]) -> Any:
        raise NotImplementedError

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.live), kv_capacity_bytes=1 << 20,
                           kv_used_bytes=KV_BYTES_PER_REQUEST * len(self.live))

    async def shutdown(self) -> None:
        for flag in self.live.values():
            flag.set()

    # -- the script -------------------------------------------------------------------
    async def _produce(self, request_id: str, stream: RequestStream, request: GenerateRequest, ids: list[int]) -> None:
        aborted = self.live[request_id]
        arrival = time.monotonic()
        sampling = request.sampling
        stream.put(RequestOutput(request_id=request_id, events=[RequestEvent.QUEUED]))
        finish, text_so_far, n = "cancelled", "", 0
        await _first(self.hold.wait(), aborted.wait())
        first_token_time = time.monotonic()
        while not aborted.is_set():
            await asyncio.sleep(0)  # one "engine step" per loop turn
            if aborted.is_set():
                break
            token_id = 100 + n + (sampling.seed or 0) % 50
            text = f" w{n}"
            n += 1
            usage = Usage(prompt_tokens=len(ids), completion_tokens=n)
            logprobs = None
            if sampling.logprobs is not None:
                top = [TopLogprob(token_id + 1, -1.5), TopLogprob(token_id + 2, -2.5)][: sampling.logprobs]
                logprobs = [TokenLogprob(token_id=token_id, logprob=-0.25, top=top)]
            out = RequestOutput(request_id=request_id, text=text, token_ids=[token_id], token_texts=[text],
                                logprobs=logprobs, usage=usage, arrival_time=arrival, first_token_time=first_token_time)
            hit = next((s for s in sampling.stop if s in text_so_far + text), None)
            if hit is not None:
                out.text = (text_so_far + text).split(hit, 1)[0][len(text_so_far):]
                finish, out.stop_reason = "stop", hit
            elif FAIL_ID in ids and n == 3:
                finish, out.text, out.error = "error", "", GenerationError("the fake engine failed")
            elif n >= sampling.max_tokens:
                finish = "length"
            text_so_far += out.text
            if finish != "cancelled":
                out.finished, out.finish_reason = True, finish  # type: ignore[assignment]
                stream.put(out)
                break
            stream.put(out)
        if finish == "cancelled":
            stream.put(RequestOutput(request_id=request_id, finished=True, finish_reason="cancelled",
                                     usage=Usage(prompt_tokens=len(ids), completion_tokens=n)))
        del self.live[request_id]
        if not self.live:
            self.idle.set()
        if self.sink is not None:
            self.sink.observe_request(protocol=request.protocol, finish_reason=finish, queue_s=0.001,
                                      ttft_s=first_token_time - arrival, inter_token_s=[0.001] * max(0, n - 1),
                                      e2e_s=time.monotonic() - arrival, num_prompt_tokens=len(ids),
                                      num_generated_tokens=n)


async def _first(*aws: Any) -> None:
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def make_config(**overrides: Any) -> Any:
    """A server config for tests (no socket, no gRPC), with ``area.field`` overrides."""
    args = {"uds.no_socket": True, "evergreen.grpc_port": 0, "http.log_level": "warning"}
    args.update(overrides)
    return config_mod.load(args, env={})


@contextlib.asynccontextmanager
async def live_app(client: Any, **overrides: Any) -> AsyncIterator[str]:
    """This API, /health and the middleware on a loopback port; yields the base URL.

    Only this protocol's routes are mounted, so other protocols' work in progress cannot
    break these tests (the end-to-end tests use the whole server).
    """
    deps = make_deps(make_config(**overrides), client)
    inner = Starlette(routes=[*observability.routes(deps), *adapter.routes(deps)])
    inner.state.deps = deps
    app = middleware.wrap(inner, deps, render_error=adapter.http_error)
    async with serving(app) as port:
        yield f"http://127.0.0.1:{port}"
