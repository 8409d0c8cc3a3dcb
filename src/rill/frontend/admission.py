"""The CPU part of admitting a request: prompt size bound, chat templating, tokenization.

Every protocol reaches the engine through the client's ``SubmissionPolicy``
(``rill.frontend.policy``: one request, or the choices of one OpenAI request), which calls
``PromptAdmission.token_ids``, as ``InprocClient.tokenize`` does, so the same rules hold on
every protocol:

1. the prompt's size in characters is checked first (``PromptTooLarge`` past
   ``--max-prompt-chars``), so a huge prompt costs no tokenizer time at all;
2. the chat template is rendered and the text tokenized in a small thread pool owned by the
   frontend, never on the event loop: a 3 MB prompt takes seconds to tokenize, and the loop
   must keep answering ``/health`` and every other client's stream meanwhile;
3. client-given token ids are checked against the vocabulary (in the pool when the list is
   long), and every prompt against the context: one that leaves no room for a new token is
   ``ContextLengthExceeded``, on every protocol alike.

Text is encoded with ``tokenizers``' batch call, which releases the GIL while Rust works
(the plain ``encode`` holds it: in a worker thread it would still freeze the loop). Only
turning the ids into a Python list holds it, so a text over the context is refused from
its token count, before that list is built (1.6M ids held the GIL for 50–170 ms).

Small plain prompts skip the pool (``FAST_PATH_MAX_SIZE``); ``benchmarks/loop_stall.py
--fast-path`` measures the trade-off.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias

import msgspec

from rill.errors import ContextLengthExceeded, InvalidRequest, PromptTooLarge
from rill.types import GenerateRequest, ModelInfo, check_chat_messages, check_template_kwargs

FAST_PATH_MAX_SIZE = 256
"""Prompts of at most this many characters (or token ids) are admitted on the event loop.

Measured with the test checkpoint's byte-level BPE on the shared 2-core machine
(``benchmarks/loop_stall.py --fast-path``, two runs at load 3 and 10): encoding 64
characters inline took 60–290 µs and 256 characters 230–770 µs, while an empty round trip
through the pool cost 230–500 µs and a 256-character one 550–1100 µs. Up to 256 characters
tokenizing inline is cheaper than handing it over and holds the loop no longer than a hop
would; from about 1,000 characters on the pool wins, so longer prompts always go there."""


Prompt: TypeAlias = str | list[int] | GenerateRequest
"""One prompt to admit: a text, token ids, or a request whose ``prompt``,
``prompt_token_ids`` or ``messages`` (with its chat-template settings) is the prompt. Plain
texts and id lists let a protocol pass a long prompt list without building a request per
prompt on the event loop first (200,000 ``GenerateRequest`` objects take seconds there)."""


class PromptTokenizer(Protocol):
    """What admission needs of a tokenizer (``rill.models.tokenizer.Tokenizer`` has it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (may hold the GIL: used for small prompts only)."""
        ...

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True, max_context_tokens: int | None = None
    ) -> list[list[int]]:
        """Token ids of each text, computed without holding the GIL; ``ContextLengthExceeded``
        for a text of ``max_context_tokens`` tokens or more, before its id list is built."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Any],
        /,
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text the chat template makes of ``messages``."""
        ...


class PromptAdmission:
    """Tokenizes prompts off the event loop, in a bounded pool of worker threads.

    Args:
        max_prompt_chars: the most characters one request's prompts may hold together
            (message contents and template variables count too).
        num_threads: worker threads; more prompts than that wait their turn in the pool's
            queue, and a cancelled request that has not started is dropped from it.
    """

    def __init__(self, *, max_prompt_chars: int, num_threads: int) -> None:
        self.max_prompt_chars = max_prompt_chars
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="rill-tokenize")

    async def token_ids(
        self, tokenizer: PromptTokenizer, prompts: Sequence[Prompt], model: ModelInfo
    ) -> list[list[int]]:
        """The token ids of each prompt (a request's ``messages`` rendered by the chat template).

        Raises:
            PromptTooLarge: the prompts hold more than ``max_prompt_chars`` characters.
            ContextLengthExceeded: a prompt leaves no room in ``model``'s context for one new token.
            InvalidRequest: not exactly one prompt field in a request, a token id outside the
                vocabulary, or the chat template refused the messages.
        """
        if _is_small(prompts):
            return prompt_token_ids(tokenizer, prompts, model, self.max_prompt_chars)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, prompt_token_ids, tokenizer, prompts, model, self.max_prompt_chars
        )

    async def render_chat(
        self,
        tokenizer: PromptTokenizer,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool,
        chat_template_kwargs: Mapping[str, Any],
    ) -> str:
        """The chat template's text for ``messages``, rendered in the pool (same size bound)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool,
            _render_bounded,
            tokenizer,
            messages,
            add_generation_prompt,
            chat_template_kwargs,
            self.max_prompt_chars,
        )

    async def tokenize(
        self, tokenizer: PromptTokenizer, prompt: Prompt, model: ModelInfo, *, add_special_tokens: bool
    ) -> list[int]:
        """Token ids of one prompt for counting (``/tokenize``), in the pool, under the same size
        bound as ``token_ids``; a prompt longer than the context is counted, not refused.

        Raises:
            PromptTooLarge: the prompt holds more than ``max_prompt_chars`` characters.
            InvalidRequest: not exactly one prompt field, a token id outside the vocabulary,
                or the chat template refused the messages.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._pool, _tokenize_one, tokenizer, prompt, model, self.max_prompt_chars, add_special_tokens
        )

    async def detokenize(
        self, tokenizer: Any, token_ids: Sequence[int], model: ModelInfo, *, skip_special_tokens: bool = False
    ) -> str:
        """The text of ``token_ids`` (``/detokenize``, echoed prompts), checked and decoded in the pool.

        On the loop only the length is compared (no walk over the ids); the vocabulary check
        and the decode, O(n) each, run in a worker, the decode without holding the GIL.

        Raises:
            PromptTooLarge: more than ``max_prompt_chars`` ids (each counts one, as in prompts).
            InvalidRequest: an id outside the vocabulary.
        """
        if len(token_ids) > self.max_prompt_chars:
            raise PromptTooLarge(len(token_ids), self.max_prompt_chars)
        loop = asyncio.get_running_loop()
        text: str = await loop.run_in_executor(
            self._pool, _detokenize, tokenizer, token_ids, model.vocab_size, skip_special_tokens
        )
        return text

    def close(self) -> None:
        """Stop the workers; queued jobs that have not started are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def prompt_token_ids(
    tokenizer: PromptTokenizer, prompts: Sequence[Prompt], model: ModelInfo, max_prompt_chars: int
) -> list[list[int]]:
    """The synchronous body of ``PromptAdmission.token_ids`` (runs in a worker thread).

    Plain texts are encoded in one batch call, so a long list of prompts costs one trip
    through the tokenizer instead of one per prompt.
    """
    check_size(prompts, max_prompt_chars)
    vocab_size, context = model.vocab_size, model.max_context_tokens
    out: list[list[int] | None] = [None] * len(prompts)
    texts: dict[int, str] = {}
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            texts[i] = prompt
        elif isinstance(prompt, list):
            out[i] = _checked_ids(prompt, vocab_size)
        elif prompt.messages is not None:
            text = _render_messages(tokenizer, prompt, model)
            # The template writes every special token it wants (BOS included): no post-processor.
            out[i] = _encode(tokenizer, [text], False, context)[0]
        else:
            _check_one_field(prompt)
            if prompt.prompt_token_ids is not None:
                out[i] = _checked_ids(prompt.prompt_token_ids, vocab_size)
            else:
                texts[i] = prompt.prompt or ""
    for i, ids in zip(texts, _encode(tokenizer, list(texts.values()), True, context)):
        out[i] = ids
    token_ids = [ids if ids is not None else [] for ids in out]
    longest = max(map(len, token_ids), default=0)
    if longest >= context:  # long texts were refused by count already; this covers ids and short texts
        raise ContextLengthExceeded(longest, context)
    return token_ids


def render(
    tokenizer: PromptTokenizer,
    messages: Sequence[Any],
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, Any],
    tools: Sequence[Any] | None = None,
    *,
    tool_format: str | None = None,
) -> str:
    """The chat template's text for ``messages``, after the checks every protocol shares.

    ``chat_template_kwargs`` are template variables; ``tools`` the functions offered, the
    template's own ``tools`` argument (it picks a ``tool_use`` template where there is one).
    When the template ignores ``tools`` (``rill.models.chat_template.renders_tools``), they
    are listed in the system message instead, with how to call them in ``tool_format`` (the
    model's own format, else hermes, as ``--tool-call-parser auto`` reads; see
    ``rill.models.tool_prompt``).

    Raises:
        InvalidRequest: a message's role is not a chat role, a variable name is reserved,
            or the template failed.
    """
    check_chat_messages(list(messages))
    if tools and not _template_renders_tools(tokenizer, tools):
        # Imported here: rill.models loads torch, and admission must stay importable without it.
        from rill.models.tool_prompt import with_tool_prompt

        messages = with_tool_prompt(messages, tools, tool_format or "hermes")
    return tokenizer.apply_chat_template(
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        chat_template_kwargs=check_template_kwargs(dict(chat_template_kwargs)),
    )


def _template_renders_tools(tokenizer: PromptTokenizer, tools: Sequence[Any]) -> bool:
    """Whether the template ``tokenizer`` renders for ``tools`` shows them to the model; True
    when that cannot be told (no template source to probe: nothing is added then)."""
    from rill.models.chat_template import renders_tools

    get_template = getattr(tokenizer, "get_chat_template", None)
    source = get_template(tools) if get_template is not None else None
    return True if source is None else renders_tools(source)


def check_size(prompts: Sequence[Prompt], max_prompt_chars: int) -> None:
    """Raise ``PromptTooLarge`` when the prompts hold more than ``max_prompt_chars`` characters.

    Token ids count one each; messages count the characters of every string in them, in the
    template variables and in the tools. The walk stops as soon as the bound is passed.
    """
    total = 0
    for prompt in prompts:
        if isinstance(prompt, (str, list)):
            total += len(prompt)
        else:
            total += len(prompt.prompt or "") + len(prompt.prompt_token_ids or ())
            if prompt.messages is not None:
                total += _chars_in(
                    [prompt.messages, prompt.chat_template_kwargs, prompt.tools], max_prompt_chars - total
                )
        if total > max_prompt_chars:
            raise PromptTooLarge(total, max_prompt_chars)


def _chars_in(root: Any, budget: int) -> int:
    """Characters in every string inside ``root`` (iteratively: nesting depth costs no stack)."""
    total = 0
    stack = [root]
    while stack and total <= budget:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, Mapping):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, msgspec.Struct):
            stack.extend(getattr(item, name) for name in item.__struct_fields__)
    return total


def _is_small(prompts: Sequence[Prompt]) -> bool:
    size = 0
    for prompt in prompts:
        if isinstance(prompt, (str, list)):
            size += len(prompt)
        elif prompt.messages is not None:
            return False
        else:
            size += len(prompt.prompt or "") + len(prompt.prompt_token_ids or ())
        if size > FAST_PATH_MAX_SIZE:
            return False
    return True


def _check_one_field(request: GenerateRequest) -> None:
    given = [x for x in (request.prompt, request.prompt_token_ids, request.messages) if x is not None]
    if len(given) != 1:
        raise InvalidRequest("give exactly one of prompt, prompt_token_ids or messages", field="prompt")


def _checked_ids(ids: Sequence[int], vocab_size: int, field: str = "prompt_token_ids") -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt token id {bad} is outside the vocabulary (0..{vocab_size - 1})", field=field)
    return list(ids)


def _detokenize(tokenizer: Any, token_ids: Sequence[int], vocab_size: int, skip_special_tokens: bool) -> str:
    """The body of ``PromptAdmission.detokenize`` (runs in a worker thread); ``/detokenize``
    keeps special tokens, so that tokenizing its text again gives the ids back."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", field="tokens")
    texts: list[str] = tokenizer.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)
    return texts[0]


def _render_messages(tokenizer: PromptTokenizer, prompt: GenerateRequest, model: ModelInfo) -> str:
    """A chat request's prompt text: its template applied to its messages (and its tools, in
    a system prompt where the template drops them)."""
    _check_one_field(prompt)
    assert prompt.messages is not None
    return render(
        tokenizer,
        prompt.messages,
        prompt.add_generation_prompt,
        prompt.chat_template_kwargs,
        prompt.tools,
        tool_format=model.tool_call_format,
    )


def _tokenize_one(
    tokenizer: PromptTokenizer, prompt: Prompt, model: ModelInfo, max_prompt_chars: int, add_special_tokens: bool
) -> list[int]:
    check_size([prompt], max_prompt_chars)
    if isinstance(prompt, list):
        return _checked_ids(prompt, model.vocab_size)
    if isinstance(prompt, str):
        text = prompt
    elif prompt.messages is not None:
        text = _render_messages(tokenizer, prompt, model)
    else:
        _check_one_field(prompt)
        if prompt.prompt_token_ids is not None:
            return _checked_ids(prompt.prompt_token_ids, model.vocab_size)
        text = prompt.prompt or ""
    # No context bound: counting a prompt that would not fit is what /tokenize is asked for;
    # the character bound above already limits the work.
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def _encode(
    tokenizer: PromptTokenizer, texts: list[str], add_special_tokens: bool, max_context_tokens: int
) -> list[list[int]]:
    if not texts:
        return []
    if len(texts) == 1 and len(texts[0]) <= FAST_PATH_MAX_SIZE:
        return [tokenizer.encode(texts[0], add_special_tokens=add_special_tokens)]
    return tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens, max_context_tokens=max_context_tokens)


def _render_bounded(
    tokenizer: PromptTokenizer,
    messages: Sequence[Any],
    add_generation_prompt: bool,
    chat_template_kwargs: Mapping[str, Any],
    max_prompt_chars: int,
) -> str:
    check_size(
        [GenerateRequest(messages=list(messages), chat_template_kwargs=dict(chat_template_kwargs))], max_prompt_chars
    )
    return render(tokenizer, messages, add_generation_prompt, chat_template_kwargs)
