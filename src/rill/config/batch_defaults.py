"""The batch ``/ws`` generation defaults: values for the ``generation_config`` fields a
message leaves out, read once at startup from the environment and a ``.env`` file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

from rill.config.values import convert


@dataclass(frozen=True)
class SamplingDefaults:
    """Values for the ``generation_config`` fields a batch ``/ws`` message leaves out.

    Read once at startup by ``sampling_defaults()`` from ``RILL_DEFAULT_<NAME>`` or the
    source project's ``MODEL_DEFAULT_<NAME>`` (e.g. ``MODEL_DEFAULT_TEMPERATURE``).
    """

    num_beams: int = 1
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    max_new_tokens: int = 2048
    repetition_penalty: float = 1.0
    length_penalty: float = 1.0


def sampling_defaults(
    env: Mapping[str, str] | None = None, dotenv_path: str | Path | None = ".env"
) -> SamplingDefaults:
    """The batch ``/ws`` generation defaults from the environment and a ``.env`` file.

    Args:
        env: the process environment (``os.environ`` when None).
        dotenv_path: a ``.env`` file (relative paths are taken from the working folder);
            None or a missing file means none. Real environment variables win over it.

    Returns:
        ``SamplingDefaults``; for each field ``RILL_DEFAULT_<NAME>`` beats
        ``MODEL_DEFAULT_<NAME>`` within the same source.

    Raises:
        ConfigError: a variable's value has the wrong type (the message names it).
    """
    env = os.environ if env is None else env
    layers: list[Mapping[str, Any]] = [env]
    if dotenv_path is not None and Path(dotenv_path).is_file():
        from dotenv import dotenv_values

        layers.append({k: v for k, v in dotenv_values(dotenv_path).items() if v is not None})
    hints = get_type_hints(SamplingDefaults)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(SamplingDefaults):
        for layer in layers:
            name = next(
                (n for n in (f"RILL_DEFAULT_{f.name.upper()}", f"MODEL_DEFAULT_{f.name.upper()}") if n in layer), None
            )
            if name is not None:
                values[f.name] = convert(layer[name].strip(), hints[f.name], f"environment variable {name}")
                break
    return SamplingDefaults(**values)
