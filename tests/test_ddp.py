"""Real multiprocess DDP on CPU (gloo): disjoint, complete, equal-length data per rank, and
exact resume. Each case runs ``tests/ddp_fit.py`` as its own program (Lightning launches
rank 1 by re-executing it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_datamodule import stream_pipeline

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "ddp_fit.py"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from stacklm.corpus import iter_default_corpus
    from stacklm.tokenizer.bpe import train_from_iterable

    d = tmp_path_factory.mktemp("tok")
    train_from_iterable(iter_default_corpus(400_000), 512).tokenizer.save(d / "tokenizer.stacklm.json")
    return d


def run_ddp(*args: str, expect_crash: bool = False) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if expect_crash:
        assert res.returncode != 0
    else:
        assert res.returncode == 0, res.stderr[-4000:]


def seen(out: Path) -> list[list]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_stream_mode_ddp_disjoint_equal_and_resumable(tokenizer_dir, tmp_path):
    pipe = json.dumps(stream_pipeline(total_tokens=16_000))
    common = ["--mode", "stream", "--tokenizer", str(tokenizer_dir), "--pipeline", pipe]
    run_ddp(*common, "--out", str(tmp_path / "full"))
    full = seen(tmp_path / "full")
    n = 16_000 // (2 * 2 * 64)
    assert len(full[0]) == len(full[1]) == n  # equal batch counts: the epoch ends together, no hang
    rows = [{h for s in rank for h in s[2]} for rank in full]
    assert not rows[0] & rows[1]  # the ranks read disjoint documents

    k = 5
    run_ddp(*common, "--out", str(tmp_path / "run1"), "--ckpt-every", str(k), "--crash-after", str(k + 2), expect_crash=True)
    ckpt = tmp_path / "run1" / "ckpt" / f"epoch=0-step={k}.ckpt"
    assert ckpt.exists()
    run_ddp(*common, "--out", str(tmp_path / "run2"), "--resume", str(ckpt))
    resumed = seen(tmp_path / "run2")
    for r in (0, 1):
        assert [s[1] for s in resumed[r]] == [s[1] for s in full[r][k:]]
