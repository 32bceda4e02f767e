"""Attention masks from a packed batch: dense (tests, CPU), ``cu_seqlens`` (flash-attn varlen),
FlexAttention ``BlockMask`` -- from ``seq_ids``, or from the loader's padded ``cu_seqlens``
(``segments_from_cu``, ``block_mask_from_cu``: no host sync, for the GPU path).

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
    """The (B, T, T) mask that ``cu_seqlens`` describes, padded or not (to check one helper
    against another)."""
    return dense_mask(segments_from_cu(cu, batch, T))


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


def segments_from_cu(cu: torch.Tensor, batch: int, T: int) -> torch.Tensor:
    """``(B, T)`` segment index of every token, flat over the batch, from a (padded) ``cu_seqlens``:
    one ``searchsorted``, no host sync (``stacklm.data.contract.derive_planes`` does the same)."""
    flat = torch.arange(batch * T, device=cu.device, dtype=cu.dtype)
    return (torch.searchsorted(cu, flat, right=True) - 1).view(batch, T)


def block_mask_from_cu(cu: torch.Tensor, batch: int, T: int, block_size: int = 128):
    """FlexAttention ``BlockMask`` from the loader's padded ``cu_seqlens``, without a host sync.

    Why not ``create_block_mask``: it evaluates the mask over every (query, key) pair to find
    which tiles are empty, partial or full. Packed rows make that a closed form on the tiles
    (segments are contiguous, so a tile's documents are the range between its first and last
    token's): a key tile ``j`` below the diagonal of query tile ``i`` is empty unless the key
    tile's last document reaches the query tile's first; it is full when both tiles hold one
    and the same document (and are whole tiles); diagonal tiles are partial. All tensor ops on
    ``cu``'s device, then ``BlockMask.from_kv_blocks``; tested equal to ``create_block_mask``
    and to ``dense_mask`` on CPU (tests/data/test_lean_planes.py).
    """
    from torch.nn.attention.flex_attention import BlockMask

    seg = segments_from_cu(cu, batch, T)
    n = -(-T // block_size)
    firsts = torch.arange(n, device=cu.device) * block_size
    lasts = torch.clamp(firsts + block_size, max=T) - 1
    first, last = seg[:, firsts], seg[:, lasts]  # (B, n): each tile's first and last document
    q, k = torch.arange(n, device=cu.device)[:, None], torch.arange(n, device=cu.device)[None, :]
    below = k < q
    touches = last[:, None, :] >= first[:, :, None]  # [b, q tile, k tile]
    one_doc = first == last
    whole = (lasts - firsts + 1 == block_size)
    full = below & touches & (one_doc & whole)[:, :, None] & (one_doc & whole)[:, None, :] \
        & (first[:, :, None] == first[:, None, :])
    partial = ((below & touches) | (k == q)) & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = blocks[:, None].to(torch.int32)  # heads broadcast
        idx = torch.argsort(blocks, dim=-1, descending=True, stable=True)
        return blocks.sum(-1).to(torch.int32), idx.to(torch.int32)

    def document_causal(b, h, q_idx, kv_idx):
        return (seg[b, q_idx] == seg[b, kv_idx]) & (kv_idx <= q_idx)

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=document_causal, seq_lengths=(T, T))
