"""Per-source loss (stacklm.source_loss.SourceLossCallback) through real Lightning Trainers: every
logged value equals the one computed here from the run's own provenance — the step log's rows
and pieces for training (``stacklm inspect --step``'s reader), the prebuild's rows for
validation — on a module whose per-token loss is a known function of the target. Shards mode
on one process and on two gloo ranks (the sums must be over both ranks' tokens), stream mode
on one; and the GPT module's per-token loss is its loss."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from stacklm.data.contract import IGNORE_INDEX
from stacklm.datamodule import StackDataModule
from stacklm.inspector.steps import step_provenance
from tests.helpers.ledger import data_section, write_corpus
from tests.helpers.lightning import run_program
from tests.runners.source_loss_fit import PlantedLoss, fit, planted

ROOT = Path(__file__).resolve().parents[1]


def file_pipeline(root: Path, total: int = 20_000) -> dict:
    """The ledger corpus: ``web`` two local jsonl files, ``books`` its parquet file read through ``datasets``."""
    section = data_section(root, total=total)
    section["mix"]["entries"][1] = {"name": "books", "kind": "hf", "path": "parquet", "weight": 0.4, "domain": "prose",
                                    "data_files": [str(root / "books" / "c.parquet")]}
    return {k: v for k, v in section.items() if k not in ("seq_len", "batch_size")}


def logged(out: Path) -> dict[int, dict[str, float]]:
    """step -> every value the CSV logger wrote at that step."""
    steps: dict[int, dict[str, float]] = {}
    with open(out / "csv" / "version_0" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            step = int(row["step"])
            steps.setdefault(step, {}).update({k: float(v) for k, v in row.items() if v != "" and k != "step"})
    return steps


def add_rows(sums: dict[str, list[float]], targets: list[list[int]], rows: list[list[dict] | None]) -> None:
    """Add each trained target's planted loss to the source of the piece holding its window position."""
    for t_row, segments in zip(targets, rows):
        if segments is None:
            continue
        t = torch.tensor(t_row)
        loss = planted(t).tolist()
        for j, target in enumerate(t_row):
            if target == IGNORE_INDEX:
                continue
            src = next(s["source"] for s in segments if s["row_start"] <= j + 1 < s["row_end"])  # target j = window j + 1
            acc = sums.setdefault(src, [0.0, 0])
            acc[0] += loss[j]
            acc[1] += 1


def expected_train(log: Path, batches: dict[int, list], start: int, end: int) -> dict[str, list[float]]:
    """Sums over steps [start, end) from the step log's rows (per rank, in batch order) and the
    targets each rank's module saw at those steps."""
    sums: dict[str, list[float]] = {}
    for step in range(start, end):
        rows = step_provenance(log, step)["rows"]
        for rank, seen in batches.items():
            targets = [t for split, s, ts, _ in seen if split == "train" and s == step for t in ts]
            mine = [None if r.get("padding") else r["segments"] for r in rows if r["rank"] == rank]
            assert len(mine) == len(targets), (step, rank)
            add_rows(sums, targets, mine)
    return sums


def check(values: dict[str, float], sums: dict[str, list[float]], prefix: str) -> set[str]:
    got = {k.split("/")[-1]: v for k, v in values.items() if k.startswith(f"{prefix}/loss_by_source/")}
    counts = {k.split("/")[-1]: v for k, v in values.items() if k.startswith(f"{prefix}/loss_tokens_by_source/")}
    assert set(got) == set(sums) and sums, (got, sums)
    for src, (total, n) in sums.items():
        assert counts[src] == n
        assert got[src] == pytest.approx(total / n, rel=1e-12)
    return set(got)


def check_run(out: Path, data_dir: Path, ranks: int) -> None:
    from stacklm.data.storage.provenance import RowProvenance

    batches = {r: json.loads((out / f"batches{r}.json").read_text()) for r in range(ranks)}
    values = logged(out)
    train_steps = sorted(s for s, v in values.items() if any(k.startswith("train/loss_by_source/") for k in v))
    assert train_steps == [2, 4, 6]
    seen = set()
    for prev, step in zip([0, *train_steps], train_steps):
        seen |= check(values[step], expected_train(out / "steplog", batches, prev, step), "train")
    assert len(seen) == 2  # both sources of the mix were trained on and attributed
    # validation: each row found among the val split's rows by its tokens, its pieces from the side files
    val = RowProvenance(data_dir, "val")
    by_window = {}
    for i in range(val.n_rows):
        got = val(i)
        by_window[tuple(got["input_ids"][:-1])] = got["segments"]
    sums: dict[str, list[float]] = {}
    n_val = 0
    for seen in batches.values():
        for split, _, targets, ids in seen:
            if split == "val":
                n_val += len(ids)
                add_rows(sums, targets, [by_window.get(tuple(r)) if any(t != IGNORE_INDEX for t in ts) else None
                                         for r, ts in zip(ids, targets)])
    assert n_val >= 4 * ranks
    check(values[6], sums, "val")


def test_shards_mode_one_process(tokenizer_dir, shards_dir, tmp_path):
    dm = StackDataModule(mode="shards", tokenizer=str(tokenizer_dir), data_dir=str(shards_dir), seq_len=64, batch_size=2,
                         num_workers=0, val_batches=4, step_log=str(tmp_path / "steplog"))
    fit(tmp_path, dm)
    check_run(tmp_path, shards_dir, 1)


@pytest.mark.slow
def test_shards_mode_two_gloo_ranks_sum_over_ranks(tokenizer_dir, shards_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = run_program([sys.executable, str(ROOT / "tests" / "runners" / "source_loss_fit.py"), "--tokenizer", str(tokenizer_dir),
                       "--data-dir", str(shards_dir), "--out", str(tmp_path), "--devices", "2"], cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    check_run(tmp_path, shards_dir, 2)
    # each rank alone would log another value: the logged one is over both ranks' tokens
    batches = {r: json.loads((tmp_path / f"batches{r}.json").read_text()) for r in range(2)}
    alone = expected_train(tmp_path / "steplog", {0: batches[0]}, 0, 2)
    both = expected_train(tmp_path / "steplog", batches, 0, 2)
    assert any(alone[s][1] != both[s][1] for s in both)


def test_stream_mode_with_a_loader_worker(tokenizer_dir, tmp_path):
    write_corpus(tmp_path / "corpus")
    dm = StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=file_pipeline(tmp_path / "corpus"), seq_len=64,
                         batch_size=4, num_workers=1, val_batches=0, step_log=str(tmp_path / "steplog"))
    fit(tmp_path, dm)
    batches = {0: json.loads((tmp_path / "batches0.json").read_text())}
    values = logged(tmp_path)
    seen = set()
    for prev, step in ((0, 2), (2, 4), (4, 6)):
        seen |= check(values[step], expected_train(tmp_path / "steplog", batches, prev, step), "train")
    assert seen == {"web", "books"}


def test_gpt_token_loss_is_the_loss():
    from stacklm.train.model import lm_loss, lm_token_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, :2] = IGNORE_INDEX
    loss, n, per_token = lm_token_loss(logits, targets)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    assert n == 8 and loss == pytest.approx(float(ref)) and lm_loss(logits, targets)[0] == loss
    assert per_token.shape == targets.shape and (per_token[0, :2] == 0).all()
    one = torch.nn.functional.cross_entropy(logits[1, 3:4], targets[1, 3:4])
    assert per_token[1, 3] == pytest.approx(float(one))


def test_a_module_without_token_loss_is_one_notice(tokenizer_dir, shards_dir, tmp_path, capfd):
    from lightning.pytorch.loggers import CSVLogger

    from stacklm.source_loss import SourceLossCallback
    from tests.helpers.lightning import TinyLM

    dm = StackDataModule(mode="shards", tokenizer=str(tokenizer_dir), data_dir=str(shards_dir), seq_len=64, batch_size=2,
                         num_workers=0, val_batches=0)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, callbacks=[SourceLossCallback(log_every_n_steps=1)],
                        logger=CSVLogger(str(tmp_path), name="csv", version=0), enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, default_root_dir=str(tmp_path))
    trainer.fit(TinyLM(dm.vocab_size), datamodule=dm)
    err = capfd.readouterr().err
    assert err.count("SourceLossCallback: the module's step returns no 'token_loss'") == 1
    metrics = tmp_path / "csv" / "version_0" / "metrics.csv"  # TinyLM logs nothing itself: no file, or one without it
    assert not metrics.exists() or "loss_by_source" not in metrics.read_text()


def test_a_mix_schedule_logs_each_phase_under_its_name(tokenizer_dir, tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    from stacklm.source_loss import SourceLossCallback

    write_corpus(tmp_path / "corpus")
    pipeline = file_pipeline(tmp_path / "corpus", total=6_000)
    pipeline["mix"]["schedule"] = {"phases": [{"until": 0.5, "name": "early", "weights": {"web": 0.9, "books": 0.1}},
                                              {"until": 1.0, "name": "late", "weights": {"web": 0.1, "books": 0.9}}]}
    dm = StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=pipeline, seq_len=64, batch_size=4, num_workers=0,
                         val_batches=0, step_log=False)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, callbacks=[SourceLossCallback(log_every_n_steps=2)],
                        logger=CSVLogger(str(tmp_path), name="csv", version=0), enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0, default_root_dir=str(tmp_path))
    trainer.fit(PlantedLoss(), datamodule=dm)
    phases = []
    for step, values in sorted(logged(tmp_path).items()):
        plain = {k: v for k, v in values.items() if k.startswith("train/loss")}
        keyed = {k: v for k, v in values.items() if k.startswith("train/phase/")}
        if not plain:
            continue
        (name,) = {k.split("/")[2] for k in keyed}  # every value of a log point under one phase
        assert {k.replace(f"train/phase/{name}/", "train/"): v for k, v in keyed.items()} == plain
        phases.append(name)
    assert phases[0] == "early" and phases[-1] == "late" and phases == sorted(phases)  # early... then late..., once
