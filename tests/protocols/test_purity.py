"""The pure files of every protocol import no I/O, engine, frontend or clock (STYLE §6.2, rule 2).

import-linter cannot police stdlib modules such as ``asyncio`` or ``socket``, so this test
walks the AST of each pure file (imports anywhere in the file, including inside functions)
and fails on a forbidden import or on ``await`` / ``async def``. One list of files and one
list of forbidden modules serve all six protocols and ``protocols/_shared``.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import rill.protocols

PROTOCOLS_DIR = Path(rill.protocols.__file__).parent

PURE_FILES = {
    "_shared": ("b64pcm.py", "errors.py", "jsonguard.py", "sse.py", "tool_calls.py"),
    "batch_ws": ("messages.py", "codec.py", "session.py", "store.py"),
    "chat_ws": ("messages.py", "codec.py", "session.py", "segmenter.py", "queue.py"),
    "evergreen": ("errors.py", "prompt.py", "messages.py", "codec.py", "session.py"),
    "framed_uds": ("framing.py", "messages.py", "codec.py", "session.py"),
    "generate_ws": ("messages.py", "codec.py", "session.py", "actions.py", "deltas.py", "ratelimit.py"),
    "openai_http": ("messages.py", "codec.py", "session.py"),
}
"""Protocol folder → its pure files (everything but ``adapter.py`` and build tools)."""

FORBIDDEN = (
    # I/O, concurrency and clocks
    "asyncio", "socket", "threading", "selectors", "sqlite3", "time", "os", "pathlib", "io", "open",
    # web and RPC frameworks, tensors
    "starlette", "uvicorn", "websockets", "grpc", "torch",
    # media decoders (chat_ws/media.py owns them)
    "PIL", "av",
    # layers above the pure files
    "rill.engine", "rill.frontend", "rill.server", "rill.config", "rill.feedback",
)
"""Modules a pure file may not import (each with its submodules)."""

MEDIA_ALLOWED = ("io", "PIL", "av")
"""``chat_ws/media.py`` decodes images, audio and video in memory; it may use these, nothing else above."""


def imported_modules(path: Path, package: str) -> list[str]:
    """Every module ``path`` imports, relative imports resolved against ``package``."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            names.append(importlib.util.resolve_name(module, package) if node.level else module)
    return names


def forbidden_in(names: list[str], forbidden: tuple[str, ...]) -> list[str]:
    """The names that are, or are inside, a forbidden module."""
    return [name for name in names if any(name == root or name.startswith(root + ".") for root in forbidden)]


@pytest.mark.parametrize(
    ("protocol", "name"),
    [(protocol, name) for protocol, names in PURE_FILES.items() for name in names],
    ids=lambda value: value,
)
def test_pure_file_imports(protocol: str, name: str) -> None:
    path = PROTOCOLS_DIR / protocol / name
    bad = forbidden_in(imported_modules(path, f"rill.protocols.{protocol}"), FORBIDDEN)
    assert not bad, f"{protocol}/{name} imports {bad}"
    tree = ast.parse(path.read_text())
    assert not any(isinstance(node, (ast.Await, ast.AsyncFunctionDef)) for node in ast.walk(tree)), (
        f"{protocol}/{name}: no await in a pure file"
    )


def test_media_touches_no_socket_or_engine() -> None:
    forbidden = tuple(root for root in FORBIDDEN if root not in MEDIA_ALLOWED)
    bad = forbidden_in(imported_modules(PROTOCOLS_DIR / "chat_ws" / "media.py", "rill.protocols.chat_ws"), forbidden)
    assert not bad, f"chat_ws/media.py imports {bad}"
