"""Run by tests/datamodule/test_elastic_stream.py as a real program: one stream-mode fit (``--epochs``) on
``--devices`` CPU processes (real DDP over gloo when > 1; Lightning re-executes this file for
the other ranks).

Writes ``<out>/rank<r>.json``: one record per training batch that rank trained on —
``[epoch, global step, row ids]``, a row id being the hash of the row's tokens, ``null`` for a padding
row (every target ignored) — ``<out>/stats<r>.json``, the rank's delivery counts at the end, and
``<out>/seen<r>.json``, the non-padding tokens of each batch it trained on (``[epoch, global
step, tokens]``, counted here from ``input_ids``: an independent check of the delivery counts).
``--save-at N`` writes ``<out>/step<N>.ckpt`` and stops the run there (with ``--go-on``: trains on to
the end, so one uninterrupted run is also the head of a resume from that checkpoint)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402

from stacklm.datamodule import StackDataModule  # noqa: E402
from tests.helpers.lightning import row_ids  # noqa: E402
from tests.helpers.lightning import TinyLM  # noqa: E402
from tests.helpers.datamodule import SEQ_LEN, stream_pipeline  # noqa: E402
from tests.helpers.ddp import ddp_strategy  # noqa: E402


class Record(L.Callback):
    def __init__(self, out: Path, save_at: set[int], go_on: bool = False) -> None:
        self.out, self.save_at, self.go_on, self.seen, self.tokens = out, save_at, go_on, [], []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append([trainer.current_epoch, trainer.global_step, row_ids(batch)])
        pad = trainer.datamodule.tokenizer.pad_id
        self.tokens.append([trainer.current_epoch, trainer.global_step, int((batch["input_ids"] != pad).sum())])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.save_at:
            trainer.save_checkpoint(self.out / f"step{trainer.global_step}.ckpt")
            trainer.should_stop = not self.go_on

    def on_train_end(self, trainer, pl_module):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.seen))
        delivered = trainer.datamodule._train_loader.delivered.stats()["delivered"]
        (self.out / f"stats{trainer.global_rank}.json").write_text(json.dumps(delivered))
        (self.out / f"seen{trainer.global_rank}.json").write_text(json.dumps(self.tokens))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--logical-streams", type=int, default=None)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--save-at", type=int, nargs="*", default=[])
    ap.add_argument("--go-on", action="store_true", help="--save-at saves and trains on instead of stopping")
    ap.add_argument("--resume")
    ap.add_argument("--step-log", help="StackDataModule(step_log=...): a shared step log root across runs")
    ap.add_argument("--pipeline", help="a JSON file with the stream pipeline config (default: the synthetic one)")
    a = ap.parse_args()
    pipeline = json.loads(Path(a.pipeline).read_text()) if a.pipeline else stream_pipeline()
    dm = StackDataModule(mode="stream", tokenizer=a.tokenizer, pipeline=pipeline, seq_len=SEQ_LEN,
                         batch_size=a.batch_size, num_workers=a.workers, val_batches=0, logical_streams=a.logical_streams,
                         snapshot_every_n_steps=3, step_log=a.step_log if a.step_log else True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    trainer = L.Trainer(
        accelerator="cpu", devices=a.devices, strategy=ddp_strategy(a.devices), max_epochs=a.epochs,
        callbacks=[Record(out, set(a.save_at), a.go_on)], logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=a.out,
    )
    trainer.fit(TinyLM(dm.vocab_size), datamodule=dm, ckpt_path=a.resume)


if __name__ == "__main__":
    main()
