"""DataStatsCallback: a real tiny fit logged to an offline W&B run, read back from the run's
``.wandb`` transaction log with ``wandb leet inspect --json`` (wandb's own reader)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.loggers import WandbLogger

from stacklm.callbacks import DataStatsCallback, merge_data_stats
from tests.helpers.model import ContractDataModule, tiny_config
from stacklm.train.gpt_module import GPTModule, OptimConfig

HASHES = {"tokenizer": "tok-5f2c", "manifest": None, "data_config": "cfg-91ab"}
TARGET = {"web": 0.7, "code": 0.3}


class StatsDataModule(ContractDataModule):
    """Implements the data-stats protocol from what its loader really delivered."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.delivered = []  # (source of each row, tokens in row, pad tokens) per collated batch
        self.reports: list[tuple[int, dict]] = []  # (global_step at call, returned stats)
        inner = self.collate

        def counting_collate(windows):
            batch = inner(windows)
            self.delivered.append(batch)
            return batch

        self.collate = counting_collate

    def data_stats(self) -> dict:
        tokens = {"web": 0, "code": 0}
        docs = {"web": 0, "code": 0}
        pad = total = 0
        for batch in self.delivered:
            for row in range(batch["input_ids"].shape[0]):
                source = "web" if row % 3 else "code"  # a fixed split of rows between two sources
                real = int((batch["targets"][row] != -100).sum())
                tokens[source] += real
                docs[source] += int(batch["seq_ids"][row].max()) + 1
                pad += batch["input_ids"].shape[1] - real
                total += batch["input_ids"].shape[1]
        all_tokens = sum(tokens.values())
        stats = {
            "realized": {
                s: {"tokens": tokens[s], "docs": docs[s], "target_weight": TARGET[s], "realized_weight": tokens[s] / all_tokens if all_tokens else 0.0}
                for s in tokens
            },
            "dropped_docs": {"filter": {"web": {"too_short": 3 + len(self.delivered)}, "code": {"binary": 1}}, "near_dedup": {"web": {"near_dup": 2}}},
            "dropped_tokens": {"web": {"cut_by_budget": 40}},
            "holdout_docs": {"web": 5, "code": 2},
            "doc_length_hist": {"edges": [0, 8, 16, 32, 1 << 62], "counts": {"web": [0, 2, 3, 1], "code": [1, 0, 0, 0]}},
            "padding_fraction": pad / total if total else 0.0,
            "hashes": dict(HASHES),
        }
        self.reports.append((self.trainer.global_step, stats))
        return stats


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    for key, value in {
        "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path),
        "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_DATA_DIR": str(tmp_path / "data"), "WANDB_ARTIFACT_DIR": str(tmp_path / "artifacts"),
    }.items():
        monkeypatch.setenv(key, value)
    yield tmp_path
    import wandb

    wandb.teardown()  # wandb caches settings (e.g. the mode) per process; start the next test clean


def read_offline_run(root: Path) -> tuple[Path, list[dict]]:
    (run_file,) = root.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True, text=True, timeout=120, check=True,
    )
    return run_file.parent, [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


def fit(dm, callback, logger, tmp_path, max_steps=6):
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", max_steps=max_steps, log_every_n_steps=2, limit_val_batches=0, logger=logger,
        callbacks=[callback], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(GPTModule(tiny_config(), OptimConfig(warmup_steps=2)), datamodule=dm)
    return trainer


def test_offline_run_holds_the_logged_data_stats(offline_wandb):
    tmp_path = offline_wandb
    dm = StatsDataModule(seq_len=64, batch_size=6, n_docs=60)
    logger = WandbLogger(project="stacklm-test", save_dir=str(tmp_path), offline=True)
    fit(dm, DataStatsCallback(log_every_n_steps=2, table_every_n_steps=4), logger, tmp_path)
    logger.experiment.finish()

    run_dir, records = read_offline_run(tmp_path)
    config = {}
    for r in records:
        if r["type"] == "config":
            config.update(r["config"]["update"])
    assert config["data/hashes"] == HASHES

    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    data_rows = {row["trainer/global_step"]: row for row in history if "data/tokens/web" in row}
    assert sorted(data_rows) == [2, 4, 6]
    reported = dict(dm.reports)  # step -> what data_stats() returned then (the last call per step)
    for step, row in data_rows.items():
        stats = reported[step]
        for source in ("web", "code"):
            expect = stats["realized"][source]
            assert row[f"data/tokens/{source}"] == expect["tokens"] > 0
            assert row[f"data/docs/{source}"] == expect["docs"] > 0
            assert row[f"data/target_weight/{source}"] == pytest.approx(TARGET[source])
            assert row[f"data/realized_weight/{source}"] == pytest.approx(expect["realized_weight"])
            assert row[f"data/weight_gap/{source}"] == pytest.approx(expect["realized_weight"] - TARGET[source])
        assert row["data/dropped_docs/filter/web/too_short"] == stats["dropped_docs"]["filter"]["web"]["too_short"]
        assert row["data/dropped_docs/filter/code/binary"] == 1 and row["data/dropped_docs/near_dedup/web/near_dup"] == 2
        assert row["data/dropped_docs_total"] == stats["dropped_docs"]["filter"]["web"]["too_short"] + 3
        assert row["data/dropped_tokens/web/cut_by_budget"] == row["data/dropped_tokens_total"] == 40
        assert row["data/holdout_docs/web"] == 5 and "data/dropped_total" not in row
        assert row["data/padding_fraction"] == pytest.approx(stats["padding_fraction"])
        assert 0 < row["data/padding_fraction"] < 1
        assert row["loader/batches_per_s"] > 0 and row["loader/tokens_per_s"] > 0
        assert 0 <= row["loader/wait_fraction"] <= 1
    # Counts grow as the run delivers batches.
    assert data_rows[2]["data/tokens/web"] < data_rows[4]["data/tokens/web"] < data_rows[6]["data/tokens/web"]
    # The module's own metrics are in the same run.
    assert any("train/loss" in row and "train/tokens_per_s" in row for row in history)

    # The mix table and the bar chart (steps 4 only: table_every_n_steps=4; 6 is not a multiple).
    table_rows = [row for row in history if "data/mix.path" in row]
    assert [row["trainer/global_step"] for row in table_rows] == [4]
    table = json.loads((run_dir / "files" / table_rows[0]["data/mix.path"]).read_text())
    assert table["columns"] == ["source", "target_weight", "realized_weight", "tokens", "docs"]
    by_source = {r[0]: r for r in table["data"]}
    assert by_source["web"][3] == reported[4]["realized"]["web"]["tokens"]
    assert by_source["code"][2] == pytest.approx(reported[4]["realized"]["code"]["realized_weight"])
    bar = json.loads((run_dir / "files" / table_rows[0]["data/mix_bar_table.path"]).read_text())
    assert {label: w for label, w in bar["data"]}["web target"] == pytest.approx(0.7)
    assert config["_wandb.visualize.data/mix_bar"]["panel_config"]["fieldSettings"] == {"label": "label", "value": "weight"}
    # The charts: share over time (one line per source and target), doc-length histograms, drops by reason.
    chart = table_rows[0]
    series = json.loads((run_dir / "files" / chart["data/share_over_time_table.path"]).read_text())
    assert {r[1] for r in series["data"]} == {"web realized", "code realized", "web target", "code target"}
    assert chart["data/doc_length/web._type"] == "histogram" and chart["data/doc_length/web.values"] == [0, 2, 3, 1]
    drops = json.loads((run_dir / "files" / chart["data/drops_bar_table.path"]).read_text())
    assert dict(map(tuple, drops["data"]))["near_dedup/near_dup"] == 2


def test_offline_fallback_goes_into_the_run_config_loudly(offline_wandb):
    tmp_path = offline_wandb

    class FallbackDataModule(StatsDataModule):
        def data_stats(self) -> dict:
            return {**super().data_stats(), "offline_fallback": ["code"]}

    logger = WandbLogger(project="stacklm-test", save_dir=str(tmp_path), offline=True)
    with pytest.warns(RuntimeWarning, match=r"OFFLINE FALLBACK: source\(s\) \['code'\]"):
        fit(FallbackDataModule(seq_len=64, batch_size=6, n_docs=60), DataStatsCallback(log_every_n_steps=2), logger, tmp_path, max_steps=2)
    logger.experiment.finish()
    _, records = read_offline_run(tmp_path)
    config = {}
    for r in records:
        if r["type"] == "config":
            config.update(r["config"]["update"])
    assert config["data/offline_fallback"] == ["code"]
    history = [r["history"]["item"] for r in records if r["type"] == "history"]
    assert any(row.get("data/offline_fallback") == 1 for row in history)


def test_scalars_reach_every_logger(offline_wandb):
    """CSV and TensorBoard get the same data scalars as W&B (``logger.log_metrics`` on each)."""
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    tmp_path = offline_wandb
    dm = StatsDataModule(seq_len=64, batch_size=6, n_docs=60)
    csv, tb = CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")
    fit(dm, DataStatsCallback(log_every_n_steps=2), [csv, tb], tmp_path)
    import csv as csvlib

    rows = [r for r in csvlib.DictReader(open(csv.experiment.metrics_file_path)) if r.get("data/tokens/web")]
    reported = dict(dm.reports)
    assert [int(r["step"]) for r in rows] == [2, 4, 6]
    for r in rows:
        assert float(r["data/tokens/web"]) == reported[int(r["step"])]["realized"]["web"]["tokens"]
        assert float(r["data/dropped_tokens_total"]) == 40
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb.log_dir))
    acc.Reload()
    events = acc.Scalars("data/tokens/code")
    assert [e.step for e in events] == [2, 4, 6]
    assert [e.value for e in events] == [reported[e.step]["realized"]["code"]["tokens"] for e in events]


@pytest.mark.parametrize("mode", ["disabled", "disabled_run", "no_logger"])
def test_noop_with_one_line_notice(offline_wandb, monkeypatch, capsys, mode):
    tmp_path = offline_wandb
    dm = StatsDataModule(seq_len=64, batch_size=4, n_docs=30)
    if mode == "disabled":
        monkeypatch.setenv("WANDB_MODE", "disabled")
        logger = WandbLogger(project="stacklm-test", save_dir=str(tmp_path))
        expected = "WANDB_MODE=disabled"
    elif mode == "disabled_run":
        logger = WandbLogger(project="stacklm-test", save_dir=str(tmp_path), mode="disabled")
        expected = "the wandb run is disabled"
    else:
        logger = False
        expected = "no logger"
    fit(dm, DataStatsCallback(log_every_n_steps=1), logger, tmp_path, max_steps=2)
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stacklm.logging:")]
    assert len(notices) == 1 and expected in notices[0]
    assert dm.reports == []  # the protocol was never called
    assert not list(tmp_path.glob("wandb/*run-*"))
    if logger:
        logger.experiment.finish()


def test_merge_data_stats_sums_ranks():
    rank0 = {"realized": {"web": {"tokens": 300, "docs": 3, "rows": 5, "target_weight": 0.5, "realized_weight": 0.75},
                          "code": {"tokens": 100, "docs": 1, "target_weight": 0.5, "realized_weight": 0.25}},
             "delivered": {"batches": 2, "positions": 500, "tokens": 400},
             "dropped_docs": {"filter": {"web": {"short": 2}}}, "dropped_tokens": {"web": {"cut_by_budget": 7}},
             "holdout_docs": {"web": 1}, "offline_fallback": [], "ran_dry": {"code": {"batch": 9, "delivered_share": 0.2}},
             "doc_length_hist": {"edges": [0, 8, 1 << 62], "counts": {"web": [1, 2], "code": [0, 1]}},
             "padding_fraction": 0.2, "hashes": HASHES}
    rank1 = {"realized": {"web": {"tokens": 100, "docs": 1, "rows": 2, "target_weight": 0.5, "realized_weight": 0.25},
                          "code": {"tokens": 300, "docs": 5, "target_weight": 0.5, "realized_weight": 0.75}},
             "delivered": {"batches": 2, "positions": 500, "tokens": 400},
             "dropped_docs": {"filter": {"web": {"short": 1, "long": 4}}}, "dropped_tokens": {"code": {"cut_by_budget": 3}},
             "holdout_docs": {"web": 2, "code": 1}, "offline_fallback": ["code"], "ran_dry": {"code": {"batch": 4, "delivered_share": 0.7}},
             "doc_length_hist": {"edges": [0, 8, 1 << 62], "counts": {"web": [0, 1], "code": [3, 0]}},
             "padding_fraction": 0.2, "hashes": HASHES}
    merged = merge_data_stats([rank0, rank1])
    assert merged["realized"]["web"] == {"tokens": 400, "docs": 4, "rows": 7, "target_weight": 0.5, "realized_weight": 0.5}
    assert merged["realized"]["code"]["docs"] == 6 and "rows" not in merged["realized"]["code"]  # rows: only where counted
    assert merged["delivered"] == {"batches": 4, "positions": 1000, "tokens": 800}
    assert merged["padding_fraction"] == pytest.approx(0.2) and merged["hashes"] == HASHES
    assert merged["dropped_docs"] == {"filter": {"web": {"short": 3, "long": 4}}}
    assert merged["dropped_tokens"] == {"web": {"cut_by_budget": 7}, "code": {"cut_by_budget": 3}}
    assert merged["holdout_docs"] == {"web": 3, "code": 1} and merged["offline_fallback"] == ["code"]
    assert merged["ran_dry"]["code"]["batch"] == 4  # the earliest
    assert merged["doc_length_hist"]["counts"] == {"web": [1, 3], "code": [3, 1]}


class _RankDataModule:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def data_stats(self) -> dict:
        return {"realized": {"web": {"tokens": 10 * (self.rank + 1), "docs": 1, "target_weight": 1.0, "realized_weight": 1.0}},
                "dropped_docs": {"filter": {"web": {"short": self.rank}}}, "padding_fraction": 0.5, "hashes": HASHES}


class _FakeTrainer:
    def __init__(self, rank: int, world_size: int) -> None:
        self.datamodule, self.world_size = _RankDataModule(rank), world_size


def _gather_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        stats = DataStatsCallback()._collect(_FakeTrainer(rank, world_size))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(stats))
    finally:
        dist.destroy_process_group()


def test_collect_gathers_over_a_real_process_group(tmp_path):
    mp.start_processes(_gather_worker, args=(2, str(tmp_path / "pg_init"), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    for rank in range(2):
        stats = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert stats["realized"]["web"]["tokens"] == 30  # 10 + 20: every rank sees the global sum
        assert stats["dropped_docs"]["filter"]["web"]["short"] == 1
    assert os.environ.get("RANK") is None  # no distributed state leaked into this process


def test_the_logged_wait_is_the_slowest_ranks():
    """``reduce_wait``: the slowest rank's fraction and seconds, and the mean over ranks; the host
    clock counts the time from a step's end to the next batch, not the step itself."""
    from stacklm.callbacks import WaitClock, reduce_wait

    out = reduce_wait([(0.1, 1.0), (0.6, 1.2), (0.2, 0.4)])
    assert out == {"loader/wait_fraction": 0.5, "loader/wait_fraction_mean": pytest.approx((0.1 + 0.5 + 0.5) / 3),
                   "loader/wait_s": 0.6}
    assert reduce_wait([(2.0, 1.0)])["loader/wait_fraction"] == 1.0  # capped: a window is never more than all waiting
    clock, cpu = WaitClock(), torch.device("cpu")
    clock.batch_ready(cpu)  # the first batch: no step before it, nothing waited
    time.sleep(0.05)  # the step
    clock.step_end(cpu)
    time.sleep(0.1)  # the loader
    clock.batch_ready(cpu)
    waited, on_device = clock.take()
    assert 0.1 <= waited < 0.15 and on_device is False
    assert clock.take() == (0.0, False)  # a new window
    clock.step_end(cpu)
    clock.epoch_start()  # the gap into a new epoch is the workers starting, not a step's wait
    time.sleep(0.05)
    clock.batch_ready(cpu)
    assert clock.take() == (0.0, False)
