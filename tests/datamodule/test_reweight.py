"""Online re-weighting (``StackDataModule.set_mix_weights``) through a real Lightning Trainer with
two loader workers: the change takes effect at the step given, and a resume from a checkpoint
taken before or after it replays identically."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from stacklm.data.packing.nodes import DELIVERY_KEY
from stacklm.data.sources import ShardSpec
from stacklm.datamodule import StackDataModule
from stacklm.errors import DataConfigError
from stacklm.datamodule.stream import SUMMARY_KEY, _StreamIterator, first_local_batch
from tests.helpers.lightning import BatchRecorder, TinyLM, batch_hash
from tests.helpers.datamodule import stream_pipeline

STEPS, REGISTER_AT, AT_STEP = 16, 3, 8
# Synthetic documents are ~600 tokens: batches of 4 x 256 and small buffers, so the documents
# drawn after the change reach the batches within the run (buffers delay them, never reorder runs).
SEQ_LEN, BATCH = 256, 4
NEW = {"web": 0.05, "code": 0.95}


def _dm(tokenizer_dir, **kw) -> StackDataModule:
    pipeline = {**stream_pipeline(total_tokens=40_000), "shuffle_buffer": 2, "pack_buffer_docs": 2}
    args = {"mode": "stream", "tokenizer": str(tokenizer_dir), "pipeline": pipeline, "seq_len": SEQ_LEN,
            "batch_size": BATCH, "num_workers": 2, "val_batches": 0}
    args.update(kw)
    return StackDataModule(**args)


def _trainer(root, callbacks):
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, max_epochs=1, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
        num_sanity_val_steps=0,
    )


class Reweigh(L.Callback):
    """What a DoReMi-style callback does: at one step, register new weights for a later step."""

    def __init__(self, register_at: int, at_step: int, weights: dict) -> None:
        self.register_at, self.at_step, self.weights = register_at, at_step, weights

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.register_at:
            trainer.datamodule.set_mix_weights(self.weights, at_step=self.at_step)


def _reference(tokenizer_dir, change_batch: int | None, n: int) -> tuple[list[str], list[list[int]]]:
    """The rank's batches computed in this process, independently of the loader: each worker's
    stream built directly, the change applied at that worker's first batch dealt at
    ``change_batch`` or later, dealt round-robin as the loader does. Also, per worker, the
    tokens its mixer had drawn before each of its batches."""
    dm = _dm(tokenizer_dir)
    dm.setup("fit")
    ds = dm._mode._dataset("train", dm._run())
    ds.mix_changes = [] if change_batch is None else [{"step": change_batch, "batch": change_batch, "weights": NEW}]
    ds.n_batches = ds.n_batches_total // 2
    its = [_StreamIterator(ds, ShardSpec(0, 1, w, 2)) for w in range(2)]
    out, drawn = [], [[], []]
    for b in range(n):
        it = its[b % 2]
        drawn[b % 2].append(int(it._graph().mix.mixer.tokens.sum()))
        batch = dict(next(it))
        batch.pop(SUMMARY_KEY, None)
        batch.pop(DELIVERY_KEY, None)  # the loader takes both off in the main process
        out.append(batch_hash(batch))
    return out, drawn


def test_first_local_batch_maps_the_round_robin_deal():
    for workers in (1, 2, 3):
        for batch in range(12):
            for w in range(workers):
                j = first_local_batch(batch, w, workers)
                assert j * workers + w >= batch and (j == 0 or (j - 1) * workers + w < batch)


@pytest.mark.slow
def test_weights_change_at_the_step_given_and_resume_replays(tokenizer_dir, tmp_path):
    dm = _dm(tokenizer_dir)
    run = BatchRecorder()
    _trainer(tmp_path / "a", [Reweigh(REGISTER_AT, AT_STEP, NEW), run]).fit(TinyLM(512), datamodule=dm)
    got = [h for _, h in run.seen]
    assert [s for s, _ in run.seen] == list(range(STEPS))

    at, _ = _reference(tokenizer_dir, AT_STEP, STEPS)
    none, drawn = _reference(tokenizer_dir, None, STEPS)
    assert at != none  # the change shows in the batches
    assert got == at  # the trainer saw exactly the batches of a change at AT_STEP
    assert got[:AT_STEP] == none[:AT_STEP]
    assert dm._train_loader.restarts == 1
    # each worker re-weighted right before the batch it deals at AT_STEP: its mixer had drawn
    # what the reference drew before that batch (and a step earlier would be another position)
    for w in range(2):
        j = first_local_batch(AT_STEP, w, 2)
        phases_w = dm._train_loader.worker_summaries[w]["mix_phases"]
        assert phases_w[1]["name"] == f"step{AT_STEP}"
        assert phases_w[1]["entered_at_tokens"] == drawn[w][j]
    assert any(drawn[w][first_local_batch(AT_STEP - 1, w, 2)] != drawn[w][first_local_batch(AT_STEP, w, 2)] for w in range(2))

    stats = dm.data_stats()
    phases = {p["name"]: p for p in stats["mix_phases"]}
    assert list(phases) == ["all", f"step{AT_STEP}"]
    late = phases[f"step{AT_STEP}"]
    assert late["readers_entered"] == 2 and sum(late["tokens"].values()) > 0
    assert late["realized_share"]["code"] > 0.8 > phases["all"]["realized_share"]["code"]

    # crash after step 12; resume from a checkpoint before the change took effect (5) and after (10)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    crashed = BatchRecorder(crash_after_step=12)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        _trainer(tmp_path / "b", [Reweigh(REGISTER_AT, AT_STEP, NEW), ckpt, crashed]).fit(TinyLM(512), datamodule=_dm(tokenizer_dir))
    assert [h for _, h in crashed.seen] == got[:len(crashed.seen)]
    for k in (5, 10):
        path = tmp_path / "ckpt" / f"epoch=0-step={k}.ckpt"
        saved = torch.load(path, weights_only=True)["StackDataModule"]["mix_changes"]
        assert saved == [{"step": AT_STEP, "batch": AT_STEP, "weights": NEW}]
        resumed = BatchRecorder()
        # no Reweigh callback: the change comes back from the checkpoint alone
        _trainer(tmp_path / f"r{k}", [resumed]).fit(TinyLM(512), datamodule=_dm(tokenizer_dir), ckpt_path=path)
        assert [h for _, h in resumed.seen] == got[k:], k


def test_bad_re_weightings_are_named(tokenizer_dir):
    dm = _dm(tokenizer_dir)
    with pytest.raises(DataConfigError, match="exactly the sources"):
        dm.set_mix_weights({"web": 1.0})
    with pytest.raises(DataConfigError, match="exactly the sources"):
        dm.set_mix_weights({"web": 0.0, "code": 0.0})
    with pytest.raises(DataConfigError, match="stream mode"):
        StackDataModule(mode="shards", tokenizer=str(tokenizer_dir), data_dir="x").set_mix_weights(NEW)
    dm.set_mix_weights(NEW, at_step=4)  # before fit: resolved when the loader is made
    assert dm.resolved_mix_changes() == [{"step": 4, "batch": 4, "weights": NEW}]
