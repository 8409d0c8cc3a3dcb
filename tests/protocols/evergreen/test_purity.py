"""The pure files of evergreen import no I/O, no engine, no frontend (STYLE §6.2)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rill.protocols.evergreen as package

PURE_FILES = ["errors.py", "prompt.py", "messages.py", "codec.py", "session.py"]
FORBIDDEN = ("asyncio", "socket", "threading", "selectors", "starlette", "grpc", "torch", "rill.engine",
             "rill.frontend", "rill.server", "os", "pathlib", "io", "open")


@pytest.mark.parametrize("name", PURE_FILES)
def test_pure_file_imports(name: str) -> None:
    tree = ast.parse((Path(package.__file__).parent / name).read_text())
    imported: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append(node.module or "")
        assert not isinstance(node, (ast.Await, ast.AsyncFunctionDef)), f"{name}: no await in a pure file"
    bad = [m for m in imported if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"{name} imports {bad}"
