"""Run by tests/datamodule/test_ddp.py as a real program: Lightning forks the two ranks (or, with
``STACKLM_TEST_DDP=ddp``, re-executes this file for rank 1), so the ranks are real processes
talking over gloo.

Writes ``<out>/rank<r>.json``: the (global_step, batch hash, row hashes) of every training
batch that rank saw, plus its batch count."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from stacklm.datamodule import StackDataModule  # noqa: E402
from tests.helpers.lightning import DeliveredTokenTally, TinyDPO, TinyLM, batch_hash  # noqa: E402
from tests.helpers.ddp import ddp_strategy  # noqa: E402


class Record(L.Callback):
    def __init__(self, out: Path, crash_after: int | None) -> None:
        self.out, self.crash_after, self.seen = out, crash_after, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if "pair_ids" in batch:  # preference batches: the pairs by id (-1: a filler row)
            rows = [str(i) for i in batch["pair_ids"].tolist()]
        else:
            rows = [hashlib.sha256(r.numpy().tobytes()).hexdigest()[:16] for r in batch["input_ids"]]
        self.seen.append([trainer.global_step, batch_hash(batch), rows])
        self._dump(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.crash_after is not None and trainer.global_step >= self.crash_after:
            raise SystemExit(3)

    def _dump(self, trainer):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))


class SlowRank(L.Callback):
    """Rank ``rank`` sleeps ``SECONDS`` after every step: to the data callback, which stamped the
    step's end before, that is the loader making the step wait. Writes the seconds slept per step."""

    SECONDS = 0.3

    def __init__(self, rank: int, out: Path) -> None:
        self.rank, self.out, self.slept = rank, out, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import time

        if trainer.global_rank == self.rank:
            time.sleep(self.SECONDS)
            self.slept[trainer.global_step] = self.SECONDS
            (self.out / f"slept{self.rank}.json").write_text(json.dumps(self.slept))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--data-dir")
    ap.add_argument("--pipeline")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=-1)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--ckpt-every", type=int)
    ap.add_argument("--crash-after", type=int)
    ap.add_argument("--resume")
    ap.add_argument("--stats", action="store_true", help="log data stats to a CSV logger and tally the batches' tokens")
    ap.add_argument("--slow-rank", type=int, help="with --stats: this rank sleeps before fetching each next batch "
                    "(a slow loader on one rank), and writes the seconds slept to <out>/slept<rank>.json")
    a = ap.parse_args()
    dm = StackDataModule(
        mode=a.mode, tokenizer=a.tokenizer, data_dir=a.data_dir,
        pipeline=json.loads(a.pipeline) if a.pipeline else None,
        seq_len=a.seq_len, batch_size=a.batch_size, num_workers=a.workers, val_batches=0,
    )
    callbacks = [Record(Path(a.out), a.crash_after)]
    if a.ckpt_every:
        callbacks.append(ModelCheckpoint(dirpath=Path(a.out) / "ckpt", every_n_train_steps=a.ckpt_every, save_top_k=-1))
    logger = False
    if a.stats:
        from lightning.pytorch.loggers import CSVLogger

        from stacklm.callbacks import DataStatsCallback

        logger = CSVLogger(a.out, name="csv")
        tok = dm.tokenizer
        callbacks += [DataStatsCallback(log_every_n_steps=2),
                      DeliveredTokenTally(str(Path(a.out) / "tally{rank}.json"), tok.pad_id, tok.bos_id)]
        if a.slow_rank is not None:  # after the stats callback: its sleep falls between a step's end and the next batch
            callbacks.append(SlowRank(a.slow_rank, Path(a.out)))
    trainer = L.Trainer(
        accelerator="cpu", strategy=ddp_strategy(2), devices=2, max_steps=a.steps, max_epochs=a.epochs, callbacks=callbacks,
        logger=logger, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, default_root_dir=a.out,
    )
    trainer.fit((TinyDPO if a.mode == "preference" else TinyLM)(dm.vocab_size), datamodule=dm, ckpt_path=a.resume)


if __name__ == "__main__":
    main()
