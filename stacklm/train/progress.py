"""The fit's progress: a live bar on a terminal (``StepProgressBar``), plain lines elsewhere
(``LineProgressBar``); ``stacklm.train.cli`` picks one by whether stderr is a terminal.

Why not Lightning's ``RichProgressBar`` as it is: a run bounded by ``max_steps`` leaves
``max_epochs`` at -1 ("no epoch limit") and the bar said ``Epoch 0/-2``; its total is the
batches left in the epoch and its count the batch index, so a fit resumed at step 21 of 26
read ``26/5``; and with stderr redirected (``nohup``, Slurm) Rich prints nothing until one frame
at the end. Both bars here count optimizer steps against ``max_steps``.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar

from stacklm.progress_lines import ProgressLines, count, duration, eta, percent, rate


def counts_steps(trainer) -> bool:
    """A run bounded by ``max_steps`` alone: its bar counts ``global_step`` of ``max_steps``."""
    max_steps = trainer.max_steps
    return max_steps is not None and max_steps > 0 and (trainer.max_epochs is None or trainer.max_epochs < 0)


class StepProgressBar(RichProgressBar):
    """``RichProgressBar`` that says ``Epoch 0`` (no ``/-2``) when the epochs are unbounded and,
    in a ``max_steps`` run, shows ``global_step`` of ``max_steps`` (right after a resume too)."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = f"Epoch {current_epoch}"
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0:
            description += f"/{max_epochs - 1}"
        if len(self.validation_description) > len(description):  # as Lightning pads it: no flicker
            description = f"{description:{len(self.validation_description)}}"
        return description

    @property
    def total_train_batches(self) -> int | float:
        if counts_steps(self.trainer):
            return self.trainer.max_steps
        return super().total_train_batches

    def _start_at_global_step(self) -> None:
        # a reset, not an update: an update from 0 to a resumed step counts as progress made
        # now, and the rate column would show it as a burst
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.reset(self.train_progress_bar_id, total=self.trainer.max_steps, completed=self.trainer.global_step,
                                description=self._get_train_description(self.trainer.current_epoch), visible=True)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if counts_steps(trainer) and not self.is_disabled:
            self._start_at_global_step()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not counts_steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:  # a resume mid-epoch
            self._initialize_train_progress_bar_id()
            self._start_at_global_step()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
        self.refresh()


class LineProgressBar(ProgressBar):
    """The fit's progress as plain lines on stderr (``stacklm.progress_lines``), one every
    ``every_seconds`` (default 30, ``STACKLM_PROGRESS_SECONDS``) or ``every_n_steps`` optimizer
    steps, whichever comes first, plus one after the first step and one at the end::

        2026-12-07 04:20:11 fit: step 22/40 (55%)  tokens 22,236  tok/s 101  train/loss 8.002  val/loss 7.565  elapsed 0:02:45  ETA 0:02:15

    (the demo config on a loaded 2-core CPU; docs/trainer.md, "Progress in a log file").

    ``tokens``: the tokens the training step received, from the datamodule's ``data_stats()``
    (``stacklm.datamodule.delivery``: summed over ranks; a resume continues the count); absent
    for a datamodule without it. ``tok/s``: tokens since the previous line over its wall time (the
    last line: since the first step). The first line, right after the run's first step, says
    ``tok/s ?`` and ``ETA ?``: its only pace would count the start-up (the model's build, the
    loaders' first batches, a checkpoint's load), and a fit that finished in 30 s read ``ETA
    0:24:10`` there; the ETA is the pace since the first step. The metrics are those the module logs with ``prog_bar=True``.
    Under DDP only rank 0 writes; every rank takes part in the count at the same steps: there the
    interval is in steps, re-derived at each line from rank 0's pace so that the lines come about
    ``every_seconds`` apart (a time check on each rank's own clock could disagree and hang the sum).
    """

    def __init__(self, every_n_steps: int = 1000, every_seconds: float | None = None) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"LineProgressBar: every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = int(every_n_steps)
        self.every_seconds = every_seconds
        self._enabled = True
        self._lines: ProgressLines | None = None

    # ProgressBar's interface (Lightning's tuner switches bars off and on)
    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self._enabled

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer = trainer  # no disable() on the other ranks: they take part in the counts

    # ------------------------------------------------------------------ the numbers
    @staticmethod
    def _my_tokens(trainer) -> int | None:
        """The tokens this rank's training step received (``data_stats``); None without it."""
        stats = getattr(getattr(trainer, "datamodule", None), "data_stats", None)
        return int(((stats() or {}).get("delivered") or {}).get("tokens", 0)) if callable(stats) else None

    def _gather(self, trainer, mine: Any, proposal: int | None = None) -> tuple[int | None, int | None]:
        """(sum of every rank's ``mine``, rank 0's ``proposal``)."""
        import torch

        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            per_rank: list = [None] * trainer.world_size
            torch.distributed.all_gather_object(per_rank, (mine, proposal))
        else:
            per_rank = [(mine, proposal)]
        values = [m for m, _ in per_rank]
        return (None if any(v is None for v in values) else sum(values)), per_rank[0][1]

    def _metrics(self, trainer, outputs: Any) -> list[tuple[str, str]]:
        metrics = dict(trainer.progress_bar_metrics)
        if not metrics and isinstance(outputs, dict) and outputs.get("loss") is not None:
            # Lightning divides the step's loss by the accumulation before handing it here
            metrics = {"loss": float(outputs["loss"]) * trainer.accumulate_grad_batches}
        return [(k, f"{float(v):.4g}") for k, v in metrics.items()]

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer, pl_module) -> None:
        self._lines = ProgressLines("fit", seconds=self.every_seconds, every=self.every_n_steps)
        self._start_step = self._seen_step = self._lines.last_n = trainer.global_step
        self._total: float = trainer.max_steps if counts_steps(trainer) else trainer.estimated_stepping_batches
        self._last_tokens = self._gather(trainer, self._my_tokens(trainer))[0]
        self._next_step = self._start_step + 1  # a first line after the first step: the run is alive, and its pace
        self._first: tuple[int, float, int | None] | None = None  # (step, time, tokens) at the first line: the pace after start-up

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if self._lines is None or step == self._seen_step:
            return  # a micro-batch of an accumulating step, or no optimizer step taken
        self._seen_step = step
        if trainer.world_size == 1:  # seconds on this clock, or every_n_steps, whichever first
            due = step == self._start_step + 1 or self._lines.due(step)
        else:  # the same step on every rank: rank 0's pace, shared at the last line
            due = step >= self._next_step
        if due:
            self._line(trainer, step, outputs)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._lines is not None and trainer.global_step > self._start_step:
            self._line(trainer, trainer.global_step, None, final=True)
        self._lines = None

    def _line(self, trainer, step: int, outputs: Any, final: bool = False) -> None:
        lines = self._lines
        now = lines.clock()
        if self._first is None:  # start-up included: only to place the next line under DDP, never shown
            pace = (step - self._start_step) / max(now - lines.started, 1e-9)
        else:
            pace = (step - self._first[0]) / max(now - self._first[1], 1e-9)
        # the next line's step (on rank 0's pace; every rank follows it under DDP)
        proposal = step + max(1, min(self.every_n_steps, int(lines.seconds * pace) or 1))
        tokens, self._next_step = self._gather(trainer, self._my_tokens(trainer), proposal)
        first = self._first
        if first is None:
            self._first = (step, now, tokens)
        if trainer.is_global_zero and self._enabled:
            fields: list[tuple[str, str]] = [("", "done")] if final else []
            total = None if self._total == float("inf") else int(self._total)
            fields.append(("step", f"{step}/{'?' if total is None else total} ({percent(step, total)})"))
            if tokens is not None:
                if first is None or first[2] is None or step == first[0]:
                    tok_s = "?"  # no pace yet: only the start-up's
                else:
                    since = tokens - (first[2] if final else self._last_tokens)
                    tok_s = rate(since / max(now - (first[1] if final else lines.last_time), 1e-9))
                fields += [("tokens", count(tokens)), ("tok/s", tok_s)]
            fields += self._metrics(trainer, outputs)
            fields += [("elapsed", duration(now - lines.started))]
            if not final:
                fields += [("ETA", "?" if total is None or first is None else eta(total - step, pace))]
            lines.write(fields, n=step)
        else:
            lines.last_time, lines.last_n = now, step
        self._last_tokens = tokens

