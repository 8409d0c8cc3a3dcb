"""``POST /v1/embeddings`` on the wire: its messages and their codec (pure).

The request is OpenAI's: ``input`` (a string, a list of strings, a list of token ids or a list
of token-id lists), ``model`` (the embedding model's name; absent means it), ``encoding_format``
(``float``, the default, or ``base64``: each vector's little-endian float32 bytes, which the
``openai`` client sends by default and decodes itself), ``dimensions`` (where the model allows
it) and ``user`` (accepted, unused), plus vLLM's ``truncate_prompt_tokens`` (keep at most that
many tokens of each input, -1 the model's limit; without it an input over the limit is
refused). The answer is ``{"object": "list", "data": [{"object": "embedding", "index",
"embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}``.

Token-id inputs are embedded as given (no special tokens added), as vLLM does.
Errors go through the API's one table (``codec.ERROR_TABLE``).
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import msgspec
import numpy as np

from rill.errors import InvalidRequest
from rill.protocols.openai_http.codec import ModelNotFound, decode_body, model_off

# ---------------------------------------------------------------------------- messages


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/embeddings`` body (``input`` is checked by ``embedding_inputs``)."""

    input: Any = None
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None


class Embedding(msgspec.Struct, kw_only=True):
    """One vector of the answer: a list of floats, or base64 of its float32 bytes."""

    object: str = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    """``usage`` of an embeddings answer: the tokens of every input (nothing is generated)."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, kw_only=True):
    """``POST /v1/embeddings`` answer."""

    object: str = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


# ---------------------------------------------------------------------------- codec


def no_embedding_model() -> ModelNotFound:
    """The answer of ``/v1/embeddings`` on a server started without ``--embedding-model`` (404)."""
    return model_off("embedding model", "--embedding-model NAME|PATH (for example --embedding-model all-minilm-l6-v2)")


_decoder = msgspec.json.Decoder(EmbeddingRequest)
_encoder = msgspec.json.Encoder()


def decode_embeddings(body: bytes) -> EmbeddingRequest:
    """Parse a ``/v1/embeddings`` body; ``InvalidRequest`` names the bad field."""
    req = decode_body(_decoder, body)
    if req.dimensions is not None and req.dimensions < 1:
        raise InvalidRequest(f"'dimensions' must be at least 1, not {req.dimensions}", field="dimensions")
    return req


WIRE_FIELDS = {"inputs": "input", "truncate_to": "truncate_prompt_tokens"}
"""The embedding service's field names (``EmbeddingSubmission``) that this wire calls otherwise."""


def wire_named(exc: BaseException) -> BaseException:
    """``exc`` (an error of the embedding service) with the fields it names, in ``field`` and
    quoted in its message, as this wire calls them (in place: the error is the request's own)."""
    if isinstance(exc, InvalidRequest):
        for name, wire in WIRE_FIELDS.items():
            exc.message = exc.message.replace(f"'{name}'", f"'{wire}'")
        exc.args = (exc.message,)
        exc.field = WIRE_FIELDS.get(exc.field or "", exc.field)
    return exc


def embedding_inputs(req: EmbeddingRequest) -> list[str] | list[list[int]]:
    """The inputs of a request: texts, or token-id lists.

    Raises:
        InvalidRequest: ``input`` is missing, empty, or of none of the four shapes (field ``input``).
    """
    given = req.input
    if isinstance(given, str):
        return [given]
    if isinstance(given, list) and given:
        if all(isinstance(item, str) for item in given):
            return list(given)
        if all(_is_token_id(item) for item in given):
            return [list(given)]
        if all(isinstance(item, list) and all(_is_token_id(t) for t in item) for item in given):
            return [list(item) for item in given]
    if given is None:
        raise InvalidRequest("'input' is required", field="input")
    if given == []:
        raise InvalidRequest("'input' must not be an empty list", field="input")
    raise InvalidRequest(
        "'input' must be a string, a list of strings, a list of token ids or a list of token-id lists",
        field="input",
    )


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def encode_embeddings(vectors: np.ndarray, num_prompt_tokens: int, model: str, encoding_format: str | None) -> bytes:
    """The JSON answer for ``vectors`` (float32 ``[N, D]``, row ``i`` for input ``i``)."""
    if encoding_format == "base64":
        little_endian = np.ascontiguousarray(vectors, dtype="<f4")
        data = [
            Embedding(index=i, embedding=base64.b64encode(row.tobytes()).decode("ascii"))
            for i, row in enumerate(little_endian)
        ]
    else:
        data = [Embedding(index=i, embedding=row) for i, row in enumerate(vectors.tolist())]
    usage = EmbeddingUsage(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens)
    return _encoder.encode(EmbeddingList(data=data, model=model, usage=usage))
