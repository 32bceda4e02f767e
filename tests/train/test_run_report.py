"""``stacklm report``: a real fit and its resume, logged by CSVLogger + DataStatsCallback, drawn
into one HTML page whose numbers are the ones the run logged; a shards-mode fit over a prebuild
with decontamination, whose page and CSV show every drop its ledger holds."""

from __future__ import annotations

import base64
import csv
import html
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
    resumed = _fit(tokenizer_dir, tmp_path, 10, ckpt_path=tmp_path / "step6.ckpt")
    # the W&B share-over-time chart is drawn from the callback's history: it covers the steps
    # before the resume too (kept in the checkpoint), not only those from step 6 on
    (callback,) = [cb for cb in resumed.callbacks if isinstance(cb, DataStatsCallback)]
    assert [h[0] for h in callback._share_history] == [2, 4, 6, 8, 10]

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
    expected = {"loss", "mix", "doc_lengths", "padding", "loader_wait"} | ({"drops"} if dropped else set())
    assert len(pngs) == len(expected) and all(base64.b64decode(p).startswith(b"\x89PNG") for p in pngs)
    assert {p.stem for p in (tmp_path / "report_files").iterdir()} == expected
    # the page's last loss is the last train/loss the CSV holds (read here with csv on its own)
    last = None
    for path in sorted(tmp_path.rglob("metrics.csv")):
        for row in csv.DictReader(path.open()):
            if row.get("train/loss"):
                last = (int(row["step"]), float(row["train/loss"]))
    assert f"{last[1]:.4f} at step {last[0]:,}" in page
    assert "<b>last step reached</b></td><td>10<" in page
    clock = snapshot["stage_seconds"]  # the workers' seconds per stage, as the page states them (largest first)
    total = sum(clock.values())
    top = max(clock, key=clock.get)
    assert html.escape("loader workers' time by stage") + f"</b></td><td>{total:,.1f} s: {top} {100 * clock[top] / total:.0f}%" in page
    waits = [float(r["loader/wait_fraction"]) for p in data["csv"] for r in csv.DictReader(open(p)) if r.get("loader/wait_fraction")]
    assert f"{100 * waits[-1]:.1f}% of the last window (slowest rank), {100 * sum(waits) / len(waits):.1f}% averaged" in page
    for src, r in snapshot["realized"].items():
        assert f"{r['tokens']:,} tokens, {r['docs']:,} documents begun" in page
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


@pytest.mark.slow
def test_shards_run_shows_every_drop_of_its_ledger_on_the_page_and_in_the_csv(tokenizer_dir, tmp_path, monkeypatch):  # noqa: F811
    """Shards mode with decontamination on: the CSV's ``data/dropped_docs/*``, ``dropped_tokens``,
    ``holdout_docs``, ``cut_docs`` and ``decontam`` keys and the report page hold exactly what the
    prebuild's manifest holds (its ledger and drop summary, read here with json alone)."""
    from stacklm.corpus.synthetic import synthetic_text
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.prebuild import prebuild

    # an evaluation set made of 25 words of every third web document: those documents overlap it
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps({"question": " ".join(synthetic_text(i, "prose", 1).split()[5:30])}) + "\n"
                                              for i in range(0, 60, 3)))
    pipeline = {**stream_pipeline(total_tokens=12_000), "seq_len": SEQ_LEN, "batch_size": BATCH,
                "decontaminate": {"sets": [{"name": "qa", "files": [str(tmp_path / "qa.jsonl")], "fields": ["question"]}]}}
    prebuild(PipelineConfig.from_dict(pipeline), tokenizer_dir, tmp_path / "shards", tokens_per_shard=SEQ_LEN * 64, progress=False)
    top = json.loads((tmp_path / "shards" / "manifest.json").read_text())

    # what the ledger says, as the logs must name it (docs/trainer.md, "W&B and CSV keys")
    want = {}
    for src, units in top["ledger"]["train"]["sources"].items():
        for key, n in units["docs"]["dropped"].items():
            stage, reason = key.split("/", 1)
            want[f"data/dropped_docs/{stage}/{src}/{reason}"] = n
        for key, n in units["tokens"]["dropped"].items():
            want[f"data/dropped_tokens/{src}/{key.split('/', 1)[1]}"] = n
        if units["docs"]["holdout"]:
            want[f"data/holdout_docs/{src}"] = units["docs"]["holdout"]
    for src, per in top["drops"]["train"].items():
        if per["truncated_to_budget"]:
            want[f"data/cut_docs/{src}/cut_by_budget"] = per["truncated_to_budget"]
        assert per.get("decontaminated", 0) == sum(n for k, n in want.items() if k.startswith(f"data/dropped_docs/decontam/{src}/"))
    qa = top["decontamination"]["train"]["sets"]["qa"]
    want["data/decontam/qa/docs"], want["data/decontam/qa/tokens"] = qa["docs"], qa["tokens"]
    assert qa["docs"] > 0 and any("/dedup/" in k or "/filter/" in k for k in want)  # decontamination and another stage

    run = tmp_path / "run"
    dm = StackDataModule(mode="shards", tokenizer=str(tokenizer_dir), data_dir=str(tmp_path / "shards"), seq_len=SEQ_LEN,
                         batch_size=BATCH, val_batches=0, step_log=False)
    trainer = L.Trainer(accelerator="cpu", max_steps=7, logger=CSVLogger(run, name="csv"), log_every_n_steps=2,
                        callbacks=[DataStatsCallback(log_every_n_steps=3)], enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, enable_checkpointing=False, default_root_dir=run)
    trainer.fit(LoggingLM(dm.vocab_size), datamodule=dm)

    (path,) = run.rglob("metrics.csv")
    last = [r for r in csv.DictReader(open(path)) if r.get("data/dropped_docs_total")][-1]
    logged = {k: int(float(v)) for k, v in last.items() if v and k.startswith(("data/dropped_", "data/holdout_docs/", "data/cut_docs/",
                                                                               "data/decontam/qa/docs", "data/decontam/qa/tokens"))}
    assert int(last["step"]) == 7
    assert logged == {**{k: n for k, n in want.items() if n}, "data/dropped_docs_total": sum(n for k, n in want.items() if "/dropped_docs/" in k),
                      "data/dropped_tokens_total": sum(n for k, n in want.items() if "/dropped_tokens/" in k)}

    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    table = {key: int(count.split()[0].replace(",", ""))  # per drop row: its count cell and the key it is logged as
             for count, key in re.findall(r"<td>([^<]*)</td><td>(data/[^<]*)</td></tr>", page)}
    assert table == {k: n for k, n in want.items() if n}
    # the run reached step 7; train/loss was last logged at 5 (every 2 steps: Lightning logs steps 1, 3, 5)
    assert "<b>last step reached</b></td><td>7<" in page and re.search(r"at step 5<", page)
    # shards mode delivers packed rows: the page says how many held each source, as the CSV logged it
    snapshot = json.loads(next(run.rglob(DATA_STATS_FILE)).read_text())
    for src, r in snapshot["realized"].items():
        assert f"{r['tokens']:,} tokens in {r['rows']:,} packed rows, {r['docs']:,} documents begun" in page
        assert int(float(last[f"data/rows/{src}"])) == r["rows"] > 0

    # under DDP every rank reads the same manifest: its drops are counted once in the sum over
    # ranks the callback logs (stacklm.callbacks.merge_data_stats), not once per rank
    from stacklm.callbacks import data_scalars, merge_data_stats

    rank0 = dm.data_stats()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    both = data_scalars(merge_data_stats([rank0, dm.data_stats()]))
    assert {k: int(v) for k, v in both.items() if k in logged} == logged


def test_a_series_of_one_point_is_drawn(tmp_path):
    """A panel whose series has one logged point shows it (a marker), not an empty axis."""
    from stacklm.run_report import figures

    log = tmp_path / "lightning_logs" / "version_0"
    log.mkdir(parents=True)
    (log / "metrics.csv").write_text("data/padding_fraction,data/realized_weight/web,data/target_weight/web,step,train/loss\n"
                                     "0.1,0.7,0.7,3,\n,,,1,5.0\n")
    figs = figures(read_run(tmp_path))
    for name in ("loss", "mix", "padding"):
        (line, *_) = figs[name].axes[0].lines
        assert len(line.get_xdata()) == 1 and line.get_marker() == "o", name
