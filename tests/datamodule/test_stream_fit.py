"""The Stack-100M run's shape at toy scale, exactly as users run it: ``python -m trainer fit
--config <yaml>`` in a subprocess, stream mode with 2 loader workers, a WandbLogger (offline)
and a CSV logger, a local parquet source read through ``datasets`` (``kind: hf``, ``path:
parquet``) next to a local jsonl source, exact + near dedup and best-fit packing. It fits,
checkpoints, resumes from the checkpoint with ``--ckpt_path`` and finishes; every logged data
number is checked against the tokens counted in the batches themselves."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tests.helpers.model import tiny_config

ROOT = Path(__file__).resolve().parents[2]
STEPS, CKPT_EVERY = 12, 6


def write_config(tmp_path: Path, tok_dir: Path, tok, docs: list[str]) -> Path:
    half = len(docs) // 2
    pq.write_table(pa.table({"text": docs[:half], "id": list(range(half))}), tmp_path / "web.parquet")
    with open(tmp_path / "code.jsonl", "w") as f:
        for d in docs[half:]:
            f.write(json.dumps({"text": d}) + "\n")
    config = {
        "seed_everything": 0,
        "model": {"config": tiny_config().to_dict(), "optim": {"lr": 1e-3, "warmup_steps": 2, "total_steps": STEPS}},
        "trainer": {
            "accelerator": "cpu", "devices": 1, "max_steps": CKPT_EVERY, "log_every_n_steps": 2, "enable_progress_bar": False,
            "enable_model_summary": False, "limit_val_batches": 2, "val_check_interval": CKPT_EVERY,
            "check_val_every_n_epoch": None, "num_sanity_val_steps": 0, "default_root_dir": str(tmp_path),
            "logger": [
                {"class_path": "lightning.pytorch.loggers.WandbLogger",
                 "init_args": {"offline": True, "save_dir": str(tmp_path), "project": "stacklm-test"}},
                {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": str(tmp_path), "name": "csv"}},
            ],
            "callbacks": [
                {"class_path": "stacklm.callbacks.DataStatsCallback", "init_args": {"log_every_n_steps": 2}},
                {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                 "init_args": {"dirpath": str(tmp_path / "ckpt"), "every_n_train_steps": CKPT_EVERY, "save_top_k": -1}},
                {"class_path": "tests.helpers.lightning.DeliveredTokenTally",
                 "init_args": {"out": str(tmp_path / "tally.json"), "pad_id": tok.pad_id, "bos_id": tok.bos_id}},
            ],
        },
        "data": {
            "mode": "stream", "tokenizer": str(tok_dir), "seq_len": 64, "batch_size": 4, "num_workers": 2, "seed": 0,
            "pipeline": {
                "mix": {"name": "toy", "total_tokens": 40_000, "entries": [
                    {"name": "web", "kind": "hf", "path": "parquet", "data_files": [str(tmp_path / "web.parquet")],
                     "weight": 0.7, "domain": "prose"},
                    {"name": "code", "kind": "local", "path": str(tmp_path / "code.jsonl"), "weight": 0.3, "domain": "code"},
                ]},
                "strategy": "best_fit", "holdout_fraction": 0.05, "shuffle_buffer": 50, "pack_buffer_docs": 20,
                "dedup": {"exact": True, "near": True},
            },
        },
    }
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_fit(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "WANDB_DIR": str(tmp_path), "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
           "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "HF_DATASETS_CACHE": str(tmp_path / "hf-cache"),
           "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "trainer", "fit", *args], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


# What a fit printed before issue 25 that was neither ours nor true of the run (a jsonargparse
# round-trip warning for the optimizer betas, torchdata's deprecated set_vital, Lightning's
# "IterableDataset has __len__ ... duplicate data", its pytree deprecation, tensorboardX notice,
# "No seed found" and hosted-service tips).
NOISE = ("JsonargparseWarning", "does not round-trip", "set_vital", "IterableDataset` has `__len__`",
         "LeafSpec", "tensorboardX", "No seed found", "Tip:", "Warning:", "deprecated", "You have overridden")


def assert_quiet(out: subprocess.CompletedProcess) -> None:
    lines = out.stderr.splitlines()
    noisy = [line for line in lines if any(n in line for n in NOISE)]
    assert not noisy, "\n".join(noisy)
    assert len(lines) <= 12, out.stderr  # Lightning's few lines (seed, devices, the stop) and ours


def data_rows(metrics_csv: Path) -> dict[int, dict[str, str]]:
    return {int(r["step"]): r for r in csv.DictReader(open(metrics_csv)) if r.get("data/tokens/web")}


@pytest.mark.slow
def test_stream_fit_with_workers_wandb_and_datasets_sources_resumes_and_logs_true_numbers(
        tmp_path, tokenizer_512, saved_tokenizer_dir, real_docs):
    tok = tokenizer_512
    docs = [d for d in real_docs if len(d) > 200][:1200]
    config = write_config(tmp_path, saved_tokenizer_dir(tok), tok, docs)

    assert_quiet(run_fit(tmp_path, "--config", str(config)))
    ckpt = tmp_path / "ckpt" / f"epoch=0-step={CKPT_EVERY}.ckpt"
    assert ckpt.exists()
    first_tally = {int(k): v for k, v in json.loads((tmp_path / "tally.json").read_text()).items()}
    assert_quiet(run_fit(tmp_path, "--config", str(config), "--trainer.max_steps", str(STEPS), "--ckpt_path", str(ckpt)))
    tally = {**first_tally, **{int(k): v for k, v in json.loads((tmp_path / "tally.json").read_text()).items()}}
    assert sorted(tally) == list(range(1, STEPS + 1))

    # the resume continued the run's CSV folder (stacklm.run_identity): one version, both fits' rows
    assert [p.name for p in (tmp_path / "csv").iterdir()] == ["version_0"]
    rows = data_rows(tmp_path / "csv" / "version_0" / "metrics.csv")
    first, resumed = ({s: r for s, r in rows.items() if s <= CKPT_EVERY}, {s: r for s, r in rows.items() if s > CKPT_EVERY})
    assert sorted(first) == [2, 4, 6] and sorted(resumed) == [8, 10, 12]  # the first numbers at the first logging step
    for step, row in {**first, **resumed}.items():
        tokens, bos = tally[step]
        logged = float(row["data/tokens/web"]) + float(row["data/tokens/code"])
        assert logged == tokens, (step, logged, tokens)  # what the batches delivered, exactly; resume continues it
        assert float(row["data/docs/web"]) + float(row["data/docs/code"]) >= bos
        positions = step * 4 * 63
        assert float(row["data/padding_fraction"]) == pytest.approx(1 - tokens / positions)
        assert float(row["data/target_weight/web"]) == pytest.approx(0.7)
        assert float(row["data/dropped_docs_total"]) > 0 and float(row["data/holdout_docs/web"]) > 0
        assert float(row["data/offline_fallback"]) == 0
        assert float(row["data/ledger_ok"]) == 1 and float(row["data/ledger_problems"]) == 0  # the token ledger adds up
        assert 0 <= float(row["loader/wait_fraction"]) <= 1
        # the workers' time per stage of the graph (StageClock), since they started: in the first fit every
        # stage worked; the resumed one's restored buffers held what its last steps needed (the packer's own work)
        stages = {k.rsplit("/", 1)[1]: float(v) for k, v in row.items() if k.startswith("loader/stage_seconds/") and v}
        assert stages and min(stages.values()) > 0
        if step <= CKPT_EVERY:
            assert set(stages) >= {"source", "filter", "dedup", "tokenize", "mix", "shuffle", "pack"}, step
    assert float(resumed[STEPS]["data/tokens/web"]) > 0 and float(resumed[STEPS]["data/tokens/code"]) > 0
    assert float(resumed[12]["data/dropped_docs/dedup/web/exact_dup"]) + float(resumed[12].get("data/dropped_docs/dedup/web/near_dup") or 0) > 0
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and len({r.name for r in runs}) == 1  # two attempts, one W&B run id
    (tmp_path / "loader_wait.json").write_text(json.dumps({s: float(r["loader/wait_fraction"]) for s, r in {**first, **resumed}.items()}))
