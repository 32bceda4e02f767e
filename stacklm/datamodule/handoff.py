"""Batches from loader workers through reused shared-memory blocks.

Why our own: torch's ``DataLoader`` moves every tensor storage of every batch into a fresh
shared-memory block and passes its file descriptor to the main process (a socket round trip,
a new mapping and its page faults on both sides): about 1.4 ms of CPU a batch, measured
(``bench/loader.py``, "2 workers" rows), which at 16k tokens a batch is ten times what reading
and deriving the batch costs. Here a worker copies its batch's one buffer into a block the main
process has released and sends only the block's number; torch passes a block once, the first
time it travels, and the main process keeps its mapping for the rest of the pass.

Release: the main process builds the batch's tensors over a numpy view of the block made for
that batch, and a ``weakref.finalize`` on that view clears the block's busy byte once no tensor
of the batch (nor any view of one) is alive; the worker reuses a block only when that byte is
clear, else it makes a new one. A consumer that keeps batches keeps their blocks: nothing is
overwritten while it can still be read.

Only a batch whose tensors all share one storage travels this way (the contract buffer, the
lean planes' buffer: ``stacklm.data.contract``); anything else goes torch's way, unchanged.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import numpy as np
import torch

SLOT_KEY = "__stacklm_block__"
HEADER = 64  # the busy byte, then padding: the data starts aligned for any dtype


class WorkerBlocks:
    """A worker's blocks: ``(shared uint8 tensor, its numpy view)``; byte 0 of each is busy (1)
    or released by the main process (0)."""

    def __init__(self) -> None:
        self.blocks: list[tuple[torch.Tensor, np.ndarray]] = []

    def _block_for(self, nbytes: int) -> tuple[int, bool]:
        """A released block holding ``nbytes``, or a new one: ``(index, new)``."""
        for i, (_, view) in enumerate(self.blocks):
            if view[0] == 0 and len(view) - HEADER >= nbytes:
                return i, False
        block = torch.empty(HEADER + nbytes, dtype=torch.uint8).share_memory_()
        self.blocks.append((block, block.numpy()))
        return len(self.blocks) - 1, True

    def pack(self, batch: Any) -> Any:
        """``batch`` with its tensors replaced by one block reference (a dict whose tensors share
        one storage), else as it is."""
        if not isinstance(batch, dict):
            return batch
        tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if not tensors:
            return batch
        storages = {v.untyped_storage().data_ptr() for v in tensors.values()}
        if len(storages) != 1 or any(v.device.type != "cpu" for v in tensors.values()):
            return batch
        storage = next(iter(tensors.values())).untyped_storage()
        nbytes = storage.nbytes()
        index, new = self._block_for(nbytes)
        block, view = self.blocks[index]
        view[HEADER : HEADER + nbytes] = storage_bytes(storage)
        view[0] = 1
        out = {k: v for k, v in batch.items() if k not in tensors}
        out[SLOT_KEY] = {
            "pid": os.getpid(), "block": index, "nbytes": nbytes, "new": block if new else None,
            "tensors": {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape), tuple(v.stride()), v.storage_offset())
                        for k, v in tensors.items()},
        }
        return out


def storage_bytes(storage: torch.UntypedStorage) -> np.ndarray:
    """The bytes of a CPU storage as a uint8 array (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


class MainBlocks:
    """The main process's mappings of the workers' blocks, for one pass of a loader."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, int], np.ndarray] = {}

    def unpack(self, batch: Any) -> Any:
        """A worker's message back to its batch: tensors over the block, released when unused."""
        if not isinstance(batch, dict) or SLOT_KEY not in batch:
            return batch
        batch = dict(batch)
        info = batch.pop(SLOT_KEY)
        key = (int(info["pid"]), int(info["block"]))
        if info["new"] is not None:
            self.blocks[key] = info["new"].numpy()
        block = self.blocks[key]
        data = block[HEADER : HEADER + int(info["nbytes"])]  # this batch's own view: its life is the batch's
        weakref.finalize(data, _release, block)
        base = torch.from_numpy(data)
        for name, (dtype, shape, stride, offset) in info["tensors"].items():
            batch[name] = base.view(getattr(torch, dtype)).as_strided(shape, stride, offset)
        return batch


def _release(block: np.ndarray) -> None:
    block[0] = 0  # the worker may write this block again


_WORKER_BLOCKS: WorkerBlocks | None = None


def worker_pack(batch: Any) -> Any:
    """A loader's ``collate_fn`` for whole batches (``batch_size=None``): in a worker, the batch
    by block (``WorkerBlocks.pack``); in the main process, numpy planes as tensors, the rest as
    it is."""
    global _WORKER_BLOCKS
    if not isinstance(batch, dict):
        return torch.utils.data.default_convert(batch)
    batch = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
    if torch.utils.data.get_worker_info() is None:
        return batch
    if _WORKER_BLOCKS is None:
        _WORKER_BLOCKS = WorkerBlocks()
    return _WORKER_BLOCKS.pack(batch)
