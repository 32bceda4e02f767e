"""A stream loader's workers go away when its iteration is closed, not at a later garbage collection.

The stream loader keeps its last ``DataLoader`` iterator (``_iterator``), and it is held in
a reference cycle with its datamodule, so the workers of an iteration a custom training loop
(or a benchmark, or a notebook) stops early used to live on until whichever garbage collection
came next — which then stalled ~5 s per worker while they were joined (10 s with 2 workers,
measured; Lightning itself drops the iterator and is not affected)."""

from __future__ import annotations

import gc

from stacklm.datamodule import StackDataModule
from tests.helpers.lightning import batch_hash
from tests.helpers.datamodule import SEQ_LEN, stream_pipeline


def _loader(tokenizer_dir):  # noqa: F811
    dm = StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=stream_pipeline(), seq_len=SEQ_LEN, batch_size=2,
                         num_workers=2, val_batches=0, step_log=False)
    dm.setup("fit")
    return dm.train_dataloader()


def test_a_closed_stream_iteration_releases_its_workers_and_keeps_its_state(tokenizer_dir):  # noqa: F811
    gc.disable()  # no collection may clean up for us
    try:
        loader = _loader(tokenizer_dir)
        batches = iter(loader)
        seen = [batch_hash(next(batches)) for _ in range(3)]
        workers = list(loader._iterator._workers)
        assert len(workers) == 2 and all(w.is_alive() for w in workers)
        batches.close()  # a custom loop stops early (or drops the iterator)
        for w in workers:
            w.join(timeout=2.0)  # told to stop, a worker exits in milliseconds
            assert not w.is_alive()
        state = loader.state_dict()  # still the position after the 3 batches taken
    finally:
        gc.enable()
    resumed = _loader(tokenizer_dir)
    resumed.load_state_dict(state)
    reference = _loader(tokenizer_dir)
    want = [batch_hash(b) for _, b in zip(range(5), reference)]
    assert seen == want[:3]
    assert [batch_hash(b) for _, b in zip(range(2), resumed)] == want[3:5]


def test_a_scripts_loader_workers_skip_its_imports_unless_they_need_its_names(tokenizer_dir, tmp_path):  # noqa: F811
    """A training script imports Lightning at its top; ``multiprocessing`` re-runs the main script
    in every forkserver worker, which cost each stream worker ~6 CPU-s before its first batch.
    ``stacklm.datamodule.lazy_main``: a worker runs the script only when it unpickles a name the
    script defines (then it must, and does), so a plain worker holds no Lightning."""
    import json
    import os
    import sys
    from pathlib import Path

    from tests.helpers.lightning import run_program

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    res = run_program([sys.executable, str(root / "tests" / "runners" / "worker_main_probe.py"), str(tokenizer_dir), str(tmp_path)],
                      cwd=root, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    plain = [json.loads((tmp_path / f"plain{w}").read_text()) for w in range(2)]
    assert plain == [{"lightning": False, "lightning.pytorch": False, "wandb": False}] * 2, plain
    from_main = [json.loads((tmp_path / f"main{w}").read_text()) for w in range(2)]
    assert from_main == [{"lightning": True, "ran": True}] * 2, from_main
