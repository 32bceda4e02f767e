"""``GPTModule``: the LightningModule that trains ``stacklm.train.model.GPT`` on batch-contract dicts.

Logs (per optimizer step, written at Lightning's ``log_every_n_steps``):
  - ``train/loss`` — mean cross-entropy over targets != -100;
  - ``train/lr``;
  - ``train/tokens`` — trained tokens (targets != -100) over all ranks since the start of
    the run; kept in a buffer, so it is in the checkpoint and continues across a resume;
  - ``train/tokens_per_s`` — trained tokens per wall-clock second since the last log point.
Validation logs ``val/loss``, token-weighted over the whole validation set.

Before the first step it checks the datamodule (``vocab_size`` <= embedding rows,
``seq_len`` == the model's) and the first batch (keys, dtypes, id and position ranges), so
mismatched data fails with a message instead of a device-side assert mid-run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import lightning.pytorch as L
import torch

from stacklm.config import Config
from stacklm.train.model import GPT, GPTConfig, check_batch, lm_loss


@dataclass
class OptimConfig(Config):
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``."""

    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 1000
    total_steps: int | None = None  # None: the trainer's estimated_stepping_batches (max_steps)

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError(f"OptimConfig needs lr > 0, 0 <= min_lr_ratio <= 1, warmup_steps >= 0; got {self}")


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier at optimizer step ``step``: linear 1/warmup … 1, then cosine to ``min_lr_ratio``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTModule(L.LightningModule):
    """Trains ``GPT(config)``; ``optim`` sets AdamW and the schedule; ``compile`` wraps the
    model with ``torch.compile`` (in place, so checkpoint keys are unchanged)."""

    def __init__(self, config: GPTConfig | None = None, optim: OptimConfig | None = None, compile: bool = False) -> None:
        super().__init__()
        self.config = GPTConfig.coerce(config)
        self.optim = OptimConfig.coerce(optim)
        self.compile_model = compile
        # Plain dicts, so checkpoints and W&B configs hold no pickled project classes.
        self.save_hyperparameters({"config": self.config.to_dict(), "optim": asdict(self.optim), "compile": compile})
        self.model = GPT(self.config)
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))
        self._batch_checked = False
        self._last_log_step = -1
        self._last_log_time = 0.0
        self._last_log_tokens = 0

    # ---------------------------------------------------------------- checks
    def setup(self, stage: str) -> None:
        if self._trainer is not None:
            check_datamodule(getattr(self.trainer, "datamodule", None), self.config)
        if self.compile_model and stage == "fit":
            self.model.compile()

    def _check_first_batch(self, batch: Mapping[str, torch.Tensor]) -> None:
        if not self._batch_checked:
            check_batch(batch, self.config)
            self._batch_checked = True

    # ---------------------------------------------------------------- steps
    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch["input_ids"], batch["position_ids"], batch["seq_ids"])

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._check_first_batch(batch)
        loss, n_tokens = lm_loss(self(batch), batch["targets"])
        self.tokens_seen += sum_across_ranks(n_tokens.detach().to(torch.long))
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_train_start(self) -> None:
        self._last_log_time = time.perf_counter()
        self._last_log_tokens = int(self.tokens_seen)

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        step = self.trainer.global_step
        if step == self._last_log_step or step % self.trainer.log_every_n_steps:
            return  # log once per optimizer step, at Lightning's interval (host sync only here)
        self._last_log_step = step
        now, tokens = time.perf_counter(), int(self.tokens_seen)
        elapsed = max(now - self._last_log_time, 1e-9)
        self.log("train/tokens", float(tokens))
        self.log("train/tokens_per_s", (tokens - self._last_log_tokens) / elapsed)
        self.log("train/lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        self._last_log_time, self._last_log_tokens = now, tokens

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self._check_first_batch(batch)
        loss, n_tokens = lm_loss(self(batch), batch["targets"])
        # batch_size=n_tokens makes the epoch value a token-weighted mean, not a mean of batch means.
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=max(int(n_tokens), 1))
        return loss

    # ---------------------------------------------------------------- optimizer
    def configure_optimizers(self):
        decay, no_decay = [], []
        for p in self.model.parameters():  # the tied embedding appears once
            if p.requires_grad:
                (decay if p.ndim >= 2 else no_decay).append(p)
        o = self.optim
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=o.betas, eps=o.eps, fused=self.device.type == "cuda",
        )
        total = o.total_steps or int(self.trainer.estimated_stepping_batches)
        if not math.isfinite(total) or total <= 0:
            raise ValueError("the LR schedule needs a finite length: set trainer.max_steps or model.optim.total_steps")
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, o.warmup_steps, total, o.min_lr_ratio)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def sum_across_ranks(t: torch.Tensor) -> torch.Tensor:
    """All-reduce sum of a small tensor when running distributed, else ``t``.

    Plain ``all_reduce`` rather than ``strategy.reduce``: the latter adds a barrier, which
    blocks the host every step; this one is queued on the stream like the gradient reduction.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        t = t.clone()
        torch.distributed.all_reduce(t)
    return t


def check_datamodule(datamodule, config: GPTConfig) -> None:
    """Refuse a datamodule whose ``vocab_size`` exceeds the embedding or whose ``seq_len``
    differs from the model's. Attributes that are absent (or None) are not checked."""
    if datamodule is None:
        return
    from stacklm.errors import ConfigError

    name = type(datamodule).__name__
    if getattr(datamodule, "mode", None) == "preference":
        raise ConfigError(
            f"{name}(mode='preference') yields chosen/rejected pair batches, which the built-in GPT "
            "(a next-token loss on the batch contract) cannot train; use your own LightningModule with a "
            "DPO-style loss (docs/chat.md, 'Preference data'), or mode: sft"
        )
    vocab = getattr(datamodule, "vocab_size", None)
    if vocab is not None and int(vocab) > config.vocab_size:
        raise ConfigError(
            f"{name}.vocab_size = {vocab} but the model embedding has {config.vocab_size} rows; "
            f"set model.config.vocab_size >= {vocab} or use the tokenizer the model was built for"
        )
    seq_len = getattr(datamodule, "seq_len", None)
    if seq_len is not None and int(seq_len) != config.seq_len:
        raise ConfigError(
            f"{name}.seq_len = {seq_len} but the model's seq_len = {config.seq_len}; "
            "set both to the same value (data windows and RoPE tables must agree)"
        )
