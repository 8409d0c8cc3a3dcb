"""The pure files of generate_ws import no I/O, no engine and no web framework (STYLE §6.2)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rill.protocols.generate_ws as pkg

PURE = ("messages", "codec", "session", "actions", "deltas", "ratelimit")
FORBIDDEN = ("asyncio", "socket", "threading", "sqlite3", "starlette", "uvicorn", "websockets", "grpc", "torch",
             "rill.engine", "rill.frontend", "rill.server", "rill.feedback")


@pytest.mark.parametrize("name", PURE)
def test_pure_module_imports(name: str) -> None:
    tree = ast.parse((Path(pkg.__file__).parent / f"{name}.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    bad = {mod for mod in imported for root in FORBIDDEN if mod == root or mod.startswith(root + ".")}
    assert not bad, f"{name}.py imports {sorted(bad)}"
    assert not any(isinstance(node, (ast.Await, ast.AsyncFunctionDef)) for node in ast.walk(tree))
