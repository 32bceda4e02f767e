"""Workers die with their parent (``stacklm.parent_death``): a real ``stacklm prebuild --workers 2``
SIGKILLed at its pool's start-up and mid-build, and loader workers of a killed training process.

The prebuild is killed by ``tests/runners/kill_probe.py``, a script that makes itself a child subreaper,
so the orphans are re-parented to it (as under ``docker --init``, tini or systemd), not to PID 1:
the harder case, where a worker that only checks ``os.getppid() == 1`` goes on running jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from stacklm.data.storage import manifest as mf
from stacklm.data.storage.shards import dtype_name, token_dtype, write_shard
from stacklm.prebuild import load_config, prebuild
from tests.runners.kill_probe import children, running
from tests.helpers.prebuild import TOKENS_PER_SHARD, own_config, tree

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "tests" / "runners" / "kill_probe.py"
ENV = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@pytest.fixture(scope="module")
def tok_dir(tokenizer_2048, saved_tokenizer_dir):
    return saved_tokenizer_dir(tokenizer_2048)


def _probe(*args: str) -> dict:
    res = subprocess.run([sys.executable, str(PROBE), "prebuild", *args, "--subreaper"], cwd=REPO, env=ENV,
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def _assert_nothing_ran_on(report: dict) -> None:
    """Every process of the killed prebuild stopped within ~1 s, and after that nothing in the
    output directory changed for 2 s and no new temporary file appeared."""
    assert len(report["pool_workers"]) == 2, report  # the pool was running when it was killed
    assert report["still_running"] == [], report
    assert report["seconds_until_none_ran"] < 1.0, report
    assert report["changed_after"] == [], report
    assert report["tmp_2s_later"] == report["tmp_when_gone"], report
    # Once the parent has exited nothing more lands, but for the file operation each worker
    # was inside when the kernel killed it (until then, while the parent's memory is torn
    # down, jobs run on: nothing can reach them sooner).
    assert report["shards_at_parent_death"] <= report["shards_after"] <= report["shards_at_parent_death"] + 2, report


@pytest.mark.slow
def test_sigkilled_prebuild_leaves_no_worker_writing_and_resumes_byte_identical(tmp_path, tok_dir):
    # no dedup pass (it would start a pool of its own first): the packing jobs' pool is the subject
    cfg = own_config(tmp_path, tok_dir, 80_000, dedup={"exact": False, "near": False})
    out = tmp_path / "killed"
    common = ("--config", str(cfg), "--out", str(out), "--workers", "2", "--tokens-per-shard", str(TOKENS_PER_SHARD))

    # 1. Killed while the pool's workers are still starting (importing, before their
    #    initializer): they must notice the parent is gone and run no job at all.
    early = _probe(*common, "--kill-at", "startup")
    assert early["shards_at_kill"] == 0
    assert early["still_running"] == [] and early["changed_after"] == [], early
    assert early["seconds_until_none_ran"] < 3.0, early  # a worker reaching its initializer: interpreter start-up
    assert not (out / "train").exists() or not any((out / "train").iterdir()), sorted((out / "train").iterdir())

    # 2. Killed mid-build, with shards written and jobs running.
    mid = _probe(*common, "--kill-at", "10")
    _assert_nothing_ran_on(mid)
    assert 10 <= mid["shards_at_kill"] and not (out / "manifest.json").exists()

    # 3. The same command finishes the build, byte-identical to an uninterrupted one.
    done = subprocess.run([sys.executable, "-m", "stacklm", "prebuild", *common, "--no-progress"], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = tmp_path / "uninterrupted"
    prebuild(load_config(cfg)[0], tok_dir, expected, workers=2, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    got, want = tree(out), tree(expected)
    assert got.keys() == want.keys()
    assert [k for k in want if got[k] != want[k]] == []


def _write_as_orphan(path: str) -> None:
    """In a forked child: become a worker of this process, then find the parent changed (what a
    re-parented orphan sees where no death signal came, e.g. off Linux) and try to write."""
    from stacklm import atomic, parent_death

    parent_death.die_with_parent(os.getppid())
    assert not parent_death.orphaned()
    parent_death._watched = -1  # as if re-parented
    atomic.atomic_write_bytes(path, b"data")
    os._exit(0)  # not reached: the write exits first


def test_an_orphan_writes_nothing_where_no_signal_came(tmp_path):
    import multiprocessing as mp

    from stacklm import parent_death

    target = tmp_path / "shard_00000.tokens.bin"
    child = mp.get_context("fork").Process(target=_write_as_orphan, args=(str(target),))
    child.start()
    child.join(30)
    assert child.exitcode == parent_death.ORPHAN_EXIT_STATUS
    assert list(tmp_path.iterdir()) == []  # neither the file nor a temporary one
    assert not parent_death.orphaned()  # this process never called die_with_parent: never an orphan


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        kids = set(children(todo.pop())) - found
        found |= kids
        todo += kids
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_loader_workers_of_a_killed_process_stop_at_once(tmp_path, context):
    """Shards mode's loader workers (forked) and the stream modes' (forkserver, ``WorkerEnv``):
    SIGKILL the process that iterates, and within 1 s none of its workers runs (torch's own
    watchdog notices a forked worker's dead parent after up to 5 s, and never a forkserver
    worker's: it compares ``os.getppid()`` with the forkserver, which outlived the trainer)."""
    d = tmp_path / "train"
    d.mkdir()
    vocab, seq_len = 512, 32
    rows = np.random.default_rng(0).integers(3, vocab, size=(64, seq_len))
    rows[:, 0] = 1  # bos
    info = write_shard(d, 0, rows, token_dtype(vocab)).to_dict()
    mf.write_manifest(d, {"format": mf.FORMAT, "version": mf.VERSION, "split": "train", "seq_len": seq_len,
                          "dtype": dtype_name(token_dtype(vocab)), "vocab_size": vocab, "bos_id": 1, "eos_id": 2, "pad_id": 0,
                          "tokenizer_hash": "0" * 64, "shards": [info], "n_seq": len(rows)})
    proc = subprocess.Popen([sys.executable, str(PROBE), "loader", "--data", str(d), "--context", context], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", proc.stderr.read()[-3000:] if proc.poll() is not None else line
        everything = _descendants(proc.pid)
        helpers = {p for p in children(proc.pid) if "resource_tracker" in _cmdline(p) or "forkserver" in _cmdline(p)}
        workers = everything - helpers  # the forkserver's children are the workers there
        assert len(workers) == 2, (everything, helpers)
        assert len(helpers) >= (1 if context == "forkserver" else 0), helpers
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        while running(workers) and time.monotonic() - t0 < 10:
            time.sleep(0.002)
        took = time.monotonic() - t0
        assert running(workers) == [] and took < 1.0, (running(workers), took)
        # The forkserver used to wait on its workers forever (each holds its "alive" pipe); now
        # it ends once they have (its interpreter's shutdown with torch loaded takes a moment).
        while running(everything) and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        assert running(everything) == [], [(p, _cmdline(p)[:80]) for p in running(everything)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
