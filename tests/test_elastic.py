"""Elastic shards-mode resume through a real Lightning ``Trainer``, with real DDP on CPU (gloo).

A two-epoch one-process run is the reference: the rows it trains on, in order, epoch by
epoch. Runs stopped mid-epoch are resumed on another shape — world 1->2, 2->1, 2->3, workers
0<->2, batch 4->8, and everything at once inside the second epoch — and the rows the first
run trained before the checkpoint plus those the resumed run trained after it must be the
reference's, row by row, in the same order, every row of each epoch once, padding only in an
epoch's last step. Each run is ``tests/elastic_fit.py`` as its own program.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_datamodule import shards_dir, tokenizer_dir  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "elastic_fit.py"


def fit(tokenizer_dir, shards_dir, out: Path, *, devices=1, workers=0, batch=4, save_at=(), resume=None) -> dict:
    args = ["--tokenizer", str(tokenizer_dir), "--data-dir", str(shards_dir), "--out", str(out), "--devices", str(devices),
            "--workers", str(workers), "--batch-size", str(batch)]
    if save_at:
        args += ["--save-at", *map(str, save_at)]
    if resume:
        args += ["--resume", str(resume)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]
    lengths = [json.loads((out / f"lengths{r}.json").read_text()) for r in range(devices)]
    return {"ranks": ranks, "lengths": lengths, "devices": devices, "batch": batch, "out": out}


def global_rows(run: dict, *, before: int | None = None, after: int | None = None) -> dict[int, list]:
    """Data epoch -> the rows of every step in order (rank-major inside a step), padding kept
    as ``None``; only steps ``< before`` / ``>= after`` (global step at the batch's start)."""
    steps: dict[tuple[int, int], dict[int, list]] = {}
    for rank, records in enumerate(run["ranks"]):
        for data_epoch, lightning_epoch, step, rows in records:
            assert data_epoch == lightning_epoch, f"data epoch {data_epoch} trained as Lightning epoch {lightning_epoch}"
            assert len(rows) == run["batch"]
            if (before is None or step < before) and (after is None or step >= after):
                steps.setdefault((data_epoch, step), {})[rank] = rows
    out: dict[int, list] = {}
    for (epoch, _), per_rank in sorted(steps.items()):
        assert sorted(per_rank) == list(range(run["devices"])), "every rank trains every step"
        out.setdefault(epoch, []).append([r for rank in sorted(per_rank) for r in per_rank[rank]])
    return out


def check_epochs(steps_by_epoch: dict[int, list], reference: dict[int, list[str]], step_size: int) -> int:
    """Every epoch's rows are the reference's, in order; padding fills the last step only.
    Returns how many rows were checked."""
    assert sorted(steps_by_epoch) == sorted(reference)
    checked = 0
    for epoch, steps in steps_by_epoch.items():
        flat = [r for s in steps for r in s]
        real = [r for r in flat if r is not None]
        assert real == reference[epoch], f"epoch {epoch}: rows differ from the one-process epoch"
        assert all(None not in s for s in steps[:-1]), f"epoch {epoch}: padding before the last step"
        assert sum(r is None for r in steps[-1]) < step_size
        checked += len(real)
    return checked


@pytest.mark.slow
def test_shards_resume_on_any_shape_trains_every_row_once(tokenizer_dir, shards_dir, tmp_path):  # noqa: F811
    from stacklm.data.dataset import PackedMemmapDataset
    from tests.elastic_fit import row_ids

    ds = PackedMemmapDataset(shards_dir, "train")
    n = len(ds)
    everything = sorted(row_ids(ds.get_batch(list(range(n)))))
    per_epoch = math.ceil(n / 4)
    k0, k1 = 13, per_epoch + 7  # a step inside epoch 0, one inside epoch 1

    ref_run = fit(tokenizer_dir, shards_dir, tmp_path / "ref", save_at=(k0, k1))
    ref_steps = global_rows(ref_run)
    reference = {e: [r for s in steps for r in s if r is not None] for e, steps in ref_steps.items()}
    assert sorted(reference) == [0, 1]
    for epoch, rows in reference.items():
        assert sorted(rows) == everything  # the one-process epoch: every row once
    assert reference[0] != reference[1]  # each epoch draws a new order
    assert ref_run["lengths"][0] == [[0, per_epoch], [1, per_epoch]]
    check_epochs(ref_steps, reference, 4)

    two = fit(tokenizer_dir, shards_dir, tmp_path / "two", devices=2, workers=2, save_at=(9,))
    check_epochs(global_rows(two), reference, 8)  # 2 ranks x 2 workers: the same global order

    results = {}
    cases = [
        ("world 1->2", ref_run, k0, dict(devices=2)),
        ("workers 0->2", ref_run, k0, dict(workers=2)),
        ("batch 4->8", ref_run, k0, dict(batch=8)),
        ("world 2->1, workers 2->0", two, 9, dict()),
        ("world 2->3", two, 9, dict(devices=3, workers=2)),
        ("in epoch 1: world 1->2, workers 0->2, batch 4->8", ref_run, k1, dict(devices=2, workers=2, batch=8)),
    ]
    for i, (name, first, k, shape) in enumerate(cases):
        resumed = fit(tokenizer_dir, shards_dir, tmp_path / f"case{i}", resume=first["out"] / f"step{k}.ckpt", **shape)
        head, tail = global_rows(first, before=k), global_rows(resumed)
        joined = {e: head.get(e, []) + tail.get(e, []) for e in sorted(set(head) | set(tail))}
        step = resumed["devices"] * resumed["batch"]
        rows = check_epochs(joined, reference, step)
        # Lightning's length of the resumed epoch: the steps before + the rows left at the new
        # shape; the next epoch is whole at the new shape
        e0 = 0 if k < per_epoch else 1
        before = len(head.get(e0, []))
        old_step = first["devices"] * first["batch"]
        want = [[e0, before + math.ceil((n - before * old_step) / step)]] + ([[1, math.ceil(n / step)]] if e0 == 0 else [])
        assert all(lengths == want for lengths in resumed["lengths"]), (name, resumed["lengths"], want)
        results[name] = rows
    print("elastic grid (rows checked against the one-process epochs):", json.dumps(results))
    assert all(v >= n for v in results.values())
