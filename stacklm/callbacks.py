"""W&B logging of what the data layer did: realized mix, token counts, drops, padding, throughput.

``DataStatsCallback`` is a Lightning ``Callback``. Every ``log_every_n_steps`` optimizer steps
it logs, to the run's ``WandbLogger``:

  ``data/tokens/<source>``, ``data/docs/<source>``       tokens / documents delivered so far
  ``data/target_weight/<source>``, ``data/realized_weight/<source>``, ``data/weight_gap/<source>``
  ``data/mix`` (a ``wandb.Table``) and ``data/mix_bar`` (``wandb.plot.bar``: realized next to
                                                    target weight per source)
  ``data/dropped/<stage>/<source>/<reason>``, ``data/dropped_total``   documents dropped, by reason
  ``data/padding_fraction``
  ``data/phase/<phase>/{realized,target}_share/<source>``  per mixture phase (``mix_phases``)
  ``loader/batches_per_s``, ``loader/tokens_per_s``     rate of batches through the train loop
  ``loader/wait_fraction``                             share of wall time spent waiting on the loader
and, once at fit start, the hashes into the run config under ``data/hashes``.

The data-stats protocol
-----------------------
The datamodule provides the numbers; the callback only formats and ships them::

    datamodule.data_stats() -> {
        "realized": {source: {"tokens": int, "docs": int,
                              "target_weight": float, "realized_weight": float}},
        "dropped":  {stage: {source: {reason: int}}},       # e.g. {"filter": {"web": {"too_short": 3}}}
        "padding_fraction": float,                          # pad tokens / all tokens delivered
        "hashes": {"tokenizer": str, "manifest": str | None, "data_config": str},
        "mix_phases": [ {"name", "planned_tokens", "tokens", "docs", "target_share",
                         "realized_share", ...} ],              # stream mode, stacklm.data.schedule
    }

Counts are cumulative since the start of the run (a resumed run continues them) and cover
what *this rank* has delivered (its loader workers merged). The callback calls
``data_stats()`` on every rank at the same steps and, under DDP, sums tokens, docs and drops
over ranks (``all_gather_object``), recomputes realized weights from the summed tokens and
averages the padding fraction. Keep it cheap: it runs every ``log_every_n_steps`` steps.
Any key may be missing; a datamodule without ``data_stats`` still gets loader throughput.

Without a ``WandbLogger`` in ``trainer.loggers``, or with ``WANDB_MODE=disabled``, the
callback prints one notice and does nothing else (``data_stats`` is never called).
Offline runs (``WANDB_MODE=offline`` or ``WandbLogger(offline=True)``) log normally.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


def _wandb_logger(trainer: Trainer):
    from lightning.pytorch.loggers import WandbLogger

    return next((lg for lg in trainer.loggers if isinstance(lg, WandbLogger)), None)


def _is_disabled(run: Any) -> bool:
    return bool(getattr(run, "disabled", False)) or getattr(getattr(run, "settings", None), "mode", None) == "disabled"


def merge_data_stats(per_rank: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum the protocol dicts of several ranks (tokens, docs, drops; padding averaged)."""
    realized: dict[str, dict[str, Any]] = {}
    dropped: dict[str, dict[str, dict[str, int]]] = {}
    paddings = []
    for stats in per_rank:
        for source, row in (stats.get("realized") or {}).items():
            out = realized.setdefault(source, {"tokens": 0, "docs": 0, "target_weight": row.get("target_weight")})
            out["tokens"] += int(row.get("tokens", 0))
            out["docs"] += int(row.get("docs", 0))
        for stage, by_source in (stats.get("dropped") or {}).items():
            for source, by_reason in by_source.items():
                slot = dropped.setdefault(stage, {}).setdefault(source, {})
                for reason, count in by_reason.items():
                    slot[reason] = slot.get(reason, 0) + int(count)
        if stats.get("padding_fraction") is not None:
            paddings.append(float(stats["padding_fraction"]))
    total = sum(row["tokens"] for row in realized.values())
    for row in realized.values():
        row["realized_weight"] = row["tokens"] / total if total else 0.0
    merged = {"realized": realized, "dropped": dropped, "hashes": dict(per_rank[0].get("hashes") or {}) if per_rank else {}}
    phases = [stats["mix_phases"] for stats in per_rank if stats.get("mix_phases")]
    if phases:
        from stacklm.data.schedule import merge_phase_reports

        merged["mix_phases"] = merge_phase_reports(phases)
    if paddings:
        merged["padding_fraction"] = sum(paddings) / len(paddings)
    return merged


def data_scalars(stats: Mapping[str, Any]) -> dict[str, float]:
    """The protocol dict flattened into W&B scalar keys (see the module docstring)."""
    out: dict[str, float] = {}
    for source, row in (stats.get("realized") or {}).items():
        for key in ("tokens", "docs", "target_weight", "realized_weight"):
            if row.get(key) is not None:
                out[f"data/{key}/{source}"] = float(row[key])
        if row.get("target_weight") is not None and row.get("realized_weight") is not None:
            out[f"data/weight_gap/{source}"] = float(row["realized_weight"]) - float(row["target_weight"])
    dropped_total = 0
    for stage, by_source in (stats.get("dropped") or {}).items():
        for source, by_reason in by_source.items():
            for reason, count in by_reason.items():
                out[f"data/dropped/{stage}/{source}/{reason}"] = float(count)
                dropped_total += int(count)
    if stats.get("dropped") is not None:
        out["data/dropped_total"] = float(dropped_total)
    if stats.get("padding_fraction") is not None:
        out["data/padding_fraction"] = float(stats["padding_fraction"])
    for phase in stats.get("mix_phases") or ():  # mixture schedules: realized vs target per phase
        for source, share in phase["realized_share"].items():
            out[f"data/phase/{phase['name']}/realized_share/{source}"] = float(share)
            out[f"data/phase/{phase['name']}/target_share/{source}"] = float(phase["target_share"][source])
    return out


class DataStatsCallback(Callback):
    """Logs the datamodule's ``data_stats()`` and loader throughput to W&B (module docstring).

    ``log_every_n_steps``: interval in optimizer steps for scalars; ``table_every_n_steps``:
    interval for the mix table and bar chart (each one is a W&B artifact; default: same).
    """

    def __init__(self, log_every_n_steps: int = 50, table_every_n_steps: int | None = None) -> None:
        if log_every_n_steps <= 0:
            raise ValueError(f"log_every_n_steps must be > 0, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.table_every_n_steps = table_every_n_steps or log_every_n_steps
        self.enabled = False
        self._last_logged_step = -1
        self._reset_window()

    def _reset_window(self) -> None:
        self._window_start = time.perf_counter()
        self._window_batches = 0
        self._window_tokens = 0
        self._window_wait = 0.0
        self._last_batch_end: float | None = None

    # ---------------------------------------------------------------- lifecycle
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        logger = _wandb_logger(trainer)
        reason = None
        if logger is None:
            reason = "no WandbLogger in trainer.loggers"
        elif os.environ.get("WANDB_MODE", "").lower() == "disabled":
            reason = "WANDB_MODE=disabled"
        elif trainer.is_global_zero and _is_disabled(logger.experiment):
            reason = "the wandb run is disabled"
        # Rank 0 decides (only it holds the run); every rank must agree, since logging
        # gathers data_stats() from all ranks.
        self.enabled = bool(trainer.strategy.broadcast(reason is None, src=0))
        if reason and trainer.is_global_zero:
            # The prefix is the module's old name (renamed: it shadowed the standard library's
            # `logging`); the notice keeps it so that filters on it keep matching.
            print(f"stacklm.logging: {reason}; DataStatsCallback logs nothing.", file=sys.stderr)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.enabled:
            return
        stats = self._collect(trainer)
        hashes = stats.get("hashes") if stats else None
        if hashes and trainer.is_global_zero:
            _wandb_logger(trainer).experiment.config.update({"data/hashes": dict(hashes)}, allow_val_change=True)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset_window()

    # ---------------------------------------------------------------- per batch
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.enabled and self._last_batch_end is not None:
            # Lightning fetches the next batch between these two hooks.
            self._window_wait += time.perf_counter() - self._last_batch_end

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.enabled:
            return
        self._window_batches += 1
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        self._window_tokens += int(ids.numel()) if isinstance(ids, torch.Tensor) else 0
        step = trainer.global_step
        if step != self._last_logged_step and step % self.log_every_n_steps == 0:
            self._last_logged_step = step
            self._log(trainer, step, with_table=step % self.table_every_n_steps == 0)
        self._last_batch_end = time.perf_counter()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.enabled and trainer.global_step != self._last_logged_step:
            self._last_logged_step = trainer.global_step
            self._log(trainer, trainer.global_step, with_table=True)

    # ---------------------------------------------------------------- logging
    def _collect(self, trainer: Trainer) -> dict[str, Any] | None:
        """``data_stats()`` merged over ranks (one rank: normalised as-is); None without the protocol."""
        data_stats = getattr(getattr(trainer, "datamodule", None), "data_stats", None)
        if not callable(data_stats):
            return None
        stats = data_stats()
        per_rank = [stats]
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            per_rank = [None] * trainer.world_size
            torch.distributed.all_gather_object(per_rank, stats)
        return merge_data_stats(per_rank)

    def _throughput(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self._window_start, 1e-9)
        out = {
            "loader/batches_per_s": self._window_batches / elapsed,
            "loader/tokens_per_s": self._window_tokens / elapsed,
            "loader/wait_fraction": min(1.0, self._window_wait / elapsed),
        }
        self._window_start, self._window_batches, self._window_tokens, self._window_wait = time.perf_counter(), 0, 0, 0.0
        return out

    def _log(self, trainer: Trainer, step: int, with_table: bool) -> None:
        stats = self._collect(trainer)  # collective under DDP: every rank gets here
        if not trainer.is_global_zero:
            self._throughput()
            return
        logger = _wandb_logger(trainer)
        metrics = self._throughput()
        if stats:
            metrics.update(data_scalars(stats))
        logger.log_metrics(metrics, step=step)
        if with_table and stats and stats.get("realized"):
            self._log_mix_table(logger, stats["realized"], step)

    @staticmethod
    def _log_mix_table(logger, realized: Mapping[str, Mapping[str, Any]], step: int) -> None:
        import wandb

        columns = ["source", "target_weight", "realized_weight", "tokens", "docs"]
        rows = [[s, r.get("target_weight"), r.get("realized_weight"), r.get("tokens"), r.get("docs")] for s, r in realized.items()]
        table = wandb.Table(columns=columns, data=rows)
        # Long format so one bar chart shows realized next to target for every source.
        long = wandb.Table(columns=["label", "weight"])
        for s, r in realized.items():
            long.add_data(f"{s} target", float(r.get("target_weight") or 0.0))
            long.add_data(f"{s} realized", float(r.get("realized_weight") or 0.0))
        bar = wandb.plot.bar(long, "label", "weight", title="data mix: target vs realized weight")
        logger.experiment.log({"data/mix": table, "data/mix_bar": bar, "trainer/global_step": step})
