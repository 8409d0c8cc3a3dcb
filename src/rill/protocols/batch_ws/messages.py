"""Wire messages of the batch WebSocket ``/ws`` (``shared/specs/batch-websocket.md``).

Pure: msgspec structs only; imports nothing from the engine or the frontend. Field names are
exactly those on the wire (the codec renames nothing).

Client → server, one text frame = one batch (several may be in flight on one socket)::

    {"prompts": [{"request_id": "a", "prompt": "..."}], "only_new_tokens": true,
     "stream_response": true, "generation_config": {"max_new_tokens": 100, ...}}

Server → client, every frame is a JSON array (``ServerEvent``s of one batch, in prompt
order), or ``[{"error": "..."}]`` for a problem with the frame itself (``SocketError``)::

    ACCEPTED → STARTED → INITIALIZED → PROGRESS* → COMPLETE      (per request_id)
    ACCEPTED → ... → ERROR                                      (that request_id failed)
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from rill.protocols._shared.sampling import Field, SamplingMap, same
from rill.types import ResponseFormat

NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]


class PromptItem(msgspec.Struct, kw_only=True):
    """One prompt of a batch.

    ``request_id`` names it in every event and keys its continuation: if a generation with
    this id ended without eos and is still kept, ``prompt`` is ignored and generation
    continues from where it stopped. ``prompt`` may be left out only for such a continuation.
    """

    request_id: NonEmptyStr
    prompt: str | None = None


class GenerationConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Generation settings shared by every prompt of a batch; None = the server's default.

    ``do_sample`` false means greedy; ``num_beams`` > 1 means beam search (deterministic,
    sampling fields ignored) ranked with ``length_penalty``. ``top_k`` 0 disables top-k.
    ``response_format`` constrains every prompt's output (``rill.types.ResponseFormat``, as
    OpenAI's). ``speculative`` (rill's): speculative decoding when the server runs it; false
    or 0 turns it off, N drafts at most N tokens (same output, only the speed differs).
    Unknown keys are ignored, as the source project does.
    """

    num_beams: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    length_penalty: float | None = None
    response_format: ResponseFormat | None = None
    speculative: bool | int | None = None

    def filled_from(self, defaults: GenerationConfig) -> GenerationConfig:
        """A copy where every field left None takes the value from ``defaults``."""
        return GenerationConfig(
            **{
                name: value if (value := getattr(self, name)) is not None else getattr(defaults, name)
                for name in self.__struct_fields__
            }
        )


SAMPLING = SamplingMap(
    GenerationConfig,
    Field("max_new_tokens", "max_tokens"),
    same(
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "num_beams",
        "length_penalty",
        "response_format",
        "speculative",
    ),
)
"""``generation_config`` → ``SamplingParams``; without ``do_sample`` (or with beams) the session
drops ``rill.types.DRAW_ONLY_FIELDS`` and decodes greedily, as Hugging Face does."""


class BatchRequest(msgspec.Struct, kw_only=True):
    """Client → server: generate for every prompt of ``prompts`` (at least one).

    ``only_new_tokens`` (default true): INITIALIZED/COMPLETE texts leave the prompt out.
    ``stream_response`` (default true): send INITIALIZED and PROGRESS events; when false
    only ACCEPTED, STARTED and COMPLETE (or ERROR) are sent. As in the source project, a
    value of either flag that is not a JSON boolean counts as true.
    """

    prompts: Annotated[list[PromptItem], msgspec.Meta(min_length=1)]
    only_new_tokens: Any = True
    stream_response: Any = True
    generation_config: GenerationConfig | None = None

    def __post_init__(self) -> None:
        # NOTE: the source project treats any non-boolean as true; clients rely on it.
        if not isinstance(self.only_new_tokens, bool):
            self.only_new_tokens = True
        if not isinstance(self.stream_response, bool):
            self.stream_response = True


class Accepted(msgspec.Struct, kw_only=True, tag_field="type", tag="ACCEPTED"):
    """The prompt passed validation and was queued."""

    request_id: str


class Started(msgspec.Struct, kw_only=True, tag_field="type", tag="STARTED"):
    """The engine picked the prompt up (its prefill began)."""

    request_id: str


class Initialized(msgspec.Struct, kw_only=True, tag_field="type", tag="INITIALIZED"):
    """The prompt is in the KV cache; tokens follow.

    ``text`` is empty with ``only_new_tokens``, else the prompt (for a continuation: the
    prompt plus everything generated so far).
    """

    request_id: str
    text: str


class Progress(msgspec.Struct, kw_only=True, tag_field="type", tag="PROGRESS"):
    """New text of one prompt in one engine step (only prompts that produced a token).

    Concatenating a prompt's PROGRESS texts gives its COMPLETE text (minus INITIALIZED text).
    """

    request_id: str
    text: str


class Complete(msgspec.Struct, kw_only=True, tag_field="type", tag="COMPLETE"):
    """Summary of one finished prompt.

    ``text``: generated text (with the INITIALIZED text in front unless ``only_new_tokens``);
    ``is_eos``: generation ended on the end-of-sequence token (not on ``max_new_tokens``);
    ``new_tokens_count``: tokens generated by this message; ``execution_time``: seconds
    from receiving the message to this prompt's end.
    """

    request_id: str
    text: str
    is_eos: bool
    new_tokens_count: int
    execution_time: float


class Error(msgspec.Struct, kw_only=True, tag_field="type", tag="ERROR"):
    """One prompt failed; the other prompts of the batch carry on."""

    request_id: str
    error: str


ServerEvent = Accepted | Started | Initialized | Progress | Complete | Error
"""Elements of the arrays the server sends for a batch."""


class SocketError(msgspec.Struct, kw_only=True):
    """A problem with a whole frame (bad JSON, bad payload); sent as ``[{"error": ...}]``.

    No request_id: nothing of that frame was accepted. The socket stays usable.
    """

    error: str
