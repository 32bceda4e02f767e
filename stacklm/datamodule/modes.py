"""What differs between ``StackDataModule``'s modes, one class per mode.

``StackDataModule`` picks its mode's class once, from the ``mode`` argument, and delegates to
it everything that differs: which arguments the mode needs, its train and val loaders, the
data numbers of a train loader for logging, and the hash of the data config a resume must
match. What the modes share (the module's arguments, tokenizer, rank and world size, snapshot
interval, config parsing) stays on the module, which each mode reads as ``self.dm``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stacklm.data.sft.preference_pipeline import PreferenceBuilder
from stacklm.data.sources import ShardSpec
from stacklm.datamodule.errors import DataConfigError
from stacklm.datamodule.loader import StackDataLoader
from stacklm.datamodule.logical import LogicalStreamDataset, resume_segment
from stacklm.datamodule.shards_loader import ShardsLoader, start_position
from stacklm.datamodule.stream import PipelineBuilder, SFTBuilder, StreamDataset, merge_worker_summaries
from stacklm.datamodule.workers import WorkerEnv, worker_context

if TYPE_CHECKING:
    from stacklm.datamodule.module import StackDataModule


class DataMode:
    """One mode of ``StackDataModule``; ``dm`` is the module it serves."""

    name: str

    def __init__(self, dm: StackDataModule) -> None:
        self.dm = dm

    @classmethod
    def check_arguments(cls, *, data_dir: str | None, pipeline: dict[str, Any] | None) -> None:
        """Raise ``DataConfigError`` when an argument the mode needs is missing."""

    def train_loader(self):
        raise NotImplementedError

    def val_loader(self):
        raise NotImplementedError

    def loader_stats(self, loader) -> dict[str, Any]:
        """What ``loader`` (this mode's train loader) delivered so far, in the ``data_stats``
        protocol (``stacklm.callbacks``), less the hashes."""
        raise NotImplementedError

    def data_config_hash(self) -> str:
        raise NotImplementedError


# The prebuild manifest's per-source drop counts that are whole documents (the others count
# repaired bytes, truncated documents or cut tokens).
_PREBUILD_DOC_DROPS = ("filtered", "exact_dup", "near_dup", "dropped_empty", "dropped_binary", "empty_after_tokenize")


class ShardsMode(DataMode):
    """A prebuilt shard directory (``stacklm prebuild``) read through memmaps, in one global
    seeded permutation per epoch sliced by rank and worker (``ShardsLoader``). Its resume
    position is shape-free and kept in the datamodule's checkpoint state, so a resume may change
    world size, worker count and batch size."""

    name = "shards"

    @classmethod
    def check_arguments(cls, *, data_dir: str | None, pipeline: dict[str, Any] | None) -> None:
        if data_dir is None:
            raise DataConfigError("StackDataModule(mode='shards'): pass data_dir=<prebuilt shard directory>")

    def __init__(self, dm: StackDataModule) -> None:
        super().__init__(dm)
        self.restored: dict[str, int] | None = None  # the checkpoint's position, until the first loader takes it
        # ``skip_steps`` resolved to stream positions: [{"steps": [a, b], "positions": [lo, hi], "step_rows": n}]
        # (global position = epoch x rows + position in the epoch's permutation), in the checkpoint
        self.skips: list[dict[str, Any]] = []
        self.restored_step_rows: int | None = None  # rows per optimizer step of the run that wrote the checkpoint
        self._forced_reload = False
        self._delivered = None  # DeliveryCounter of the train rows taken, across epochs and loader rebuilds

    def train_loader(self) -> ShardsLoader:
        """Starts where the last train loader stopped, else at the checkpoint's position.

        Lightning counts an epoch's steps from ``len(loader)`` once, when it builds the loader;
        a resume on another shape gives the resumed epoch another length than a whole epoch,
        so the trainer is told to rebuild the loader at the next epoch
        (``reload_dataloaders_every_n_epochs=1``, set back once the lengths agree again)."""
        dm = self.dm
        last = dm._train_loader
        position = self.restored
        if isinstance(last, ShardsLoader):
            position = last.position()
            if last.batches_yielded:  # rebuilt at the start of the next epoch: Lightning counts from 0
                position = start_position(position["epoch"] + 1) if position["rows_served"] >= last.num_rows else {**position, "steps": 0}
            # else rebuilt before serving anything (Lightning moved on to the next epoch while
            # restoring a checkpoint saved at an epoch's last step): the same position
        self.restored = None
        self.resolve_skips(position)
        loader = self._loader("train", position)
        trainer = getattr(dm, "trainer", None)
        if trainer is not None:
            if len(loader) != loader.full_epoch_steps() and not trainer.reload_dataloaders_every_n_epochs:
                trainer.reload_dataloaders_every_n_epochs, self._forced_reload = 1, True
            elif self._forced_reload and len(loader) == loader.full_epoch_steps():
                trainer.reload_dataloaders_every_n_epochs, self._forced_reload = 0, False
        return loader

    def val_loader(self) -> ShardsLoader:
        return self._loader("val", None)

    def resolve_skips(self, position: dict[str, int] | None) -> None:
        """Turn each ``skip_steps`` range not yet resolved into the stream positions its steps
        consume, walking from ``position`` (at the trainer's step now) as the loader serves:
        at the rows per step of the run that wrote the checkpoint (those steps' own data), else
        of this run. Shape-free from then on, kept in the checkpoint, so a resume on any shape
        passes over exactly those rows."""
        from stacklm.datamodule.shards_loader import walk_steps

        dm = self.dm
        done = {tuple(r["steps"]) for r in self.skips}
        todo = sorted(tuple(r) for r in dm.skip_steps if tuple(r) not in done)
        if not todo:
            return
        trainer = getattr(dm, "trainer", None)
        now = int(trainer.global_step) if trainer is not None else 0
        accumulate = int(trainer.accumulate_grad_batches) if trainer is not None else 1
        step_rows = self.restored_step_rows or dm.world_size * dm.batch_size * accumulate
        n_rows = len(dm.shards_dataset("train"))
        pos = position or {"epoch": 0, "rows_served": 0}
        start = int(pos["epoch"]) * n_rows + int(pos["rows_served"])
        for a, b in todo:
            if a < now:
                raise DataConfigError(
                    f"StackDataModule: skip_steps ({a}, {b}) starts before this run's step {now} (the checkpoint's): the "
                    f"steps from {a} on are already trained; resume from a checkpoint at or before step {a}"
                )
            gaps = [tuple(r["positions"]) for r in self.skips]
            steps = list(walk_steps(start, b + 1 - now, step_rows, n_rows, gaps))
            lo, hi = int(steps[a - now][0][0]), int(steps[-1][1])
            self.skips.append({"steps": [a, b], "positions": [lo, hi], "step_rows": int(step_rows)})
        self.skips.sort(key=lambda r: r["positions"][0])

    def skipped_steps(self):
        """``(step, epoch, rows)`` of every skipped step: the rows it would have had (all ranks'),
        for the step log."""
        from stacklm.data.storage.dataset import ElasticSampler
        from stacklm.datamodule.shards_loader import walk_steps

        dm = self.dm
        n_rows = len(dm.shards_dataset("train"))
        order = ElasticSampler(n_rows, 1, seed=dm.seed, rank=0, world_size=1, shuffle=True, loop=False)
        for r in self.skips:
            a, b = r["steps"]
            others = [tuple(o["positions"]) for o in self.skips if o is not r]
            for k, (positions, _) in enumerate(walk_steps(r["positions"][0], b - a + 1, r["step_rows"], n_rows, others)):
                epoch = int(positions[0]) // n_rows if len(positions) else 0
                yield a + k, epoch, order.permutation(epoch)[positions - epoch * n_rows]

    def position(self) -> dict[str, int] | None:
        loader = self.dm._train_loader
        return loader.position() if isinstance(loader, ShardsLoader) else self.restored

    def _loader(self, split: str, position: dict[str, int] | None) -> ShardsLoader:
        from stacklm.data.storage.dataset import ElasticSampler

        dm = self.dm
        ds = dm.shards_dataset(split)
        train = split == "train"
        if not train and len(ds) < dm.world_size * dm.batch_size:
            raise DataConfigError(
                f"StackDataModule: {ds.path} has {len(ds)} sequences, fewer than one global batch of "
                f"{dm.world_size} rank(s) x {dm.batch_size}; lower batch_size or build more data"
            )
        order = ElasticSampler(ds, dm.batch_size, seed=dm.seed, rank=dm.rank, world_size=dm.world_size, shuffle=train, loop=False)
        return ShardsLoader(
            ds, order, batch_size=dm.batch_size, rank=dm.rank, world_size=dm.world_size, num_workers=dm.num_workers,
            tail="pad" if train else "drop", position=position,
            skips=[tuple(r["positions"]) for r in self.skips] if train else None,
            delivered=self.delivered if train else None, row_counts=self._row_counts if train else None,
        )

    @property
    def delivered(self):
        """This rank's ``DeliveryCounter`` of the train rows the trainer took (exact per source
        when the prebuild wrote provenance)."""
        if self._delivered is None:
            from stacklm.datamodule.delivery import DeliveryCounter

            sources = self._manifest["sources"]
            self._delivered = DeliveryCounter([s["name"] for s in sources], {s["name"]: s["target_weight"] for s in sources})
        return self._delivered

    def row_sources(self, split: str):
        """The split's ``provenance.RowSources`` (loaded once, on first use), its source names
        in ``names``; ``None`` for a prebuild without provenance."""
        cache = self.__dict__.setdefault("_row_sources", {})
        if split not in cache:
            from stacklm.data.storage.provenance import RowSources

            names = [s["name"] for s in self._manifest["sources"]]
            spans = RowSources.load(Path(self.dm.data_dir) / self._manifest["splits"][split]["path"], names)
            if spans is not None:
                spans.names = names
            cache[split] = spans
        return cache[split]

    @functools.cached_property
    def _row_counts(self):
        from stacklm.data.storage.provenance import row_source_counts

        split = Path(self.dm.data_dir) / self._manifest["splits"]["train"]["path"]
        return row_source_counts(split, [s["name"] for s in self._manifest["sources"]])

    def delivered_state(self) -> list[dict[str, Any]]:
        """Every rank's delivered counts (gathered: Lightning writes rank 0's checkpoint)."""
        from stacklm.datamodule.loader import gather_from_ranks

        return gather_from_ranks(self.delivered.state_dict())

    def restore_delivered(self, per_rank: list[dict[str, Any]]) -> None:
        """Totals over the checkpoint's ranks continue on rank 0 (a resume may change the world
        size; the logged numbers are sums over ranks)."""
        from stacklm.dist import rank_world

        counter = self.delivered
        counter.reset()
        if rank_world()[0] == 0:
            counter.load_sum(per_rank)

    def loader_stats(self, loader: ShardsLoader) -> dict[str, Any]:
        """Per-source delivery counted from the rows the trainer took (each row's per-source
        tokens and documents from the prebuild's provenance side files); a prebuild without
        provenance falls back, loudly, to the manifest's realized mix scaled by the share of the
        split served. Drops are the prebuild's (what was removed before the shards existed)."""
        top = self._manifest
        split = top["splits"]["train"]
        drops = top["drops"]["train"]
        dropped_docs = {"prebuild": {src: {k: int(per[k]) for k in _PREBUILD_DOC_DROPS if per.get(k)} for src, per in drops.items()}}
        dropped_tokens = {src: {"cut_by_budget": int(per["tokens_cut_by_budget"])} for src, per in drops.items()
                          if per.get("tokens_cut_by_budget")}
        fallback = sorted(s["name"] for s in top["sources"] if s.get("offline_fallback"))
        out = {"dropped_docs": dropped_docs, "dropped_tokens": dropped_tokens, "offline_fallback": fallback}
        if self._row_counts is not None:
            stats = self.delivered.stats()
            stats.pop("doc_length_hist", None)  # a document's length spans rows; not known per row
            return {**out, **stats}
        if not getattr(self, "_warned_estimate", False):
            self._warned_estimate = True
            warnings.warn(
                f"stacklm: {self.dm.data_dir} has no provenance side files (built with --no-provenance or an older "
                "stacklm): per-source delivered counts are ESTIMATED from the manifest's mix scaled by the rows served; "
                "rebuild with `stacklm prebuild` for exact counts", RuntimeWarning, stacklevel=2,
            )
        frac = loader.samples_yielded / max(1, split["n_seq"])
        realized = {
            s["name"]: {"tokens": int(round(s["tokens"] * frac)), "docs": int(round(s["docs"] * frac)),
                        "target_weight": s["target_weight"], "realized_weight": s["realized_weight"]}
            for s in top["sources"]
        }
        return {**out, "realized": realized, "realized_estimated": True, "padding_fraction": split["packing"]["pad_fraction"]}

    @functools.cached_property
    def _manifest(self) -> dict[str, Any]:
        from stacklm.data.storage.manifest import read_manifest

        return read_manifest(self.dm.data_dir)  # checked: its split paths are joined to data_dir

    def data_config_hash(self) -> str:
        """Content, not place: a moved or copied shard directory has the same hash."""
        from stacklm.datamodule.identity import shards_content_hash

        dm = self.dm
        return hashlib.sha256(f"shards:{shards_content_hash(dm.data_dir)}:{dm.seq_len}:{dm.seed}".encode()).hexdigest()


class _WorkerStreamMode(DataMode):
    """A mode whose loader workers each build their own graph (``StreamDataset``) and report
    what they delivered in summaries riding on the batches."""

    @classmethod
    def check_arguments(cls, *, data_dir: str | None, pipeline: dict[str, Any] | None) -> None:
        if pipeline is None:
            raise DataConfigError(f"StackDataModule(mode={cls.name!r}): pass pipeline=<config dict>")

    def train_loader(self) -> StackDataLoader:
        return self._loader(self._dataset("train"), epoch_source=self._trainer_epoch)

    def val_loader(self) -> StackDataLoader:
        return self._loader(self._dataset("val"))  # the same validation order every epoch

    def _dataset(self, split: str) -> StreamDataset:
        """This rank's stream of ``split`` batches."""
        raise NotImplementedError

    def _loader(self, dataset: StreamDataset, epoch_source=None) -> StackDataLoader:
        workers = self.dm.num_workers
        context = worker_context(needs_datasets=self._needs_datasets()) if workers > 0 else None
        return StackDataLoader(
            dataset,
            batch_size=None,
            num_workers=workers,
            persistent_workers=False,
            multiprocessing_context=context,
            worker_init_fn=WorkerEnv(os.environ) if workers > 0 else None,
            snapshot_every_n_steps=self.dm.snapshot_interval(),
            epoch_source=epoch_source,
            vocab_size=self.dm.vocab_size,
        )

    def _trainer_epoch(self) -> int | None:
        """The epoch Lightning is about to run (restored on resume), so each epoch is its own pass."""
        trainer = getattr(self.dm, "trainer", None)
        return None if trainer is None else trainer.current_epoch

    def _needs_datasets(self) -> bool:
        """Does a source read through ``datasets`` (preloaded in the worker forkserver then)?"""
        return False

    def loader_stats(self, loader: StackDataLoader) -> dict[str, Any]:
        """Delivered (counted in the main process as batches reach the step, from the counts
        each stream and SFT batch carries) plus the workers' drops."""
        out: dict[str, Any] = {}
        if loader.worker_summaries:
            out.update(merge_worker_summaries(list(loader.worker_summaries.values())))
        out.update(loader.delivered.stats())
        return out


class StreamMode(_WorkerStreamMode):
    """The on-the-fly node graph (``stacklm.data.nodes``) straight from the sources, as
    ``logical_streams`` logical streams (each its own graph over its own part of every source,
    with an equal token budget) dealt to (rank x worker) at run time
    (``stacklm.datamodule.logical``): a resume may change world size, workers and batch size."""

    name = "stream"

    def __init__(self, dm: StackDataModule) -> None:
        super().__init__(dm)
        # the checkpoint's stream record (``stream_state``) until the first train loader takes it
        self.restored: dict[str, Any] | None = None
        self.quota: int | None = None  # train windows per logical stream per epoch, fixed for the run
        self._forced_reload = False

    def logical_streams(self) -> int:
        """Fixed for the run: the argument, else the checkpoint's, else this first run's readers
        (world x workers, so a fresh run reads exactly as one reader per worker would)."""
        dm = self.dm
        if dm.logical_streams is None:
            dm.logical_streams = dm.world_size * max(1, dm.num_workers)
        return int(dm.logical_streams)

    def train_loader(self) -> StackDataLoader:
        """At the checkpoint's position in its epoch, on this run's shape; Lightning counts the
        epoch's steps from ``len(loader)`` once, so when the resumed epoch's length differs from
        a whole one the trainer rebuilds the loader at the next epoch (as in ``ShardsMode``)."""
        last = self.dm._train_loader
        loader = super().train_loader()
        if isinstance(last, StackDataLoader):  # rebuilt for a new epoch: the run's delivery counts go on
            loader.delivered.load_state_dict(last.delivered.state_dict())
        self.restored = None
        trainer = getattr(self.dm, "trainer", None)
        ds = loader.dataset
        if trainer is not None:
            if len(ds) != ds.full_epoch_len() and not trainer.reload_dataloaders_every_n_epochs:
                trainer.reload_dataloaders_every_n_epochs, self._forced_reload = 1, True
            elif self._forced_reload and len(ds) == ds.full_epoch_len():
                trainer.reload_dataloaders_every_n_epochs, self._forced_reload = 0, False
        return loader

    def _dataset(self, split: str) -> StreamDataset:
        dm = self.dm
        cfg = dm.pipeline_config()
        tok = dm.tokenizer
        world = dm.world_size
        if split == "train":
            budget = cfg.mix.total_tokens
            n_total = budget // (world * cfg.batch_size * cfg.seq_len)
        else:
            budget = max(1, round(cfg.mix.total_tokens * cfg.holdout_fraction))
            n_total = dm.val_batches if dm.val_batches is not None else budget // (world * cfg.batch_size * cfg.seq_len)
        if n_total < 1:
            raise DataConfigError(
                f"StackDataModule: the {split} token budget ({budget:,} tokens) gives zero batches of "
                f"{cfg.batch_size} x {cfg.seq_len} tokens on {world} rank(s); raise mix.total_tokens"
                + (" or holdout_fraction, or set val_batches" if split == "val" else "")
            )
        workers = max(1, dm.num_workers)
        n_total = max(workers, n_total // workers * workers)  # equal share per worker
        logical = self.logical_streams()
        quota = world * n_total * cfg.batch_size // logical  # windows per logical stream per epoch
        if split == "train":
            if self.quota is None:
                self.quota = int(self.restored["quota"]) if self.restored else quota
            quota = self.quota
        if quota < 1:
            raise DataConfigError(
                f"StackDataModule: {logical} logical streams share {world * n_total * cfg.batch_size} {split} windows, fewer "
                "than one each; lower logical_streams or raise mix.total_tokens"
            )
        readers = world * workers
        if split == "train" and readers > logical and not getattr(self, "_warned_idle", False):
            self._warned_idle = True
            warnings.warn(
                f"stacklm: {readers} readers (ranks x num_workers) but the data is read as {logical} logical streams: "
                f"{readers - logical} reader(s) hold no stream and deliver padding rows only (no loss; a logged loss of 0 on "
                "their batches). Set data.logical_streams to a multiple of every ranks x workers you will use (e.g. 8 or 16) "
                "when you start a run, or resume with at most that many readers.",
                RuntimeWarning, stacklevel=2,
            )
        if cfg.decontaminate is not None:  # built here, once, before any worker starts: workers memory-map it
            from stacklm.data.quality.decontam import ensure_index

            ensure_index(cfg.decontaminate)
        build = PipelineBuilder(cfg.to_dict(), dm.tokenizer_path, split)
        ds = LogicalStreamDataset(
            build, logical_streams=logical, quota=quota, split=split, rank=dm.rank, world_size=world,
            n_batches_total=n_total, batch_size=cfg.batch_size, seq_len=cfg.seq_len, pad_id=tok.pad_id,
            sources=[entry.name for entry in cfg.mix.entries], target_weights=dict(cfg.mix.weights),
        )
        ds.workers = workers
        if split == "train":
            ds.mix_changes = dm.resolved_mix_changes()
            epoch = self._trainer_epoch()
            ds.epoch = int(epoch) if epoch is not None else 0
            ds.resume = resume_segment(self.restored, quota, dm.shape())
        return ds

    def stream_state(self) -> dict[str, Any] | None:
        """The checkpoint's shape-free stream position (``logical.stream_record``), ``None``
        before the first train loader (then the restored one, if any)."""
        loader = self.dm._train_loader
        if not isinstance(loader, StackDataLoader) or not isinstance(loader.dataset, LogicalStreamDataset):
            return self.restored
        return loader.stream_record()

    def _needs_datasets(self) -> bool:
        return any(entry.kind == "hf" for entry in self.dm.pipeline_config().mix.entries)

    def data_config_hash(self) -> str:
        return self.dm.pipeline_config().config_hash()


def _sft_target_weights(cfg) -> dict[str, float]:
    total = sum(s.weight for s in cfg.sources)
    return {s.name: s.weight / total for s in cfg.sources}


class SFTMode(_WorkerStreamMode):
    """Chat conversations rendered and packed by ``stacklm.data.sft``."""

    name = "sft"
    builder = SFTBuilder

    def _dataset(self, split: str) -> StreamDataset:
        """Conversations have no token budget, so the per-worker batch count comes from a
        counting pass over every (rank, worker) reader (identical on every rank); readers
        that run dry earlier pad with fully masked batches so all ranks step together."""
        dm = self.dm
        cfg = dm.sft_config()
        build = self.builder(cfg.to_dict(), dm.tokenizer_path, split)
        workers = max(1, dm.num_workers)
        fixed = dm.train_batches if split == "train" else dm.val_batches
        if fixed is not None:
            per_worker = max(1, fixed // workers)
        else:
            counts = [
                sum(1 for _ in build(ShardSpec(r, dm.world_size, w, workers), dm.world_size * workers).batches)
                for r in range(dm.world_size)
                for w in range(workers)
            ]
            per_worker = max(counts)
            if per_worker == 0:
                raise DataConfigError(f"StackDataModule(mode={self.name!r}): the {split} split yields no batches; check the sources")
        return StreamDataset(
            build, split=split, rank=dm.rank, world_size=dm.world_size, n_batches_total=per_worker * workers,
            batch_size=cfg.batch_size, seq_len=cfg.seq_len, pad_id=dm.tokenizer.pad_id,
            sources=[s.name for s in cfg.sources], target_weights=_sft_target_weights(cfg),
        )

    def _needs_datasets(self) -> bool:
        return any(source.kind == "hf" for source in self.dm.sft_config().sources)

    def data_config_hash(self) -> str:
        return self.dm.sft_config().config_hash()


class PreferenceMode(SFTMode):
    """Chosen/rejected pairs (``stacklm.data.sft.preference``) on the SFT config and loaders:
    batches of ``chosen_*``/``rejected_*`` tensors and ``pair_ids``."""

    name = "preference"
    builder = PreferenceBuilder


MODE_CLASSES: dict[str, type[DataMode]] = {mode.name: mode for mode in (ShardsMode, StreamMode, SFTMode, PreferenceMode)}
MODES = tuple(MODE_CLASSES)
