"""Where settings come from: command-line flags, ``RILL_*`` environment variables and a
TOML file, read once by ``load`` into a ``ServerConfig``.

Precedence: flags > environment variables > the TOML file (``--config``) > defaults. A field
named ``kv_cache_memory`` is the flag ``--kv-cache-memory``, the environment variable
``RILL_KV_CACHE_MEMORY`` and the TOML key ``kv_cache_memory`` (top level or in the section
named after its area, e.g. ``[engine]``). ``add_arguments`` builds the flags from the
fields of ``areas.AREAS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import tomllib
from collections.abc import Mapping
from typing import Any, get_type_hints

from rill.config.areas import AREAS, FORMER_AREAS, ServerConfig
from rill.config.checks import validate
from rill.config.values import base_type, check_api_key, convert
from rill.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per config field (defaults suppressed, so only given flags override)."""
    parser.add_argument("--config", help="TOML config file (flags and RILL_* variables override it)")
    for area, cls in AREAS.items():
        group = parser.add_argument_group(area)
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kind = base_type(hints[f.name])
            help_text = f"{f.metadata.get('help', '')} (default: {_default_of(f)})"
            if kind is bool:
                group.add_argument(
                    flag, dest=f"{area}.{f.name}", action="store_true", default=argparse.SUPPRESS, help=help_text
                )
            elif f.metadata.get("repeat"):
                group.add_argument(
                    flag,
                    dest=f"{area}.{f.name}",
                    action="append",
                    default=argparse.SUPPRESS,
                    metavar=f.name.upper(),
                    help=help_text,
                )
            else:
                # metavar: without it argparse shows the dest, e.g. HTTP.MAX_TOKENS_CAP
                group.add_argument(
                    flag, dest=f"{area}.{f.name}", default=argparse.SUPPRESS, metavar=f.name.upper(), help=help_text
                )


def load(
    args: argparse.Namespace | Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None
) -> ServerConfig:
    """Build the effective config from flags, environment and an optional TOML file."""
    flag_values = dict(vars(args)) if isinstance(args, argparse.Namespace) else dict(args or {})
    env = os.environ if env is None else env
    config_file = flag_values.pop("config", None) or env.get("RILL_CONFIG")
    file_values = _read_toml(config_file) if config_file else {}
    if config_file:
        _check_file_keys(config_file, file_values)
    areas: dict[str, Any] = {}
    for area, cls in AREAS.items():
        hints = get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw, source = _pick(area, f.name, flag_values, env, file_values)
            if source is not None:
                values[f.name] = convert(raw, hints[f.name], source)
                if (area, f.name) == ("policy", "api_key"):
                    _check_api_key_setting(raw, values[f.name], source)
        areas[area] = cls(**values)
    config = ServerConfig(**areas)
    validate(config)
    return config


def _pick(
    area: str, name: str, flags: Mapping[str, Any], env: Mapping[str, str], file: Mapping[str, Any]
) -> tuple[Any, str | None]:
    # The second item names where the value came from, as the user wrote it, for errors.
    flag = "--" + name.replace("_", "-")
    areas = (area, FORMER_AREAS[name]) if area == "policy" and name in FORMER_AREAS else (area,)
    for where in areas:
        if f"{where}.{name}" in flags:
            return flags[f"{where}.{name}"], f"flag {flag}"
    if name in flags:
        return flags[name], f"flag {flag}"
    env_name = "RILL_" + name.upper()
    if env_name in env:
        return env[env_name], f"environment variable {env_name}"
    for where in areas:
        section = file.get(where)
        if isinstance(section, dict) and name in section:
            return section[name], f"config file key [{where}] {name}"
    if name in file:
        return file[name], f"config file key {name}"
    return None, None


def _check_api_key_setting(raw: Any, keys: list[str], where: str) -> None:
    """Refuse a given but empty ``api_key`` (``RILL_API_KEY=""``, ``--api-key ""``) and bad keys."""
    items = raw if isinstance(raw, list) else [raw]
    if not keys or any(not str(item).strip() for item in items):
        raise ConfigError(f"{where}: an API key must not be empty (drop the setting to run without keys)")
    for key in keys:
        check_api_key(key, where)


def _check_file_keys(path: str, values: Mapping[str, Any]) -> None:
    """Refuse unknown keys and sections: a typo in a config file must not pass silently."""
    every_field = {f.name for cls in AREAS.values() for f in dataclasses.fields(cls)}
    for key, value in values.items():
        if key in AREAS:
            if not isinstance(value, dict):
                raise ConfigError(f"config file {path}: [{key}] must be a table of settings")
            known = {f.name for f in dataclasses.fields(AREAS[key])}
            known |= {name for name, former in FORMER_AREAS.items() if former == key}
            for name in value:
                if name not in known:
                    raise ConfigError(
                        f"config file {path}: unknown setting '{name}' in [{key}]{_did_you_mean(name, known)}"
                    )
        elif key not in every_field:
            what = "section" if isinstance(value, dict) else "setting"
            raise ConfigError(
                f"config file {path}: unknown {what} '{key}'{_did_you_mean(key, every_field | set(AREAS))}"
            )


def _did_you_mean(name: str, known: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(known), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None
