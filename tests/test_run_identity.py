"""One run, one story (stacklm.run_identity): ``stacklm-train fit`` killed by SIGKILL after
its step-4 checkpoint, then resumed from it with ``--ckpt_path``, continues the same W&B run
(offline: the same run id) and the same CSV folder, whose rows the killed attempt logged past
the checkpoint are moved aside; ``stacklm report`` reads it as one run resumed at step 4."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stacklm.run_identity import CHECKPOINT_KEY, SUPERSEDED_FILE, saved_run
from stacklm.run_report import read_run
from tests.helpers.datamodule import stream_pipeline
from tests.helpers.model import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def config(tmp_path: Path, tok_dir: Path, kill_at: int | None) -> Path:
    callbacks = [
        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
         "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": 4, "save_top_k": -1}},
    ]
    if kill_at is not None:
        callbacks.append({"class_path": "tests.helpers.lightning.KillAt", "init_args": {"step": kill_at}})
    cfg = {
        "seed_everything": 0,
        "model": {"config": tiny_config(vocab_size=512).to_dict(), "optim": {"lr": 1e-3, "warmup_steps": 2, "total_steps": 10}},
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": 10, "log_every_n_steps": 1, "enable_progress_bar": False,
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
    path = tmp_path / ("killed.yaml" if kill_at is not None else "fit.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_fit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_DIR": str(tmp_path), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")}
    return subprocess.run([sys.executable, "-m", "trainer", "fit", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_a_killed_fit_resumed_is_one_wandb_run_and_one_csv(tokenizer_dir, tmp_path):
    killed = run_fit(tmp_path, "--config", str(config(tmp_path, tokenizer_dir, kill_at=6)))
    assert killed.returncode == -9, killed.stderr[-3000:]  # SIGKILL
    ckpt = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    saved = saved_run(ckpt)
    assert saved["global_step"] == 4 and saved["csv_version"] == 0 and saved["wandb_id"]
    (first_run,) = (tmp_path / "wandb").glob("offline-run-*")
    assert first_run.name.endswith(saved["wandb_id"])

    out = run_fit(tmp_path, "--config", str(config(tmp_path, tokenizer_dir, kill_at=None)), "--ckpt_path", str(ckpt))
    assert out.returncode == 0, out.stderr[-3000:]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(saved["wandb_id"]) for r in runs)  # both attempts: the one run id
    assert all(list(r.glob(f"run-{saved['wandb_id']}.wandb")) for r in runs)
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
