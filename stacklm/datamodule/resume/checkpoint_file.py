"""A checkpoint file is whole or absent: written next to its final name, then renamed.

Lightning's ``TorchCheckpointIO`` writes a local checkpoint through an fsspec transaction, which
stages it in the system temp folder and *moves* it to its name at commit: across filesystems
that move is a copy, so a full disk at the checkpoint folder left ``epoch=0-step=5.ckpt``
truncated under its final name (716,800 of 1,737,853 bytes, not a valid zip), and a later
``--ckpt_path last`` or resume picked up a broken file.

``WholeCheckpointIO`` serializes the checkpoint as Lightning does (``torch.save``) and writes the
bytes with ``stacklm.atomic.atomic_write_bytes``: a temporary file in the checkpoint's own
folder, fsynced, renamed over the name (the same filesystem, so the rename is atomic), the
folder fsynced. A failed write removes the temporary file and raises, naming the file; the
checkpoint it would have replaced (``last.ckpt``, or the one ``ModelCheckpoint`` would have
deleted after it) is untouched. Remote URLs (``s3://``) keep Lightning's path, where an object
appears whole at the end of its upload.

``StackDataModule.setup`` puts it on the trainer's strategy when that strategy uses the default
``TorchCheckpointIO`` (a checkpoint IO of your own is left as it is); ``trainer.fit`` with
``plugins=[WholeCheckpointIO()]`` does the same without the datamodule.
"""

from __future__ import annotations

import io
import os
from typing import Any

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO


class WholeCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local files are written whole or not at all."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        fs, local = fsspec.core.url_to_fs(str(path))
        if storage_options is not None or not isinstance(fs, LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        import torch

        from stacklm.atomic import atomic_write_bytes

        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
        atomic_write_bytes(local, buffer.getbuffer())


def use_whole_checkpoints(trainer) -> None:
    """Give ``trainer``'s strategy a ``WholeCheckpointIO`` if it would use Lightning's default one."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is None:
        return
    if type(strategy.checkpoint_io) is TorchCheckpointIO:  # exactly the default: a subclass or wrapper is the user's
        strategy.checkpoint_io = WholeCheckpointIO()
