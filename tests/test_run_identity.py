"""One run, one story (stacklm.run_identity): ``stacklm-train fit`` killed by SIGKILL after
its step-4 checkpoint, then resumed from it with ``--ckpt_path``, continues the same W&B run
(offline: the same run id) and the same CSV folder, whose rows the killed attempt logged past
the checkpoint are moved aside; ``stacklm report`` reads it as one run resumed at step 4.

Both fits run as under ``nohup ... > log 2>&1`` (stdout and stderr to a file), so they are also
the test of what such a log shows (``stacklm.train.progress.LineProgressBar``): plain progress
lines at their interval whose step counts ``max_steps`` across the resume and whose tokens and
loss are the batches' own (``DeliveredTokenTally``) and the CSV logger's."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stacklm.progress_lines import SECONDS_ENV, STYLE_ENV
from stacklm.run_identity import CHECKPOINT_KEY, SUPERSEDED_FILE, saved_run
from stacklm.run_report import read_run
from tests.helpers.datamodule import stream_pipeline
from tests.helpers.model import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def config(tmp_path: Path, tok_dir: Path, tok, kill_at: int | None, bar: dict | None = None) -> Path:
    name = "killed" if kill_at is not None else "fit"
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 4, "save_top_k": -1}},
        {"class_path": "tests.helpers.lightning.DeliveredTokenTally",
         "init_args": {"out": str(tmp_path / f"{name}.tally.json"), "pad_id": tok.pad_id, "bos_id": tok.bos_id}},
    ]
    if kill_at is not None:
        callbacks.append({"class_path": "tests.helpers.lightning.KillAt", "init_args": {"step": kill_at}})
    if bar is not None:  # named in the config; otherwise the CLI's default for a redirected stderr
        callbacks.append({"class_path": "stacklm.train.progress.LineProgressBar", "init_args": bar})
    cfg = {
        "seed_everything": 0,
        "model": {"config": tiny_config(vocab_size=512).to_dict(), "optim": {"lr": 1e-3, "warmup_steps": 2, "total_steps": 10}},
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 10, "log_every_n_steps": 1,
            "enable_model_summary": False, "limit_val_batches": 0, "num_sanity_val_steps": 0, "default_root_dir": str(tmp_path),
            "logger": [
                {"class_path": "lightning.pytorch.loggers.WandbLogger",
                 "init_args": {"offline": True, "save_dir": str(tmp_path), "project": "stacklm-test"}},
                # flushed every step, so the killed attempt's rows past the checkpoint reach the file
                {"class_path": "lightning.pytorch.loggers.CSVLogger",
                 "init_args": {"save_dir": str(tmp_path), "name": "csv", "flush_logs_every_n_steps": 1}},
            ],
            "callbacks": callbacks,
        },
        "data": {"mode": "stream", "tokenizer": str(tok_dir), "seq_len": 64, "batch_size": 2, "num_workers": 0, "seed": 0,
                 "val_batches": 0, "pipeline": stream_pipeline(total_tokens=20_000)},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_fit(tmp_path: Path, log: str, env: dict[str, str], *args: str) -> tuple[int, str]:
    """``python -m trainer fit`` with stdout and stderr to ``log`` (as ``nohup ... > log 2>&1``):
    its exit status and what it wrote."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_DIR": str(tmp_path), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), **env}
    env.pop(STYLE_ENV, None)  # the choice is the terminal test's
    with open(tmp_path / log, "w") as f:
        code = subprocess.run([sys.executable, "-m", "trainer", "fit", *args], cwd=tmp_path, env=env, stdout=f, stderr=f,
                              timeout=600).returncode
    return code, (tmp_path / log).read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tokenizer_512, tokenizer_dir) -> dict:
    """The fit killed after step 6 (the CLI's default bar, a line every step:
    ``STACKLM_PROGRESS_SECONDS=0``), then its resume from the step-4 checkpoint to step 10
    (a ``LineProgressBar`` named in the config: every 2 steps, the seconds far off)."""
    tmp = tmp_path_factory.mktemp("run_identity")
    code, killed = run_fit(tmp, "killed.log", {SECONDS_ENV: "0"}, "--config", str(config(tmp, tokenizer_dir, tokenizer_512, kill_at=6)))
    assert code == -9, killed[-3000:]  # SIGKILL
    after_kill = sorted(p.name for p in (tmp / "wandb").glob("offline-run-*"))
    ckpt = tmp / "ckpt" / "epoch=0-step=4.ckpt"
    resumed_config = config(tmp, tokenizer_dir, tokenizer_512, kill_at=None, bar={"every_n_steps": 2, "every_seconds": 3600})
    code, resumed = run_fit(tmp, "resumed.log", {}, "--config", str(resumed_config), "--ckpt_path", str(ckpt))
    assert code == 0, resumed[-3000:]
    return {"dir": tmp, "ckpt": ckpt, "after_kill": after_kill, "killed": killed, "resumed": resumed}


@pytest.mark.slow
def test_a_killed_fit_resumed_is_one_wandb_run_and_one_csv(runs):
    tmp_path, ckpt = runs["dir"], runs["ckpt"]
    saved = saved_run(ckpt)
    assert saved["global_step"] == 4 and saved["csv_version"] == 0 and saved["wandb_id"]
    (first_run,) = runs["after_kill"]
    assert first_run.endswith(saved["wandb_id"])

    runs_ = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs_) == 2 and all(r.name.endswith(saved["wandb_id"]) for r in runs_)  # both attempts: the one run id
    assert all(list(r.glob(f"run-{saved['wandb_id']}.wandb")) for r in runs_)
    assert saved_run(tmp_path / "ckpt" / "epoch=0-step=8.ckpt")["wandb_id"] == saved["wandb_id"]

    assert [p.name for p in (tmp_path / "csv").iterdir()] == ["version_0"]  # no second CSV folder
    rows = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / "metrics.csv")))
    loss_steps = [int(r["step"]) for r in rows if r.get("train/loss")]
    assert loss_steps == sorted(set(loss_steps)) and set(range(1, 9)) <= set(loss_steps)  # each step once, in order
    assert [float(r["run/resumed_at"]) for r in rows if r.get("run/resumed_at")] == [4.0]
    superseded = list(csv.DictReader(open(tmp_path / "csv" / "version_0" / SUPERSEDED_FILE)))
    # the killed attempt's rows of batches 4.. (Lightning logs batch k's loss at step k; the checkpoint holds batches 0..3)
    assert superseded and all(int(r["step"]) >= 4 for r in superseded)

    data = read_run(tmp_path)
    assert len(data["csv"]) == 1 and data["resumes"] == [4] and not data["other_runs"]
    assert CHECKPOINT_KEY == "stacklm_run"


LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d fit: (?P<done>done  )?step (?P<step>\d+)/(?P<total>\d+) \(\d+%\)  "
                  r"tokens (?P<tokens>[\d,]+)  tok/s (?P<rate>[\d.]+[kMG]?|\?)  train/loss (?P<loss>\S+)  elapsed \d+:\d\d:\d\d"
                  r"(?:  ETA (?P<eta>\d+:\d\d:\d\d|\?))?$")


def fit_lines(text: str) -> list[dict]:
    """The progress lines of a fit's log, each as its fields (a line that starts like one must be one)."""
    found = [line for line in text.splitlines() if re.match(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d fit: ", line)]
    assert all(LINE.match(line) for line in found), found
    return [{**LINE.match(line).groupdict(), "line": line} for line in found]


@pytest.mark.slow
def test_a_redirected_fit_and_its_resume_write_true_progress_lines(runs):
    for text in (runs["killed"], runs["resumed"]):
        assert "\r" not in text and "\x1b" not in text, repr(text[-2000:])  # no bar frames, no colours
        assert "Epoch 0" not in text  # no Rich bar (nor its one frame at the end)
    killed, resumed = fit_lines(runs["killed"]), fit_lines(runs["resumed"])
    # a line after every step (STACKLM_PROGRESS_SECONDS=0), until the SIGKILL in step 6
    assert [(int(x["step"]), bool(x["done"])) for x in killed] == [(s, False) for s in range(1, 6)], runs["killed"]
    # resumed at step 4 to step 10, every 2 steps: the run's first step, 7, 9, then the closing line
    assert [(int(x["step"]), bool(x["done"])) for x in resumed] == [(5, False), (7, False), (9, False), (10, True)], runs["resumed"]
    assert {x["total"] for x in killed + resumed} == {"10"}  # max_steps, not the batches left in the epoch
    tmp = runs["dir"]
    # the batches' own non-pad tokens, counted apart (DeliveredTokenTally); the resume continues the killed count
    tally = {int(k): v[0] for name in ("killed", "fit") for k, v in json.loads((tmp / f"{name}.tally.json").read_text()).items()}
    # the loss the CSV logger got for the step's batch (logged before its optimizer step: at step - 1); the
    # killed attempt's rows past the checkpoint are in the superseded file
    csv_dir = tmp / "csv" / "version_0"
    killed_loss = {int(r["step"]): float(r["train/loss"]) for f in ("metrics.csv", SUPERSEDED_FILE)
                   for r in csv.DictReader(open(csv_dir / f)) if r.get("train/loss") and (int(r["step"]) < 4) == (f == "metrics.csv")}
    resumed_loss = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(open(csv_dir / "metrics.csv")) if r.get("train/loss")}
    for x, losses in [(x, killed_loss) for x in killed] + [(x, resumed_loss) for x in resumed]:
        step = int(x["step"])
        assert int(x["tokens"].replace(",", "")) == tally[step], (x["line"], tally[step])
        assert float(x["loss"]) == pytest.approx(losses[step - 1], rel=1e-3), (x["line"], losses[step - 1])
        assert (x["eta"] is None) == bool(x["done"]), x["line"]
        if x is killed[0] or x is resumed[0]:  # the run's first step: no pace yet but the start-up's
            assert (x["rate"], x["eta"]) == ("?", "?"), x["line"]
        else:
            assert float(x["rate"].rstrip("kMG")) > 0 and x["eta"] != "?", x["line"]
