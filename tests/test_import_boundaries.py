"""Which layer may import which (STYLE §6.2), checked on every module found under ``src/rill``.

The files are discovered, not listed: a new module is held to its folder's rules the day it
is added. Imports are read from the AST, anywhere in a file (inside functions and under
``TYPE_CHECKING`` too), relative imports resolved. The rules:

* the engine imports nothing of the frontend, the protocols or the server, and no asyncio,
  web, RPC or metrics library;
* only the composition root (``cli.py``, ``__main__.py``) imports ``rill.server``; adapters
  and the other server-side modules receive what they need (``rill.deps.Deps``);
* a protocol package imports no other protocol package (shared code is ``protocols/_shared``).

The purity of the protocols' pure files (no I/O, no clock) is ``tests/protocols/test_purity.py``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import rill

SRC = Path(rill.__file__).parent

ENGINE_FORBIDDEN = (
    "rill.frontend",
    "rill.protocols",
    "rill.server",
    "rill.cli",
    "rill.deps",
    "rill.connections",
    "asyncio",
    "starlette",
    "uvicorn",
    "websockets",
    "grpc",
    "prometheus_client",
)
"""Modules no file under ``rill/engine`` imports (each with its submodules)."""

COMPOSITION_ROOT = ("rill.cli", "rill.__main__", "rill.server")
"""The only modules that may import ``rill.server``."""


def module_name(path: Path) -> str:
    """``src/rill/a/b.py`` → ``rill.a.b``; a package's ``__init__.py`` → the package."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(path: Path) -> str:
    """The package relative imports in ``path`` resolve against."""
    name = module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported_modules(path: Path, source: str | None = None) -> list[str]:
    """Every module ``path`` (or ``source``, read as if it were at ``path``) imports, relative
    imports resolved; ``from a import b`` counts both ``a`` and ``a.b``."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            resolved = importlib.util.resolve_name(base, package_of(path)) if node.level else base
            names += [resolved] + [f"{resolved}.{alias.name}" for alias in node.names]
    return names


def inside(name: str, roots: tuple[str, ...]) -> bool:
    """True when ``name`` is one of ``roots`` or inside one."""
    return any(name == root or name.startswith(root + ".") for root in roots)


def discovered(under: str = "") -> list[Path]:
    """Every ``.py`` file under ``rill/<under>`` (generated protobuf modules excluded)."""
    return sorted(p for p in (SRC / under).rglob("*.py") if "_pb" not in p.parts)


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(SRC)) for p in paths]


ENGINE_FILES = discovered("engine")
ALL_FILES = discovered()
PROTOCOL_FILES = [p for p in discovered("protocols") if p.parent != SRC / "protocols"]


def test_discovery_finds_the_layers() -> None:
    # Guards the walk itself: an empty or mis-rooted discovery would make every rule vacuous.
    assert len(ENGINE_FILES) >= 10 and SRC / "engine" / "core.py" in ENGINE_FILES
    assert SRC / "server.py" in ALL_FILES and SRC / "protocols" / "evergreen" / "adapter.py" in PROTOCOL_FILES
    assert imported_modules(SRC / "engine" / "core.py"), "the AST walk found no import in engine/core.py"


@pytest.mark.parametrize("path", ENGINE_FILES, ids=_ids(ENGINE_FILES))
def test_the_engine_imports_no_layer_above_it(path: Path) -> None:
    bad = [name for name in imported_modules(path) if inside(name, ENGINE_FORBIDDEN)]
    assert not bad, f"{path.relative_to(SRC)} imports {bad}"


@pytest.mark.parametrize("path", ALL_FILES, ids=_ids(ALL_FILES))
def test_only_the_composition_root_imports_the_server(path: Path) -> None:
    if module_name(path) in COMPOSITION_ROOT:
        return
    bad = [name for name in imported_modules(path) if inside(name, ("rill.server",))]
    assert not bad, f"{path.relative_to(SRC)} imports {bad} (upward: take rill.deps.Deps instead)"


@pytest.mark.parametrize("path", PROTOCOL_FILES, ids=_ids(PROTOCOL_FILES))
def test_protocol_packages_are_independent(path: Path) -> None:
    own = ".".join(module_name(path).split(".")[:3])  # rill.protocols.<name>
    allowed = (own, "rill.protocols._shared")
    bad = [
        name
        for name in imported_modules(path)
        if inside(name, ("rill.protocols",)) and name != "rill.protocols" and not inside(name, allowed)
    ]
    assert not bad, f"{path.relative_to(SRC)} imports {bad} (shared code belongs in protocols/_shared)"


def test_the_rules_catch_a_violation() -> None:
    # The checks themselves can fail: upward imports, relative or under TYPE_CHECKING, are seen.
    source = (
        "from ..server import Deps\nimport typing\nif typing.TYPE_CHECKING:\n"
        "    from rill.frontend import client\nfrom rill import protocols\n"
    )
    names = imported_modules(SRC / "engine" / "probe.py", source)
    assert {n for n in names if inside(n, ENGINE_FORBIDDEN)} == {
        "rill.server",
        "rill.server.Deps",
        "rill.frontend",
        "rill.frontend.client",
        "rill.protocols",
    }
