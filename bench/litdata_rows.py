"""The same train rows as a litdata set, for the benchmarks that compare with litdata
(``bench/loader.py``, ``bench/startup.py``). litdata is a bench-only dependency; nothing in
``stacklm`` imports it. Install it into the dev environment without its dependencies'
resolution, ``pip install --no-deps litdata==0.2.76 obstore tifffile``: a plain ``pip install
litdata`` also pulls a torchvision built for another torch, and with it installed
``import transformers`` (hence Lightning's imports here) fails with "operator torchvision::nms
does not exist" (seen on this project's torch 2.13 CPU).

Each row of a ``PackedMemmapDataset`` becomes one litdata item (a uint16 tensor of ``seq_len``
tokens) written by ``litdata.optimize`` with ``TokensLoader``, so ``StreamingDataset(...,
item_loader=TokensLoader(block_size=seq_len))`` item ``i`` is row ``i`` of the shard set.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path


def _rows_of(args):
    """litdata optimize's fn: one shard file's rows, each a uint16 tensor of ``seq_len`` tokens."""
    import numpy as np
    import torch

    path, n_rows, seq_len = args
    rows = np.fromfile(path, dtype=np.uint16).reshape(n_rows, seq_len)
    for row in rows:
        yield torch.from_numpy(row.copy())


def write_litdata(out: Path, shards: Path) -> Path:
    """Write the ``train`` rows of the shard set under ``shards`` to ``out`` (litdata's format)."""
    from litdata import optimize
    from litdata.streaming.item_loader import TokensLoader

    from stacklm.data.storage.dataset import PackedMemmapDataset
    from stacklm.data.storage.shards import tokens_path

    ds = PackedMemmapDataset(shards, "train", verify_content=False)
    assert ds.dtype.itemsize == 2, "litdata rows are written as uint16"
    inputs = [(str(tokens_path(ds.path, n)), int(r), ds.seq_len) for n, r in zip(ds.shard_names, ds.shard_rows)]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        optimize(fn=_rows_of, inputs=inputs, output_dir=str(out), chunk_bytes="64MB", item_loader=TokensLoader(),
                 num_workers=1, start_method="fork")
    return out
