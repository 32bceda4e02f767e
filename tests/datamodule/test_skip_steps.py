"""``StackDataModule(skip_steps=[(a, b)])`` in shards mode with a real Trainer: a run passes over
the data steps ``a..b`` consumed and trains the rest in the same order, from a fresh start or a
resume, exact on resume and on another batch size, recorded in the checkpoint and the step log.

Precisely, with ``n = b - a + 1``: the skip run's step ``k`` trains the reference's step ``k``
for ``k < a`` and the reference's step ``k + n`` for ``k >= a`` (one epoch, world 1). In rows:
the skip run's row sequence is the reference's with rows ``[a*S, (b+1)*S)`` removed
(``S`` = rows per step of the run that consumed them)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from stacklm.datamodule import StackDataModule
from stacklm.errors import DataConfigError
from tests.helpers.lightning import TinyLM
from tests.helpers.cli import run

SEQ_LEN, BATCH = 64, 2


@pytest.fixture(scope="module")
def shards_dir(tokenizer_dir, tmp_path_factory):
    from tests.helpers.datamodule import build_shards

    return build_shards(tokenizer_dir, tmp_path_factory.mktemp("shards"), total_tokens=8_000)


class RowRecorder(L.Callback):
    """``steps[k]``: the hash of each row step ``k`` trained on, in order."""

    def __init__(self) -> None:
        self.steps: dict[int, list[str]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rows = [hashlib.sha256(r.numpy().tobytes()).hexdigest()[:12] for r in batch["input_ids"]]
        self.steps.setdefault(trainer.global_step, []).extend(rows)

    def flat(self) -> list[str]:
        return [r for k in sorted(self.steps) for r in self.steps[k]]


def dm(tokenizer_dir, shards_dir, **kw):
    args = dict(mode="shards", tokenizer=str(tokenizer_dir), data_dir=str(shards_dir), seq_len=SEQ_LEN, batch_size=BATCH)
    return StackDataModule(**{**args, **kw})


def fit(root, datamodule, steps, ckpt_every=None, ckpt_path=None) -> RowRecorder:
    rec = RowRecorder()
    callbacks = [rec] + ([ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=ckpt_every, save_top_k=-1)] if ckpt_every else [])
    L.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=1, callbacks=callbacks, logger=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
              default_root_dir=root).fit(TinyLM(512), datamodule=datamodule, ckpt_path=ckpt_path)
    return rec


@pytest.mark.slow
def test_skip_steps_pass_over_exactly_those_rows_and_resume_exactly(tokenizer_dir, shards_dir, tmp_path):
    from stacklm.inspector.steps import step_provenance

    ref = fit(tmp_path / "ref", dm(tokenizer_dir, shards_dir), 14, ckpt_every=5)  # the run that spiked
    assert len(ref.steps) == 14 and all(len(r) == BATCH for r in ref.steps.values())
    # a fresh run with the skip from the start
    fresh = fit(tmp_path / "fresh", dm(tokenizer_dir, shards_dir, skip_steps=[(5, 8)], gate=False), 10)
    assert [fresh.steps[k] for k in range(10)] == [ref.steps[k if k < 5 else k + 4] for k in range(10)]
    # the way it is used: resume the spiked run from its step-5 checkpoint, skipping 5..8
    ckpt5 = tmp_path / "ref" / "ckpt" / "epoch=0-step=5.ckpt"
    skip = fit(tmp_path / "skip", dm(tokenizer_dir, shards_dir, skip_steps=[(5, 8)]), 10, ckpt_every=3, ckpt_path=ckpt5)
    assert [skip.steps[k] for k in range(5, 10)] == [ref.steps[k + 4] for k in range(5, 10)]
    saved = torch.load(tmp_path / "skip" / "ckpt" / "epoch=0-step=6.ckpt", map_location="cpu", weights_only=True)
    assert saved["StackDataModule"]["skips"] == [{"steps": [5, 8], "positions": [10, 18], "step_rows": 2}]
    # resume the skip run after the skip: the same batches as its uninterrupted run
    ckpt6 = tmp_path / "skip" / "ckpt" / "epoch=0-step=6.ckpt"
    again = fit(tmp_path / "again", dm(tokenizer_dir, shards_dir, skip_steps=[(5, 8)]), 10, ckpt_path=ckpt6)
    assert [again.steps[k] for k in range(6, 10)] == [skip.steps[k] for k in range(6, 10)]
    # ... and on another shape (batch 1: one row a step): the same rows in the same order
    other = fit(tmp_path / "other", dm(tokenizer_dir, shards_dir, skip_steps=[(5, 8)], batch_size=1), 14, ckpt_path=ckpt6)
    expected = ref.flat()[: 5 * BATCH] + ref.flat()[9 * BATCH:]  # the reference less the rows of steps 5..8
    assert other.flat() == expected[6 * BATCH : 6 * BATCH + 8]
    # the step log: step 6 of the skip run lists the rows it would have had (the reference's) as skipped
    ref6, skip6 = step_provenance(tmp_path / "ref", 6), step_provenance(tmp_path / "skip", 6)
    assert skip6["skip_steps"] == [{"steps": [5, 8], "positions": [10, 18], "step_rows": 2}]
    assert [r["row"] for r in skip6["rows"] if r.get("skipped")] == [r["row"] for r in ref6["rows"]]
    ref10 = step_provenance(tmp_path / "ref", 10)
    assert [r["row"] for r in skip6["rows"] if not r.get("skipped")] == [r["row"] for r in ref10["rows"]]
    code, out = run(tmp_path / "skip", "--step", 6)
    assert code == 0 and "step 6 is in skip_steps 5..8" in out and out.count("SKIPPED rank 0 batch -1") == BATCH
    # a skip that starts before the checkpoint's step cannot be honoured: those steps are trained
    with pytest.raises(DataConfigError, match=r"skip_steps \(5, 8\) starts before this run's step 10"):
        fit(tmp_path / "late", dm(tokenizer_dir, shards_dir, skip_steps=[(5, 8)]), 12,
            ckpt_path=tmp_path / "ref" / "ckpt" / "epoch=0-step=10.ckpt")


def test_skip_steps_are_checked(tokenizer_dir, shards_dir):
    from tests.helpers.datamodule import stream_pipeline

    for bad, message in (([(8, 5)], "0 <= first <= last"), ([(1, 4), (3, 6)], "overlap"), ([(-1, 2)], "0 <= first")):
        with pytest.raises(DataConfigError, match=message):
            dm(tokenizer_dir, shards_dir, skip_steps=bad)
    with pytest.raises(DataConfigError, match="only shards mode"):
        StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=stream_pipeline(), seq_len=SEQ_LEN,
                        batch_size=BATCH, skip_steps=[(1, 2)])


@pytest.mark.slow
def test_skip_steps_on_another_world_size(tokenizer_dir, shards_dir, tmp_path):
    """A 1-process run (batch 4) checkpointed at step 3, resumed on 2 gloo ranks (batch 4 each,
    8 rows a step) with skip_steps=[(3, 5)]: the rows the 1-process steps 3..5 consumed (12 rows
    of its order) are passed over, every other row of the epoch is trained once, in order."""
    from tests.helpers.lightning import global_rows

    def run(out, devices, *extra):
        import json
        import os
        import sys

        from tests.helpers.lightning import run_program

        root = Path(__file__).resolve().parents[2]
        args = ["--tokenizer", str(tokenizer_dir), "--data-dir", str(shards_dir), "--out", str(out), "--devices", str(devices),
                "--batch-size", "4", "--epochs", "1", *map(str, extra)]
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        res = run_program([sys.executable, str(root / "tests" / "runners" / "elastic_fit.py"), *args], cwd=root, env=env, timeout=600)
        assert res.returncode == 0, res.stderr[-4000:]
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]
        return {"ranks": ranks, "devices": devices, "batch": 4, "out": out}

    ref = run(tmp_path / "ref", 1, "--save-at", 3)
    ref_rows = [r for step in global_rows(ref)[0] for r in step if r is not None]
    two = run(tmp_path / "two", 2, "--resume", tmp_path / "ref" / "step3.ckpt", "--skip-steps", 3, 5)
    got = [r for step in global_rows(two, after=3)[0] for r in step if r is not None]
    assert got == ref_rows[3 * 4 :][3 * 4 :]  # from step 3 on, less the 3 x 4 rows of steps 3..5


def test_a_skip_range_costs_what_the_run_reaches_not_what_it_spans():
    """Issue 32.6: ``skip_steps: [[5, 100000000]]`` listed every step of the range (3 GB and
    growing). ``step_span`` jumps whole steps and epochs (the same positions as walking the steps
    one by one, checked on random cases with gaps), so the whole range resolves at once (the
    data after it is what the run without the skip trains at step b + 1, whatever max_steps is);
    the step log lists only the skipped steps the run reaches."""
    import random

    from stacklm.datamodule.resume.shards import LISTED_SKIPPED_STEPS, resolve_skips, skipped_rows, step_span, walk_steps

    rng = random.Random(0)
    for _ in range(300):
        rows, step_rows = rng.randint(1, 40), rng.randint(1, 7)
        gaps = sorted({(lo, lo + rng.randint(1, 30)) for lo in (rng.randint(0, 200) for _ in range(rng.randint(0, 3)))})
        gaps = [g for k, g in enumerate(gaps) if k == 0 or g[0] >= gaps[k - 1][1]]
        start, first, count = rng.randint(0, 60), rng.randint(0, 30), rng.randint(1, 30)
        try:
            walked = list(walk_steps(start, first + count, step_rows, rows, gaps))
        except ValueError:
            continue
        assert step_span(start, first, count, step_rows, rows, gaps) == (int(walked[first][0][0]), int(walked[-1][1]))
    whole = resolve_skips([], [(5, 100_000_000)], None, now=0, step_rows=2, num_rows=50)
    assert whole == [{"steps": [5, 100_000_000], "positions": [10, 200_000_002], "step_rows": 2}]
    listed = [step for step, _, _ in skipped_rows(whole, 50, 0, last_step=19)]
    assert listed == list(range(5, 20))  # what a run of max_steps 20 reaches
    assert sum(1 for _ in skipped_rows(whole, 50, 0)) == LISTED_SKIPPED_STEPS  # no step limit: bounded
