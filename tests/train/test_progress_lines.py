"""Progress where jobs run: with stderr redirected to a file (as under ``nohup`` or Slurm) a fit,
a prebuild and tokenizer training write plain lines (no carriage returns, no ANSI escapes) at
their interval, and their numbers are true: a fit's tokens are the tokens its batches held
(counted by ``DeliveredTokenTally``), its loss the one the CSV logger got, and after a resume its
step reads ``global_step/max_steps``; on a terminal the Rich bar counts the same."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import yaml

from stacklm.progress_lines import SECONDS_ENV, STYLE_ENV, ProgressLines, duration, eta, rate, wants_lines
from tests.helpers.datamodule import stream_pipeline
from tests.helpers.model import tiny_config

ROOT = Path(__file__).resolve().parents[2]
LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d (?P<what>[^:]+): (?P<body>.*)$")
FIT = re.compile(r"^(?:done  )?step (?P<step>\d+)/(?P<total>\d+) \(\d+%\)  tokens (?P<tokens>[\d,]+)  tok/s (?P<rate>\S+)"
                 r"  train/loss (?P<loss>\S+)  elapsed \d+:\d\d:\d\d(?:  ETA (?P<eta>\S+))?$")


def fit_config(tmp_path: Path, tok_dir: Path, tok, name: str, bar: dict | None) -> Path:
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 4, "save_top_k": -1}},
        {"class_path": "tests.helpers.lightning.DeliveredTokenTally",
         "init_args": {"out": str(tmp_path / f"{name}.tally.json"), "pad_id": tok.pad_id, "bos_id": tok.bos_id}},
    ]
    if bar is not None:  # named in the config; otherwise the CLI's default for a redirected stderr
        callbacks.append({"class_path": "stacklm.train.progress.LineProgressBar", "init_args": bar})
    cfg = {
        "seed_everything": 0,
        "model": {"config": tiny_config(vocab_size=512).to_dict(), "optim": {"lr": 1e-3, "warmup_steps": 2, "total_steps": 10}},
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 4, "log_every_n_steps": 1, "enable_model_summary": False,
            "limit_val_batches": 0, "num_sanity_val_steps": 0, "default_root_dir": str(tmp_path),
            "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path), "name": "csv"}}],
            "callbacks": callbacks,
        },
        "data": {"mode": "stream", "tokenizer": str(tok_dir), "seq_len": 64, "batch_size": 2, "num_workers": 1, "seed": 0,
                 "val_batches": 0, "pipeline": stream_pipeline(total_tokens=20_000)},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_fit(tmp_path: Path, log: Path, env: dict[str, str], *args: str) -> str:
    """``python -m trainer fit`` with stdout and stderr redirected to ``log``, as ``nohup ... > log 2>&1``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    env.pop(STYLE_ENV, None)
    with open(log, "w") as f:
        out = subprocess.run([sys.executable, "-m", "trainer", "fit", *args], cwd=tmp_path, env=env, stdout=f, stderr=f,
                             timeout=600)
    text = log.read_text()
    assert out.returncode == 0, text[-4000:]
    return text


def fit_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m and m["what"] == "fit":
            fields = FIT.match(m["body"])
            assert fields, line
            out.append({**fields.groupdict(), "done": m["body"].startswith("done"), "line": line})
    return out


@pytest.fixture(scope="module")
def fits(tmp_path_factory, tokenizer_512, saved_tokenizer_dir):
    """A 4-step fit (the CLI's default bar for a redirected stderr, ``STACKLM_PROGRESS_SECONDS=0``:
    a line every step), then its resume from the step-4 checkpoint to step 10 with a
    ``LineProgressBar`` named in the config (every 2 steps; the seconds far off)."""
    tmp = tmp_path_factory.mktemp("progress_fit")
    tok_dir = saved_tokenizer_dir(tokenizer_512)
    first = run_fit(tmp, tmp / "first.log", {SECONDS_ENV: "0"}, "--config", str(fit_config(tmp, tok_dir, tokenizer_512, "first", None)))
    resumed = run_fit(tmp, tmp / "resumed.log", {}, "--config",
                      str(fit_config(tmp, tok_dir, tokenizer_512, "resumed", {"every_n_steps": 2, "every_seconds": 3600})),
                      "--trainer.max_steps", "10", "--ckpt_path", str(tmp / "ckpt" / "epoch=0-step=4.ckpt"))
    tally = {**json.loads((tmp / "first.tally.json").read_text()), **json.loads((tmp / "resumed.tally.json").read_text())}
    (version,) = (tmp / "csv").iterdir()
    losses = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(open(version / "metrics.csv")) if r.get("train/loss")}
    return {"first": first, "resumed": resumed, "tally": {int(k): v[0] for k, v in tally.items()}, "losses": losses}


@pytest.mark.slow
def test_a_redirected_fit_writes_plain_lines_at_its_interval(fits):
    for text in (fits["first"], fits["resumed"]):
        assert "\r" not in text and "\x1b" not in text, repr(text[-2000:])  # no bar frames, no colours
        assert "Epoch 0" not in text  # no Rich bar (nor its one frame at the end)
    first, resumed = fit_lines(fits["first"]), fit_lines(fits["resumed"])
    # STACKLM_PROGRESS_SECONDS=0: a line after every step, then the closing one
    assert [(int(x["step"]), x["done"]) for x in first] == [(1, False), (2, False), (3, False), (4, False), (4, True)], fits["first"]
    assert {x["total"] for x in first} == {"4"}
    # resumed at step 4 to max_steps 10, every 2 steps: the first step of the run, then 7, 9 and the end
    assert [(int(x["step"]), x["done"]) for x in resumed] == [(5, False), (7, False), (9, False), (10, True)], fits["resumed"]
    assert {x["total"] for x in resumed} == {"10"}  # the whole run's steps, not the batches left
    for x in first + resumed:
        step = int(x["step"])
        # the batches' own non-pad tokens (DeliveredTokenTally), the resume continuing the first fit's count
        assert int(x["tokens"].replace(",", "")) == fits["tally"][step], (x["line"], fits["tally"][step])
        # what the CSV logger got for the step's batch (logged before its optimizer step: at step - 1)
        assert float(x["loss"]) == pytest.approx(fits["losses"][step - 1], rel=1e-3), x["line"]
        assert x["rate"] != "?" and float(x["rate"].rstrip("kMG")) > 0, x["line"]
        assert x["done"] == (x["eta"] is None)
    assert first[-1]["eta"] is None and resumed[-2]["eta"] not in (None, "?")


def test_the_rich_bar_counts_steps_of_max_steps_after_a_resume(tmp_path):
    """On a terminal: a fit resumed at step 21 of 26 shows 21/26, then 22/26 (Lightning's own bar
    counted the epoch's batch index against the batches left: ``26/5``)."""
    from stacklm.train.cli import _progress_bar
    from stacklm.train.progress import LineProgressBar, StepProgressBar

    (bar,) = _progress_bar({"callbacks": []}, [], terminal=True)
    assert isinstance(bar, StepProgressBar)
    assert [type(b) for b in _progress_bar({"callbacks": []}, [], terminal=False)] == [LineProgressBar]
    trainer = L.Trainer(max_steps=26, callbacks=[bar], logger=False, enable_checkpointing=False, default_root_dir=tmp_path)
    trainer.fit_loop.max_epochs = -1  # as fit() sets it for max_steps alone
    trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = 21  # global_step
    bar.setup(trainer, None, "fit")
    bar.on_train_start(trainer, None)
    bar.on_train_epoch_start(trainer, None)
    task = bar.progress.tasks[bar.train_progress_bar_id]
    assert (task.completed, task.total) == (21, 26)
    assert task.speed is None  # the resumed steps are not counted as progress made now
    trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total.completed = 22
    bar.on_train_batch_end(trainer, L.LightningModule(), None, None, batch_idx=25)
    assert (task.completed, task.total) == (22, 26)
    bar.teardown(trainer, None, "fit")


def test_the_line_writer_and_its_knobs(monkeypatch):
    import io

    now = [100.0]
    stream = io.StringIO()
    lines = ProgressLines("job", seconds=30, every=5, stream=stream, clock=lambda: now[0])
    assert not lines.due(4)
    assert lines.due(5)  # every 5 units ...
    now[0] += 30
    assert lines.due(0)  # ... or 30 s, whichever first
    text = lines.write([("", "done"), ("tokens", "1,000")], n=5)
    assert LINE.match(text)["body"] == "done  tokens 1,000" and stream.getvalue() == text + "\n"
    assert not lines.due(9) and lines.due(10)
    assert (rate(8312), rate(1.2e6), rate(0.5), duration(3725), duration(90061), eta(0, 0), eta(10, 0), eta(100, 4)) == \
        ("8.31k", "1.2M", "0.5", "1:02:05", "1d 1:01:01", "0:00:00", "?", "0:00:25")
    monkeypatch.setenv(STYLE_ENV, "lines")
    assert wants_lines()
    monkeypatch.setenv(STYLE_ENV, "bar")
    assert not wants_lines()
    monkeypatch.setenv(STYLE_ENV, "fancy")
    with pytest.raises(ValueError, match="STACKLM_PROGRESS='fancy': expected one of bar, lines"):
        wants_lines()
    monkeypatch.setenv(SECONDS_ENV, "soon")
    with pytest.raises(ValueError, match="STACKLM_PROGRESS_SECONDS='soon'"):
        ProgressLines("x")
