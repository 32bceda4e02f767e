"""The Stack-100M GPT: a pre-norm decoder that reads the packed batch contract directly.

Shape choices (``GPTConfig.stack_100m``): the tied embedding is fixed at 32768 × 512 by the
tokenizer and the run's design card, so width is 512 and the remaining budget goes to depth:
26 blocks of 8 heads × 64 with a 4× GELU MLP give 98.6M parameters (16.8M of them the
embedding). Deep-and-thin is the better use of ~100M parameters at this scale (MobileLLM,
Liu et al. 2024), and it keeps one shared matrix for input and output.

Packed rows: every attention layer applies the document-causal mask built once from
``seq_ids`` (see ``stacklm.train.attention``), and RoPE rotates queries and keys by
``position_ids`` (the offset inside each document), so a document packed at offset k of a
row sees exactly what it would see alone at the start of a row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from stacklm.config import Config
from stacklm.data.contract import BATCH_KEYS, IGNORE_INDEX
from stacklm.train.attention import BACKENDS, AttentionMask, attend, build_attention_mask


@dataclass
class GPTConfig(Config):
    """Model shape. Defaults are the Stack-100M model (``stack_100m()``)."""

    vocab_size: int = 32768  # embedding rows; must be >= the tokenizer's vocab
    seq_len: int = 2048  # window length of the data (batches carry seq_len - 1 tokens)
    n_layer: int = 26
    n_head: int = 8
    d_model: int = 512
    mlp_ratio: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    attention: str = "auto"  # one of stacklm.train.attention.BACKENDS

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.head_dim % 2:
            raise ValueError(f"GPTConfig: head_dim = d_model / n_head = {self.head_dim} must be even for RoPE")
        if self.attention not in BACKENDS:
            raise ValueError(f"GPTConfig.attention must be one of {BACKENDS}, got {self.attention!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @classmethod
    def stack_100m(cls, **overrides) -> GPTConfig:
        return cls(**overrides)

    @classmethod
    def tiny(cls, **overrides) -> GPTConfig:
        """A CPU-sized model for tests and the demo (~0.4M params besides the embedding)."""
        base = dict(vocab_size=32768, seq_len=256, n_layer=2, n_head=4, d_model=128)
        return cls(**{**base, **overrides})

    def num_params(self) -> int:
        """Parameter count, embedding counted once (it is tied to the output layer)."""
        d, hidden = self.d_model, self.mlp_ratio * self.d_model
        per_block = 4 * d * d + 2 * d * hidden + 2 * d  # qkv + proj, MLP in/out, two RMSNorm weights
        return self.vocab_size * d + self.n_layer * per_block + d  # + final norm


class RotaryEmbedding(nn.Module):
    """RoPE tables for positions ``[0, seq_len)``, looked up by ``position_ids``.

    Half-split layout (GPT-NeoX): dimension ``i`` pairs with ``i + head_dim/2`` and is rotated
    by ``position * theta^(-2i/head_dim)``. Tables stay float32 (non-persistent buffers, so
    checkpoints do not carry them) because bf16 angles lose precision at long offsets.
    """

    def __init__(self, head_dim: int, seq_len: int, theta: float) -> None:
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of shape (B, 1, T, head_dim/2), broadcasting over heads."""
        return self.cos[position_ids].unsqueeze(1), self.sin[position_ids].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, D) by the angles behind ``cos``/``sin`` (B, 1, T, D/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        y = attend(q, k, v, mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.d_model, config.mlp_ratio * config.d_model, bias=False)
        self.down = nn.Linear(config.mlp_ratio * config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope, mask)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only LM over the batch contract; ``forward`` returns logits (B, T, vocab)."""

    def __init__(self, config: GPTConfig | Mapping | None = None) -> None:
        super().__init__()
        self.config = config = GPTConfig.coerce(config)
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.rope = RotaryEmbedding(config.head_dim, config.seq_len, config.rope_theta)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.d_model, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: one 32768 x 512 matrix
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layer)
        so the residual stream's variance does not grow with depth."""
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.config.n_layer))
            else:
                nn.init.normal_(p, std=std)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields the tied matrix once

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, seq_ids: torch.Tensor,
                cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
        """Logits ``(B, T, vocab)``; ``cu_seqlens``/``max_seqlen``: a lean batch's, so the
        flex/flash-attn mask is built without a host sync (``build_attention_mask``)."""
        mask = build_attention_mask(seq_ids, self.config.attention, cu_seqlens, max_seqlen)
        rope = self.rope(position_ids)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, rope, mask)
        return self.lm_head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean cross-entropy over targets != -100, number of such targets).

    Summed then divided by the count (clamped to 1), so a batch whose targets are all -100
    (e.g. an SFT batch without assistant tokens) gives loss 0 instead of NaN.
    """
    loss, n_tokens, _ = lm_token_loss(logits, targets)
    return loss, n_tokens


def lm_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``lm_loss`` plus each target's own cross-entropy, ``(B, T)`` (0 where the target is -100).

    One ``reduction="none"`` cross-entropy, then its sum: the per-token values come at no extra
    pass over the logits, which is what lets per-source loss (``stacklm.source_loss``) attribute
    each target token's loss to its document's source."""
    flat_targets = targets.reshape(-1)
    per_token = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), flat_targets, ignore_index=IGNORE_INDEX, reduction="none"
    )
    n_tokens = (flat_targets != IGNORE_INDEX).sum()
    return per_token.sum() / n_tokens.clamp(min=1), n_tokens, per_token.view(targets.shape)


def check_batch(batch: Mapping[str, torch.Tensor], config: GPTConfig) -> None:
    """Validate one batch against the contract and the model; raises ``ValueError`` naming the field.

    Costs a device sync (max over ids), so the module runs it on the first batch only.
    """
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch is missing key(s) {missing}; the batch contract needs {list(BATCH_KEYS)} (docs/architecture.md)")
    shape = tuple(batch["input_ids"].shape)
    for key in BATCH_KEYS:
        t = batch[key]
        if t.dtype != torch.long:
            raise ValueError(f"batch[{key!r}] must be torch.long, got {t.dtype}")
        if tuple(t.shape) != shape or len(shape) != 2:
            raise ValueError(f"batch[{key!r}] has shape {tuple(t.shape)}; every key must share a (B, T) shape, input_ids has {shape}")
    T = shape[1]
    if T > config.seq_len:
        raise ValueError(f"batch rows have {T} tokens but the model's seq_len is {config.seq_len}; rebuild the data with seq_len={config.seq_len} or raise model seq_len")
    ids, pos = batch["input_ids"], batch["position_ids"]
    if T and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size):
        raise ValueError(
            f"batch['input_ids'] holds ids in [{int(ids.min())}, {int(ids.max())}] but the embedding has {config.vocab_size} rows; "
            "the tokenizer's vocab is larger than the model's vocab_size"
        )
    if T and (int(pos.min()) < 0 or int(pos.max()) >= config.seq_len):
        raise ValueError(
            f"batch['position_ids'] spans [{int(pos.min())}, {int(pos.max())}] but RoPE covers [0, {config.seq_len}); "
            f"the data's seq_len does not match the model's seq_len={config.seq_len}"
        )
