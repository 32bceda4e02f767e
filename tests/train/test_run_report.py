"""``stacklm report``: a real fit and its resume, logged by CSVLogger + DataStatsCallback, drawn
into one HTML page whose numbers are the ones the run logged."""

from __future__ import annotations

import base64
import csv
import json
import re

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from stacklm.callbacks import DATA_STATS_FILE, DataStatsCallback
from stacklm.cli import main
from stacklm.datamodule import StackDataModule
from stacklm.run_report import read_run
from stacklm.errors import UserError
from tests.helpers.lightning import TinyLM
from tests.helpers.datamodule import BATCH, SEQ_LEN, stream_pipeline


class LoggingLM(TinyLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss


def _fit(tokenizer_dir, root, max_steps, ckpt_path=None):  # noqa: F811
    dm = StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=stream_pipeline(total_tokens=20_000),
                         seq_len=SEQ_LEN, batch_size=BATCH, val_batches=0, step_log=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, logger=CSVLogger(root, name="csv"), log_every_n_steps=2,
                        callbacks=[DataStatsCallback(log_every_n_steps=2)], enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=root)
    trainer.fit(LoggingLM(dm.vocab_size), datamodule=dm, ckpt_path=ckpt_path)
    return trainer


@pytest.mark.slow
def test_report_draws_a_resumed_run_from_its_own_logs(tokenizer_dir, tmp_path, capsys):  # noqa: F811
    first = _fit(tokenizer_dir, tmp_path, 6)
    first.save_checkpoint(tmp_path / "step6.ckpt")
    _fit(tokenizer_dir, tmp_path, 10, ckpt_path=tmp_path / "step6.ckpt")

    data = read_run(tmp_path)
    v0, v1 = ([int(r["step"]) for r in csv.DictReader(open(p)) if r.get("step")] for p in data["csv"])
    assert len(data["csv"]) == 2 and data["resumes"] == [min(v1)] and max(v0) < min(v1)  # the resume's CSV continues
    snapshot = json.loads(sorted(tmp_path.rglob(DATA_STATS_FILE))[-1].read_text())
    assert snapshot["step"] == 10 and data["stats"]["step"] == 10
    # the histogram counts every delivered document once (an independent sum: the per-source docs)
    hist = snapshot["doc_length_hist"]["counts"]
    assert {s: sum(c) for s, c in hist.items()} == {s: r["docs"] for s, r in snapshot["realized"].items()}

    assert main(["report", str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    pngs = re.findall(r"src='data:image/png;base64,([^']+)'", page)
    dropped = sum(n for by_src in snapshot["dropped_docs"].values() for per in by_src.values() for n in per.values())
    expected = {"loss", "mix", "doc_lengths", "padding"} | ({"drops"} if dropped else set())
    assert len(pngs) == len(expected) and all(base64.b64decode(p).startswith(b"\x89PNG") for p in pngs)
    assert {p.stem for p in (tmp_path / "report_files").iterdir()} == expected
    # the page's last loss is the last train/loss the CSV holds (read here with csv on its own)
    last = None
    for path in sorted(tmp_path.rglob("metrics.csv")):
        for row in csv.DictReader(path.open()):
            if row.get("train/loss"):
                last = (int(row["step"]), float(row["train/loss"]))
    assert f"{last[0]:,} (train/loss {last[1]:.4f})" in page
    for src, r in snapshot["realized"].items():
        assert f"{r['tokens']:,} tokens, {r['docs']:,} docs" in page
    assert "report: " in capsys.readouterr().out

    # a new run in the same folder (an SFT run after its pre-training: steps from 0 again) is
    # not a resume: the report draws the newest run alone and names the others
    _fit(tokenizer_dir, tmp_path, 4)
    newest = read_run(tmp_path)
    assert len(newest["csv"]) == 1 and newest["resumes"] == [] and len(newest["other_runs"]) == 2
    assert max(r["step"] for r in newest["rows"]) <= 4


def test_report_refuses_a_folder_without_logs_in_one_line(tmp_path):
    with pytest.raises(UserError, match="no metrics.csv under it"):
        read_run(tmp_path)
    with pytest.raises(UserError, match="not a directory"):
        read_run(tmp_path / "absent")


def test_report_skips_a_cut_or_garbled_metrics_row_and_says_so(tmp_path, capsys):
    """A fit killed while its CSV logger flushed leaves the last line cut mid-number (``ValueError``
    traceback before): the report skips such rows, draws the rest and names each skipped row."""
    from stacklm.run_report import summary, write_report

    log = tmp_path / "lightning_logs" / "version_0"
    log.mkdir(parents=True)
    lines = ["epoch,step,train/loss"] + [f"0,{s},{5 - s * 0.1:.2f}" for s in range(6)] + ["0,6,4.4e", "0,7"]
    (log / "metrics.csv").write_text("\n".join(lines))
    data = read_run(tmp_path)
    assert [r["step"] for r in data["rows"]] == [0, 1, 2, 3, 4, 5]
    assert data["damaged_rows"] == [f"{log / 'metrics.csv'}:8", f"{log / 'metrics.csv'}:9"]
    assert dict(summary(data))["damaged CSV rows skipped"] == ", ".join(data["damaged_rows"])
    write_report(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"stacklm report: skipped the damaged row at {where} (cut or garbled: a fit killed while it wrote its log)"
                   for where in data["damaged_rows"]]
