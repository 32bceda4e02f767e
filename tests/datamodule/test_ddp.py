"""Real multiprocess DDP on CPU (gloo): disjoint, complete, equal-length data per rank, and
exact resume. Each case runs ``tests/runners/ddp_fit.py`` as its own program; Lightning forks the
two ranks (``ddp_fork``), except in the shards case's first fit, which launches them the way a
cluster job does (``ddp``: rank 1 re-executes the program; tests/helpers/ddp.py says why only
there)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.datamodule import stream_pipeline
from tests.helpers.ddp import run_ddp, seen

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "runners" / "ddp_fit.py"


def test_stream_mode_ddp_disjoint_equal_and_resumable(tokenizer_dir, tmp_path):
    tokens = 6_000  # 23 steps a rank: the checkpoint at 5, the crash at 7 and a tail after it
    pipe = json.dumps(stream_pipeline(total_tokens=tokens))
    common = ["--mode", "stream", "--tokenizer", str(tokenizer_dir), "--pipeline", pipe]
    run_ddp(*common, "--out", str(tmp_path / "full"))
    full = seen(tmp_path / "full")
    n = tokens // (2 * 2 * 64)
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

    # stream mode is elastic (stacklm.datamodule.resume.logical): the same checkpoint resumed on one
    # process trains the rows the two ranks had left, each once (padding rows aside)
    import hashlib
    from collections import Counter

    import lightning as L

    from stacklm.data.contract import IGNORE_INDEX
    from stacklm.datamodule import StackDataModule
    from tests.helpers.lightning import TinyLM

    class Rows(L.Callback):
        def __init__(self):
            self.rows = Counter()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.rows.update(hashlib.sha256(r.numpy().tobytes()).hexdigest()[:16]
                             for r, t in zip(batch["input_ids"], batch["targets"]) if not bool((t == IGNORE_INDEX).all()))

    rec = Rows()
    dm = StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=json.loads(pipe), seq_len=64, batch_size=2,
                         val_batches=0)
    L.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[rec], logger=False, enable_progress_bar=False,
              enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path / "single").fit(
        TinyLM(dm.vocab_size), datamodule=dm, ckpt_path=ckpt)
    before = Counter(h for rank in full for s in rank if s[0] < k for h in s[2])
    assert before + rec.rows == Counter(h for rank in full for s in rank for h in s[2])


@pytest.mark.slow
def test_stream_mode_ddp_logged_counts_are_the_sum_of_what_both_ranks_trained_on(tokenizer_dir, tmp_path):
    """Two real gloo ranks, two loader workers each: the logged per-source tokens (summed over
    ranks by the callback) equal the non-pad tokens both ranks' batches held, at every log step.
    Rank 1's next batch comes 0.3 s late after every step: the logged wait is the slowest rank's
    (the maximum over ranks), at least the seconds it slept. (Rank 0 waits as long: Lightning
    syncs ``should_stop`` over the ranks after every step, so a late batch on one rank holds
    every rank's next step; ``tests/train/test_logging.py`` pins the reduction itself.)"""
    import csv

    pipe = json.dumps(stream_pipeline(total_tokens=16_000))
    out = tmp_path / "stats"
    run_ddp("--mode", "stream", "--tokenizer", str(tokenizer_dir), "--pipeline", pipe, "--out", str(out),
            "--workers", "2", "--steps", "8", "--stats", "--slow-rank", "1")
    tallies = [{int(k): v for k, v in json.loads((out / f"tally{r}.json").read_text()).items()} for r in (0, 1)]
    (metrics,) = out.glob("csv/version_*/metrics.csv")
    rows = {int(r["step"]): r for r in csv.DictReader(open(metrics)) if r.get("data/tokens/web")}
    assert sorted(rows) == [2, 4, 6, 8]
    for step, row in rows.items():
        both = tallies[0][step][0] + tallies[1][step][0]
        assert float(row["data/tokens/web"]) + float(row["data/tokens/code"]) == both, step
        assert float(row["data/padding_fraction"]) == pytest.approx(1 - both / (2 * step * 2 * 63))
    slept = {int(k): v for k, v in json.loads((out / "slept1.json").read_text()).items()}
    for step in (4, 6, 8):  # a window of 2 steps, each followed by a sleep before the next batch
        row = rows[step]
        waited = sum(slept[s] for s in (step - 2, step - 1))  # the sleeps after the window's previous steps
        assert float(row["loader/wait_s"]) >= waited, (step, row["loader/wait_s"], waited)
        assert float(row["loader/wait_fraction"]) >= float(row["loader/wait_fraction_mean"]) > 0.5, step
        assert float(row["loader/wait_on_device"]) == 0.0  # CPU: the host clock


def _all_rows(shards_dir):
    import hashlib

    from stacklm.data.storage.dataset import PackedMemmapDataset

    ds = PackedMemmapDataset(shards_dir, "train")
    batch = ds.get_batch(list(range(len(ds))))
    return [hashlib.sha256(r.numpy().tobytes()).hexdigest()[:16] for r in batch["input_ids"]]


def _pad_row(shards_dir):
    """The row hash of a padding row (``tests/runners/ddp_fit.py`` hashes input ids only)."""
    import hashlib

    from stacklm.data.storage.dataset import PackedMemmapDataset
    from stacklm.datamodule.stream import _padding_batch

    ds = PackedMemmapDataset(shards_dir, "train")
    return hashlib.sha256(_padding_batch(1, ds.seq_len, ds.pad_id)["input_ids"][0].numpy().tobytes()).hexdigest()[:16]


def test_shards_mode_ddp_covers_the_epoch_once_and_resumes_elastically(tokenizer_dir, small_shards_dir, tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from stacklm.datamodule import StackDataModule
    from tests.helpers.lightning import TinyLM

    everything = _all_rows(small_shards_dir)
    common = ["--mode", "shards", "--tokenizer", str(tokenizer_dir), "--data-dir", str(small_shards_dir)]
    run_ddp(*common, "--out", str(tmp_path / "full"), spawn=True)
    full = seen(tmp_path / "full")
    assert len(full[0]) == len(full[1]) == -(-len(everything) // (2 * 2))  # equal steps; the last one padded
    pad = _pad_row(small_shards_dir)
    rows = [[h for s in rank for h in s[2] if h != pad] for rank in full]
    assert not set(rows[0]) & set(rows[1])
    served = rows[0] + rows[1]
    assert sorted(served) == sorted(everything)  # every row of the epoch, once

    # stop a 2-rank run after k steps, resume the checkpoint on ONE process: elastic resume
    k = 4
    run_ddp(*common, "--out", str(tmp_path / "run1"), "--ckpt-every", str(k), "--crash-after", str(k + 2), expect_crash=True)
    first = seen(tmp_path / "run1")
    before = [h for rank in first for s in rank[:k] for h in s[2]]

    class Rows(Callback):
        rows: list = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            import hashlib

            self.rows += [hashlib.sha256(r.numpy().tobytes()).hexdigest()[:16] for r in batch["input_ids"]]

    rec = Rows()
    dm = StackDataModule(mode="shards", tokenizer=str(tokenizer_dir), data_dir=str(small_shards_dir), seq_len=64, batch_size=2, val_batches=0)
    L.Trainer(accelerator="cpu", devices=1, max_epochs=1, callbacks=[rec], logger=False, enable_progress_bar=False,
              enable_model_summary=False, default_root_dir=tmp_path / "single").fit(
        TinyLM(dm.vocab_size), datamodule=dm, ckpt_path=tmp_path / "run1" / "ckpt" / f"epoch=0-step={k}.ckpt")
    after = rec.rows
    after = [h for h in after if h != pad]
    assert sorted(before + after) == sorted(everything)  # nothing repeated or dropped across the reshape
