"""One run, one story: a resumed fit continues the same W&B run and the same CSV folder.

Lightning opens its loggers' runs before it reads the checkpoint (``_call_setup_hook`` creates
every logger's experiment first), so a logger cannot learn from the checkpoint which run it
belongs to; left alone, every resume is a new W&B run and a new ``version_N`` CSV folder. Two
halves fix that:

* ``RunIdentity`` (a callback) writes the loggers' identities into every checkpoint, under
  ``CHECKPOINT_KEY``: the W&B run id, and the CSV logger's folder and version. On a resumed fit
  it logs ``run/resumed_at`` (the step it resumed from) to every logger, which is how
  ``stacklm report`` marks the resume inside one CSV file.
* Before the trainer exists, ``saved_run(ckpt_path)`` reads them back, and the loggers are built
  with them: ``WandbLogger(id=saved["wandb_id"])`` (W&B's ``resume="allow"``, Lightning's default,
  continues the run) and ``ContinuingCSVLogger(version=saved["csv_version"], resume_step=...)``.
  ``stacklm-train`` does both itself (``continue_logger_config``): ``--ckpt_path`` of a file is
  enough. With a plain ``Trainer``, build the loggers from ``saved_run`` yourself.

``ContinuingCSVLogger`` is Lightning's ``CSVLogger`` except on a folder that already holds a
``metrics.csv``: Lightning deletes the file (its writer's start-up); this one keeps the rows
written before the checkpoint (``RunIdentity`` flushes the CSV logger and counts its rows at
every checkpoint) and moves the later ones of steps from the checkpoint's on -- what a crashed
attempt logged after the checkpoint it is resumed from, which the resume trains again -- to
``metrics.superseded.csv``, so the file reads as the one story the model went through and
nothing is lost. (A validation Lightning ran right after a step checkpoint logged after it: it
goes to the superseded file too.)
"""

from __future__ import annotations

import csv
import os
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

CHECKPOINT_KEY = "stacklm_run"
SUPERSEDED_FILE = "metrics.superseded.csv"


def _wandb_id(logger: Any) -> str | None:
    if type(logger).__name__ != "WandbLogger":
        return None
    run = getattr(logger, "_experiment", None)
    return getattr(run, "id", None) or getattr(logger, "_id", None) or getattr(logger, "version", None)


class RunIdentity(Callback):
    """Keeps the run's logger identities in the checkpoint and marks a resume (module docstring)."""

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        ident: dict[str, Any] = {}
        for logger in trainer.loggers:
            run_id = _wandb_id(logger)
            if run_id and "wandb_id" not in ident:
                ident["wandb_id"] = str(run_id)
            if isinstance(logger, CSVLogger) and "csv_version" not in ident:
                ident["csv_root"] = os.path.abspath(logger.root_dir)
                ident["csv_version"] = logger.version
                if trainer.is_global_zero:  # the rows logged so far, flushed: what a resume from here keeps
                    logger.save()
                    ident["csv_rows"] = _count_rows(os.path.join(logger.log_dir, "metrics.csv"))
        checkpoint[CHECKPOINT_KEY] = ident

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # not on_fit_start: Lightning restores the loop's global_step from the checkpoint between the two
        if trainer.ckpt_path is not None and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({"run/resumed_at": float(trainer.global_step)}, step=trainer.global_step)


def _count_rows(path: str) -> int:
    if not os.path.isfile(path):
        return 0
    with open(path, newline="") as f:
        return sum(1 for _ in csv.DictReader(f))


def saved_run(ckpt_path: str | os.PathLike | None) -> dict[str, Any]:
    """The identities ``RunIdentity`` kept in ``ckpt_path`` plus its ``global_step``
    (``{}`` for no file, a Lightning keyword such as ``last``, or a checkpoint without them).
    Read with ``weights_only=True`` and ``mmap=True``: the tensors are not read."""
    import torch

    if ckpt_path is None or not os.path.isfile(str(ckpt_path)):
        return {}
    ckpt = torch.load(str(ckpt_path), map_location="cpu", weights_only=True, mmap=True)
    ident = dict(ckpt.get(CHECKPOINT_KEY) or {}) if isinstance(ckpt, dict) else {}
    if ident and isinstance(ckpt, dict):
        ident["global_step"] = int(ckpt.get("global_step", 0))
    return ident


class _ContinuingWriter(ExperimentWriter):
    """Lightning's CSV writer that continues an existing ``metrics.csv`` (module docstring)."""

    def __init__(self, log_dir: str, resume_step: int | None, keep_rows: int | None = None) -> None:
        self._resume_step, self._keep_rows = resume_step, keep_rows
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        if self._resume_step is None or not self._fs.isfile(self.metrics_file_path):
            return super()._check_log_dir_exists()
        with self._fs.open(self.metrics_file_path, "r", newline="") as f:
            reader = csv.DictReader(f)
            fields = list(reader.fieldnames or [])
            rows = list(reader)
        # Kept: the rows written before the checkpoint was (its ``csv_rows``), and later rows of
        # earlier steps (Lightning writes a step's own row after the checkpoint hooks of that
        # step). Steps from the checkpoint's on, logged after it, are what the resume trains again.
        first = len(rows) if self._keep_rows is None else min(int(self._keep_rows), len(rows))
        early = (lambda r: r.get("step") in (None, "") or float(r["step"]) < self._resume_step)
        keep = rows[:first] + [r for r in rows[first:] if early(r)]
        later = [r for r in rows[first:] if not early(r)]
        if later:
            path = os.path.join(self.log_dir, SUPERSEDED_FILE)
            exists = self._fs.isfile(path)
            with self._fs.open(path, "a" if exists else "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
                if not exists:
                    writer.writeheader()
                writer.writerows(later)
        with self._fs.open(self.metrics_file_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(keep)
        self.metrics_keys = [k for k in fields]  # new keys rewrite the header (Lightning's writer does)


class ContinuingCSVLogger(CSVLogger):
    """``CSVLogger`` that, given ``resume_step``, continues the ``metrics.csv`` of its version
    folder instead of deleting it (module docstring). Without ``resume_step``: ``CSVLogger``."""

    def __init__(self, *args: Any, resume_step: int | None = None, keep_rows: int | None = None, **kwargs: Any) -> None:
        """``resume_step``: the checkpoint's ``global_step``; ``keep_rows``: the rows its
        ``metrics.csv`` had when the checkpoint was written (``saved_run``'s ``csv_rows``)."""
        super().__init__(*args, **kwargs)
        self.resume_step = None if resume_step is None else int(resume_step)
        self.keep_rows = None if keep_rows is None else int(keep_rows)

    @property
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(self.log_dir, self.resume_step, self.keep_rows)
        return self._experiment


def continue_logger_config(logger: Any, saved: dict[str, Any], default_root_dir: str | None) -> Any:
    """``stacklm-train``: the ``trainer.logger`` config (jsonargparse's ``class_path`` /
    ``init_args`` namespaces, a list of them, or ``None``/``True`` for the default CSV logger)
    rewritten to continue the run ``saved`` names: a ``WandbLogger`` without an ``id`` gets the
    saved one; a ``CSVLogger`` over the saved folder gets its version and continues it. Loggers
    pointed elsewhere, or given their own id or version, are left as configured."""
    if not saved:
        return logger
    if logger in (None, True):
        root = os.path.abspath(os.path.join(default_root_dir or os.getcwd(), "lightning_logs"))
        if saved.get("csv_root") == root and saved.get("csv_version") is not None:
            return ContinuingCSVLogger(save_dir=default_root_dir or os.getcwd(), version=saved["csv_version"],
                                       resume_step=saved["global_step"], keep_rows=saved.get("csv_rows"))
        return logger
    for item in logger if isinstance(logger, list) else [logger]:
        path = str(getattr(item, "class_path", "") or "")
        args = getattr(item, "init_args", None)
        if args is None:
            continue
        if path.endswith("WandbLogger") and saved.get("wandb_id") and not args.get("id") and not args.get("version"):
            args["id"] = saved["wandb_id"]
        elif path.split(".")[-1] in ("CSVLogger", "ContinuingCSVLogger") and args.get("version") is None:
            name = args.get("name", "lightning_logs")
            root = os.path.abspath(os.path.join(str(args.get("save_dir")), name) if name else str(args.get("save_dir")))
            if saved.get("csv_root") == root and saved.get("csv_version") is not None:
                item.class_path = "stacklm.run_identity.ContinuingCSVLogger"
                args["version"] = saved["csv_version"]
                args["resume_step"] = saved["global_step"]
                args["keep_rows"] = saved.get("csv_rows")
    return logger
