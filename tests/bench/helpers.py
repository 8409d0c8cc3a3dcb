"""Loading a benchmark script (``benchmarks/*.py``) as a module for its tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(file_name: str, module_name: str) -> ModuleType:
    """``benchmarks/<file_name>`` as the module ``module_name`` (registered in ``sys.modules``,
    where a dataclass of the script looks itself up); the benchmarks folder, which the script
    puts on ``sys.path`` to import ``compare``, is taken off again, so that other tests never
    import the benchmarks' top-level modules (engine, sampler, ...) by accident."""
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / file_name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        while str(BENCHMARKS) in sys.path:
            sys.path.remove(str(BENCHMARKS))
    return module
