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


# ---------------------------------------------------------------------------------------
# Lean planes: what the loader ships (docs/architecture.md, "Batch contract", "Lean planes")
# ---------------------------------------------------------------------------------------
PLANES = ("full", "lean")  # what a loader ships: the four ``BATCH_KEYS`` planes, or ``LEAN_KEYS``
LEAN_KEYS: tuple[str, ...] = ("input_ids", "cu_seqlens", "max_seqlen", "last_targets", "pad_id")
DERIVED_KEYS: tuple[str, ...] = ("position_ids", "seq_ids", "targets")
SEGMENT_TOKENS = 64  # the padded ``cu_seqlens`` holds one boundary per this many tokens (``cu_capacity``)


def is_lean(batch) -> bool:
    """Whether ``batch`` carries the lean planes (``cu_seqlens``) rather than all four planes."""
    return "cu_seqlens" in batch and "seq_ids" not in batch


def cu_capacity(batch: int, width: int, n_segments: int = 0) -> int:
    """The length of a padded ``cu_seqlens`` for ``batch`` rows of ``width`` tokens.

    The padding rule: ``cu_seqlens`` holds the ``n_segments + 1`` real boundaries, then repeats
    the last one (``batch * width``) up to this length, so every padded segment has length 0
    (flash-attn varlen and FlexAttention skip it). The length is fixed per ``(width, batch)``,
    ``batch * ceil(width / SEGMENT_TOKENS) + 1`` -- what a ``torch.compile``d model needs not to
    recompile per batch -- as long as documents average ``SEGMENT_TOKENS`` tokens or more; a batch
    of shorter ones doubles it (``2 * (c - 1) + 1``) until it fits, capped at ``batch * width + 1``,
    so at most ``log2(SEGMENT_TOKENS)`` other lengths ever occur.
    """
    full = batch * width + 1
    cap = batch * max(1, -(-width // SEGMENT_TOKENS)) + 1
    while cap < n_segments + 1 and cap < full:
        cap = 2 * (cap - 1) + 1
    return min(cap, full)


class SegmentStarts(NamedTuple):
    """Where segments start in ``(B, L)`` windows (``segment_starts``)."""

    start: np.ndarray  # (B, L) bool
    is_pad: np.ndarray  # (B, L) bool
    pad_rows: list[int]  # rows holding any padding
    where: np.ndarray  # every start, flat in (B, L)
    row: np.ndarray  # its row
    col: np.ndarray  # its column
    starts: np.ndarray  # the starts in the inputs, flat in (B, T), T = L - 1


def segment_starts(rows: np.ndarray, bos_id: int, eos_id: int, pad_id: int) -> SegmentStarts:
    """Where a segment starts in ``(B, L)`` windows: a ``bos``, the token after an ``eos``, where
    padding starts or stops, every column 0; which tokens are padding, in which rows. Vectorised;
    padding (rare) is only looked at in its rows. Shared by the four planes (``derive_batch``)
    and the lean ones (``lean_batch``, which needs only the masks: ``_start_mask``)."""
    start, is_pad, pad_rows = _start_mask(rows, bos_id, eos_id, pad_id)
    L = rows.shape[1]
    where = np.flatnonzero(start)
    row, col = np.divmod(where, L)
    starts = (where - row)[col < L - 1]  # b*T + c == b*L + c - b
    return SegmentStarts(start, is_pad, pad_rows, where, row, col, starts)


def _start_mask(rows: np.ndarray, bos_id: int, eos_id: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The ``(B, L)`` start mask, the padding mask and the rows holding padding. The eos shift is
    or-ed in place (one pass fewer: this is the shards loader's hot path) and the per-row padding
    pass runs only in rows that hold padding (most batches have none)."""
    B, L = rows.shape
    flat = rows.reshape(-1)
    start = flat == bos_id
    np.logical_or(start[1:], flat[:-1] == eos_id, out=start[1:])  # crossing into the next row hits column 0: set below
    start = start.reshape(B, L)
    is_pad = (flat == pad_id).reshape(B, L)
    pad_rows = np.flatnonzero(is_pad.any(axis=1)).tolist() if is_pad.any() else []
    for r in pad_rows:
        start[r, 1:] |= is_pad[r, 1:] != is_pad[r, :-1]
    start[:, 0] = True
    return start, is_pad, pad_rows


def lean_batch(rows: np.ndarray, bos_id: int, eos_id: int, pad_id: int) -> dict:
    """Windows ``(B, seq_len)`` -> the lean planes the loader ships (``LEAN_KEYS``).

    ``input_ids`` int32 ``(B, T)``; ``cu_seqlens`` int32, the segment boundaries in the flattened
    ``(B * T,)`` token axis padded by ``cu_capacity``'s rule; ``max_seqlen`` the longest segment
    (a host int: flash-attn varlen takes it as one, and reading it off a device tensor would sync);
    ``last_targets`` int32 ``(B,)``, each row's last target (the window's last token, or
    ``IGNORE_INDEX``), the one target ``input_ids`` does not hold; ``pad_id`` (host int). The three
    other planes follow on the device from these (``derive_planes``), exactly as ``contract_batch``
    had them. The int32 planes share one buffer (one shared-memory block per batch from a worker).
    """
    rows = np.ascontiguousarray(rows)
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"expected windows of shape (batch, seq_len >= 2), got {rows.shape}")
    B, L = rows.shape
    T = L - 1
    start, is_pad, pad_rows = _start_mask(rows, bos_id, eos_id, pad_id)
    # the starts in the inputs, flat in (B, T): the columns < T of the (B, L) mask, indexed as they lie
    where = np.flatnonzero(start[:, :T])
    n = len(where)
    cap = cu_capacity(B, T, n)
    buf = np.empty(B * T + cap + B, dtype=np.int32)
    input_ids = buf[: B * T].reshape(B, T)
    cu = buf[B * T : B * T + cap]
    last = buf[B * T + cap :]
    input_ids[:] = rows[:, :T]
    cu[:n] = where
    cu[n:] = B * T  # the padding rule: repeat the last boundary
    max_seqlen = int((cu[1 : n + 1] - cu[:n]).max()) if n else 0
    last[:] = rows[:, T]
    last[start[:, T] | is_pad[:, T] if pad_rows else start[:, T]] = IGNORE_INDEX
    t = torch.from_numpy(buf)
    return {"input_ids": t[: B * T].view(B, T), "cu_seqlens": t[B * T : B * T + cap], "max_seqlen": max_seqlen,
            "last_targets": t[B * T + cap :], "pad_id": int(pad_id)}


def derive_planes(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, last_targets: torch.Tensor,
                  pad_id: int) -> dict[str, torch.Tensor]:
    """``position_ids``, ``seq_ids``, ``targets`` (``torch.long`` ``(B, T)``) from the lean planes:
    the helper every consumer of a lean batch calls, equal to the planes ``contract_batch`` held.

    Torch ops on the planes' own device, no ``.item()`` or data-dependent shape, so it runs on a
    GPU without a host sync: a token's segment is a ``searchsorted`` into ``cu_seqlens`` (padded
    boundaries all equal ``B * T``, so no token falls in a padded segment), its position the offset
    from that segment's start, its ``seq_ids`` the segment index minus its row's first; a target is
    the next token unless that token starts a segment or is padding, and the row's last target
    comes from ``last_targets``.
    """
    B, T = input_ids.shape
    dev = input_ids.device
    cu = cu_seqlens.to(torch.int32)
    flat = torch.arange(B * T, device=dev, dtype=torch.int32)
    seg = torch.searchsorted(cu, flat, right=True) - 1
    position_ids = (flat - cu[seg]).view(B, T).long()
    row_starts = torch.arange(0, B * T, T, device=dev, dtype=torch.int32) if T else torch.zeros(B, device=dev, dtype=torch.int32)
    first = torch.searchsorted(cu, row_starts, right=True) - 1
    seq_ids = (seg.view(B, T) - first[:, None]).long()
    nxt = input_ids.roll(-1, dims=1).long()
    ignore = (position_ids.roll(-1, dims=1) == 0) | (nxt == pad_id)
    targets = torch.where(ignore, torch.full_like(nxt, IGNORE_INDEX), nxt)
    if T:
        targets[:, -1] = last_targets.long()
    return {"position_ids": position_ids, "seq_ids": seq_ids, "targets": targets}


def full_batch(batch) -> dict:
    """``batch`` with today's four ``torch.long`` planes (``BATCH_KEYS``): a lean batch's derived
    on its device (``derive_planes``), its other keys kept; a full batch as it is."""
    if not is_lean(batch):
        return batch
    out = dict(batch)
    out.update(derive_planes(batch["input_ids"], batch["cu_seqlens"], batch["last_targets"], batch["pad_id"]))
    out["input_ids"] = batch["input_ids"].long()
    return out


def padding_batch(batch: int, seq_len: int, pad_id: int, planes: str = "full") -> dict:
    """``batch`` rows of padding (one segment each, every target ``IGNORE_INDEX``) in ``planes``:
    what a loader that ran dry yields so every rank takes the same number of steps. A row of pad
    ids holds no ``bos``/``eos``, so -1 stands for both."""
    if planes == "lean":
        return lean_batch(np.full((batch, seq_len), pad_id, dtype=np.int64), -1, -1, pad_id)
    out = contract_buffer(batch, seq_len - 1)
    p = contract_planes(out)
    p.input_ids.fill(pad_id)
    p.position_ids[:] = np.arange(seq_len - 1)
    p.seq_ids.fill(0)
    p.targets.fill(IGNORE_INDEX)
    return contract_batch(out)
