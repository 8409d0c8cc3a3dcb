"""The house's figures: how much glue each protocol carries and how the layers hold.

Prints, for the tree under ``--src`` (default: this checkout's ``src``):

* lines per adapter (``protocols/*/adapter.py``) and in the shared driver;
* ``perform`` chains: functions in ``src/rill/protocols`` that dispatch a session's actions
  with two or more ``isinstance(<action>, ...)`` tests;
* stream pumps: ``async for ... in <something>stream`` loops in ``src/rill/protocols``;
* ``hasattr`` / ``getattr`` probes in ``src/rill``: a constant member name asked of an object
  (not of a module such as ``os``), each listed with ``--list``;
* imports running back up the layers (``RANKS``) and import cycles among modules at
  run time (module-level imports only: ``TYPE_CHECKING`` blocks and imports inside
  functions are not run when a module is imported);
* modules over 400 lines and functions over 50 lines.

``duplicates`` pairs are counted by the ``duplicates`` tool, outside this script.

    .venv/bin/python benchmarks/house.py [--src DIR] [--list]
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the import walk, the cycle search and the layer table are the tests' own

from tests.test_architecture import imports, layer_table, run_time_cycles  # noqa: E402

RANKS = layer_table((ROOT / "docs" / "ARCHITECTURE.md").read_text())
"""Each top-level part of ``rill`` and its layer, read from ``docs/ARCHITECTURE.md`` (this
checkout's, also when ``--src`` names an older tree): a module may import only its own layer
or lower; a part missing there is not checked."""


def module_name(src: Path, path: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULE_OBJECTS = {"os", "socket", "torch", "transformers", "libc", "_libc", "importlib", "module", "struct"}
"""Names of modules: asking a module (or a C library) what it has is a platform check, not a probe."""


def _is_probe(node: ast.AST) -> bool:
    """``hasattr(obj, "name")`` or ``getattr(obj, "name", default)`` on an object rill types:
    asking an object whether it has a member its type should promise. Reflection over a
    struct's own fields (``getattr(self, name)`` with a variable name) is not a probe."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")):
        return False
    if len(node.args) < 2 or not (isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return False
    if node.func.id == "getattr" and len(node.args) < 3:
        return False
    base = node.args[0]
    while isinstance(base, ast.Attribute):
        base = base.value
    return not (isinstance(node.args[0], ast.Name) and node.args[0].id in MODULE_OBJECTS)


def _group(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "rill"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", default=str(Path(__file__).resolve().parent.parent / "src"))
    parser.add_argument("--list", action="store_true", help="name every probe, upward import and long function")
    args = parser.parse_args()
    src = Path(args.src)
    root = src / "rill"
    files = sorted(p for p in root.rglob("*.py") if "_pb" not in p.parts)
    modules = {module_name(src, p): p for p in files}

    print("lines per adapter:")
    for p in sorted(root.glob("protocols/*/adapter.py")):
        print(f"  {p.parent.name:14s} {len(p.read_text().splitlines()):5d}")
    for p in sorted(root.glob("protocols/_shared/driver*.py")):
        print(f"  _shared/{p.name:8s} {len(p.read_text().splitlines()):5d} (the driver)")

    chains, pumps, probes, long_functions, long_modules = [], [], [], [], []
    upward = []
    for name, path in modules.items():
        source = path.read_text()
        tree = ast.parse(source)
        rel = path.relative_to(src)
        lines = len(source.splitlines())
        if lines > 400:
            long_modules.append((lines, str(rel)))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 50:
                    long_functions.append((length, f"{rel}:{node.lineno} {node.name}"))
                if "protocols" in rel.parts:
                    tests = [
                        n
                        for n in ast.walk(node)
                        if isinstance(n, ast.Call)
                        and isinstance(n.func, ast.Name)
                        and n.func.id == "isinstance"
                        and n.args
                        and isinstance(n.args[0], ast.Name)
                        and n.args[0].id in ("action", "command")
                    ]
                    if len(tests) >= 2:
                        chains.append(f"{rel}:{node.lineno} {node.name}")
            if isinstance(node, ast.AsyncFor) and "protocols" in rel.parts:
                target = ast.unparse(node.iter)
                if "stream" in target.lower():
                    pumps.append(f"{rel}:{node.lineno} async for ... in {target}")
            if _is_probe(node):
                probes.append(f"{rel}:{node.lineno} {ast.unparse(node)[:90]}")
        for imported in imports(tree, package, run_time_only=False):
            if imported.startswith("rill.") and _group(imported) != _group(name):
                mine, theirs = RANKS.get(_group(name)), RANKS.get(_group(imported))
                if mine is not None and theirs is not None and theirs > mine:
                    upward.append(f"{rel} imports {imported}")
    packages = frozenset(name for name, path in modules.items() if path.name == "__init__.py")
    cycles = run_time_cycles({name: path.read_text() for name, path in modules.items()}, packages)

    def show(title: str, items: list) -> None:
        print(f"{title}: {len(items)}")
        if args.list:
            for item in sorted(items):
                print(f"    {item if isinstance(item, str) else item[1] + ' (' + str(item[0]) + ')'}")

    show("perform chains", chains)
    show("stream pumps", pumps)
    show("hasattr/getattr probes on objects in src/rill", probes)
    show("imports running back up", sorted(set(upward)))
    show("import cycles at run time", [" <-> ".join(c) for c in cycles])
    show("modules over 400 lines", long_modules)
    show("functions over 50 lines", long_functions)


if __name__ == "__main__":
    main()
