"""Run by tests/datamodule/test_loader_workers.py as a real program: a training script's shape (it
imports Lightning at its top) with a stream loader of 2 workers, twice.

1. ``worker_probe.ThenProbe`` (defined outside this script): each worker writes whether it holds
   Lightning to ``<out>/plain<w>``. It must not: nothing it unpickles lives in ``__main__``.
2. ``FromMain`` (defined here, so unpickling it needs this script): each worker writes the same to
   ``<out>/main<w>``, and that it ran. The script runs in the worker (as ``__mp_main__``, the way
   ``multiprocessing`` runs it) when the name is looked up, so it does hold Lightning then.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning  # noqa: E402,F401  (a training script's top)
import torch  # noqa: E402

from stacklm.datamodule import StackDataModule  # noqa: E402
from tests.helpers.datamodule import SEQ_LEN, stream_pipeline  # noqa: E402
from tests.helpers.worker_probe import ThenProbe  # noqa: E402


class FromMain:
    def __init__(self, first, out: str) -> None:
        self.first, self.out = first, out

    def __call__(self, worker_id: int) -> None:
        self.first(worker_id)
        with open(f"{self.out}{worker_id}", "w") as f:
            json.dump({"lightning": "lightning" in sys.modules, "ran": True}, f)


def main() -> None:
    tokenizer, out = sys.argv[1], Path(sys.argv[2])
    os.environ["STACKLM_TEST_PROBE"] = str(out / "plain")
    dm = StackDataModule(mode="stream", tokenizer=tokenizer, pipeline=stream_pipeline(), seq_len=SEQ_LEN, batch_size=2,
                         num_workers=2, val_batches=0, step_log=False)
    dm.setup("fit")
    loader = dm.train_dataloader()
    loader.worker_init_fn = ThenProbe(loader.worker_init_fn)
    first = next(iter(loader))
    loader = dm.train_dataloader()
    loader.worker_init_fn = FromMain(loader.worker_init_fn, str(out / "main"))
    again = next(iter(loader))
    assert first.keys() == again.keys() and all(  # tensors, and a lean batch's host ints
        torch.equal(first[k], again[k]) if isinstance(first[k], torch.Tensor) else first[k] == again[k] for k in first
    ), "the same first batch either way"
    print("ok")


if __name__ == "__main__":
    main()
