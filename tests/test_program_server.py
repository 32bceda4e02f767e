"""``tests.helpers.program_server``: a runner program forked from the preloaded server ends as the
same program run by a fresh interpreter would (status, output, environment, working directory),
so the tests that run fits through it see what a real program gives them."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.helpers.lightning import run_program
from tests.helpers.program_server import can_serve

ROOT = Path(__file__).resolve().parents[1]
PROBE = ROOT / "tests" / "runners" / "exit_probe.py"


@pytest.mark.parametrize("how, status", [("0", 0), ("3", 3), ("raise", 1), ("kill", -signal.SIGKILL)])
def test_a_served_program_ends_as_a_fresh_one(tmp_path, how, status):
    env = {**os.environ, "PROBE_VAR": "seen"}
    cmd = [sys.executable, str(PROBE), how, str(tmp_path / "seen.json")]
    assert can_serve(cmd, env)
    served = run_program(cmd, cwd=tmp_path, env=env, timeout=120)
    fresh = run_program(cmd, cwd=tmp_path, env={**env, "STACKLM_TEST_FRESH_PROGRAMS": "1"}, timeout=120)
    for res in (served, fresh):
        assert res.returncode == status
        assert res.stdout == "to stdout\n"
        assert res.stderr.startswith("to stderr\n")
        assert json.loads((tmp_path / "seen.json").read_text()) == {"cwd": str(tmp_path), "probe": "seen", "argv": [how, str(tmp_path / "seen.json")],
                                                                     "main": "__main__"}
    if how == "raise":
        assert "ValueError: the probe raised" in served.stderr and "ValueError: the probe raised" in fresh.stderr


def test_only_runner_scripts_without_the_reexecuted_launch_are_served():
    from tests.helpers.ddp import DDP_ENV

    assert not can_serve([sys.executable, "-c", "pass"], None)
    assert not can_serve([sys.executable, str(ROOT / "scripts" / "demo_report.py")], None)
    assert not can_serve([sys.executable, str(PROBE)], {DDP_ENV: "ddp"})
