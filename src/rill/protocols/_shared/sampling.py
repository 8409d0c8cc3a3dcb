"""One declared mapping per protocol from its wire's sampling fields to ``SamplingParams``.

A protocol declares, beside the wire struct that carries its sampling fields, a
``SamplingMap``: a table of ``Field(wire name, engine name, convert)``. ``patch`` reads the
fields a message sets, under the engine's names; ``params`` applies a patch and validates
the result once (``SamplingParams.validate``), naming a bad field by its wire name. Adding
a sampling parameter to a protocol is one entry in its table (and the wire struct's field).
Fields a protocol derives from several wire fields (``do_sample``, OpenAI's ``logprobs``)
stay code in that protocol, added to the patch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from rill.errors import InvalidRequest
from rill.types import SamplingParams

ENGINE_FIELDS = frozenset(SamplingParams.__struct_fields__)
"""The names a ``Field`` may map to."""


@dataclass(frozen=True, slots=True)
class Field:
    """One wire field: its name on the wire, the ``SamplingParams`` field it sets, and an
    optional conversion of the wire value (which may raise ``InvalidRequest``)."""

    wire: str
    engine: str
    convert: Callable[[Any], Any] | None = None


def same(*names: str) -> tuple[Field, ...]:
    """Fields whose wire name is the engine's name, taken as they are."""
    return tuple(Field(name, name) for name in names)


class SamplingMap:
    """A protocol's wire → ``SamplingParams`` table, checked against both structs when declared."""

    def __init__(self, wire_type: type[msgspec.Struct], *fields: Field | tuple[Field, ...]) -> None:
        """``wire_type``: the struct carrying the fields; a field naming an attribute it
        lacks, or an unknown engine field, is a ``TypeError`` at import."""
        flat = tuple(f for item in fields for f in (item if isinstance(item, tuple) else (item,)))
        for f in flat:
            if f.wire not in wire_type.__struct_fields__:
                raise TypeError(f"{wire_type.__name__} has no field '{f.wire}'")
            if f.engine not in ENGINE_FIELDS:
                raise TypeError(f"SamplingParams has no field '{f.engine}' (mapped from '{f.wire}')")
        self.wire_type = wire_type
        self.fields = flat
        self._wire_of = {f.engine: f.wire for f in flat}

    def patch(self, message: Any) -> dict[str, Any]:
        """The fields ``message`` sets (a value other than None), under engine names, converted."""
        found: dict[str, Any] = {}
        for f in self.fields:
            value = getattr(message, f.wire)
            if value is not None:
                found[f.engine] = value if f.convert is None else f.convert(value)
        return found

    def wire_name(self, engine_field: str | None) -> str | None:
        """The wire's name of an engine field (the engine's own when the table lacks it)."""
        return self._wire_of.get(engine_field, engine_field) if engine_field is not None else None

    def build(self, patch: Mapping[str, Any], base: SamplingParams | None = None) -> SamplingParams:
        """``base`` (the defaults when None) with ``patch`` applied, not validated: for a
        protocol whose requests are validated at admission only."""
        return msgspec.structs.replace(base if base is not None else SamplingParams(), **patch)

    def params(
        self,
        patch: Mapping[str, Any],
        base: SamplingParams | None = None,
        *,
        vocab_size: int | None = None,
        max_logprobs: int = 20,
        allow_prefill_only: bool = False,
    ) -> SamplingParams:
        """``build`` then ``SamplingParams.validate`` once (``allow_prefill_only``: see there).

        Raises:
            InvalidRequest: the first bad field, named (in ``field`` and the message) as on the wire.
        """
        params = self.build(patch, base)
        try:
            return params.validate(
                vocab_size=vocab_size, max_logprobs=max_logprobs, allow_prefill_only=allow_prefill_only
            )
        except InvalidRequest as exc:
            renamed = self.renamed(exc)
            if renamed is exc:
                raise
            raise renamed from exc

    def renamed(self, exc: InvalidRequest) -> InvalidRequest:
        """``exc`` with its engine field name replaced by the wire's (``exc`` itself if equal)."""
        wire = self.wire_name(exc.field)
        if wire == exc.field:
            return exc
        return InvalidRequest(exc.message.replace(f"'{exc.field}'", f"'{wire}'"), field=wire)
