"""Document-causal attention over packed rows: one rule, three kernels.

The rule (docs/architecture.md, batch contract): query ``i`` may attend to key ``j`` only when
``seq_ids[b, i] == seq_ids[b, j]`` and ``j <= i``. Every query can at least see itself, so no
row of the mask is empty and no kernel produces NaNs.

Backends (``GPTConfig.attention``):
  - ``"sdpa"``: ``F.scaled_dot_product_attention`` with a dense boolean ``(B, 1, T, T)`` mask.
    O(T²) mask memory and no skipping of masked blocks; the CPU path and the reference.
  - ``"flex"``: FlexAttention with a ``BlockMask``; fully masked 128×128 tiles are skipped,
    so packed rows of many short documents cost less than one long causal row. Compiled on
    CUDA (eager FlexAttention materialises the scores; fine for CPU tests only).
  - ``"flash_varlen"``: ``flash_attn_varlen_func`` on the flattened batch with ``cu_seqlens``
    (each segment is an independent causal sequence). Needs the ``flash-attn`` package and
    fp16/bf16 inputs.
  - ``"auto"``: flash-attn varlen when installed and on CUDA, else FlexAttention on CUDA,
    else SDPA.

The mask is built once per forward (``build_attention_mask``) and shared by every layer.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from stacklm.data.packing.masks import block_mask, block_mask_from_cu, cu_seqlens, dense_mask

BACKENDS = ("auto", "sdpa", "flex", "flash_varlen")


@functools.cache
def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(name: str, device: torch.device | str) -> str:
    """The concrete backend for ``name`` on ``device``; raises naming the fix when impossible."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not one of {BACKENDS}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        if on_cuda:
            return "flash_varlen" if flash_attn_available() else "flex"
        return "sdpa"
    if name == "flash_varlen":
        if not on_cuda:
            raise ValueError("attention='flash_varlen' needs a CUDA device; use 'sdpa' (or 'auto') on CPU")
        if not flash_attn_available():
            raise ValueError("attention='flash_varlen' needs the flash-attn package (pip install flash-attn); use 'flex' or 'auto'")
    return name


@dataclass
class AttentionMask:
    """What one backend needs to apply the document-causal rule to a batch."""

    backend: str
    dense: torch.Tensor | None = None  # sdpa: bool (B, 1, T, T)
    block: Any = None  # flex: BlockMask
    cu_seqlens: torch.Tensor | None = None  # flash_varlen: int32 (n_segments + 1,)
    max_seqlen: int = 0


@torch.compiler.disable
def build_attention_mask(seq_ids: torch.Tensor, backend: str = "auto", cu: torch.Tensor | None = None,
                         max_seqlen: int | None = None) -> AttentionMask:
    """Turn ``seq_ids`` (B, T) into the mask object of ``backend`` (``'auto'`` is resolved for
    ``seq_ids``' device).

    With the loader's padded ``cu`` and host ``max_seqlen`` (lean batches, ``stacklm.data.contract``)
    the flex and flash-attn masks are built from them with no host sync (``block_mask_from_cu``;
    flash-attn takes them as they are, the padded segments being empty); without, from ``seq_ids``
    (``cu_seqlens`` then syncs once to count segments). Kept out of ``torch.compile`` graphs: the
    masks cost little next to the layers.
    """
    backend = resolve_backend(backend, seq_ids.device)
    if backend == "sdpa":
        return AttentionMask(backend, dense=dense_mask(seq_ids)[:, None])
    if backend == "flex":
        B, T = seq_ids.shape
        return AttentionMask(backend, block=block_mask_from_cu(cu, B, T) if cu is not None else block_mask(seq_ids))
    if backend == "flash_varlen":
        if cu is not None and max_seqlen is not None:
            return AttentionMask(backend, cu_seqlens=cu.to(torch.int32), max_seqlen=int(max_seqlen))
        cu, max_len = cu_seqlens(seq_ids)
        return AttentionMask(backend, cu_seqlens=cu, max_seqlen=max_len)
    raise AssertionError(f"unreachable: backend {backend!r}")


@functools.cache
def _compiled_flex_attention():
    # FlexAttention is only fast when compiled; eager mode materialises the full score matrix.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    # Inside a compiled model the plain function is traced into the graph; outside, on CUDA,
    # use the compiled kernel; on CPU (tests) the eager reference implementation.
    if torch.compiler.is_compiling() and q.device.type == "cpu":
        # Inductor's CPU FlexAttention kernel (torch 2.13) gives wrong results when v is a strided
        # view into the fused qkv projection while q and k (after RoPE) are fresh buffers; a
        # contiguous v avoids it (found by bench/gpu.py --compile on CPU; the CUDA kernel is
        # checked by the same bench on a GPU).
        v = v.contiguous()
    if torch.compiler.is_compiling() or q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block)
    return _compiled_flex_attention()(q, k, v, block_mask=block)


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    B, H, T, D = q.shape

    def flat(x: torch.Tensor) -> torch.Tensor:  # (B, H, T, D) -> (B*T, H, D)
        return x.transpose(1, 2).reshape(B * T, H, D)

    out = flash_attn_varlen_func(
        flat(q), flat(k), flat(v),
        cu_seqlens_q=mask.cu_seqlens, cu_seqlens_k=mask.cu_seqlens,
        max_seqlen_q=mask.max_seqlen, max_seqlen_k=mask.max_seqlen,
        causal=True,
    )
    return out.view(B, T, H, D).transpose(1, 2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """Document-causal attention; ``q, k, v`` and the result are (B, heads, T, head_dim)."""
    if mask.backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense)
    if mask.backend == "flex":
        return _flex(q, k, v, mask.block)
    if mask.backend == "flash_varlen":
        return _flash_varlen(q, k, v, mask)
    raise ValueError(f"unknown attention backend {mask.backend!r}")


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """Naive softmax(QKᵀ/√d + mask)·V written out by hand: the ground truth for tests."""
    allowed = dense_mask(seq_ids)[:, None]
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1) @ v
