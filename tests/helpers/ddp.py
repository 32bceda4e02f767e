"""``tests/runners/ddp_fit.py`` run as its own program (Lightning launches the gloo ranks), and
what each rank recorded; shared by the DDP and preference tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.helpers.lightning import run_program

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "runners" / "ddp_fit.py"


def run_ddp(*args: str, expect_crash: bool = False) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = run_program([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, timeout=600)
    if expect_crash:
        assert res.returncode != 0
    else:
        assert res.returncode == 0, res.stderr[-4000:]


def seen(out: Path) -> list[list]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
