"""A checkpoint is whole or absent (``stacklm.datamodule.resume.checkpoint_file``): a disk that
fills up while a checkpoint is written leaves the previous good checkpoint, ``last.ckpt``
included, and no partial file under a checkpoint's name; the run fails naming the file, and
resumes from what is left."""

from __future__ import annotations

import errno

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import stacklm.atomic
from stacklm.atomic import TMP_MARK
from stacklm.datamodule.resume.checkpoint_file import WholeCheckpointIO
from tests.helpers.datamodule import cpu_trainer, stream_dm
from tests.helpers.lightning import TinyLM


def test_a_full_disk_leaves_the_last_good_checkpoint_and_no_half_file(tokenizer_dir, tmp_path, monkeypatch):  # noqa: F811
    folder = tmp_path / "ckpt"
    written = []
    real_write_all = stacklm.atomic._write_all

    def disk_fills_at_the_second_step_checkpoint(f, data):
        """Writes into the checkpoint folder: the third file (step 4's, after step 2's and its
        last.ckpt) gets half its bytes, then the disk is full."""
        if str(f.name).startswith(str(folder)):
            written.append(f.name)
            if len(written) == 3:
                view = memoryview(data).cast("B")
                f.write(view[: len(view) // 2])
                raise OSError(errno.ENOSPC, "No space left on device")
        real_write_all(f, data)

    monkeypatch.setattr(stacklm.atomic, "_write_all", disk_fills_at_the_second_step_checkpoint)
    ckpt = ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_top_k=1, save_last=True)
    trainer = cpu_trainer(tmp_path / "run", [ckpt], 6)
    with pytest.raises(OSError) as failed:
        trainer.fit(TinyLM(512), datamodule=stream_dm(tokenizer_dir))
    assert type(trainer.strategy.checkpoint_io) is WholeCheckpointIO
    assert failed.value.errno == errno.ENOSPC and str(folder / "epoch=0-step=4.ckpt") in str(failed.value)
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]  # no temporary file left either
    assert not any(p.name.startswith(TMP_MARK) for p in folder.iterdir())
    for name in ("epoch=0-step=2.ckpt", "last.ckpt"):
        assert torch.load(folder / name, weights_only=True)["global_step"] == 2, name  # whole, and the step-2 one

    monkeypatch.setattr(stacklm.atomic, "_write_all", real_write_all)
    resumed = cpu_trainer(tmp_path / "run2", [ModelCheckpoint(dirpath=folder, every_n_train_steps=2, save_last=True)], 6)
    resumed.fit(TinyLM(512), datamodule=stream_dm(tokenizer_dir), ckpt_path=folder / "last.ckpt")
    assert resumed.global_step == 6
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 6


def test_a_checkpoint_io_of_your_own_is_left_alone(tokenizer_dir, tmp_path):  # noqa: F811
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class Mine(TorchCheckpointIO):
        pass

    trainer = cpu_trainer(tmp_path, [], 1)
    trainer.strategy.checkpoint_io = Mine()
    trainer.fit(TinyLM(512), datamodule=stream_dm(tokenizer_dir))
    assert type(trainer.strategy.checkpoint_io) is Mine
