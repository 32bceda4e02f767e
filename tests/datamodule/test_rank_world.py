"""Rank and world size come from ``stacklm.dist.rank_world`` everywhere: under a torchrun-style
environment (RANK/WORLD_SIZE, no process group) and under a real ``torch.distributed.run``
with a gloo process group, every rank reads its own slice and the slices cover everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stacklm.datamodule.resume.sampler import ElasticSampler
from stacklm.data.sources import ShardSpec, SyntheticSource
from stacklm.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_style_environment_without_a_process_group(monkeypatch):
    n, batch = 50, 3
    slices, docs = [], []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "4")
        assert ShardSpec.current() == ShardSpec(rank, 4, 0, 1)
        sampler = ElasticSampler(n, batch, seed=1)
        assert (sampler.rank, sampler.world_size) == (rank, 4)
        it = iter(sampler)
        slices.append([next(it) for _ in range(batch * 2)])
        docs += [d["doc_id"] for d in SyntheticSource("s", "prose", num_docs=30, shard=ShardSpec.current())]
    perm = ElasticSampler(n, batch, seed=1, rank=0, world_size=1).permutation(0)
    # global step t covers positions [t*W*B, (t+1)*W*B); rank r takes its B at offset r*B
    expect = [[int(perm[t * 4 * batch + r * batch + j]) for t in range(2) for j in range(batch)] for r in range(4)]
    assert slices == expect
    assert sorted(docs) == sorted(f"s/synthetic/{i}" for i in range(30)) and len(set(docs)) == 30


def test_a_bad_launcher_environment_is_named(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="RANK=2 but WORLD_SIZE=2"):
        ShardSpec.current()
    with pytest.raises(ConfigError, match="RANK=2 but WORLD_SIZE=2"):
        ElasticSampler(10, 2)


def test_real_torchrun_ranks_read_disjoint_complete_slices(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "runners" / "torchrun_rank_check.py"), str(tmp_path)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, run in enumerate(runs):
        before, after = run["before"], run["after"]
        assert after["group"] == after["rank_world"] == before["rank_world"] == [r, 2]
        assert before["spec"] == after["spec"] == [r, 2, 0, 1]
        assert before["sampler"] == after["sampler"] == [r, 2]
        assert before["workers"] == after["workers"] == [[r, 2, 0, 2], [r, 2, 1, 2]]
        for key in ("docs", "sampled"):  # the same slice before and after the process group exists
            assert before[key] == after[key]
    docs = runs[0]["after"]["docs"] + runs[1]["after"]["docs"]
    assert sorted(docs) == sorted(f"s/synthetic/{i}" for i in range(40)) and len(set(docs)) == 40
    sampled = [runs[r]["after"]["sampled"] for r in (0, 1)]
    perm = ElasticSampler(50, 3, seed=3, rank=0, world_size=1).permutation(0)
    assert np.array_equal(np.array(sampled), [[int(perm[t * 6 + r * 3 + j]) for t in range(4) for j in range(3)] for r in (0, 1)])
