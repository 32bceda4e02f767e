"""Attention masks from a packed batch: dense (tests, CPU), ``cu_seqlens`` (flash-attn varlen),
FlexAttention ``BlockMask``.

All three encode the same rule (docs/architecture.md, "Batch contract"): token ``i`` may
attend to token ``j`` only when ``seq_ids[b, i] == seq_ids[b, j]`` and ``j <= i``. Packed rows
keep each segment contiguous (``seq_ids`` is non-decreasing along a row), which is what lets
the same batch be expressed as variable-length sequences for ``cu_seqlens``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def _seq_ids(batch_or_seq_ids: Mapping[str, torch.Tensor] | torch.Tensor) -> torch.Tensor:
    seq_ids = batch_or_seq_ids["seq_ids"] if isinstance(batch_or_seq_ids, Mapping) else batch_or_seq_ids
    if seq_ids.ndim != 2:
        raise ValueError(f"seq_ids must have shape (batch, T), got {tuple(seq_ids.shape)}")
    return seq_ids


def dense_mask(batch_or_seq_ids: Mapping[str, torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Boolean (B, T, T) mask, True where attention is allowed. O(T²) memory: tests and CPU only."""
    s = _seq_ids(batch_or_seq_ids)
    T = s.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=s.device).tril_()
    return (s[:, :, None] == s[:, None, :]) & causal


def cu_seqlens(batch_or_seq_ids: Mapping[str, torch.Tensor] | torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` over the flattened batch, as ``flash_attn_varlen_func`` wants.

    ``cu_seqlens`` is int32 of shape (n_segments + 1,): segment boundaries in the flattened
    (B*T,) token axis, starting at 0 and ending at B*T. A segment never spans two rows.
    """
    s = _seq_ids(batch_or_seq_ids)
    B, T = s.shape
    flat = s.reshape(-1)
    boundary = torch.zeros(B * T, dtype=torch.bool, device=s.device)
    boundary[1:] = flat[1:] != flat[:-1]
    boundary[::T] = True  # every row starts a segment
    starts = torch.nonzero(boundary).flatten()
    cu = torch.cat([starts, torch.tensor([B * T], device=s.device)]).to(torch.int32)
    max_seqlen = int((cu[1:] - cu[:-1]).max()) if B * T else 0
    return cu, max_seqlen


def dense_mask_from_cu_seqlens(cu: torch.Tensor, batch: int, T: int) -> torch.Tensor:
    """The (B, T, T) mask that ``cu_seqlens`` describes (to check one helper against another)."""
    seg = torch.zeros(batch * T, dtype=torch.long, device=cu.device)
    seg[cu[1:-1].long()] = 1
    seg = seg.cumsum(0).view(batch, T)
    return dense_mask(seg)


def block_mask(
    batch_or_seq_ids: Mapping[str, torch.Tensor] | torch.Tensor,
    block_size: int = 128,
    device: str | torch.device | None = None,
):
    """FlexAttention ``BlockMask`` for the batch (heads broadcast, ``H=None``).

    Built on ``seq_ids``' device unless ``device`` is given; ``create_block_mask`` works on
    CPU as well (torch >= 2.5), so tests can build it without a GPU.
    """
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError as err:  # pragma: no cover - torch too old
        raise RuntimeError(f"FlexAttention needs torch >= 2.5 (found {torch.__version__}); use dense_mask or cu_seqlens") from err
    s = _seq_ids(batch_or_seq_ids)
    device = torch.device(device) if device is not None else s.device
    s = s.to(device)
    B, T = s.shape

    def document_causal(b, h, q_idx, kv_idx):
        return (s[b, q_idx] == s[b, kv_idx]) & (kv_idx <= q_idx)

    try:
        return create_block_mask(document_causal, B, None, T, T, device=device, BLOCK_SIZE=block_size)
    except (RuntimeError, NotImplementedError) as err:
        raise RuntimeError(
            f"could not build a FlexAttention BlockMask on device {device} with torch {torch.__version__}: {err}; "
            "pass device='cuda' or use dense_mask / cu_seqlens"
        ) from err
