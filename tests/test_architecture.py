"""The rules ``docs/ARCHITECTURE.md`` states, checked on every module under ``src/rill``.

The layer table is read from the document itself, so the document is the rule: an import
from a lower layer to a higher one fails, a top-level part of ``rill`` the table does not
name fails, and a cycle of module-level imports (what runs when a module is imported; imports
inside functions and under ``TYPE_CHECKING`` do not) fails. Each check is shown to catch a
planted violation.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

import rill

SRC = Path(rill.__file__).parent
DOC = SRC.parent.parent / "docs" / "ARCHITECTURE.md"


def layer_table(text: str) -> dict[str, int]:
    """``{part: layer}`` from the document's table rows ``| N | `a`, `b` | ... |``."""
    layers: dict[str, int] = {}
    for match in re.finditer(r"^\| (\d+) \| ([^|]+) \|", text, flags=re.MULTILINE):
        for name in re.findall(r"`([^`]+)`", match.group(2)):
            layers[name] = int(match.group(1))
    return layers


LAYERS = layer_table(DOC.read_text())


def module_name(path: Path) -> str:
    """``src/rill/a/b.py`` → ``rill.a.b``; a package's ``__init__.py`` → the package."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def part_of(module: str) -> str | None:
    """The top-level part of ``rill`` a module belongs to (None for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def imports(tree: ast.AST, package: str, *, run_time_only: bool) -> list[str]:
    """The modules a file imports (``from a import b``: ``a`` and ``a.b``); with
    ``run_time_only``, only those run on import (not in functions, not under TYPE_CHECKING)."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if run_time_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if run_time_only and isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    visit(ast.Module(body=[stmt], type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                found.extend(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = "." * child.level + (child.module or "")
                resolved = importlib.util.resolve_name(base, package) if child.level else base
                found.append(resolved)
                found.extend(f"{resolved}.{alias.name}" for alias in child.names)
            visit(child)

    visit(tree)
    return found


def upward_imports(path: Path, source: str, layers: dict[str, int]) -> list[str]:
    """Imports in ``source`` (read as if at ``path``) of a part in a higher layer."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    mine = part_of(name)
    if mine is None:
        return []
    bad = []
    for imported in imports(ast.parse(source), package, run_time_only=False):
        theirs = part_of(imported) if imported.startswith("rill.") else None
        if theirs is not None and theirs != mine and layers.get(theirs, -1) > layers[mine]:
            bad.append(f"{imported} (layer {layers[theirs]} > {layers[mine]})")
    return bad


def run_time_cycles(files: dict[str, str], packages: frozenset[str] = frozenset()) -> list[list[str]]:
    """Cycles among module-level imports of ``{module: source}`` (strongly connected
    components); ``packages`` names the modules that are packages (their ``__init__``)."""
    graph: dict[str, set[str]] = {}
    for name, source in files.items():
        package = name if name in packages else name.rpartition(".")[0]
        edges = set()
        for imported in imports(ast.parse(source), package, run_time_only=True):
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges.add(imported)
        graph[name] = edges
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


FILES = sorted(p for p in SRC.rglob("*.py") if "_pb" not in p.parts)


def test_the_document_has_a_layer_for_every_part_of_rill() -> None:
    assert LAYERS.get("errors") == 0 and LAYERS.get("protocols", 0) > LAYERS.get("engine", 99)
    parts = {part_of(module_name(p)) for p in FILES} - {None}
    missing = sorted(parts - set(LAYERS))
    assert not missing, f"docs/ARCHITECTURE.md gives no layer to {missing}"


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(SRC)) for p in FILES])
def test_imports_go_down_the_layers(path: Path) -> None:
    bad = upward_imports(path, path.read_text(), LAYERS)
    assert not bad, f"{path.relative_to(SRC)} imports up: {bad}"


def test_no_import_cycle_at_run_time() -> None:
    files = {module_name(p): p.read_text() for p in FILES}
    packages = frozenset(module_name(p) for p in FILES if p.name == "__init__.py")
    assert len(files) > 100
    assert run_time_cycles(files, packages) == []


def test_the_checks_catch_a_violation() -> None:
    # An engine module importing the frontend (layer 5 > 4), even inside a function.
    planted = "def f():\n    from rill.frontend import client\n"
    assert upward_imports(SRC / "engine" / "probe.py", planted, LAYERS) == [
        "rill.frontend (layer 5 > 4)",
        "rill.frontend.client (layer 5 > 4)",
    ]
    # Two modules importing each other at module level form a cycle; inside a function, not.
    assert run_time_cycles({"rill.a": "import rill.b\n", "rill.b": "from rill import a\n", "rill": ""}) == [
        ["rill.a", "rill.b"]
    ]
    assert run_time_cycles({"rill.a": "import rill.b\n", "rill.b": "def f():\n    import rill.a\n", "rill": ""}) == []
    assert layer_table("| 3 | `x`, `y` | z |\n| 4 | `w` | v |\n") == {"x": 3, "y": 3, "w": 4}
