"""Host -> device batch transfer for ``StackDataModule``: pinned, non-blocking, one copy per
buffer, then the lean planes derived on the device.

Why not Lightning's default (``move_data_to_device``): it copies each tensor on its own from
pageable memory, which blocks the host until the copy is done. A batch's planes share one
buffer (``stacklm.data.contract``: one shared-memory block per batch from a loader worker), so
here each buffer is pinned once, copied once with ``non_blocking=True`` (the host goes on while
the copy runs, ordered on the stream before the step's kernels), and the planes are rebuilt as
views of the device copy. A lean batch (``planes: lean``) then gets ``position_ids``, ``seq_ids``
and ``targets`` derived on the device (``contract.full_batch``): no host sync on either side.
"""

from __future__ import annotations

from typing import Any

import torch

from stacklm.data.contract import full_batch, is_lean


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a dict of tensors and host values) on ``device``: each CPU buffer pinned and
    copied once, non-blocking; other values as they are. ``None`` for anything else (the caller
    falls back to Lightning's default)."""
    if not isinstance(batch, dict) or torch.device(device).type != "cuda":
        return None
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # storage pointer -> (host whole, device whole)
    out = {}
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor) or value.device.type != "cpu":
            out[key] = value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            continue
        storage = value.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in buffers:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)  # the buffer as bytes, every plane in it
            host = whole if whole.is_pinned() else whole.pin_memory()
            buffers[ptr] = (host, host.to(device, non_blocking=True))
        dev_bytes = buffers[ptr][1]
        typed = dev_bytes.view(value.dtype) if value.element_size() == 1 or dev_bytes.numel() % value.element_size() == 0 else None
        if typed is None:  # a buffer whose size is no multiple of the dtype: copy the tensor alone
            out[key] = value.pin_memory().to(device, non_blocking=True)
            continue
        out[key] = typed.as_strided(value.shape, value.stride(), value.storage_offset())
    return out


def after_transfer(batch: Any) -> Any:
    """A lean batch with today's four planes derived on its device; any other batch as it is."""
    if isinstance(batch, dict) and is_lean(batch):
        return full_batch(batch)
    return batch
