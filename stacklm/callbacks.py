"""Logging of what the data layer did: delivered mix, token counts, drops, padding, throughput.

``DataStatsCallback`` is a Lightning ``Callback``. Every ``log_every_n_steps`` optimizer steps
it logs these scalars through **every logger of the trainer** (CSV, TensorBoard, W&B, ...):

  ``data/tokens/<source>``, ``data/docs/<source>``       tokens / documents begun (first token) delivered to the step so far
  ``data/rows/<source>``                               shards mode: packed rows delivered that hold the source's tokens
  ``data/target_weight/<source>``, ``data/realized_weight/<source>``, ``data/weight_gap/<source>``
  ``data/dropped_docs/<stage>/<source>/<reason>``, ``data/dropped_docs_total``   documents dropped
  ``data/dropped_tokens/<source>/<reason>``, ``data/dropped_tokens_total``      tokens dropped (cut by the budget)
  ``data/holdout_docs/<source>``                       documents set aside for the other split (not drops)
  ``data/decontam/<set>/{docs,tokens,cut_docs,cut_tokens}``  removed for sharing n-grams with an evaluation set
  ``data/cut_docs/<source>/<reason>``                  kept but cut short: by the mix budget (cut_by_budget), SFT to fit (truncated, ...)
  ``data/padding_fraction``                            pad positions / all positions delivered
  ``data/offline_fallback``                            sources reading the synthetic fallback (0 unless opted in)
  ``data/ran_dry/<source>``                            the step at which a source ran dry (once it has)
  ``data/phase/<phase>/{realized,target}_share/<source>``  per mixture phase (``mix_phases``: what the mixer drew)
  ``loader/batches_per_s``, ``loader/tokens_per_s``     rank 0's rate of batches through the train loop
  ``loader/wait_fraction``                             share of the window the step waited for its batch: the
                                                       maximum over ranks (the slowest rank holds all of them)
  ``loader/wait_fraction_mean``, ``loader/wait_s``      the mean over ranks; the waiting rank's seconds in the window
  ``loader/wait_on_device``                            1 when the wait is timed on the GPU (CUDA events), 0: host clock
  ``loader/stage_seconds/<stage>``                     stream mode: the loader workers' seconds in each pipeline stage's
                                                       own work (source ... tokenize, mix, shuffle, pack, batch), summed
                                                       over workers and ranks, since the workers started (``StageClock``)

The drop, cut and holdout keys come from one list, ``drop_rows`` (each ``<stage>/<reason>`` as
the token ledger names it), which the W&B drops chart and ``stacklm report`` also draw from.

and, on W&B only, every ``table_every_n_steps``: ``data/mix`` (a table), ``data/mix_bar`` (realized
next to target share per source), ``data/share_over_time`` (realized and target share per source
against the step), ``data/doc_length/<source>`` (a histogram of the delivered documents' lengths)
``data/drops_bar`` (dropped documents by stage and reason) and ``data/decontam_examples`` (a few
overlapping n-grams per evaluation set, with where each document came from). The hashes go into the run
config under ``data/hashes`` at fit start, and ``data/offline_fallback`` when a source falls back.
Beside every file logger's metrics (CSV, TensorBoard) the latest ``data_stats()`` is kept as
``data_stats.json`` at the same interval, so ``stacklm report`` draws those charts without W&B.

A source that runs dry is a warning naming the source, the step and its delivered vs target
share (the datamodule warns when the worker's summary arrives; the callback logs the step).

The data-stats protocol
-----------------------
The datamodule provides the numbers; the callback only formats and ships them::

    datamodule.data_stats() -> {
        "realized": {source: {"tokens": int, "docs": int, "rows": int,   # rows: shards mode only
                              "target_weight": float, "realized_weight": float}},
        "delivered": {"batches": int, "positions": int, "tokens": int},
        "dropped_docs":   {stage: {source: {reason: int}}},  # e.g. {"filter": {"web": {"too_short": 3}}}
        "dropped_tokens": {source: {reason: int}},           # e.g. {"web": {"cut_by_budget": 812}}
        "holdout_docs": {source: int},
        "cut_docs": {source: {reason: int}},                # kept but cut: cut_by_budget; SFT: cut to fit seq_len
        "offline_fallback": [source, ...],
        "ran_dry": {source: {"batch": int, "delivered_share": float, "target_share": float, ...}},
        "doc_length_hist": {"edges": [int], "counts": {source: [int]}},
        "padding_fraction": float,                          # pad positions / all positions delivered
        "hashes": {"tokenizer": str, "manifest": str | None, "data_config": str},
        "mix_phases": [ {"name", "planned_tokens", "tokens", "docs", "target_share",
                         "realized_share", ...} ],              # stream mode, stacklm.data.mix.schedule
        "decontamination": {"n", "mode", "index", "sets": {set: {"docs", "tokens", "cut_docs", "cut_tokens",
                                                                  "examples": [...]}}},  # stacklm.data.quality.decontam
    }

``realized``, ``delivered``, ``doc_length_hist`` and ``padding_fraction`` count the batches that
reached the training step (stream mode counts every batch's own per-source counts; a resumed
run continues them); drops, holdout and dry sources are counted by the loader workers as
they process documents. Counts cover *this rank*; the callback calls ``data_stats()`` on every
rank at the same steps and, under DDP, sums them over ranks (``all_gather_object``) and
recomputes the shares and the padding fraction from the sums. Any key may be missing; a
datamodule without ``data_stats`` still gets loader throughput.

Without any logger (``logger=False``), or when the only logger is a disabled W&B run, the
callback prints one notice and does nothing else (``data_stats`` is never called).
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from stacklm.atomic import atomic_write_text
from stacklm.once import first_time

DATA_STATS_FILE = "data_stats.json"  # the latest data_stats() beside a file logger's metrics (``stacklm report``)


def reduce_wait(per_rank: list[tuple[float, float]]) -> dict[str, float]:
    """``(seconds waited, window seconds)`` per rank -> the logged wait: the slowest rank's
    fraction and seconds (under DDP every rank waits for it: at the gradient all-reduce, and at
    Lightning's per-step ``should_stop`` sync) and the mean fraction over the ranks."""
    fractions = [min(1.0, w / max(e, 1e-9)) for w, e in per_rank]
    slowest = int(np.argmax(fractions))
    return {"loader/wait_fraction": fractions[slowest], "loader/wait_fraction_mean": float(np.mean(fractions)),
            "loader/wait_s": float(per_rank[slowest][0])}


class WaitClock:
    """How long the training step waits for its next batch, as the device sees it.

    On a CUDA device: an event recorded after a step's work (``step_end``) and one recorded once
    the next batch is on the device (``batch_ready``; Lightning moves the batch before
    ``on_train_batch_start``). The time between them on the GPU's own clock is time it had
    nothing to do for want of data: zero while the host runs ahead, the loader's delay and the
    copy when it does not. Host code never waits for an event: they are read once per logging
    window (``take``), the one sync. On the CPU: the host clock between the same two points.
    """

    def __init__(self) -> None:
        self._pairs: list[tuple[Any, Any]] = []  # (step end, batch ready) CUDA events of this window
        self._end_event = None
        self._end_host: float | None = None
        self.host_s = 0.0

    def epoch_start(self) -> None:
        """A new epoch and window: the gap before its first batch is the loader starting (its
        workers), not a step's wait."""
        self._end_event, self._end_host, self._pairs, self.host_s = None, None, [], 0.0

    def batch_ready(self, device: torch.device) -> None:
        now = time.perf_counter()
        if self._end_host is not None:
            self.host_s += now - self._end_host
        if self._end_event is not None and device.type == "cuda":
            ready = torch.cuda.Event(enable_timing=True)
            ready.record()
            self._pairs.append((self._end_event, ready))

    def step_end(self, device: torch.device) -> None:
        self._end_host = time.perf_counter()
        if device.type == "cuda":
            self._end_event = torch.cuda.Event(enable_timing=True)
            self._end_event.record()
        else:
            self._end_event = None

    def take(self) -> tuple[float, bool]:
        """``(seconds waited in the window, timed on the device)``, and a new window."""
        if self._pairs:
            self._pairs[-1][1].synchronize()  # all of the window's events are done once its last is
            waited, on_device = sum(end.elapsed_time(ready) for end, ready in self._pairs) / 1000.0, True
        else:
            waited, on_device = self.host_s, False
        self._pairs, self.host_s = [], 0.0
        return waited, on_device


def _plain_number(x: Any) -> Any:
    """json.dumps fallback: numpy/torch scalars and arrays as plain numbers and lists."""
    if hasattr(x, "tolist"):
        return x.tolist()
    raise TypeError(f"not JSON: {type(x).__name__}")


def _wandb_logger(trainer: Trainer):
    from lightning.pytorch.loggers import WandbLogger

    return next((lg for lg in trainer.loggers if isinstance(lg, WandbLogger)), None)


def _is_disabled(run: Any) -> bool:
    return bool(getattr(run, "disabled", False)) or getattr(getattr(run, "settings", None), "mode", None) == "disabled"


def _add(slot: dict, key: str, n: int) -> None:
    slot[key] = slot.get(key, 0) + int(n)


def merge_data_stats(per_rank: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum the protocol dicts of several ranks (tokens, docs, positions, drops, holdout,
    histograms); shares and padding recomputed from the sums; fallbacks and dry sources united."""
    realized: dict[str, dict[str, Any]] = {}
    dropped_docs: dict[str, dict[str, dict[str, int]]] = {}
    dropped_tokens: dict[str, dict[str, int]] = {}
    cut_docs: dict[str, dict[str, int]] = {}
    holdout: dict[str, int] = {}
    delivered: dict[str, int] = {}
    fallback: set[str] = set()
    ran_dry: dict[str, dict[str, Any]] = {}
    hist: dict[str, Any] = {}
    paddings = []
    for stats in per_rank:
        for source, row in (stats.get("realized") or {}).items():
            out = realized.setdefault(source, {"tokens": 0, "docs": 0, "target_weight": row.get("target_weight")})
            out["tokens"] += int(row.get("tokens", 0))
            out["docs"] += int(row.get("docs", 0))
            if "rows" in row:  # shards mode: the packed rows holding the source's tokens
                out["rows"] = out.get("rows", 0) + int(row["rows"])
        for stage, by_source in (stats.get("dropped_docs") or {}).items():
            for source, by_reason in by_source.items():
                slot = dropped_docs.setdefault(stage, {}).setdefault(source, {})
                for reason, count in by_reason.items():
                    _add(slot, reason, count)
        for source, by_reason in (stats.get("dropped_tokens") or {}).items():
            for reason, count in by_reason.items():
                _add(dropped_tokens.setdefault(source, {}), reason, count)
        for source, by_reason in (stats.get("cut_docs") or {}).items():
            for reason, count in by_reason.items():
                _add(cut_docs.setdefault(source, {}), reason, count)
        for source, count in (stats.get("holdout_docs") or {}).items():
            _add(holdout, source, count)
        for key, count in (stats.get("delivered") or {}).items():
            _add(delivered, key, count)
        fallback |= set(stats.get("offline_fallback") or ())
        for source, info in (stats.get("ran_dry") or {}).items():
            if source not in ran_dry or info.get("batch", 0) < ran_dry[source].get("batch", 0):
                ran_dry[source] = dict(info)
        h = stats.get("doc_length_hist")
        if h:
            hist.setdefault("edges", list(h["edges"]))
            counts = hist.setdefault("counts", {})
            for source, c in h["counts"].items():
                counts[source] = [a + b for a, b in zip(counts.get(source, [0] * len(c)), c)]
        if stats.get("padding_fraction") is not None:
            paddings.append(float(stats["padding_fraction"]))
    total = sum(row["tokens"] for row in realized.values())
    for row in realized.values():
        row["realized_weight"] = row["tokens"] / total if total else 0.0
    merged: dict[str, Any] = {"realized": realized, "hashes": dict(per_rank[0].get("hashes") or {}) if per_rank else {}}
    for key, value, present in (("dropped_docs", dropped_docs, "dropped_docs"), ("dropped_tokens", dropped_tokens, "dropped_tokens"),
                                ("holdout_docs", holdout, "holdout_docs"), ("delivered", delivered, "delivered"), ("cut_docs", cut_docs, "cut_docs"),
                                ("ran_dry", ran_dry, "ran_dry"), ("doc_length_hist", hist, "doc_length_hist")):
        if any(present in s for s in per_rank):
            merged[key] = value
    if any("offline_fallback" in s for s in per_rank):
        merged["offline_fallback"] = sorted(fallback)
    ledgers = [stats["ledger"]["sources"] for stats in per_rank if stats.get("ledger")]
    if ledgers:  # additive over ranks (stacklm.data.ledger)
        from stacklm.data import ledger

        merged["ledger"] = ledger.with_status(ledger.merge(ledgers))
    decontam = [stats["decontamination"] for stats in per_rank if stats.get("decontamination")]
    if decontam:  # counts add over ranks; examples kept in a stable order
        from stacklm.data.quality.decontam import merge_reports

        merged["decontamination"] = merge_reports(decontam)
    phases = [stats["mix_phases"] for stats in per_rank if stats.get("mix_phases")]
    if phases:
        from stacklm.data.mix.schedule import merge_phase_reports

        merged["mix_phases"] = merge_phase_reports(phases)
    clocks = [stats["stage_seconds"] for stats in per_rank if stats.get("stage_seconds")]
    if clocks:  # the loader workers' seconds per stage, summed over the ranks
        merged["stage_seconds"] = {stage: sum(c.get(stage, 0.0) for c in clocks) for stage in sorted({k for c in clocks for k in c})}
    if delivered.get("positions"):
        merged["padding_fraction"] = 1.0 - delivered.get("tokens", 0) / delivered["positions"]
    elif paddings:
        merged["padding_fraction"] = sum(paddings) / len(paddings)
    return merged


def drop_rows(stats: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every drop, cut and set-aside count of a ``data_stats`` dict with its scalar key: the one
    list the logged scalars (CSV, TensorBoard, W&B), the W&B drops chart and ``stacklm report``
    are made from, so they name and count the same things. Each row: ``key``, ``kind``
    (``dropped_docs``, ``dropped_tokens``, ``holdout_docs``, ``cut_docs``, ``decontam``), ``label``
    (``stage/reason`` as the ledger names it, ``stacklm ledger``), ``source`` (``""``: every
    source), ``unit`` (``docs`` or ``tokens``) and ``count``."""
    rows: list[dict[str, Any]] = []

    def row(key: str, kind: str, label: str, source: str, unit: str, count: Any) -> None:
        rows.append({"key": key, "kind": kind, "label": label, "source": source, "unit": unit, "count": int(count)})

    for stage, by_source in sorted((stats.get("dropped_docs") or {}).items()):
        for source, by_reason in sorted(by_source.items()):
            for reason, count in sorted(by_reason.items()):
                row(f"data/dropped_docs/{stage}/{source}/{reason}", "dropped_docs", f"{stage}/{reason}", source, "docs", count)
    for source, by_reason in sorted((stats.get("dropped_tokens") or {}).items()):
        for reason, count in sorted(by_reason.items()):  # what the mix budget cut (the ledger's mix/cut_by_budget)
            row(f"data/dropped_tokens/{source}/{reason}", "dropped_tokens", f"mix/{reason}", source, "tokens", count)
    for source, count in sorted((stats.get("holdout_docs") or {}).items()):
        row(f"data/holdout_docs/{source}", "holdout_docs", "holdout/other_split", source, "docs", count)
    for source, by_reason in sorted((stats.get("cut_docs") or {}).items()):
        for reason, count in sorted(by_reason.items()):
            row(f"data/cut_docs/{source}/{reason}", "cut_docs", f"cut/{reason}", source, "docs", count)
    for name, rep in sorted(((stats.get("decontamination") or {}).get("sets") or {}).items()):  # per evaluation set
        for key in ("docs", "tokens", "cut_docs", "cut_tokens"):
            row(f"data/decontam/{name}/{key}", "decontam", f"decontam/{name}: {key.replace('_', ' ')}", "",
                "tokens" if key.endswith("tokens") else "docs", rep.get(key, 0))
    return rows


def dropped_docs_by_reason(stats: Mapping[str, Any]) -> dict[str, int]:
    """Dropped documents per ``stage/reason``, summed over the sources (``drop_rows``): the W&B
    drops chart and the report's."""
    out: dict[str, int] = {}
    for r in drop_rows(stats):
        if r["kind"] == "dropped_docs":
            out[r["label"]] = out.get(r["label"], 0) + r["count"]
    return out


def data_scalars(stats: Mapping[str, Any]) -> dict[str, float]:
    """The protocol dict flattened into scalar keys (see the module docstring)."""
    out: dict[str, float] = {}
    for source, row in (stats.get("realized") or {}).items():
        for key in ("tokens", "docs", "rows", "target_weight", "realized_weight"):
            if row.get(key) is not None:
                out[f"data/{key}/{source}"] = float(row[key])
        if row.get("target_weight") is not None and row.get("realized_weight") is not None:
            out[f"data/weight_gap/{source}"] = float(row["realized_weight"]) - float(row["target_weight"])
    drops = drop_rows(stats)
    out.update({r["key"]: float(r["count"]) for r in drops})
    for kind in ("dropped_docs", "dropped_tokens"):
        if stats.get(kind) is not None:
            out[f"data/{kind}_total"] = float(sum(r["count"] for r in drops if r["kind"] == kind))
    if stats.get("offline_fallback") is not None:
        out["data/offline_fallback"] = float(len(stats["offline_fallback"]))
    if stats.get("padding_fraction") is not None:
        out["data/padding_fraction"] = float(stats["padding_fraction"])
    if stats.get("ledger") is not None:  # 1 while every ledger identity holds (stacklm.data.ledger)
        out["data/ledger_ok"] = float(bool(stats["ledger"]["ok"]))
        out["data/ledger_problems"] = float(len(stats["ledger"]["problems"]))
    for stage, seconds in (stats.get("stage_seconds") or {}).items():  # the workers' own time per stage
        out[f"loader/stage_seconds/{stage}"] = float(seconds)
    for phase in stats.get("mix_phases") or ():  # mixture schedules: realized vs target per phase
        for source, share in phase["realized_share"].items():
            out[f"data/phase/{phase['name']}/realized_share/{source}"] = float(share)
            out[f"data/phase/{phase['name']}/target_share/{source}"] = float(phase["target_share"][source])
    return out


class DataStatsCallback(Callback):
    """Logs the datamodule's ``data_stats()`` and loader throughput through every logger of the
    trainer, plus charts on W&B (module docstring).

    ``log_every_n_steps``: interval in optimizer steps for scalars; ``table_every_n_steps``:
    interval for the W&B tables and charts (each one is a W&B artifact; default: same).
    """

    def __init__(self, log_every_n_steps: int = 50, table_every_n_steps: int | None = None) -> None:
        if log_every_n_steps <= 0:
            raise ValueError(f"log_every_n_steps must be > 0, got {log_every_n_steps}")
        self.log_every_n_steps = log_every_n_steps
        self.table_every_n_steps = table_every_n_steps or log_every_n_steps
        self.enabled = False
        self.use_wandb = False
        self._last_logged_step = -1
        self._share_history: list[tuple[int, dict[str, float], dict[str, float]]] = []  # (step, realized, target)
        self._dry_logged: set[str] = set()
        self._fallback_recorded: list[str] = []
        self._reset_window()

    def _reset_window(self) -> None:
        self._window_start = time.perf_counter()
        self._window_batches = 0
        self._window_tokens = 0
        self._wait = WaitClock()

    # ---------------------------------------------------------------- lifecycle
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        wandb_logger = _wandb_logger(trainer)
        use_wandb = wandb_logger is not None and os.environ.get("WANDB_MODE", "").lower() != "disabled"
        if use_wandb and trainer.is_global_zero and _is_disabled(wandb_logger.experiment):
            use_wandb = False
        others = [lg for lg in trainer.loggers if lg is not wandb_logger]
        reason = None
        if not (use_wandb or others):
            if not trainer.loggers:
                reason = "no logger in trainer.loggers"
            elif os.environ.get("WANDB_MODE", "").lower() == "disabled":
                reason = "WANDB_MODE=disabled and no other logger"
            else:
                reason = "the wandb run is disabled and there is no other logger"
        # Rank 0 decides (only it holds the loggers); every rank must agree, since logging
        # gathers data_stats() from all ranks.
        self.enabled = bool(trainer.strategy.broadcast(reason is None, src=0))
        self.use_wandb = bool(trainer.strategy.broadcast(use_wandb, src=0))
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
            for logger in trainer.loggers:
                logger.log_hyperparams({"data/hashes": dict(hashes)})

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._window_start, self._window_batches, self._window_tokens = time.perf_counter(), 0, 0
        self._wait.epoch_start()

    # ---------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """In the checkpoint: the history the W&B share-over-time chart is drawn from and the
        steps sources ran dry at, so a resumed fit's chart covers the whole run, not the steps
        from the resume on. Plain lists and numbers (read back with ``weights_only``)."""
        return {"share_history": [[int(step), dict(real), dict(target)] for step, real, target in self._share_history],
                "dry_steps": {s: int(v) for s, v in getattr(self, "_dry_steps", {}).items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._share_history = [(int(step), dict(real), dict(target)) for step, real, target in state_dict.get("share_history", ())]
        self._dry_steps = {s: int(v) for s, v in (state_dict.get("dry_steps") or {}).items()}
        self._dry_logged = set(self._dry_steps)

    # ---------------------------------------------------------------- per batch
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.enabled:  # Lightning fetches the next batch (and moves it to the device) before this hook
            self._wait.batch_ready(pl_module.device)

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
        self._wait.step_end(pl_module.device)  # after the logging: its time is not the loader's

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.enabled and trainer.global_step != self._last_logged_step:
            self._last_logged_step = trainer.global_step
            self._log(trainer, trainer.global_step, with_table=True)
        if self.enabled and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()

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

    def _throughput(self, trainer: Trainer) -> dict[str, float]:
        """This window's rates (this rank's) and the wait over all ranks (a collective under DDP)."""
        elapsed = max(time.perf_counter() - self._window_start, 1e-9)
        waited, on_device = self._wait.take()
        per_rank = [(waited, elapsed)]
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            per_rank = [None] * trainer.world_size
            torch.distributed.all_gather_object(per_rank, (waited, elapsed))
        out = {"loader/batches_per_s": self._window_batches / elapsed, "loader/tokens_per_s": self._window_tokens / elapsed,
               **reduce_wait(per_rank), "loader/wait_on_device": float(on_device)}
        self._window_start, self._window_batches, self._window_tokens = time.perf_counter(), 0, 0
        return out

    def _log(self, trainer: Trainer, step: int, with_table: bool) -> None:
        stats = self._collect(trainer)  # collective under DDP: every rank gets here
        metrics = self._throughput(trainer)  # collective too
        if not trainer.is_global_zero:
            return
        if stats:
            metrics.update(data_scalars(stats))
            metrics.update(self._dry_sources(stats, step))
            self._record_fallback(trainer, stats)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        if stats and stats.get("realized"):
            self._share_history.append((step, {s: r.get("realized_weight") or 0.0 for s, r in stats["realized"].items()},
                                        {s: r.get("target_weight") or 0.0 for s, r in stats["realized"].items()}))
        if self.use_wandb and with_table and stats and stats.get("realized"):
            self._log_wandb_charts(_wandb_logger(trainer), stats, step)
        if with_table and stats:
            self._write_snapshot(trainer, stats, step)

    @staticmethod
    def _write_snapshot(trainer: Trainer, stats: Mapping[str, Any], step: int) -> None:
        """``DATA_STATS_FILE`` in each file logger's folder (CSV, TensorBoard): what the scalars
        cannot carry (the document-length histograms, drops by stage and reason), so
        ``stacklm report`` draws a run without W&B. Replaced atomically at every table step."""
        keep = ("realized", "delivered", "dropped_docs", "dropped_tokens", "holdout_docs", "cut_docs",
                "doc_length_hist", "padding_fraction", "hashes", "mix_phases", "decontamination", "stage_seconds")
        snapshot = {"step": int(step), **{k: stats[k] for k in keep if k in stats}}
        for logger in trainer.loggers:
            log_dir = getattr(logger, "log_dir", None)
            if type(logger).__name__ == "WandbLogger" or not isinstance(log_dir, str):
                continue
            os.makedirs(log_dir, exist_ok=True)
            atomic_write_text(os.path.join(log_dir, DATA_STATS_FILE), json.dumps(snapshot, default=_plain_number))

    def _dry_sources(self, stats: Mapping[str, Any], step: int) -> dict[str, float]:
        """``data/ran_dry/<source>`` = the step it was first seen dry, with a log warning then."""
        out = {}
        for source, info in (stats.get("ran_dry") or {}).items():
            if source not in self._dry_logged:
                self._dry_logged.add(source)
                info = {**info, "step": step}
                target = info.get("target_share")
                if first_time("ran_dry", source):  # not when the loader already said it (DeliveryCounter.note_dry)
                    warnings.warn(
                        f"stacklm: source {source!r} ran dry (seen at step {step}, after {info.get('batch')} batches of rank "
                        f"{info.get('rank', 0)}): delivered share {float(info.get('delivered_share') or 0):.4f} vs target "
                        f"{'?' if target is None else f'{float(target):.4f}'}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                self._dry_steps = {**getattr(self, "_dry_steps", {}), source: step}
            out[f"data/ran_dry/{source}"] = float(getattr(self, "_dry_steps", {}).get(source, step))
        return out

    def _record_fallback(self, trainer: Trainer, stats: Mapping[str, Any]) -> None:
        """A source on the synthetic fallback goes into every logger's run config, once it shows."""
        fallback = list(stats.get("offline_fallback") or ())
        if fallback and fallback != self._fallback_recorded:
            self._fallback_recorded = fallback
            unsaid = [s for s in fallback if first_time("fallback_offline", s)]  # the source or loader may have said it
            if unsaid:
                warnings.warn(f"stacklm: OFFLINE FALLBACK: source(s) {unsaid} train on synthetic text, not the real data",
                              RuntimeWarning, stacklevel=2)
            for logger in trainer.loggers:
                logger.log_hyperparams({"data/offline_fallback": fallback})

    def _log_wandb_charts(self, logger, stats: Mapping[str, Any], step: int) -> None:
        from stacklm.optional import require

        wandb = require("wandb", "wandb", "the W&B data-mix charts")

        realized = stats["realized"]
        columns = ["source", "target_weight", "realized_weight", "tokens", "docs"]
        rows = [[s, r.get("target_weight"), r.get("realized_weight"), r.get("tokens"), r.get("docs")] for s, r in realized.items()]
        payload: dict[str, Any] = {"data/mix": wandb.Table(columns=columns, data=rows)}
        # Long format so one bar chart shows realized next to target for every source.
        long = wandb.Table(columns=["label", "weight"])
        for s, r in realized.items():
            long.add_data(f"{s} target", float(r.get("target_weight") or 0.0))
            long.add_data(f"{s} realized", float(r.get("realized_weight") or 0.0))
        payload["data/mix_bar"] = wandb.plot.bar(long, "label", "weight", title="data mix: target vs realized weight")
        if self._share_history:
            names = list(realized)
            xs = [h[0] for h in self._share_history]
            ys = [[h[1].get(s, 0.0) for h in self._share_history] for s in names]
            ys += [[h[2].get(s, 0.0) for h in self._share_history] for s in names]
            keys = [f"{s} realized" for s in names] + [f"{s} target" for s in names]
            payload["data/share_over_time"] = wandb.plot.line_series(
                xs=xs, ys=ys, keys=keys, title="data mix: realized vs target share", xname="step")
        hist = stats.get("doc_length_hist")
        if hist:
            edges = np.asarray(hist["edges"], dtype=np.float64)
            edges[-1] = max(edges[-2] * 2, 1.0)  # the open last bin, drawn as one more doubling
            for source, counts in hist["counts"].items():
                if sum(counts):
                    payload[f"data/doc_length/{source}"] = wandb.Histogram(np_histogram=(list(counts), edges.tolist()))
        drops = wandb.Table(columns=["reason", "docs"])
        for label, count in dropped_docs_by_reason(stats).items():
            drops.add_data(label, count)
        examples = wandb.Table(columns=["set", "source", "file", "record", "ngram", "text"])
        for name, rep in ((stats.get("decontamination") or {}).get("sets") or {}).items():
            for ex in rep.get("examples", ()):
                examples.add_data(name, ex["source"], ex.get("file"), ex.get("record"), ex["ngram"], ex["text"])
        if examples.data:
            payload["data/decontam_examples"] = examples
        if drops.data:
            payload["data/drops_bar"] = wandb.plot.bar(drops, "reason", "docs", title="dropped documents by reason")
        logger.experiment.log({**payload, "trainer/global_step": step})
