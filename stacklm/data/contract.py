"""The batch contract (docs/architecture.md, "Batch contract"): its keys, the ignore index, and
the one buffer a batch lives in.

A batch is a dict of ``torch.long`` tensors of shape ``(B, T)``: ``input_ids``,
``position_ids`` (offset inside the token's own document), ``seq_ids`` (document index inside
the row) and ``targets`` (the next token, or ``IGNORE_INDEX`` where no loss is taken). Every
producer (the packer's ``collate``, the shard reader's ``derive_batch``, SFT's ``collate_sft``)
writes the planes of one ``contract_buffer`` and hands out ``contract_batch`` views of it; the
trainer checks batches against ``BATCH_KEYS``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from stacklm.constants import IGNORE_INDEX  # noqa: F401 -- part of the contract; defined below chat/ and data/


class ContractPlanes(NamedTuple):
    """The planes of a ``contract_buffer`` by name, in ``BATCH_KEYS`` order."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    seq_ids: np.ndarray
    targets: np.ndarray


BATCH_KEYS: tuple[str, ...] = ContractPlanes._fields


def contract_buffer(batch: int, width: int) -> np.ndarray:
    """An empty ``(4, batch, width)`` int64 buffer, one plane per ``BATCH_KEYS`` entry.

    Why one buffer: a loader worker then hands the main process one shared-memory block per
    batch instead of four (each block costs a file-descriptor round trip, about 0.4 ms).
    """
    return np.empty((len(BATCH_KEYS), batch, width), dtype=np.int64)


def contract_planes(buffer: np.ndarray) -> ContractPlanes:
    """The planes of a ``contract_buffer`` to fill, by name (views, no copy)."""
    return ContractPlanes(*buffer)


def contract_batch(buffer: np.ndarray) -> dict[str, torch.Tensor]:
    """The batch dict over a filled ``contract_buffer``: contiguous views, no copy."""
    planes = torch.from_numpy(buffer)
    return {name: planes[i] for i, name in enumerate(BATCH_KEYS)}
