"""``bench/gpu.py``, the GPU-readiness script, exercised on CPU.

``--device cpu --quick`` runs its whole path at toy scale: FlexAttention against the SDPA
reference on real packed rows (logits, loss, a document packed vs alone, and two controls that
show the checks can fail), then training steps fed from prebuilt shards and from stream mode.
On a CUDA machine the same script runs the Stack-100M model (docs/trainer.md).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from stacklm.data.packing.pack import collate
from stacklm.train.model import GPT, GPTConfig

from tests.helpers.bench import load_bench

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu.py"
QUICK_STEPS = 6  # bench/gpu.py's QUICK["steps"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bench") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--json", str(out)],
        check=False, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT,
    )
    assert proc.returncode == 0, f"bench/gpu.py failed (rc {proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc.stdout, time.perf_counter() - t


def test_flex_matches_the_sdpa_reference_on_packed_rows(quick_run):
    report, stdout, _ = quick_run
    kernels = report["kernels"]
    rows = {(r["backend"], r["precision"]): r for r in kernels["rows"]}
    assert set(rows) == {("sdpa", "fp32"), ("flex", "fp32"), ("sdpa", "bf16"), ("flex", "bf16")}
    assert min(kernels["batch"]["segments_per_row"]) >= 2, "rows must pack several documents for the mask to matter"
    assert kernels["batch"]["documents_checked"], "no document was checked packed vs alone"

    flex = rows[("flex", "fp32")]
    assert flex["max_logit_diff"] < 1e-4
    assert flex["loss_diff"] < 1e-4
    assert flex["doc_max_diff"] < 1e-4 and rows[("sdpa", "fp32")]["doc_max_diff"] < 1e-4
    # The checks can fail: a wrong mask or wrong positions move a packed document's logits.
    assert kernels["controls"]["no document mask"] > 1e-2
    assert kernels["controls"]["positions reversed in each document"] > 1e-2
    # bf16 flex is as close to the fp32 reference as bf16 SDPA is (within the bench's slack).
    assert rows[("flex", "bf16")]["ok"] and rows[("flex", "bf16")]["vs_fp32"]["max_logit_diff"] > 0
    assert kernels["verdicts"] == [] and "kernels: all checks passed" in stdout


def test_throughput_from_shards_and_from_stream(quick_run):
    report, stdout, seconds = quick_run
    rows = {r["feed"]: r for r in report["throughput"]["rows"]}
    assert set(rows) == {"in-memory", "shards", "stream"}
    for feed, r in rows.items():
        assert "error" not in r, f"{feed}: {r.get('error')}"
        assert r["steps"] == QUICK_STEPS and r["masked_batches"] == 0
        assert r["tokens_per_s"] > 0 and 0 < r["nonpad_tokens_per_s"] <= r["tokens_per_s"]
        assert 0.0 <= r["wait_fraction"] <= 1.0
        assert math.isfinite(r["loss_first"]) and math.isfinite(r["loss_last"])
    assert rows["shards"]["workers"] == rows["stream"]["workers"] == 1
    assert "B. training throughput" in stdout and "wait frac" in stdout
    print(f"bench/gpu.py --device cpu --quick took {seconds:.0f}s")


def test_wait_fraction_sees_a_slow_loader():
    """The bench's wait fraction is time blocked in next(loader) over wall time: a loader that
    sleeps before every batch shows up as mostly waiting, one batch repeated as hardly any."""
    gpu = load_bench("gpu")
    args = gpu.parse_args(["--device", "cpu", "--quick", "--warmup", "1", "--steps", "3"])
    config = GPTConfig.tiny(vocab_size=512, seq_len=64, d_model=64, attention="sdpa")
    rng = np.random.default_rng(0)
    bos, eos, pad = 509, 510, 511
    window = np.concatenate([[bos], rng.integers(0, 256, 30), [eos, bos], rng.integers(0, 256, 20), [eos], np.full(10, pad)])
    batch = collate(np.stack([window] * 2), bos, eos, pad)

    class SlowLoader:
        def __iter__(self):
            for _ in range(4):
                time.sleep(0.5)
                yield batch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slow = gpu.train(args, config, SlowLoader(), torch.device("cpu"), pad)
        fast = gpu.train(args, config, gpu.RepeatBatch(batch, 4), torch.device("cpu"), pad)
    assert slow["wait_fraction"] > 0.5 and fast["wait_fraction"] < 0.2
    assert slow["tokens_per_s"] < fast["tokens_per_s"]
    assert slow["nonpad_tokens_per_s"] < slow["tokens_per_s"]  # the padded tail is not counted


@pytest.mark.slow
def test_compiled_flex_on_cpu_matches_sdpa():
    """A torch.compile'd model with FlexAttention on CPU gives SDPA's logits (Inductor's CPU flex
    kernel needs a contiguous v there; see stacklm.train.attention._flex)."""
    torch.manual_seed(0)
    seq_ids = torch.tensor([[0] * 20 + [1] * 30 + [2] * 13, [0] * 40 + [1] * 23])
    starts = torch.cat([torch.ones(2, 1, dtype=torch.bool), seq_ids[:, 1:] != seq_ids[:, :-1]], dim=1)
    index = torch.arange(seq_ids.shape[1]).expand_as(seq_ids)
    position_ids = index - torch.cummax(torch.where(starts, index, 0), dim=1).values
    input_ids = torch.randint(0, 500, seq_ids.shape)
    config = GPTConfig.tiny(vocab_size=512, seq_len=64, d_model=64, n_layer=1, init_std=0.06, attention="flex")
    reference = GPT({**config.to_dict(), "attention": "sdpa"}).eval()
    compiled = GPT(config).eval()
    compiled.load_state_dict(reference.state_dict())
    compiled.compile()
    with torch.no_grad():
        expected = reference(input_ids, position_ids, seq_ids)
        got = compiled(input_ids, position_ids, seq_ids)
    # The mask matters here: one segment per row gives other logits.
    with torch.no_grad():
        unmasked = reference(input_ids, position_ids, torch.zeros_like(seq_ids))
    assert (unmasked - expected).abs().max() > 1e-2
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_sync_check_fails_loudly_without_cuda():
    """Part C (``--sync-check``: no host sync on lean batches) needs CUDA; on a CPU device it
    exits 2 naming why, before any work, instead of passing without having checked anything."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--sync-check"],
                          check=False, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--sync-check needs a CUDA device" in proc.stderr and "set_sync_debug_mode" in proc.stderr
