"""Run by tests/datamodule/test_elastic.py as a real program: one shards-mode fit on ``--devices`` CPU
processes (real DDP over gloo when > 1; Lightning re-executes this file for the other ranks).

Writes ``<out>/rank<r>.json``: one record per training batch that rank trained on —
``[data epoch, Lightning epoch, global step, row ids]``, a row id being the hash of the row's
tokens, ``null`` for a padding row (every target ignored) — and ``<out>/lengths<r>.json``, the
trainer's batch count of every epoch. ``--save-at`` steps write ``<out>/step<N>.ckpt``."""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

from stacklm.datamodule import StackDataModule  # noqa: E402
from tests.helpers.lightning import TinyLM  # noqa: E402
from tests.helpers.lightning import row_ids
from tests.helpers.ddp import ddp_strategy  # noqa: E402


class Record(L.Callback):
    def __init__(self, out: Path, save_at: set[int], save_epoch_end: bool = False) -> None:
        self.out, self.save_at, self.seen, self.lengths = out, save_at, [], []
        self.save_epoch_end = save_epoch_end

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not self.lengths or self.lengths[-1][0] != trainer.current_epoch:  # this run's first batch of the epoch
            self.lengths.append([trainer.current_epoch, trainer.num_training_batches])
        loader = trainer.datamodule._train_loader
        self.seen.append([loader.epoch, trainer.current_epoch, trainer.global_step, row_ids(batch)])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.save_at:
            trainer.save_checkpoint(self.out / f"step{trainer.global_step}.ckpt")

    def on_train_epoch_end(self, trainer, pl_module):
        if self.save_epoch_end:
            trainer.save_checkpoint(self.out / f"epoch{trainer.current_epoch}-end.ckpt")

    def on_train_end(self, trainer, pl_module):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))
        (self.out / f"lengths{trainer.global_rank}.json").write_text(json.dumps(self.lengths))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--save-at", type=int, nargs="*", default=[])
    ap.add_argument("--save-epoch-end", action="store_true")
    ap.add_argument("--resume")
    ap.add_argument("--step-log", help="StackDataModule(step_log=...): a shared step log root across runs")
    ap.add_argument("--skip-steps", type=int, nargs="*", default=[], help="StackDataModule(skip_steps=...): a b [a b ...]")
    a = ap.parse_args()
    # A hung run (a collective one rank never joins, a loader worker that never exits) dumps every
    # thread's stack and exits, so the test fails with where it hung instead of a bare timeout.
    faulthandler.dump_traceback_later(420, exit=True)
    dm = StackDataModule(mode="shards", tokenizer=a.tokenizer, data_dir=a.data_dir, seq_len=a.seq_len,
                         batch_size=a.batch_size, num_workers=a.workers, val_batches=0,
                         step_log=a.step_log if a.step_log else True,
                         skip_steps=list(zip(a.skip_steps[::2], a.skip_steps[1::2])) or None)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=a.devices, strategy=ddp_strategy(a.devices), max_epochs=a.epochs,
        callbacks=[Record(out, set(a.save_at), a.save_epoch_end)], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=a.out,
    )
    trainer.fit(TinyLM(dm.vocab_size), datamodule=dm, ckpt_path=a.resume)


if __name__ == "__main__":
    main()
