"""Load a script of ``bench/`` as a module, so a test runs its smallest configuration through the
script's own functions (the benches are programs, not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench(script: str) -> ModuleType:
    """``bench/<script>.py`` imported as ``bench_<script>`` (registered in ``sys.modules`` first:
    its dataclasses look their module up while the script runs)."""
    spec = importlib.util.spec_from_file_location(f"bench_{script}", BENCH / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
