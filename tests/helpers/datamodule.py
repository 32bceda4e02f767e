"""The tests' two-source stream mix, its prebuilt shards, a stream ``StackDataModule`` and the crash-and-resume run through a real ``Trainer``, shared by the datamodule, DDP, elastic, remote and report tests."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
import pytest

from stacklm.datamodule import StackDataModule
from tests.helpers.lightning import BatchRecorder, TinyLM


SEQ_LEN, BATCH = 64, 2


def build_shards(tokenizer_dir, out, total_tokens: int = 20_000):  # noqa: F811
    """Prebuilt shards of ``stream_pipeline``'s two-source mix at the tests' seq_len and batch."""
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.prebuild import prebuild

    cfg = PipelineConfig.from_dict({**stream_pipeline(total_tokens=total_tokens), "seq_len": SEQ_LEN, "batch_size": BATCH})
    prebuild(cfg, tokenizer_dir, out, tokens_per_shard=SEQ_LEN * 64, progress=False)
    return out


def stream_pipeline(total_tokens: int = 12_000) -> dict:
    return {
        "mix": {
            "name": "tiny",
            "total_tokens": total_tokens,
            "entries": [
                {"name": "web", "kind": "synthetic", "weight": 0.7, "domain": "prose", "seed": 1, "num_docs": 2000},
                {"name": "code", "kind": "synthetic", "weight": 0.3, "domain": "code", "seed": 2, "num_docs": 800},
            ],
        },
        "shuffle_buffer": 16,
        "pack_buffer_docs": 16,
        "holdout_fraction": 0.1,
        "tokenize_batch_docs": 8,
    }


def stream_dm(tokenizer_dir, **kw) -> StackDataModule:
    args = dict(mode="stream", tokenizer=str(tokenizer_dir), pipeline=stream_pipeline(), seq_len=SEQ_LEN,
                batch_size=BATCH, num_workers=0, val_batches=2)
    args.update(kw)
    return StackDataModule(**args)


def crash_and_resume(tokenizer_dir, tmp_path, steps: int, k: int, **kw):
    """The uninterrupted run's batches, and those of a run that checkpointed at step ``k``,
    crashed two steps later and was resumed from that checkpoint by a fresh Trainer."""
    full = BatchRecorder()
    cpu_trainer(tmp_path / "full", [full], steps).fit(TinyLM(512), datamodule=stream_dm(tokenizer_dir, **kw))
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=k, save_top_k=-1)
    crashed = BatchRecorder(crash_after_step=k + 2)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        cpu_trainer(tmp_path / "run1", [ckpt, crashed], steps).fit(TinyLM(512), datamodule=stream_dm(tokenizer_dir, **kw))
    path = tmp_path / "ckpt" / f"epoch=0-step={k}.ckpt"
    assert path.exists(), sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert crashed.seen[:k] == full.seen[:k]
    resumed = BatchRecorder()
    cpu_trainer(tmp_path / "run2", [resumed], steps).fit(TinyLM(512), datamodule=stream_dm(tokenizer_dir, **kw), ckpt_path=path)
    return full.seen, resumed.seen


def cpu_trainer(tmp_path, callbacks, max_steps):
    return L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=1, callbacks=callbacks,
        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp_path, num_sanity_val_steps=0,
    )
