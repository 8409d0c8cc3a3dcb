"""Starlette routes of the OpenAI-compatible API and their engine I/O.

Routes: ``GET /v1/models`` (and ``/v1/models/{model}``), ``POST /v1/completions``,
``POST /v1/chat/completions``, ``POST /v1/embeddings`` (the embedding model's, when the server
has one: ``rill.frontend.embeddings``), OpenAI's audio routes (``audio_api.py``: transcriptions,
translations, speech), ``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes).

One request, start to end:

1. read the body; ``codec`` parses it, checks the model name (503 while loading) and maps
   it to the prompts and the parameters of its choices;
2. one ``client.submit``: the frontend's policy tokenizes the prompts (chat template and
   tokenizer off the event loop, prompt size bounded), fits ``max_tokens`` to what remains
   of the context and the server's cap, validates the parameters once, builds the tools'
   argument validators off the loop, and starts one engine request per choice. If any
   choice is refused (queue full, ...) the others are cancelled and the client gets the
   error with its status (its field named as sent: ``codec.renamed``), before any byte of a
   200 is sent;
4. a ``Responder`` (``responder.py``) writes the SSE stream or the JSON body, while a watcher
   task waits for the ASGI ``http.disconnect`` message: a client that goes away closes every
   ``RequestStream`` at once, which aborts its requests in the engine (their KV is freed in
   the next step) — not only at the next failed write.

Protocol decisions live in ``codec`` and ``session``; this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from rill import auth
from rill.deps import Deps
from rill.errors import RillError
from rill.frontend.admission import Prompt
from rill.frontend.client import Submission
from rill.frontend.embeddings import EmbeddingModelInfo, EmbeddingSubmission
from rill.frontend.stream import RequestStream
from rill.protocols.openai_http import codec, embeddings, tools
from rill.protocols.openai_http.audio_api import AudioApi
from rill.protocols.openai_http.messages import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from rill.protocols.openai_http.responder import (
    JSON_MEDIA_TYPE,
    Responder,
    close_all,
    count_rejection,
    error_response,
)
from rill.protocols.openai_http.responses_api import ResponsesApi
from rill.protocols.openai_http.session import EchoPrompt, Kind, ResponseSession
from rill.types import GenerateRequest

log = logging.getLogger("rill.openai_http")

_INLINE_FLOATS = 32768
"""Embedding answers with more floats than this are encoded in a worker thread (about 2 ms inline)."""


def routes(deps: Deps) -> list[BaseRoute]:
    """The API's routes on the shared HTTP port (mounted by ``rill.server.build_app``)."""
    api = OpenAIApi(deps)
    responses = ResponsesApi(api)
    deps.stoppers.append(responses.aclose)
    deps.stoppers.append(api.audio.aclose)
    return [
        *responses.routes(),
        *api.audio.routes(),
        Route("/v1/models", api.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", api.get_model, methods=["GET"]),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/embeddings", api.embeddings, methods=["POST"]),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
    ]


def http_error(exc: BaseException) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and OpenAI error JSON for ``exc``: the server's format for refusals made
    before any route runs (``rill.middleware``: keys, sizes, unknown paths)."""
    wire = codec.error_for(exc)
    return wire.status, wire.headers, wire.body


class OpenAIApi:
    """Endpoint handlers bound to one server's ``Deps``."""

    def __init__(self, deps: Deps) -> None:
        self.deps = deps
        self.client = deps.client
        self.created = int(time.time())
        self.token_text = _token_texts(self.client)
        self.audio = AudioApi(deps)

    # -- models ------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        """``GET /v1/models``: the served model, and the embedding model once it has loaded."""
        try:
            cards = [self._card(self._served())]
        except RillError as exc:
            return error_response(exc)
        embedder = self._embedding_model()
        if embedder is not None:
            cards.append(self._embedding_card(embedder))
        cards.extend(self.audio.cards(self.created))
        return Response(codec.encode(ModelList(data=cards)), media_type=JSON_MEDIA_TYPE)

    async def get_model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``: the served model or the embedding model, or 404 for any other name."""
        try:
            served = self._served()
            embedder = self._embedding_model()
            if embedder is not None and request.path_params["model"] == embedder.name:
                return Response(codec.encode(self._embedding_card(embedder)), media_type=JSON_MEDIA_TYPE)
            for card in self.audio.cards(self.created):
                if request.path_params["model"] == card.id:
                    return Response(codec.encode(card), media_type=JSON_MEDIA_TYPE)
            codec.check_model(request.path_params["model"], served.name)
        except RillError as exc:
            return error_response(exc)
        return Response(codec.encode(self._card(served)), media_type=JSON_MEDIA_TYPE)

    # -- embeddings ----------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        """``POST /v1/embeddings``: the embedding model's vectors (404 when the server has none)."""
        try:
            service = self.deps.embeddings
            if service is None:
                raise embeddings.no_embedding_model()
            req = embeddings.decode_embeddings(await request.body())
            info = service.require_model()
            codec.check_model(req.model, info.name, route="/v1/embeddings")
            result = await service.embed(
                EmbeddingSubmission(
                    inputs=embeddings.embedding_inputs(req),
                    dimensions=req.dimensions,
                    truncate_to=req.truncate_prompt_tokens,
                    principal=auth.scope_principal(request.scope),
                )
            )
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - answered through the error table
            self._count_rejection(exc)
            return error_response(embeddings.wire_named(exc))
        encode = functools.partial(
            embeddings.encode_embeddings, result.vectors, result.num_prompt_tokens, info.name, req.encoding_format
        )
        # 2,048 vectors of 384 floats are 15 MB of JSON (~0.1 s to write): off the event loop.
        body = await asyncio.to_thread(encode) if result.vectors.size > _INLINE_FLOATS else encode()
        return Response(body, media_type=JSON_MEDIA_TYPE)

    def _embedding_model(self) -> EmbeddingModelInfo | None:
        """The embedding model's facts once it has loaded (None: none, or not yet)."""
        service = self.deps.embeddings
        return service.require_model() if service is not None and service.state().phase == "ready" else None

    def _embedding_card(self, info: EmbeddingModelInfo) -> ModelCard:
        return ModelCard(id=info.name, created=self.created, max_model_len=info.max_input_tokens)

    # -- tokenizer -----------------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` (vLLM's shape): ``{count, max_model_len, tokens}``."""
        try:
            served = self._served()
            req = codec.decode_tokenize(await request.body())
            codec.check_model(req.model, served.name)
            prompt, add_special_tokens = codec.tokenize_prompt(req, served)
            tokens = await self.client.tokenize_prompt(prompt, add_special_tokens)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - answered through the error table
            return error_response(exc)
        return Response(
            codec.encode(TokenizeResponse(count=len(tokens), max_model_len=served.max_context_tokens, tokens=tokens)),
            media_type=JSON_MEDIA_TYPE,
        )

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize`` (vLLM's shape): ``{tokens}`` → ``{prompt}``."""
        try:
            served = self._served()
            req = codec.decode_detokenize(await request.body())
            codec.check_model(req.model, served.name)
            text = await self.client.detokenize(req.tokens or [])
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as exc:  # noqa: BLE001 - answered through the error table
            return error_response(exc)
        return Response(codec.encode(DetokenizeResponse(prompt=text)), media_type=JSON_MEDIA_TYPE)

    # -- generation ----------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._generate(request, Kind.COMPLETION)

    async def chat_completions(self, request: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._generate(request, Kind.CHAT)

    async def _generate(self, request: Request, kind: Kind) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:
            return Response(status_code=499)  # nobody is listening; nothing was started
        response_id = ("chatcmpl-" if kind is Kind.CHAT else "cmpl-") + uuid.uuid4().hex
        streams: list[RequestStream] = []
        try:
            served = self._served()
            req: Any = codec.decode_chat(body) if kind is Kind.CHAT else codec.decode_completion(body)
            codec.check_model(req.model, served.name)
            given = self._prompts(req, kind, served)
            codec.check_choices(req, len(given), served)
            sampling = codec.sampling_params(req, served)
            # A reply written as a bare JSON call is a call when its arguments are valid for the
            # tool's schema: the validators are CPU work, built where grammar compiles run.
            text_calls = tools.text_call_check(req) if kind is Kind.CHAT else None
            submission = Submission(
                prompts=given,
                sampling=sampling,
                num_candidates=codec.candidates_per_prompt(req),
                allow_prefill_only=kind is Kind.COMPLETION,
                request_id=response_id,
                protocol=codec.PROTOCOL,
                principal=auth.scope_principal(request.scope),
                prepare=text_calls.prepare if text_calls is not None else None,
            )
            try:
                streams = await self.client.submit(submission)
            except RillError as exc:
                raise codec.renamed(exc, req) from exc
            echo = await self._echo(req, kind, given, streams)
            return self._responder(kind, req, served.name, response_id, streams, echo, text_calls)
        except Exception as exc:  # noqa: BLE001 - answered through the error table
            await close_all(streams)  # submitted requests must never outlive a failed handler
            self._count_rejection(exc)
            return error_response(exc)
        except BaseException:
            await close_all(streams)
            raise

    async def _echo(
        self, req: Any, kind: Kind, given: list[Any], streams: list[RequestStream]
    ) -> list[EchoPrompt] | None:
        """Completions ``echo``: each prompt as sent (token-id prompts decoded, off the event
        loop: a prompt may be as long as the context) with its token ids (those of the
        prompt's first choice)."""
        if kind is not Kind.COMPLETION or not req.echo:
            return None
        candidates = codec.candidates_per_prompt(req)
        echoed = []
        for index, prompt in enumerate(given):
            ids = streams[index * candidates].prompt_token_ids
            text = prompt if isinstance(prompt, str) else await self.client.detokenize(ids, skip_special_tokens=True)
            echoed.append(EchoPrompt(text=text, token_ids=ids))
        return echoed

    def _responder(
        self,
        kind: Kind,
        req: Any,
        model: str,
        response_id: str,
        streams: list[RequestStream],
        echo: list[EchoPrompt] | None = None,
        text_calls: tools.ArgumentsCheck | None = None,
    ) -> Responder:
        if kind is Kind.CHAT:
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
        session = ResponseSession(
            kind=kind,
            response_id=response_id,
            created=int(time.time()),
            model=model,
            num_choices=len(streams),
            n=req.n or 1,
            logprobs=logprobs,
            token_text=_token_texts(self.client),
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            tool_format=self._tool_format() if kind is Kind.CHAT and tools.parses_tool_calls(req) else None,
            candidates=codec.candidates_per_prompt(req),
            echo=echo,
            prompt_logprobs=req.prompt_logprobs,
            text_calls=text_calls,
        )
        return Responder(
            session, streams, is_streaming=bool(req.stream), keepalive_s=self.deps.config.http.sse_keepalive_s
        )

    def _tool_format(self) -> str | None:
        """The tool-call format to read: ``--tool-call-parser``, or the chat template's (hermes if none)."""
        chosen = self.deps.config.http.tool_call_parser
        if chosen == "none":
            return None  # forced calls (tool_choice required) are written as hermes, returned as text
        if chosen != "auto":
            return chosen
        info = self.client.model_info
        return (info.tool_call_format if info is not None else None) or "hermes"

    def _count_rejection(self, exc: Exception) -> None:
        count_rejection(self.deps.metrics, exc)

    def _prompts(self, req: Any, kind: Kind, served: codec.ServedModel) -> list[Prompt]:
        """The prompts to tokenize: texts and id lists as they came, or the chat as a request
        holding only its messages, template settings and tools."""
        if kind is Kind.CHAT:
            return [
                GenerateRequest(
                    messages=codec.chat_messages(req, served),
                    add_generation_prompt=req.add_generation_prompt is not False,
                    chat_template_kwargs=codec.template_kwargs(req),
                    tools=codec.template_tools(req),
                )
            ]
        # A list of texts and id lists is a list of prompts (lists are invariant to the checker).
        return cast(
            list[Prompt], codec.completion_prompts(req, max_choices=self.deps.config.http.max_choices_per_request)
        )

    def _served(self) -> codec.ServedModel:
        info = self.client.require_model()
        return codec.ServedModel(
            name=info.name,
            max_context_tokens=info.max_context_tokens,
            vocab_size=info.vocab_size,
            has_chat_template=info.has_chat_template,
            max_choices=self.deps.config.http.max_choices_per_request,
            modalities=tuple(info.modalities),
            tool_format=self._tool_format() or "hermes",
        )

    def _card(self, served: codec.ServedModel) -> ModelCard:
        return ModelCard(id=served.name, created=self.created, max_model_len=served.max_context_tokens)


def _token_texts(client: Any) -> Callable[[int], str]:
    cache: dict[int, str] = {}

    def token_text(token_id: int) -> str:
        if token_id not in cache:
            cache[token_id] = client.decode([token_id])
        return cache[token_id]

    return token_text
