"""Run by tests/test_source_loss.py: a fit with ``SourceLossCallback`` and a module whose
per-token loss is a known function of the target (``planted``), so the test can compute every
logged per-source value itself, from the step log's provenance (train) and the prebuild's
rows (validation). As a program: ``--devices`` CPU processes (real DDP over gloo when > 1).

Writes ``<out>/batches<r>.json``: per batch this rank trained or validated on, ``[split, global
step, targets, input_ids]``; the logged values are in ``<out>/csv/version_0/metrics.csv``."""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from stacklm.data.contract import IGNORE_INDEX  # noqa: E402


def planted(targets: torch.Tensor) -> torch.Tensor:
    """Each target's "loss": 1 + (id mod 13), distinct enough per source to catch a wrong attribution."""
    return (1 + targets.clamp(min=0) % 13).double()


class PlantedLoss(L.LightningModule):
    """Returns ``token_loss = planted(targets)`` (plus a real parameter so optimizer steps run);
    records every batch's targets and ids with the step it ran at."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[list] = []

    def _step(self, split: str, batch):
        token_loss = planted(batch["targets"])
        keep = batch["targets"] != IGNORE_INDEX
        loss = token_loss[keep].sum() / keep.sum().clamp(min=1) + self.w * 0
        self.seen.append([split, self.trainer.global_step, batch["targets"].tolist(), batch["input_ids"].tolist()])
        return {"loss": loss.float(), "token_loss": token_loss}

    def training_step(self, batch, batch_idx):
        out = self._step("train", batch)
        out["token_loss"] = out["token_loss"].detach()
        return out

    def validation_step(self, batch, batch_idx):
        return self._step("val", batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(out: Path, dm, devices: int = 1, max_steps: int = 6, every: int = 2) -> None:
    from lightning.pytorch.loggers import CSVLogger

    from stacklm.source_loss import SourceLossCallback

    module = PlantedLoss()
    trainer = L.Trainer(
        # re-executed ranks ("ddp"), not forked: every rank writes its file after fit() returns,
        # and a forked rank exits inside fit()
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=max_steps,
        callbacks=[SourceLossCallback(log_every_n_steps=every)], logger=CSVLogger(str(out), name="csv", version=0),
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, val_check_interval=max_steps,
        limit_val_batches=4, num_sanity_val_steps=0, default_root_dir=str(out), log_every_n_steps=every,
    )
    trainer.fit(module, datamodule=dm)
    (out / f"batches{trainer.global_rank}.json").write_text(json.dumps(module.seen))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--devices", type=int, default=2)
    a = ap.parse_args()
    faulthandler.dump_traceback_later(420, exit=True)  # a hung collective says where
    from stacklm.datamodule import StackDataModule

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dm = StackDataModule(mode="shards", tokenizer=a.tokenizer, data_dir=a.data_dir, seq_len=64, batch_size=2, num_workers=0,
                         val_batches=4, step_log=str(out / "steplog"))
    fit(out, dm, devices=a.devices)


if __name__ == "__main__":
    main()
