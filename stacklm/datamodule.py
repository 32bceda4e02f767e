"""``StackDataModule``: what users hand to ``trainer.fit``.

Modes, one batch contract (``input_ids``, ``position_ids``, ``seq_ids``, ``targets``):
- ``shards``: a prebuilt directory (``stacklm prebuild``) read through memmaps, in one global
  seeded permutation per epoch sliced by rank and worker; the loader state is
  (seed, epoch, samples consumed globally), so resume is O(1) and elastic.
- ``stream``: the on-the-fly node graph (``stacklm.data.nodes``) straight from the sources;
  each (rank, worker) builds its own graph over its shard of the documents.
- ``sft``: chat conversations rendered and packed by ``stacklm.data.sft``.

Loaders are ``torchdata``'s ``StatefulDataLoader`` (or a thin elastic wrapper in shards
mode): Lightning stores their ``state_dict()`` in the checkpoint and restores it, so a resumed
fit sees exactly the batches the uninterrupted run would have.

DDP: every rank must yield the same number of batches or the last collective hangs. Shards
mode slices the permutation into equal per-rank parts; stream/sft modes give each (rank,
worker) an equal token budget and a fixed batch count (``batches_per_worker``), padding a
stream that runs dry with fully masked batches (counted and warned, never silent).
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from stacklm.data.nodes import PipelineConfig, build_pipeline
from stacklm.data.sources import ShardSpec
from stacklm.errors import ConfigError

MODES = ("shards", "stream", "sft")
DEFAULT_SNAPSHOT_STEPS = 1000  # without a step checkpoint interval to follow; see StackDataModule
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


class DataConfigError(ConfigError):
    """The data set-up does not fit the model or the checkpoint; raised before any step."""


def _padding_batch(batch_size: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    t = seq_len - 1
    return {
        "input_ids": torch.full((batch_size, t), pad_id, dtype=torch.long),
        "position_ids": torch.arange(t, dtype=torch.long).expand(batch_size, t).clone(),
        "seq_ids": torch.zeros((batch_size, t), dtype=torch.long),
        "targets": torch.full((batch_size, t), -100, dtype=torch.long),
    }


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
            batch = _padding_batch(self.ds.batch_size, self.ds.seq_len, self.ds.pad_id)
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


_ND = "__ndarray__"


def to_checkpoint_safe(obj: Any) -> Any:
    """numpy arrays/scalars -> tensors/ints, so the loader state loads with ``torch.load``'s
    default ``weights_only=True`` (a checkpoint must not need pickle trust to resume)."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return {_ND: torch.from_numpy(np.ascontiguousarray(obj).copy())}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: to_checkpoint_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_checkpoint_safe(v) for v in obj)
    return obj


def from_checkpoint_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and _ND in obj:
            return obj[_ND].numpy()
        return {k: from_checkpoint_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_checkpoint_safe(v) for v in obj)
    return obj


def _dist() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def gather_from_ranks(state: Any) -> list[Any]:
    """Every rank's loader state, on every rank.

    Lightning writes the checkpoint from rank 0 only, but each rank's stream position is its
    own; ``dump_checkpoint`` runs on all ranks, so gathering here puts all of them in the file.
    """
    rank, world = _dist()
    if world == 1:
        return [state]
    import pickle

    # pre-pickled numpy/plain containers (tensor pickling across processes is fragile here)
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, pickle.dumps(state))
    return [pickle.loads(b) for b in out]


def pick_rank_state(per_rank: list[Any], mode: str) -> Any:
    rank, world = _dist()
    if len(per_rank) != world:
        raise DataConfigError(
            f"refusing to resume: the checkpoint's {mode}-mode loader state is from {len(per_rank)} rank(s) but this run "
            f"has {world}. A stream's position is per rank; resume with the same number of devices (shards mode "
            "resumes on any world size)."
        )
    return per_rank[rank]


class StackDataLoader(StatefulDataLoader):
    """``StatefulDataLoader`` whose checkpoint state is per rank and weights_only-safe.

    Its dataset has a length, so Lightning's fit loop does not fetch ahead: the state at a
    checkpoint is exactly "after the batches trained on". Under DDP, Lightning writes the
    checkpoint from rank 0 only, so every rank's state is gathered into it (each rank reads a
    different part of the stream) and each rank restores its own.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker_summaries: dict[int, dict[str, Any]] = {}  # worker id -> its latest summary

    def __iter__(self) -> Iterator[Any]:
        for batch in super().__iter__():
            if isinstance(batch, dict) and SUMMARY_KEY in batch:
                batch = dict(batch)
                summary = batch.pop(SUMMARY_KEY)
                self.worker_summaries[summary["worker"]] = summary
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"per_rank": to_checkpoint_safe(gather_from_ranks(super().state_dict()))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(from_checkpoint_safe(pick_rank_state(state_dict["per_rank"], "stream")))


class _IndexBatches(torch.utils.data.Sampler):
    """Feeds a ``DataLoader`` whole index batches from an ``ElasticSampler`` (main process)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        return self.sampler.batches()


class _BatchFetch:
    """Picklable ``dataset[indices] -> batch`` for loader workers."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, indices):
        return self.dataset.get_batch(indices)


class ShardsLoader:
    """Shards-mode loader: this rank's slice of one global seeded permutation per epoch.

    The state is ``ElasticSampler``'s ``(seed, epoch, consumed)`` as of the batches the
    consumer has taken, so resume is
    O(1) and may change world size, batch size or worker count. It has a length, so Lightning
    does not fetch ahead of the step it trains. Every rank yields the same
    number of batches per epoch: the epoch's tail shorter than one global step (``< world x
    batch`` rows) is not served that epoch and is counted in ``elastic.dropped_tail``; the next
    epoch is a fresh permutation, so no row is starved across epochs.
    """

    def __init__(self, dataset, sampler, num_workers: int = 0) -> None:
        self.dataset, self.elastic = dataset, sampler  # not ".sampler": Lightning would probe it as a DataLoader's
        self.num_workers = num_workers
        self._taken = 0
        self.batches_yielded = 0
        self.samples_yielded = 0

    def __len__(self) -> int:
        """Steps in a *whole* epoch at this shape: Lightning subtracts the steps it has already
        done when it resumes mid-epoch (the iterator itself serves only what is left, and
        ends early if a resume changed the shape)."""
        return self.elastic.num_samples // self.elastic.step_size

    def __iter__(self):
        loader = torch.utils.data.DataLoader(
            _BatchFetch(self.dataset), batch_size=None, sampler=_IndexBatches(self.elastic), num_workers=self.num_workers,
        )
        self._taken = 0
        for batch in loader:
            self._taken += 1
            self.batches_yielded += 1
            self.samples_yielded += int(batch["input_ids"].shape[0])
            yield batch

    def state_dict(self) -> dict[str, Any]:
        # counted here, not in the sampler: the DataLoader's own prefetching runs the sampler
        # ahead of what the consumer has taken
        return {"sampler": self.elastic.state_after(self._taken)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.elastic.load_state_dict(state["sampler"])


class _PipelineBuilder:
    """Picklable (spawned workers) factory of one reader's graph: the mix budget is split
    evenly over all readers (ranks x workers), each reading its own shard of the sources."""

    def __init__(self, config: dict[str, Any], tokenizer_path: str, split: str) -> None:
        self.config, self.tokenizer_path, self.split = config, tokenizer_path, split

    def __call__(self, shard: ShardSpec, n_readers: int):
        from dataclasses import replace

        from stacklm.tokenizer.bpe import StackTokenizer

        cfg = PipelineConfig.from_dict(self.config)
        per_reader = replace(cfg.mix, total_tokens=max(1, cfg.mix.total_tokens // n_readers))
        return build_pipeline(replace(cfg, mix=per_reader), StackTokenizer.load(self.tokenizer_path), split=self.split, shard=shard)


class _SFTBuilder:
    """Picklable factory of one reader's SFT graph (``stacklm.data.sft``)."""

    def __init__(self, config: dict[str, Any], tokenizer_path: str, split: str) -> None:
        self.config, self.tokenizer_path, self.split = config, tokenizer_path, split

    def __call__(self, shard: ShardSpec, n_readers: int):
        from stacklm.data.sft import SFTConfig, build_sft_pipeline
        from stacklm.tokenizer.bpe import StackTokenizer

        return build_sft_pipeline(SFTConfig.from_dict(self.config), StackTokenizer.load(self.tokenizer_path),
                                  split=self.split, shard=shard)


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

    def __len__(self) -> int:
        return self.n_batches_total

    def builder(self, shard: ShardSpec):
        return self.build(shard, shard.count)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        # each worker yields an equal share; the loader interleaves them round-robin
        self.n_batches = self.n_batches_total // workers
        return _StreamIterator(self, ShardSpec(self.rank, self.world_size, worker, workers))


class StackDataModule(L.LightningDataModule):
    """Lightning data module over stacklm's shards, streams or SFT conversations.

    Args:
        mode: ``"shards"``, ``"stream"`` or ``"sft"``.
        tokenizer: path of the tokenizer artifact (dir or ``tokenizer.stacklm.json``).
        data_dir: prebuilt shard directory (``shards`` mode).
        pipeline: the stream pipeline config as a dict (``stream`` mode; see ``PipelineConfig``),
            or the SFT config (``sft`` mode).
        seq_len, batch_size, num_workers, seed: as usual; ``seq_len`` counts the window before
            the next-token shift (batches are ``seq_len - 1`` wide).
        val_batches: validation batches per rank (stream/sft); ``None`` = from the holdout budget
            (stream) or a counting pass (sft); ``0`` disables validation.
        train_batches: sft mode: training batches per rank per epoch; ``None`` = a counting pass.
        snapshot_every_n_steps: how often loader workers send their state to the main process.
            A snapshot copies the shuffle buffer and the dedup indexes (~190 MB per million
            documents), and ``StatefulDataLoader`` takes ``3 x num_workers + 1`` of them (prefetch 2)
            around each multiple of this interval, so it must be rare. A resume replays at most
            this many batches from the last snapshot, deterministically (still exact).
            ``None`` (default): the trainer's step checkpoint interval
            (``ModelCheckpoint(every_n_train_steps=N)``), so a resume replays nothing; else
            ``DEFAULT_SNAPSHOT_STEPS``.
    """

    def __init__(
        self,
        mode: str = "shards",
        tokenizer: str | None = None,
        data_dir: str | None = None,
        pipeline: dict[str, Any] | None = None,
        seq_len: int = 2048,
        batch_size: int = 8,
        num_workers: int = 0,
        seed: int = 0,
        val_batches: int | None = None,
        train_batches: int | None = None,
        snapshot_every_n_steps: int | None = None,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise DataConfigError(f"StackDataModule: mode must be one of {MODES}, got {mode!r}")
        if tokenizer is None:
            raise DataConfigError("StackDataModule: pass tokenizer=<path to the tokenizer artifact directory>")
        if mode == "shards" and data_dir is None:
            raise DataConfigError("StackDataModule(mode='shards'): pass data_dir=<prebuilt shard directory>")
        if mode in ("stream", "sft") and pipeline is None:
            raise DataConfigError(f"StackDataModule(mode={mode!r}): pass pipeline=<config dict>")
        if snapshot_every_n_steps is not None and int(snapshot_every_n_steps) < 1:
            raise DataConfigError(
                f"StackDataModule: snapshot_every_n_steps must be >= 1 (or None to follow the checkpoint interval), "
                f"got {snapshot_every_n_steps}"
            )
        self.save_hyperparameters()
        self.mode = mode
        self.tokenizer_path = tokenizer
        self.data_dir = data_dir
        self.pipeline_dict = dict(pipeline or {})
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.val_batches = val_batches
        self.train_batches = train_batches
        self.snapshot_every_n_steps = snapshot_every_n_steps
        self._tok = None
        self._train_loader = None
        self._val_loader = None
        self._rank, self._world = 0, 1

    # ------------------------------------------------------------------ shared facts
    @property
    def tokenizer(self):
        if self._tok is None:
            from stacklm.tokenizer.bpe import StackTokenizer

            self._tok = StackTokenizer.load(self.tokenizer_path)
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def tokenizer_hash(self) -> str:
        """Content hash of the tokenizer (ids, not training metadata): the one manifests carry."""
        from stacklm.data.manifest import tokenizer_hash

        return tokenizer_hash(self.tokenizer)

    def pipeline_config(self) -> PipelineConfig:
        d = dict(self.pipeline_dict)
        d.setdefault("seq_len", self.seq_len)
        d.setdefault("batch_size", self.batch_size)
        d.setdefault("seed", self.seed)
        cfg = PipelineConfig.from_dict(d)
        if cfg.seq_len != self.seq_len or cfg.batch_size != self.batch_size:
            raise DataConfigError(
                f"StackDataModule: pipeline seq_len/batch_size ({cfg.seq_len}/{cfg.batch_size}) differ from the module's "
                f"({self.seq_len}/{self.batch_size}); set them in one place"
            )
        return cfg

    def data_config_hash(self) -> str:
        if self.mode == "sft":
            return self.sft_config().config_hash()
        if self.mode == "shards":
            return hashlib.sha256(f"shards:{Path(self.data_dir).resolve()}:{self.seq_len}:{self.batch_size}:{self.seed}".encode()).hexdigest()
        return self.pipeline_config().config_hash()

    # ------------------------------------------------------------------ lightning hooks
    def setup(self, stage: str | None = None) -> None:
        trainer = getattr(self, "trainer", None)
        if trainer is not None:
            self._rank, self._world = trainer.global_rank, trainer.world_size

    def _stream_dataset(self, split: str) -> StreamDataset:
        cfg = self.pipeline_config()
        tok = self.tokenizer
        world = self._world
        if split == "train":
            budget = cfg.mix.total_tokens
            n_total = budget // (world * cfg.batch_size * cfg.seq_len)
        else:
            budget = max(1, round(cfg.mix.total_tokens * cfg.holdout_fraction))
            n_total = self.val_batches if self.val_batches is not None else budget // (world * cfg.batch_size * cfg.seq_len)
        if n_total < 1:
            raise DataConfigError(
                f"StackDataModule: the {split} token budget ({budget:,} tokens) gives zero batches of "
                f"{cfg.batch_size} x {cfg.seq_len} tokens on {world} rank(s); raise mix.total_tokens"
                + (" or holdout_fraction, or set val_batches" if split == "val" else "")
            )
        workers = max(1, self.num_workers)
        n_total = max(workers, n_total // workers * workers)  # equal share per worker
        build = _PipelineBuilder(cfg.to_dict(), self.tokenizer_path, split)
        return StreamDataset(
            build, split=split, rank=self._rank, world_size=world, n_batches_total=n_total,
            batch_size=cfg.batch_size, seq_len=cfg.seq_len, pad_id=tok.pad_id,
        )

    def _loader(self, dataset) -> StackDataLoader:
        return StackDataLoader(
            dataset,
            batch_size=None,
            num_workers=self.num_workers,
            persistent_workers=False,
            snapshot_every_n_steps=self.snapshot_interval(),
        )

    def snapshot_interval(self) -> int:
        """Steps between worker state snapshots (see ``snapshot_every_n_steps``)."""
        if self.snapshot_every_n_steps is not None:
            return int(self.snapshot_every_n_steps)
        trainer = getattr(self, "trainer", None)
        steps = [getattr(cb, "_every_n_train_steps", 0) or 0 for cb in (trainer.checkpoint_callbacks if trainer else [])]
        steps = [n for n in steps if n > 0]
        return min(steps) if steps else DEFAULT_SNAPSHOT_STEPS

    def train_dataloader(self):
        if self.mode == "stream":
            self._train_loader = self._loader(self._stream_dataset("train"))
        elif self.mode == "shards":
            self._train_loader = self._shards_loader("train")
        else:
            self._train_loader = self._sft_loader("train")
        return self._train_loader

    def val_dataloader(self):
        if self.val_batches == 0:
            return []
        if self.mode == "stream":
            return self._loader(self._stream_dataset("val"))
        if self.mode == "shards":
            return self._shards_loader("val")
        return self._sft_loader("val")

    def shards_dataset(self, split: str):
        from stacklm.data.dataset import PackedMemmapDataset

        ds = PackedMemmapDataset(self.data_dir, split, tokenizer=self.tokenizer)
        if ds.seq_len != self.seq_len:
            raise DataConfigError(
                f"StackDataModule: {ds.path} was built with seq_len {ds.seq_len} but the module has seq_len {self.seq_len}; "
                "use the same seq_len or rebuild the shards"
            )
        return ds

    def _shards_loader(self, split: str):
        from stacklm.data.dataset import ElasticSampler

        ds = self.shards_dataset(split)
        sampler = ElasticSampler(
            ds, self.batch_size, seed=self.seed, rank=self._rank, world_size=self._world,
            shuffle=split == "train", loop=False, drop_last=True,
        )
        if len(sampler) == 0:
            raise DataConfigError(
                f"StackDataModule: {ds.path} has {len(ds)} sequences, fewer than one global batch of "
                f"{self._world} rank(s) x {self.batch_size}; lower batch_size or build more data"
            )
        return ShardsLoader(ds, sampler, num_workers=self.num_workers)

    def sft_config(self):
        from stacklm.data.sft import SFTConfig

        d = dict(self.pipeline_dict)
        d.setdefault("seq_len", self.seq_len)
        d.setdefault("batch_size", self.batch_size)
        d.setdefault("seed", self.seed)
        return SFTConfig.from_dict(d)

    def _sft_loader(self, split: str):
        """Conversations have no token budget, so the per-worker batch count comes from a
        counting pass over every (rank, worker) reader (identical on every rank); readers
        that run dry earlier pad with fully masked batches so all ranks step together."""
        cfg = self.sft_config()
        build = _SFTBuilder(cfg.to_dict(), self.tokenizer_path, split)
        workers = max(1, self.num_workers)
        fixed = self.train_batches if split == "train" else self.val_batches
        if fixed is not None:
            per_worker = max(1, fixed // workers)
        else:
            counts = [
                sum(1 for _ in build(ShardSpec(r, self._world, w, workers), self._world * workers).batches)
                for r in range(self._world)
                for w in range(workers)
            ]
            per_worker = max(counts)
            if per_worker == 0:
                raise DataConfigError(f"StackDataModule(mode='sft'): the {split} split yields no batches; check the sources")
        ds = StreamDataset(
            build, split=split, rank=self._rank, world_size=self._world, n_batches_total=per_worker * workers,
            batch_size=cfg.batch_size, seq_len=cfg.seq_len, pad_id=self.tokenizer.pad_id,
        )
        return self._loader(ds)

    # ------------------------------------------------------------------ logging protocol
    def data_stats(self) -> dict[str, Any]:
        """This rank's cumulative data numbers for ``stacklm.callbacks.DataStatsCallback``."""
        out: dict[str, Any] = {"hashes": dict(self.hashes)}
        loader = self._train_loader
        if loader is not None and self.mode in ("stream", "sft"):
            if loader.worker_summaries:
                out.update(merge_worker_summaries(list(loader.worker_summaries.values())))
        elif loader is not None and self.mode == "shards":
            out.update(self._shards_stats(loader))
        return out

    def _shards_stats(self, loader: "ShardsLoader") -> dict[str, Any]:
        """Shards interleave every source inside each window, so per-source delivery is the
        manifest's realized mix scaled by the fraction of the split this rank has served;
        drops and padding are the prebuild's (what was removed before the shards existed)."""
        top = self._manifest
        split = top["splits"]["train"]
        frac = loader.samples_yielded / max(1, split["n_seq"])
        realized = {
            s["name"]: {"tokens": int(round(s["tokens"] * frac)), "docs": int(round(s["docs"] * frac)),
                        "target_weight": s["target_weight"], "realized_weight": s["realized_weight"]}
            for s in top["sources"]
        }
        dropped = {"prebuild": {src: {k: v for k, v in per.items() if v} for src, per in top["drops"]["train"].items()}}
        return {"realized": realized, "dropped": dropped, "padding_fraction": split["packing"]["pad_fraction"]}

    @functools.cached_property
    def _manifest(self) -> dict[str, Any]:
        import json

        return json.loads((Path(self.data_dir) / "manifest.json").read_text())

    @functools.cached_property
    def hashes(self) -> dict[str, str | None]:
        """Tokenizer, manifest and data-config hashes: fixed for the module's life, so computed
        once (logging asks for them every few steps, checkpoints at every save)."""
        manifest = None
        if self.data_dir is not None and (Path(self.data_dir) / "manifest.json").exists():
            manifest = hashlib.sha256((Path(self.data_dir) / "manifest.json").read_bytes()).hexdigest()
        return {"tokenizer": self.tokenizer_hash(), "manifest": manifest, "data_config": self.data_config_hash()}

    # ------------------------------------------------------------------ checkpoint guard
    def state_dict(self) -> dict[str, Any]:
        """Stored in the checkpoint: what the data was, so a resume with other data refuses."""
        return {"mode": self.mode, "data_config_hash": self.hashes["data_config"], "tokenizer_hash": self.hashes["tokenizer"],
                "seq_len": self.seq_len, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = self.state_dict()
        diffs = [f"{k}: checkpoint {state.get(k)!r} vs now {mine[k]!r}" for k in mine if state.get(k) != mine[k]]
        if diffs:
            raise DataConfigError(
                "refusing to resume: the checkpoint was trained on different data (" + "; ".join(diffs) + "). "
                "Resume with the same data config, or start a new run."
            )
