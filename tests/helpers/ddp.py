"""``tests/runners/ddp_fit.py`` run as its own program (Lightning launches the gloo ranks), and
what each rank recorded; shared by the DDP and preference tests.

The runners' ranks are forked (Lightning's ``ddp_fork``) unless a test asks for the launch users
run on a cluster, ``ddp``, which re-executes the program per rank: a re-executed rank pays the
whole Lightning import again (6-10 CPU-s here), a forked one inherits it. The test about that
launch sets ``spawn=True``; the runners read the choice from ``STACKLM_TEST_DDP``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.helpers.lightning import run_program

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "runners" / "ddp_fit.py"


DDP_ENV = "STACKLM_TEST_DDP"


def ddp_strategy(devices: int) -> str:
    """The runners' strategy: ``auto`` on one process, else forked ranks unless the test asked
    for re-executed ones (``spawn=True``)."""
    return "auto" if devices <= 1 else os.environ.get(DDP_ENV, "ddp_fork")


def run_ddp(*args: str, expect_crash: bool = False, spawn: bool = False) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", DDP_ENV: "ddp" if spawn else "ddp_fork"}
    res = run_program([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, timeout=600)
    if expect_crash:
        assert res.returncode != 0
    else:
        assert res.returncode == 0, res.stderr[-4000:]


def seen(out: Path) -> list[list]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
