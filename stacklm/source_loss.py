"""Loss per data source: which part of the mix the model learns, and which it does not.

``SourceLossCallback`` is a Lightning ``Callback``. Each target token's loss is attributed to
the source of the document the token belongs to (token-weighted, not a mean of row means), and
logged through **every logger of the trainer** (CSV, TensorBoard, W&B, ...):

  ``train/loss_by_source/<source>``        mean loss of the source's target tokens since the last log point
  ``train/loss_tokens_by_source/<source>`` how many target tokens that mean is over
  ``train/phase/<phase>/loss_by_source/<source>``  the same, under the mixture phase the run is in
                                           (only with a ``schedule:`` of several phases, stream mode)
  ``val/loss_by_source/<source>``          over the whole validation pass (and ``val/loss_tokens_by_source/<source>``)

Training values are logged every ``log_every_n_steps`` optimizer steps (default: the trainer's
``log_every_n_steps``) at the trainer's ``global_step`` (the steps ``DataStatsCallback`` logs at)
and at the end of the fit. Under DDP the per-source sums of loss and of token counts are summed
over the ranks (one ``all_reduce`` of a ``2 x sources`` tensor per log point) before dividing,
so the logged value is the mean over every rank's tokens, whatever each rank drew.

Where the sources come from: the datamodule's ``batch_sources(split)`` (``StackDataModule``:
stream mode's per-row document pieces, shards mode's global rows looked up in the prebuild's
provenance side files), read in the batch hook, for the batch just trained on. A datamodule
without it, a prebuild without provenance, or SFT batches: one notice, nothing logged.

What the LightningModule must provide: ``training_step`` (and ``validation_step``) returns a
dict with the usual ``"loss"`` and ``"token_loss"``: each target's own loss, shape ``(B, T)``
like ``batch["targets"]``, any value where the target is ``-100`` (those are not counted);
detach it in ``training_step``. ``stacklm.train.GPTModule`` does; in a module of your own, use
``F.cross_entropy(..., reduction="none")`` and sum it for the loss (``stacklm.train.model.
lm_token_loss``), which costs no more than the mean. A module that returns no ``token_loss``:
one notice naming the key, nothing logged.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from stacklm.data.contract import IGNORE_INDEX


class _Sums:
    """Per-source sums of loss and of target tokens, on the module's device (float64, so the
    sums stay exact enough over a long interval)."""

    def __init__(self) -> None:
        self.names: list[str] | None = None
        self.acc: torch.Tensor | None = None  # (2, n): loss sums, token counts

    def add(self, names: list[str], sources: torch.Tensor, targets: torch.Tensor, token_loss: torch.Tensor) -> None:
        if self.acc is None or names != self.names:
            self.names = list(names)
            self.acc = torch.zeros(2, len(names), dtype=torch.float64, device=token_loss.device)
        keep = (targets != IGNORE_INDEX) & (sources >= 0)
        idx = sources[keep].long()
        self.acc[0].index_add_(0, idx, token_loss.detach()[keep].double())
        self.acc[1].index_add_(0, idx, torch.ones_like(idx, dtype=torch.float64))

    def reduce(self) -> torch.Tensor | None:
        """The sums over all ranks (a collective under DDP: every rank calls it at the same
        point), then reset."""
        if self.acc is None:
            return None
        out, self.acc = self.acc, torch.zeros_like(self.acc)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(out)
        return out.cpu()


def _scalars(prefix: str, names: list[str], sums: torch.Tensor) -> dict[str, float]:
    out = {}
    for i, name in enumerate(names):
        n = float(sums[1, i])
        if n > 0:  # a source with no token in the interval has no loss there (not 0)
            out[f"{prefix}/loss_by_source/{name}"] = float(sums[0, i]) / n
            out[f"{prefix}/loss_tokens_by_source/{name}"] = n
    return out


class SourceLossCallback(Callback):
    """Logs the training and validation loss per data source (module docstring).

    ``log_every_n_steps``: interval in optimizer steps (``None``: the trainer's);
    ``key``: the key of the per-token loss in what the steps return.
    """

    def __init__(self, log_every_n_steps: int | None = None, key: str = "token_loss") -> None:
        if log_every_n_steps is not None and log_every_n_steps <= 0:
            raise ValueError(f"SourceLossCallback: log_every_n_steps must be > 0, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.key = key
        self._train, self._val = _Sums(), _Sums()
        self._last_logged_step = -1
        self._said: set[str] = set()
        self._off = False

    # ---------------------------------------------------------------- helpers
    def _notice(self, trainer: Trainer, what: str, line: str) -> None:
        if what not in self._said and trainer.is_global_zero:
            print(f"stacklm: SourceLossCallback: {line}", file=sys.stderr)
        self._said.add(what)

    def _add(self, trainer: Trainer, sums: _Sums, split: str, outputs: Any, batch: Any) -> None:
        token_loss = outputs.get(self.key) if isinstance(outputs, Mapping) else None
        if not isinstance(token_loss, torch.Tensor):
            self._off = True  # every rank runs the same module: all stop together
            self._notice(trainer, "key", f"the module's step returns no {self.key!r} (each target's loss, shape (B, T)); "
                         "per-source loss is not logged (see stacklm.source_loss)")
            return
        batch_sources = getattr(getattr(trainer, "datamodule", None), "batch_sources", None)
        got = batch_sources(split) if callable(batch_sources) else None
        if got is None:
            self._notice(trainer, f"sources-{split}", f"the {split} batches carry no row provenance (SFT batches, a prebuild "
                         "without provenance, or a datamodule without batch_sources); no per-source loss for them")
            return
        names, positions = got
        targets = batch["targets"]
        t = targets.shape[1]
        # targets[:, j] is window position j + 1
        sources = torch.from_numpy(positions[:, 1 : t + 1]).to(token_loss.device, non_blocking=True)
        if tuple(sources.shape) != tuple(targets.shape):
            raise ValueError(f"SourceLossCallback: the {split} loader's last rows give sources of shape {tuple(sources.shape)} "
                             f"but the batch's targets are {tuple(targets.shape)}; the loader fetched ahead of the step")
        sums.add(names, sources, targets, token_loss)

    def _interval(self, trainer: Trainer) -> int:
        return int(self.log_every_n_steps or trainer.log_every_n_steps or 50)

    def _log_train(self, trainer: Trainer, step: int) -> None:
        sums = self._train.reduce()  # collective: every rank reaches this at the same step
        if sums is None or not trainer.is_global_zero:
            return
        metrics = _scalars("train", self._train.names, sums)
        phase = getattr(getattr(trainer, "datamodule", None), "mix_phase", None)
        phase = phase() if callable(phase) else None
        if phase is not None:
            metrics.update({f"train/phase/{phase}/{k.removeprefix('train/')}": v for k, v in list(metrics.items())})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    # ---------------------------------------------------------------- training
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._off:
            return
        self._add(trainer, self._train, "train", outputs, batch)
        step = trainer.global_step
        if step != self._last_logged_step and step % self._interval(trainer) == 0 and not self._off:
            self._last_logged_step = step
            self._log_train(trainer, step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._off and trainer.global_step != self._last_logged_step:
            self._last_logged_step = trainer.global_step
            self._log_train(trainer, trainer.global_step)

    # ---------------------------------------------------------------- validation
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._val = _Sums()

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if not self._off:
            self._add(trainer, self._val, "val", outputs, batch)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._off:
            return
        sums = self._val.reduce()  # collective
        if sums is None or trainer.sanity_checking or not trainer.is_global_zero:
            return
        metrics = _scalars("val", self._val.names, sums)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
