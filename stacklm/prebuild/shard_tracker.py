"""A prebuild job's accounting beside its shard writer (``ShardTracker``): what each written
window delivers per source, and each shard's provenance side file.

Here, not in ``stacklm.data.storage.provenance``: it reads a packer's window origins
(``stacklm.data.packing.origins``) and writes the side files that module defines, so in
storage it closed a circle (storage -> packing -> storage); only the prebuild writers (``jobs``
and the datatrove writer in ``stacklm.scale``) use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data.packing.origins import content_by_source
from stacklm.data.storage.provenance import encode_rows, prov_path
from stacklm.data.storage.shards import atomic_write_shard_file


class ShardTracker:
    """Sits next to the shard writer of a prebuild job: counts what each written window
    delivers per source (the ledger's ``delivered``: documents where their ``<bos>`` is,
    document tokens) and, with ``provenance``, collects each row's pieces and writes the
    shard's side file right before the shard itself. Its state (the counts) goes into the job's
    checkpoint; the pieces never need to, since a checkpoint is taken only after a shard."""

    def __init__(self, pack_node, provenance: bool) -> None:
        self.pack = pack_node
        self.provenance = bool(provenance)
        self.delivered = np.zeros((len(pack_node.packer.sources), 2), dtype=np.int64)
        self.rows: list[list[tuple[int, ...]]] = []
        self.bytes = 0  # side-file bytes written by this job (this run)

    def window(self, window: np.ndarray) -> None:
        origin = self.pack.last_origin  # stacklm.data.packing.origins.WindowOrigin
        p = self.pack.packer
        n = len(p.sources)
        if len(self.delivered) < n:
            self.delivered = np.vstack([self.delivered, np.zeros((n - len(self.delivered), 2), np.int64)])
        self.delivered[:, 1] += content_by_source(window, origin.origin, n, p.bos_id, p.eos_id)
        for src, _ in origin.starts:
            self.delivered[src, 0] += 1
        if self.provenance:
            self.rows.append(origin.pieces)

    def commit(self, split_dir: Path, name: str) -> None:
        if self.provenance:
            data = encode_rows(self.rows)
            atomic_write_shard_file(prov_path(split_dir, name), data, fsync_parent=False)
            self.bytes += len(data)
        self.rows = []

    def delivered_by_source(self) -> dict[str, list[int]]:
        return {s: [int(x) for x in self.delivered[i]] if i < len(self.delivered) else [0, 0]
                for i, s in enumerate(self.pack.packer.sources)}

    def state(self) -> dict[str, Any]:
        return {"delivered": self.delivered.tolist()}

    def load_state(self, state: Mapping[str, Any] | None) -> None:
        if state:
            self.delivered = np.asarray(state["delivered"], dtype=np.int64).reshape(-1, 2)
