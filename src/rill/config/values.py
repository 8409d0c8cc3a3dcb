"""Setting values from text: sizes (``4GiB``), API keys, and a field's type from a flag,
a variable or a TOML value.

Pure functions shared by the loader (``loader.py``), the per-area settings (``areas.py``)
and the batch ``/ws`` defaults (``batch_defaults.py``); each error is a ``ConfigError``
naming where the value came from.
"""

from __future__ import annotations

import re
from typing import Any, get_args, get_origin

from rill.errors import ConfigError

_API_KEY_RE = re.compile(r"^[\x21-\x7e]+$")


def check_api_key(key: str, where: str) -> str:
    """``key`` if it can be an API key; else ``ConfigError`` naming ``where`` it came from.

    An empty key would either refuse everything or (on a protocol that compared loosely)
    accept an empty token, and a key with spaces or non-ASCII characters cannot be sent in
    an ``Authorization: Bearer`` header: both are start-up errors, never auth turned off.
    """
    if not key.strip():
        raise ConfigError(f"{where}: an API key must not be empty (drop the setting to run without keys)")
    if not _API_KEY_RE.match(key):
        raise ConfigError(f"{where}: an API key must be printable ASCII without spaces")
    return key


_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*$")
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "ki": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "mi": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "gi": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
    "ti": 1024**4,
}


def parse_size(text: str | int, name: str = "size") -> int:
    """Parse ``4GiB``, ``512MiB``, ``1.5G`` or a plain byte count into bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ConfigError(f"{name}: cannot parse size {text!r} (use bytes or e.g. 512MiB, 4GiB)")
    number, unit = match.groups()
    return int(float(number) * _UNITS[(unit or "").lower()])


def base_type(hint: Any) -> type:
    """The class a field's type hint stores: ``list`` for ``list[...]``, the first non-None
    member of a union, else the hint itself (every config field's hint ends in a class)."""
    args = [a for a in get_args(hint) if a is not type(None)]
    if get_origin(hint) is list:
        return list
    if args:
        return base_type(args[0])
    if not isinstance(hint, type):
        raise TypeError(f"a config field's type must end in a class, not {hint!r}")
    return hint


def convert(raw: Any, hint: Any, where: str) -> Any:
    """``raw`` (a flag's or variable's text, or a TOML value) as the type ``hint`` names;
    ``ConfigError`` naming ``where`` it came from when it cannot be one."""
    kind = base_type(hint)
    if raw is None:
        return None
    if isinstance(raw, str) and not raw.strip() and type(None) in get_args(hint):
        return None  # RILL_MAX_TOKENS_CAP= (empty) means "unset" for an optional setting
    try:
        if kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if kind is list:
            if isinstance(raw, str):
                return [part.strip() for part in raw.split(",") if part.strip()]
            return [str(item) for item in raw]
        if kind is int:
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)  # int(2.7) would silently become 2, int(True) 1
            return int(raw)
        if kind is float:
            if isinstance(raw, bool):
                raise ValueError(raw)
            return float(raw)
        return str(raw)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: cannot use {raw!r} as {kind.__name__}") from exc
