"""The pure files of chat_ws import no I/O, engine, frontend or clock (STYLE §6.2, rule 2)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rill.protocols.chat_ws as package

PURE = [Path(package.__file__).parent / n for n in ("messages.py", "codec.py", "session.py", "segmenter.py", "queue.py")]
PURE.append(Path(package.__file__).parent.parent / "_shared" / "b64pcm.py")
FORBIDDEN = ("asyncio", "socket", "threading", "selectors", "time", "starlette", "websockets", "grpc", "torch",
             "rill.engine", "rill.frontend", "rill.server", "rill.config", "PIL", "av")


@pytest.mark.parametrize("path", PURE, ids=lambda p: p.name)
def test_pure_file_imports(path: Path) -> None:
    tree = ast.parse(path.read_text())
    imported: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported.append(node.module or "")
        assert not isinstance(node, (ast.Await, ast.AsyncFunctionDef)), f"{path.name}: no await in a pure file"
    bad = [m for m in imported if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert not bad, f"{path.name} imports {bad}"


def test_media_touches_no_socket_or_engine() -> None:
    tree = ast.parse((Path(package.__file__).parent / "media.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] in ("asyncio", "socket", "starlette", "torch")
                or m.startswith(("rill.engine", "rill.frontend"))]
