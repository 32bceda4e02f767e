"""Elastic shards-mode resume through a real Lightning ``Trainer``, with real DDP on CPU (gloo).

A two-epoch one-process run is the reference: the rows it trains on, in order, epoch by
epoch. Runs stopped mid-epoch are resumed on another shape — world 1->2, 2->1, 2->3, workers
0<->2, batch 4->8, and everything at once inside the second epoch — and the rows the first
run trained before the checkpoint plus those the resumed run trained after it must be the
reference's, row by row, in the same order, every row of each epoch once, padding only in an
epoch's last step. Each run is ``tests/runners/elastic_fit.py`` as its own program.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.lightning import run_program
from tests.helpers.lightning import global_rows

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "runners" / "elastic_fit.py"


def fit(tokenizer_dir, shards_dir, out: Path, *, devices=1, workers=0, batch=4, save_at=(), epoch_end=False, resume=None) -> dict:  # noqa: F811
    args = ["--tokenizer", str(tokenizer_dir), "--data-dir", str(shards_dir), "--out", str(out), "--devices", str(devices),
            "--workers", str(workers), "--batch-size", str(batch)]
    if save_at:
        args += ["--save-at", *map(str, save_at)]
    if epoch_end:
        args.append("--save-epoch-end")
    if resume:
        args += ["--resume", str(resume)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = run_program([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(devices)]
    lengths = [json.loads((out / f"lengths{r}.json").read_text()) for r in range(devices)]
    return {"ranks": ranks, "lengths": lengths, "devices": devices, "batch": batch, "out": out}


def check_epochs(steps_by_epoch: dict[int, list], reference: dict[int, list[str]]) -> int:
    """Every epoch's rows are the reference's, in order; padding fills the last step only.
    Returns how many rows were checked."""
    assert sorted(steps_by_epoch) == sorted(reference)
    checked = 0
    for epoch, steps in steps_by_epoch.items():
        flat = [r for s in steps for r in s]
        real = [r for r in flat if r is not None]
        assert real == reference[epoch], f"epoch {epoch}: rows differ from the one-process epoch"
        assert all(None not in s for s in steps[:-1]), f"epoch {epoch}: padding before the last step"
        assert sum(r is None for r in steps[-1]) < len(steps[-1])  # the padded step holds a row
        checked += len(real)
    return checked


@pytest.mark.slow
def test_shards_resume_on_any_shape_trains_every_row_once(tokenizer_dir, small_shards_dir, tmp_path):  # noqa: F811
    from stacklm.data.storage.dataset import PackedMemmapDataset
    from tests.helpers.lightning import row_ids

    ds = PackedMemmapDataset(small_shards_dir, "train")
    n = len(ds)
    everything = sorted(row_ids(ds.get_batch(list(range(n)))))
    per_epoch = math.ceil(n / 4)
    k0, k1 = 13, per_epoch + 7  # a step inside epoch 0, one inside epoch 1
    assert math.ceil(n / 8) > 9 and per_epoch > k0  # the saved steps below fall inside the epochs they name

    ref_run = fit(tokenizer_dir, small_shards_dir, tmp_path / "ref", save_at=(k0, k1), epoch_end=True)
    ref_steps = global_rows(ref_run)
    reference = {e: [r for s in steps for r in s if r is not None] for e, steps in ref_steps.items()}
    assert sorted(reference) == [0, 1]
    for rows in reference.values():
        assert sorted(rows) == everything  # the one-process epoch: every row once
    assert reference[0] != reference[1]  # each epoch draws a new order
    assert ref_run["lengths"][0] == [[0, per_epoch], [1, per_epoch]]
    check_epochs(ref_steps, reference)

    per_epoch_two = math.ceil(n / 8)
    two = fit(tokenizer_dir, small_shards_dir, tmp_path / "two", devices=2, workers=2, save_at=(9, per_epoch_two))
    check_epochs(global_rows(two), reference)  # 2 ranks x 2 workers: the same global order

    results = {}
    cases = [  # name, first run, its checkpoint, the step it holds, the new shape
        ("world 1->2", ref_run, f"step{k0}", k0, {"devices": 2}),
        ("workers 0->2", ref_run, f"step{k0}", k0, {"workers": 2}),
        ("batch 4->8", ref_run, f"step{k0}", k0, {"batch": 8}),
        ("world 2->1, workers 2->0", two, "step9", 9, {}),
        ("world 2->3", two, "step9", 9, {"devices": 3, "workers": 2}),
        ("in epoch 1: world 1->2, workers 0->2, batch 4->8", ref_run, f"step{k1}", k1, {"devices": 2, "workers": 2, "batch": 8}),
        # saved at the last step of an epoch (Lightning counts on from there) and at its end
        ("last step of epoch 0: world 2->1", two, f"step{per_epoch_two}", per_epoch_two, {}),
        ("end of epoch 0: world 1->2", ref_run, "epoch0-end", per_epoch, {"devices": 2}),
    ]
    for i, (name, first, ckpt, k, shape) in enumerate(cases):
        resumed = fit(tokenizer_dir, small_shards_dir, tmp_path / f"case{i}", resume=first["out"] / f"{ckpt}.ckpt", **shape)
        head, tail = global_rows(first, before=k), global_rows(resumed)
        joined = {e: head.get(e, []) + tail.get(e, []) for e in sorted(set(head) | set(tail))}
        step = resumed["devices"] * resumed["batch"]
        rows = check_epochs(joined, reference)
        # Lightning's length of the resumed epoch: the steps before + the rows left at the new
        # shape; the next epoch is whole at the new shape
        old_step = first["devices"] * first["batch"]
        if min(tail) == 0:
            before = len(head.get(0, []))
            want = [[0, before + math.ceil((n - before * old_step) / step)], [1, math.ceil(n / step)]]
        elif k == first["lengths"][0][0][1]:  # saved at the last step of epoch 0
            want = [[1, (k if k < math.ceil(n / step) else 0) + math.ceil(n / step)]]
        else:
            before = len(head.get(1, []))
            want = [[1, before + math.ceil((n - before * old_step) / step)]]
        assert all(lengths == want for lengths in resumed["lengths"]), (name, resumed["lengths"], want)
        results[name] = rows
    print("elastic grid (rows checked against the one-process epochs):", json.dumps(results))
    assert all(v >= n for v in results.values())


# ------------------------------------------------------------------ epochs draw new orders
def _stream_dm(tokenizer_dir, **kw):  # noqa: F811
    from stacklm.datamodule import StackDataModule
    from tests.helpers.datamodule import stream_pipeline

    args = {"mode": "stream", "tokenizer": str(tokenizer_dir), "pipeline": stream_pipeline(total_tokens=3_000), "seq_len": 64,
                "batch_size": 2, "num_workers": 0, "val_batches": 0}
    return StackDataModule(**{**args, **kw})


def assert_new_order(epoch0: list[str], epoch1: list[str]) -> None:
    """A new order: most positions hold another batch. (Not all: the tiny synthetic corpus has
    few, long documents, and a long document that starts a row packs into the same windows
    whatever precedes it.)"""
    same = sum(a == b for a, b in zip(epoch0, epoch1))
    assert epoch0[0] != epoch1[0] and same < len(epoch0) // 2, f"{same} of {len(epoch0)} batches in the same place"


def _loader_at(dm, epoch: int):
    dm.setup("fit")
    loader = dm.train_dataloader()
    if dm.mode == "shards":
        from stacklm.datamodule.resume.shards import start_position

        loader.load_state_dict({"position": start_position(epoch)})
    else:
        loader.epoch = epoch
    return loader


@pytest.mark.parametrize("mode", ["stream", "shards"])
def test_each_epoch_draws_a_new_order_and_resumes_exactly_inside_it(tokenizer_dir, shards_dir, mode):  # noqa: F811
    from tests.helpers.lightning import batch_hash
    from tests.helpers.resume import check_save_load_state

    kw = {"num_workers": 2} if mode == "stream" else {"mode": "shards", "data_dir": str(shards_dir), "pipeline": None}
    epoch0 = [batch_hash(b) for b in _loader_at(_stream_dm(tokenizer_dir, **kw), 0)]
    full = check_save_load_state(lambda: _loader_at(_stream_dm(tokenizer_dir, **kw), 1), lambda n: (1, n // 2),
                                 state_round_trip="torch")
    epoch1 = [batch_hash(b) for b in full]
    assert len(epoch0) == len(epoch1) >= 6
    assert_new_order(epoch0, epoch1)
    again = _loader_at(_stream_dm(tokenizer_dir, **kw), 1)
    assert [batch_hash(b) for b in again] == epoch1  # deterministic in (seed, epoch)
    # a fresh loader takes the epoch from the saved state
    fresh, saved = _loader_at(_stream_dm(tokenizer_dir, **kw), 0), again.state_dict()
    fresh.load_state_dict(saved)
    assert (fresh.epoch if mode == "stream" else fresh.position()["epoch"]) == 2 - (mode == "stream")


def test_stream_epochs_keep_the_holdout_and_reseed_mix_and_shuffle(tokenizer_512):
    from stacklm.data.quality.holdout import holdout_split
    from stacklm.data.pipeline import PipelineConfig, build_pipeline, epoch_seed
    from tests.helpers.datamodule import stream_pipeline

    cfg = PipelineConfig.from_dict({**stream_pipeline(total_tokens=3_000), "seq_len": 64, "batch_size": 2})
    pipes = [build_pipeline(cfg, tokenizer_512, "train", epoch=e) for e in (0, 1)]
    for pipe in pipes:  # the holdout keeps the config's seed: a val document never trains, in any epoch
        for chain in pipe.chains.values():
            assert chain["holdout"].seed == cfg.seed
        docs = []
        for chain in pipe.chains.values():
            node = chain["holdout"]
            node.reset()
            docs += [next(node) for _ in range(20)]
        assert all(holdout_split(d["text"], cfg.holdout_fraction, cfg.seed) == "train" for d in docs)
    assert pipes[0].mix.mixer.seed == cfg.seed and pipes[1].mix.mixer.seed == epoch_seed(cfg.seed, 1) != cfg.seed
    assert epoch_seed(cfg.seed, 2) not in (cfg.seed, epoch_seed(cfg.seed, 1))


def test_stream_trainer_epochs_differ_and_resume_inside_the_second(tokenizer_dir, tmp_path):  # noqa: F811
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests.helpers.lightning import BatchRecorder, TinyLM

    def trainer(root, callbacks):
        return L.Trainer(accelerator="cpu", devices=1, max_epochs=2, callbacks=callbacks, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, default_root_dir=root)

    full = BatchRecorder()
    trainer(tmp_path / "full", [full]).fit(TinyLM(512), datamodule=_stream_dm(tokenizer_dir, num_workers=1))
    per_epoch = len(full.seen) // 2
    assert len(full.seen) == 2 * per_epoch and per_epoch >= 6
    assert_new_order([h for _, h in full.seen[:per_epoch]], [h for _, h in full.seen[per_epoch:]])
    k = per_epoch + 3  # inside the second epoch
    crashed = BatchRecorder(crash_after_step=k + 1)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=k, save_top_k=-1)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        trainer(tmp_path / "run1", [ckpt, crashed]).fit(TinyLM(512), datamodule=_stream_dm(tokenizer_dir, num_workers=1))
    resumed = BatchRecorder()
    trainer(tmp_path / "run2", [resumed]).fit(TinyLM(512), datamodule=_stream_dm(tokenizer_dir, num_workers=1),
                                              ckpt_path=tmp_path / "ckpt" / f"epoch=1-step={k}.ckpt")
    assert resumed.seen == full.seen[k:]


# ------------------------------------------------------------------ content-addressed resume
def _fit_shards(root, data_dir, tokenizer_dir, *, steps, ckpt_every=None, ckpt_path=None, **kw):  # noqa: F811
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stacklm.datamodule import StackDataModule
    from tests.helpers.lightning import TinyLM

    dm = StackDataModule(**{**{"mode": "shards", "tokenizer": str(tokenizer_dir), "data_dir": str(data_dir), "seq_len": 64,
                                   "batch_size": 2, "val_batches": 0}, **kw})
    callbacks = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=ckpt_every, save_top_k=-1)] if ckpt_every else []
    L.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=1, callbacks=callbacks, logger=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
              enable_checkpointing=bool(ckpt_every), default_root_dir=root).fit(TinyLM(512), datamodule=dm, ckpt_path=ckpt_path)
    return dm


def test_a_moved_shard_dir_resumes_and_other_data_at_the_same_path_is_refused(tokenizer_dir, shards_dir, tmp_path):  # noqa: F811
    import shutil

    from stacklm.data.pipeline import PipelineConfig
    from stacklm.errors import DataConfigError
    from stacklm.datamodule.resume.identity import shards_content_hash
    from stacklm.prebuild import prebuild
    from tests.helpers.datamodule import stream_pipeline

    here = tmp_path / "here"
    shutil.copytree(shards_dir, here)
    _fit_shards(tmp_path / "a", here, tokenizer_dir, steps=3, ckpt_every=3)
    ckpt = tmp_path / "a" / "ckpt" / "epoch=0-step=3.ckpt"
    first = shards_content_hash(here)

    moved = tmp_path / "elsewhere" / "shards"
    shutil.move(here, moved)  # moved to another disk or node: the same content resumes
    dm = _fit_shards(tmp_path / "b", moved, tokenizer_dir, steps=5, ckpt_path=ckpt)
    assert dm._train_loader.position()["steps"] == 5

    # another dataset rebuilt where the first one was: refused, naming both content hashes
    cfg = PipelineConfig.from_dict({**stream_pipeline(total_tokens=16_000), "seq_len": 64, "batch_size": 2, "seed": 5})
    prebuild(cfg, tokenizer_dir, here, tokens_per_shard=64 * 64, progress=False)
    other = shards_content_hash(here)
    assert other != first
    with pytest.raises(DataConfigError, match="different data") as err:
        _fit_shards(tmp_path / "c", here, tokenizer_dir, steps=5, ckpt_path=ckpt)
    assert first in str(err.value) and other in str(err.value) and str(moved) not in str(err.value)


def test_sft_resume_on_another_shape_is_refused_before_a_step(tokenizer_dir, tmp_path):  # noqa: F811
    """Stream mode re-deals its logical streams on a new shape (tests/datamodule/test_elastic_stream.py);
    SFT mode cannot yet, and says so before the first step."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from stacklm.datamodule import StackDataModule
    from stacklm.errors import DataConfigError
    from tests.helpers.lightning import BatchRecorder, TinyLM
    from tests.helpers.sft import make_conversations, write_jsonl

    def trainer(root, callbacks, steps):
        return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, default_root_dir=root)

    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in make_conversations(60)])
    pipeline = {"sources": [{"name": "chats", "kind": "local", "path": [str(path)]}], "shuffle_buffer": 8,
                "pack_buffer_docs": 4, "holdout_fraction": 0.0}

    def _sft_dm(tokenizer_dir, **kw):
        args = {"mode": "sft", "tokenizer": str(tokenizer_dir), "pipeline": pipeline, "seq_len": 128, "batch_size": 2,
                "num_workers": 0, "val_batches": 0}
        return StackDataModule(**{**args, **kw})

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer(tmp_path / "a", [ckpt], 2).fit(TinyLM(512), datamodule=_sft_dm(tokenizer_dir))
    for change, kw in (("num_workers 0 -> 2", {"num_workers": 2}), ("batch_size 2 -> 4", {"batch_size": 4})):
        rec = BatchRecorder()
        with pytest.raises(DataConfigError, match=change) as err:
            trainer(tmp_path / "b", [rec], 4).fit(TinyLM(512), datamodule=_sft_dm(tokenizer_dir, **kw),
                                                   ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
        assert rec.seen == [] and "resume with the checkpoint's" in str(err.value)
