"""Streams of batches built on the fly: a rank's share of a node graph (pre-training) or of
the SFT pipeline, split across loader workers, each worker yielding a fixed batch count.

Every ``SUMMARY_EVERY_N_BATCHES`` batches a worker's summary of what it delivered rides on a
batch under ``SUMMARY_KEY`` (``StackDataLoader`` takes it off); ``merge_worker_summaries``
turns the latest ones into the ``data_stats`` protocol (``stacklm.callbacks``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from stacklm.data.contract import IGNORE_INDEX, contract_batch, contract_buffer, contract_planes
from stacklm.data.nodes import PipelineConfig
from stacklm.data.sources import ShardSpec

SUMMARY_KEY = "stacklm_summary"  # rides on a batch from a worker; the loader takes it off
SUMMARY_EVERY_N_BATCHES = 8


def merge_worker_summaries(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum the per-worker summaries into the ``data_stats`` protocol (``stacklm.callbacks``)."""
    realized: dict[str, dict[str, Any]] = {}
    dropped: dict[str, dict[str, dict[str, int]]] = {}
    pad = doc_tokens = 0
    for s in summaries:
        for src, row in s["realized"].items():
            out = realized.setdefault(src, {"tokens": 0, "docs": 0, "target_weight": row["target_weight"]})
            out["tokens"] += int(row["tokens"])
            out["docs"] += int(row["docs"])
        for stage, per_src in s["stats"].items():
            if stage == "tokenize":
                continue  # counts read-ahead, not delivery; the mix counts what was delivered
            for src, per_reason in per_src.items():
                for reason, n in per_reason.items():
                    if reason != "kept":
                        slot = dropped.setdefault(stage, {}).setdefault(src, {})
                        slot[reason] = slot.get(reason, 0) + int(n)
        pad += int(s["packing"].get("pad_tokens", 0))
        doc_tokens += int(s["packing"].get("doc_tokens", 0))
    total = sum(r["tokens"] for r in realized.values())
    for r in realized.values():
        r["realized_weight"] = r["tokens"] / total if total else 0.0
    return {"realized": realized, "dropped": dropped,
            "padding_fraction": pad / (pad + doc_tokens) if pad + doc_tokens else 0.0}


def _padding_batch(batch_size: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """A batch of padding rows that carries no loss (every target ``IGNORE_INDEX``)."""
    out = contract_buffer(batch_size, seq_len - 1)
    planes = contract_planes(out)
    planes.input_ids.fill(pad_id)
    planes.position_ids[:] = np.arange(seq_len - 1)
    planes.seq_ids.fill(0)
    planes.targets.fill(IGNORE_INDEX)
    return contract_batch(out)


class _StreamIterator:
    """One worker's stream: builds its node graph lazily, yields exactly ``n_batches``.

    Stateful (``state_dict``/``load_state_dict``) so ``StatefulDataLoader`` snapshots it in
    the worker and restores it there before iteration resumes. Every
    ``SUMMARY_EVERY_N_BATCHES`` batches (and with the last) a small summary of what the
    worker delivered rides on the batch under ``SUMMARY_KEY``; ``StackDataLoader`` takes it
    off, so logging stays fresh while the heavy state snapshots stay rare.
    """

    def __init__(self, dataset: "StreamDataset", shard: ShardSpec) -> None:
        self.ds = dataset
        self.shard = shard
        self.graph = None
        self.yielded = 0
        self.padded = 0

    def _graph(self):
        if self.graph is None:
            self.graph = self.ds.builder(self.shard)
        return self.graph

    def __iter__(self) -> "_StreamIterator":
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.yielded >= self.ds.n_batches:
            raise StopIteration
        graph = self._graph()
        try:
            batch = next(graph.batches)
        except StopIteration:
            if self.padded == 0:
                warnings.warn(
                    f"stacklm: the {self.ds.split} stream of rank {self.shard.rank} worker {self.shard.worker} ran dry after "
                    f"{self.yielded} of {self.ds.n_batches} batches; padding the rest with fully masked batches so "
                    "every rank takes the same number of steps. Give the mix more data or lower the token budget.",
                    stacklevel=2,
                )
            self.padded += 1
            pad = getattr(graph, "padding_batch", _padding_batch)  # a graph with its own batch keys pads with its own
            batch = pad(self.ds.batch_size, self.ds.seq_len, self.ds.pad_id)
        self.yielded += 1
        if self.yielded % SUMMARY_EVERY_N_BATCHES == 0 or self.yielded == self.ds.n_batches or self.padded == 1:
            batch = {**batch, SUMMARY_KEY: self.summary()}
        return batch

    def summary(self) -> dict[str, Any]:
        """What this worker delivered so far (cumulative; restored with the state on resume)."""
        graph = self._graph()
        return {"worker": self.shard.worker, "realized": graph.realized(), "stats": graph.stats(),
                "packing": graph.packing(), "padding_batches": self.padded}

    def state_dict(self) -> dict[str, Any]:
        return {"graph": self._graph().batches.state_dict(), "yielded": self.yielded, "padded": self.padded}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._graph().batches.reset(state["graph"])
        self.yielded = int(state["yielded"])
        self.padded = int(state["padded"])


class PipelineBuilder:
    """Picklable (spawned workers) factory of one reader's graph: the mix budget is split
    evenly over all readers (ranks x workers), each reading its own shard of the sources."""

    def __init__(self, config: dict[str, Any], tokenizer_path: str, split: str) -> None:
        self.config, self.tokenizer_path, self.split = config, tokenizer_path, split

    def __call__(self, shard: ShardSpec, n_readers: int, epoch: int = 0):
        from dataclasses import replace

        from stacklm.tokenizer.bpe import StackTokenizer

        cfg = PipelineConfig.from_dict(self.config)
        per_reader = replace(cfg.mix, total_tokens=max(1, cfg.mix.total_tokens // n_readers))
        return replace(cfg, mix=per_reader).build(StackTokenizer.load(self.tokenizer_path), split=self.split, shard=shard,
                                                  epoch=epoch)


class SFTBuilder:
    """Picklable factory of one reader's SFT graph (``stacklm.data.sft``)."""

    def __init__(self, config: dict[str, Any], tokenizer_path: str, split: str) -> None:
        self.config, self.tokenizer_path, self.split = config, tokenizer_path, split

    def __call__(self, shard: ShardSpec, n_readers: int, epoch: int = 0):  # one order every epoch (counted once)
        from stacklm.data.sft import SFTConfig
        from stacklm.tokenizer.bpe import StackTokenizer

        return SFTConfig.from_dict(self.config).build(StackTokenizer.load(self.tokenizer_path), split=self.split, shard=shard)


class StreamDataset(IterableDataset):
    """A rank's share of a node-graph stream, split across loader workers."""

    def __init__(
        self,
        build: Callable[[ShardSpec, int], Any],
        *,
        split: str,
        rank: int,
        world_size: int,
        n_batches_total: int,
        batch_size: int,
        seq_len: int,
        pad_id: int,
    ) -> None:
        self.build, self.split = build, split
        self.rank, self.world_size = rank, world_size
        self.n_batches_total = n_batches_total
        self.batch_size, self.seq_len, self.pad_id = batch_size, seq_len, pad_id
        self.n_batches = n_batches_total
        self.epoch = 0  # the pass over the data; set by the loader before its workers start

    def __len__(self) -> int:
        return self.n_batches_total

    def builder(self, shard: ShardSpec):
        return self.build(shard, shard.count, epoch=self.epoch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        # each worker yields an equal share; the loader interleaves them round-robin
        self.n_batches = self.n_batches_total // workers
        return _StreamIterator(self, ShardSpec(self.rank, self.world_size, worker, workers))
