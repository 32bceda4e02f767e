"""The packing stage as ``torchdata.nodes``: ``PackNode`` (windows, with their origins and the
token ledger's per-source counts, resumable exactly) and ``PackBatchNode`` (batches of them,
each carrying what it delivers per source, and with provenance its rows' pieces for the step
log). Kept apart from ``pack.py`` so the packers stay one job: placing tokens in windows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode, Batcher, Mapper

from stacklm.data.packing.origins import (
    WindowOrigin,
    content_by_source,
    delivery_counts,
)
from stacklm.data.packing.pack import DEFAULT_BUFFER_DOCS, Collate, make_packer


class PackNode(BaseNode[np.ndarray]):
    """Yields packed windows (int32 arrays of ``seq_len``) one at a time.

    State: the source's state, the packer's buffer (one concatenated token array + lengths +
    arrival numbers, or the partial greedy window), the windows completed but not yet yielded
    (one 2-D array) and the counters, so a restored node continues bit for bit.
    """

    SOURCE_KEY = "source"

    def __init__(
        self,
        source: BaseNode[dict],
        seq_len: int,
        strategy: str,
        bos_id: int,
        eos_id: int,
        pad_id: int,
        buffer_docs: int = DEFAULT_BUFFER_DOCS,
        sources: Sequence[str] | None = None,
        provenance: bool = False,
        refs=None,
    ) -> None:
        super().__init__()
        self.source = source
        self.packer = make_packer(strategy, seq_len, bos_id, eos_id, pad_id, buffer_docs, sources, provenance)
        self.packer.refs = refs  # a ``doc_refs.DocRefs``: the buffer is checkpointed by position
        self._ready: deque[np.ndarray] = deque()
        self._source_done = False
        self.last_origin: WindowOrigin | None = None  # of the window ``next`` returned last (tracking sources)
        # Tracking sources: per source index, [docs, document tokens] of the windows ``next``
        # returned (the token ledger's "emitted"; stacklm.data.ledger). In the state.
        self.emitted = np.zeros((0, 2), dtype=np.int64)
        # ... and of the windows a batcher then dropped (``drop_last``: never delivered)
        self.dropped_last = np.zeros((0, 2), dtype=np.int64)

    def _count_emitted(self, window: np.ndarray, origin: WindowOrigin, sign: int = 1) -> None:
        p = self.packer
        n = len(p.sources)
        if len(self.emitted) < n:
            self.emitted = np.vstack([self.emitted, np.zeros((n - len(self.emitted), 2), dtype=np.int64)])
        self.emitted[:, 1] += sign * content_by_source(window, origin.origin, n, p.bos_id, p.eos_id)
        for src, _ in origin.starts:
            self.emitted[src, 0] += sign

    def count_dropped(self, windows: Sequence[np.ndarray], origins: Sequence[WindowOrigin]) -> None:
        """Windows ``next`` returned that the batcher dropped (an incomplete last batch with
        ``drop_last``): moved from ``emitted`` to ``dropped_last``, so the ledger says so."""
        before = self.emitted.copy()
        for window, origin in zip(windows, origins):
            self._count_emitted(window, origin, sign=-1)
        if len(self.dropped_last) < len(self.emitted):
            self.dropped_last = np.vstack([self.dropped_last, np.zeros((len(self.emitted) - len(self.dropped_last), 2), np.int64)])
        self.dropped_last += before - self.emitted

    def dropped_by_source(self) -> dict[str, list[int]]:
        return {name: [int(x) for x in self.dropped_last[i]] for i, name in enumerate(self.packer.sources)
                if i < len(self.dropped_last) and self.dropped_last[i].any()}

    def buffered(self) -> dict[str, list[int]]:
        """Per source name ``[docs, document tokens]`` pushed into the packer but not returned by
        ``next`` yet (its buffer, and windows completed but not yielded)."""
        p = self.packer
        per = p.buffered()
        for window, origin in zip(self._ready, p.origins):
            for src, _ in origin.starts:
                per.setdefault(src, [0, 0])[0] += 1
            for src, n in enumerate(content_by_source(window, origin.origin, len(p.sources), p.bos_id, p.eos_id).tolist()):
                if n:
                    per.setdefault(src, [0, 0])[1] += n
        return {p.sources[i]: v for i, v in per.items()}

    def emitted_by_source(self) -> dict[str, list[int]]:
        return {name: [int(x) for x in self.emitted[i]] if i < len(self.emitted) else [0, 0]
                for i, name in enumerate(self.packer.sources)}

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._ready = deque()
        self.emitted = np.zeros((0, 2), dtype=np.int64)
        self.dropped_last = np.zeros((0, 2), dtype=np.int64)
        if initial_state is None:
            self.source.reset()
            self.packer.reset()
            self._source_done = False
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        self.packer.load_state(initial_state["packer"])
        self._ready.extend(np.asarray(initial_state["ready"], dtype=np.int32).copy())
        self._source_done = bool(initial_state["source_done"])
        if "emitted" in initial_state:
            self.emitted = np.asarray(initial_state["emitted"], dtype=np.int64).reshape(-1, 2).copy()
        if "dropped_last" in initial_state:
            self.dropped_last = np.asarray(initial_state["dropped_last"], dtype=np.int64).reshape(-1, 2).copy()

    def next(self) -> np.ndarray:
        while not self._ready:
            if self._source_done:
                raise StopIteration
            try:
                doc = next(self.source)
            except StopIteration:
                self._source_done = True
                self._ready.extend(self.packer.finish())
                continue
            self._ready.extend(self.packer.push(doc))
        window = self._ready.popleft()
        if self.packer.track_sources:  # the packer's origins queue runs in step with _ready
            self.last_origin = self.packer.origins.popleft()
            self._count_emitted(window, self.last_origin)
        return window

    def get_state(self) -> dict[str, Any]:
        ready = np.stack(self._ready) if self._ready else np.zeros((0, self.packer.seq_len), dtype=np.int32)
        if ready.size and ready.min() >= 0 and ready.max() <= np.iinfo(np.uint16).max:
            ready = ready.astype(np.uint16)  # vocab <= 65536: half the bytes (reset reads it back as int32)
        out = {
            self.SOURCE_KEY: self.source.state_dict(),
            "packer": self.packer.state(),
            "ready": ready,
            "source_done": self._source_done,
        }
        if self.packer.track_sources:
            out["emitted"] = self.emitted.copy()
            if len(self.dropped_last):
                out["dropped_last"] = self.dropped_last.copy()
        return out

    def summary(self) -> dict[str, Any]:
        return self.packer.summary()


DELIVERY_KEY = "stacklm_delivery"  # rides on a stream batch to the main process's loader, which takes it off


class PackBatchNode(BaseNode[dict]):
    """Batches of ``batch_size`` windows from a source-tracking ``PackNode``, collated to the batch
    contract, each carrying ``delivery_counts`` of its windows under ``DELIVERY_KEY``.

    Why the counts ride on the batch: only the batch knows what it delivers. A worker's own
    counters run ahead by its shuffle and pack buffers and the loader's prefetch, so the main
    process counts these when the batch reaches the training step
    (``stacklm.datamodule.delivery``), and takes the key off before the model sees the batch.
    State: the pack node's (this node holds nothing between batches).
    """

    PACK_KEY = "pack"

    def __init__(self, pack_node: PackNode, batch_size: int, drop_last: bool = True, collate=None, planes: str = "full") -> None:
        super().__init__()
        if not pack_node.packer.track_sources:
            raise ValueError("PackBatchNode needs a PackNode built with sources=[...] (it counts tokens per source)")
        self.pack, self.batch_size, self.drop_last = pack_node, int(batch_size), bool(drop_last)
        p = pack_node.packer
        # ``collate``: windows -> batch contract (the SFT graph passes its loss-aware one), in ``planes``
        self.collate = collate if collate is not None else Collate(p.bos_id, p.eos_id, p.pad_id, planes)

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self.pack.reset(initial_state[self.PACK_KEY] if initial_state is not None else None)

    def next(self) -> dict:
        windows, origins = [], []
        while len(windows) < self.batch_size:
            try:
                windows.append(next(self.pack))
            except StopIteration:
                break
            origins.append(self.pack.last_origin)
        if not windows or (self.drop_last and len(windows) < self.batch_size):
            if windows:  # kept by the mix, never delivered: the ledger counts them (stacklm.data.ledger)
                self.pack.count_dropped(windows, origins)
            raise StopIteration
        batch = self.collate(windows)
        p = self.pack.packer
        batch[DELIVERY_KEY] = delivery_counts(origins, len(p.sources), windows if p.provenance else None)
        return batch

    def get_state(self) -> dict[str, Any]:
        return {self.PACK_KEY: self.pack.state_dict()}


def batch_node(pack_node: PackNode, batch_size: int, drop_last: bool = True, planes: str = "full") -> BaseNode[dict[str, Any]]:
    """A node of batch-contract dicts (the four planes or the lean ones, ``planes``):
    ``PackBatchNode`` (with delivery counts) over a source-tracking pack node, else ``Batcher`` +
    ``Collate`` (state handled by the torchdata nodes)."""
    if pack_node.packer.track_sources:
        return PackBatchNode(pack_node, batch_size, drop_last, planes=planes)
    p = pack_node.packer
    return Mapper(Batcher(pack_node, batch_size, drop_last=drop_last), Collate(p.bos_id, p.eos_id, p.pad_id, planes))
