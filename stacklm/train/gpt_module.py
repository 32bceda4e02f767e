"""``GPTModule``: the LightningModule that trains ``stacklm.train.model.GPT`` on batch-contract dicts.

Logs (per optimizer step, written at Lightning's ``log_every_n_steps``):
  - ``train/loss`` — mean cross-entropy over targets != -100 (``training_step`` also returns
    each target's own loss as ``token_loss``, for ``stacklm.source_loss.SourceLossCallback``);
  - ``train/lr``;
  - ``train/tokens`` — trained tokens (targets != -100) over all ranks since the start of
    the run; kept in a buffer, so it is in the checkpoint and continues across a resume;
  - ``train/tokens_per_s`` — trained tokens per wall-clock second since the last log point.
Validation logs ``val/loss``, token-weighted over the whole validation set.

``init_from=CKPT`` starts a new run from another run's weights (pre-training -> SFT): at fit start
the checkpoint's ``model.*`` tensors are loaded into the model, nothing else (not its data
position, optimizer, schedule or step), after checking that the model shape and the tokenizer
match (``load_init_weights``). A resume (``ckpt_path``) restores its own weights instead.

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
from stacklm.data.contract import full_batch
from stacklm.errors import ConfigError
from stacklm.train.model import GPT, GPTConfig, check_batch, lm_token_loss


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

    def __init__(
        self, config: GPTConfig | None = None, optim: OptimConfig | None = None, compile: bool = False,
        init_from: str | None = None,
    ) -> None:
        """``init_from``: a checkpoint (``.ckpt``) whose model weights this run starts from."""
        super().__init__()
        self.config = GPTConfig.coerce(config)
        self.optim = OptimConfig.coerce(optim)
        self.compile_model = compile
        self.init_from = str(init_from) if init_from else None
        # Plain dicts, so checkpoints and W&B configs hold no pickled project classes.
        self.save_hyperparameters({"config": self.config.to_dict(), "optim": asdict(self.optim), "compile": compile,
                                   "init_from": self.init_from})
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

    @staticmethod
    def with_planes(batch):
        """A lean batch from a loader other than ``StackDataModule``'s (whose own
        ``on_after_batch_transfer`` derives them): the four planes on its device
        (``stacklm.data.contract.full_batch``); a full batch as it is. Called by the steps, not
        as this module's ``on_after_batch_transfer``: with a datamodule that also defines the
        hook, Lightning uses the datamodule's and warns about the module's in every fit."""
        return full_batch(batch) if isinstance(batch, Mapping) else batch

    def _check_first_batch(self, batch: Mapping[str, torch.Tensor]) -> None:
        if not self._batch_checked:
            check_batch(batch, self.config)
            self._batch_checked = True

    # ---------------------------------------------------------------- steps
    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        # a lean batch (``StackDataModule`` derived its planes after the transfer) also brings its
        # padded cu_seqlens and host max_seqlen: the varlen/flex masks need no host sync then
        return self.model(batch["input_ids"], batch["position_ids"], batch["seq_ids"],
                          batch.get("cu_seqlens"), batch.get("max_seqlen"))

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        batch = self.with_planes(batch)
        self._check_first_batch(batch)
        loss, n_tokens, token_loss = lm_token_loss(self(batch), batch["targets"])
        self.tokens_seen += sum_across_ranks(n_tokens.detach().to(torch.long))
        self.log("train/loss", loss, prog_bar=True)
        # token_loss: each target's loss, for callbacks (per-source loss, stacklm.source_loss); detached
        return {"loss": loss, "token_loss": token_loss.detach()}

    def on_fit_start(self) -> None:
        # After Lightning restored a resumed run's checkpoint (trainer.ckpt_path set): then the
        # run's own weights win and init_from is not read. The optimizer already holds these
        # parameters; loading copies into them in place.
        if self.init_from and self.trainer.ckpt_path is None:
            summary = load_init_weights(self, self.init_from, getattr(self.trainer, "datamodule", None))
            if self.trainer.is_global_zero:
                print(summary, flush=True)

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

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        batch = self.with_planes(batch)
        self._check_first_batch(batch)
        loss, n_tokens, token_loss = lm_token_loss(self(batch), batch["targets"])
        # batch_size=n_tokens makes the epoch value a token-weighted mean, not a mean of batch means.
        self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=max(int(n_tokens), 1))
        return {"loss": loss, "token_loss": token_loss}

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


def load_init_weights(module: GPTModule, path: str, datamodule=None) -> str:
    """Copy the ``model.*`` tensors of checkpoint ``path`` into ``module.model`` and return a
    one-line summary. Refused, with a line naming the checkpoint and the field: a file that is
    not a Lightning checkpoint of this model, another model shape (``model.config`` fields
    differ: listed with both values), or another tokenizer than ``datamodule``'s (the checkpoint's
    data identity holds the tokenizer hash of the data it trained on; embedding rows of one
    tokenizer mean nothing under another). ``seq_len`` may differ (RoPE tables are not weights).
    Read with ``weights_only=True``: a checkpoint is data, never code."""

    where = f"model.init_from: {path}"
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file; give the pre-training run's checkpoint (e.g. ckpt/last.ckpt)") from None
    except Exception as e:  # noqa: BLE001 -- anything torch cannot read as a data-only checkpoint
        raise ConfigError(f"{where}: not a readable checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    weights = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(weights, dict) or not any(k.startswith("model.") for k in weights):
        raise ConfigError(f"{where}: holds no 'state_dict' with model.* weights; is it a stacklm-train checkpoint?")
    saved = (ckpt.get("hyper_parameters") or {}).get("config") or {}
    mine = module.config.to_dict()
    shape_fields = ("vocab_size", "n_layer", "n_head", "d_model", "mlp_ratio")
    diffs = [f"{k} {saved.get(k)} vs {mine[k]}" for k in shape_fields if k in saved and saved[k] != mine[k]]
    if diffs:
        raise ConfigError(f"{where}: the checkpoint's model has another shape (checkpoint vs this run: {', '.join(diffs)}); "
                          "set model.config to the pre-training run's values")
    ident = ((ckpt.get("StackDataModule") or {}).get("identity") or {}).get("tokenizer")
    now = datamodule.tokenizer_hash() if datamodule is not None and hasattr(datamodule, "tokenizer_hash") else None
    if ident and now and ident != now:
        raise ConfigError(f"{where}: trained with tokenizer {ident[:16]}..., this run's data.tokenizer is {now[:16]}...; "
                          "use the pre-training run's tokenizer (its embedding rows belong to those ids)")
    model_weights = {k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")}
    mine_sd = module.model.state_dict()
    missing = sorted(set(mine_sd) - set(model_weights))
    extra = sorted(set(model_weights) - set(mine_sd))
    bad = [k for k in set(mine_sd) & set(model_weights) if mine_sd[k].shape != model_weights[k].shape]
    if missing or extra or bad:
        raise ConfigError(f"{where}: weights do not fit this model (missing {missing[:3]}, unexpected {extra[:3]}, "
                          f"other shapes {sorted(bad)[:3]})")
    with torch.no_grad():
        module.model.load_state_dict(model_weights, strict=True)
    return (f"model.init_from: {len(model_weights)} weight tensors from {path} (that run's step {ckpt.get('global_step', '?')}); "
            "data position, optimizer and schedule start fresh")


def check_datamodule(datamodule, config: GPTConfig) -> None:
    """Refuse a datamodule whose ``vocab_size`` exceeds the embedding or whose ``seq_len``
    differs from the model's. Attributes that are absent (or None) are not checked."""
    if datamodule is None:
        return

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
