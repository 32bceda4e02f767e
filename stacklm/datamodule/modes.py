"""What differs between ``StackDataModule``'s modes, one class per mode.

``StackDataModule`` picks its mode's class once, from the ``mode`` argument, and delegates to
it everything that differs: which arguments the mode needs, its train and val loaders, the
data numbers of a train loader for logging, the hash of the data config a resume must match,
and its part of the checkpoint state (``state`` / ``restore``, in the shape ``resume.state``
gives it). A mode is built from the module's typed config (``ModeArgs``: the ``DataConfig``,
parsed once, and where the data is read) and is handed, at each call, the facts of the fit it
serves (``Run``) and the loader it made before; it returns what it produces and never sees the
module. The resume rules it applies are in ``resume/``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stacklm.data.sft.reader import say_split_drops
from stacklm.data.sources import ShardSpec
from stacklm.datamodule.loader import StackDataLoader
from stacklm.datamodule.resume.logical import LogicalStreamDataset, resume_segment
from stacklm.datamodule.resume.sampler import ElasticSampler
from stacklm.datamodule.resume.shards import next_position, resolve_skips, skipped_rows
from stacklm.datamodule.section import DataConfig
from stacklm.datamodule.shards_loader import ShardsLoader
from stacklm.datamodule.stream import PipelineBuilder, PreferenceBuilder, SFTBuilder, StreamDataset, merge_worker_summaries
from stacklm.datamodule.workers import WorkerEnv, worker_context
from stacklm.errors import DataConfigError, ResumeRefused


@dataclass(frozen=True)
class ModeArgs:
    """What a mode is built from: the module's ``DataConfig`` (its arguments, checked, with the
    pipeline parsed once; ``StackDataModule``'s docstring says what each is) and where shards
    mode reads the data from."""

    config: DataConfig
    data_dir: str | None = None  # ``config.data_dir``, or its local mirror when that is a remote URL
    data_url: str | None = None  # a remote data_dir's URL, for messages
    shard_cache: Any = None  # a remote train split streamed through a bounded cache (``prefetch.ShardCache``)


def _no_trainer() -> None:
    return None


@dataclass(frozen=True)
class Run:
    """The fit a mode serves, as the module reads it off the trainer at each call (the defaults:
    no trainer)."""

    tokenizer: Any  # the loaded ``StackTokenizer``
    rank: int = 0
    world_size: int = 1
    # reads the epoch Lightning is about to run (restored on resume), at each pass; None without a trainer
    current_epoch: Callable[[], int | None] = _no_trainer
    step: int = 0  # ``trainer.global_step``
    accumulate: int = 1  # ``trainer.accumulate_grad_batches``
    last_step: int | None = None  # ``trainer.max_steps - 1``; None when the run has no step limit
    snapshot_interval: int = 1000  # steps between loader worker snapshots (``StackDataModule.snapshot_interval``)
    mix_changes: tuple[dict[str, Any], ...] = ()  # stream mode's re-weightings, per-rank batch indices resolved

    def shape(self, config: DataConfig) -> dict[str, int]:
        """How this run reads the data: world size, loader workers, batch size."""
        return {"world_size": self.world_size, "num_workers": config.num_workers, "batch_size": config.batch_size}


def shards_dataset(args: ModeArgs, split: str, tokenizer):
    """The prebuilt ``split`` of ``args.data_dir`` (``PackedMemmapDataset``), checked against the
    module's ``seq_len``."""
    from stacklm.data.storage.dataset import PackedMemmapDataset

    seq_len = args.config.seq_len
    ds = PackedMemmapDataset(args.data_dir, split, tokenizer=tokenizer, verify_content=args.config.verify_shards,
                             cache=args.shard_cache if split == "train" else None, planes=args.config.planes)
    if ds.seq_len != seq_len:
        raise DataConfigError(
            f"StackDataModule: {ds.path} was built with seq_len {ds.seq_len} but the module has seq_len {seq_len}; "
            "use the same seq_len or rebuild the shards"
        )
    return ds


class DataMode:
    """One mode of ``StackDataModule``, built from its config and data place (``args``)."""

    name: str

    def __init__(self, args: ModeArgs) -> None:
        self.args = args
        self.config = args.config  # the module's ``DataConfig``

    @classmethod
    def check_arguments(cls, config: DataConfig) -> None:
        """Raise ``DataConfigError`` when an argument the mode needs is missing."""

    def train_loader(self, run: Run, last: Any = None):
        """A new train loader; ``last`` is the one this mode made before in this fit (rebuilt per
        epoch), ``None`` at the first."""
        raise NotImplementedError

    def val_loader(self, run: Run):
        raise NotImplementedError

    def epoch_lengths(self, loader: Any) -> tuple[int, int] | None:
        """``(steps of the epoch the train loader starts, steps of a whole epoch)`` when a resume
        can make them differ (``resume.state.EpochReload``), else ``None``."""
        return None

    def state(self, loader: Any, run: Run) -> dict[str, Any]:
        """This mode's keys of the checkpoint state (``resume.state.SHAPES``) at ``loader``, the
        current train loader (``None`` before the first)."""
        return {}

    def restore(self, saved: dict[str, Any]) -> None:
        """Take a checkpoint's state (checked and in this mode's shape, ``resume.state.check_state``)
        for the next train loader."""

    def loader_stats(self, loader) -> dict[str, Any]:
        """What ``loader`` (this mode's train loader) delivered so far, in the ``data_stats``
        protocol (``stacklm.callbacks``), less the hashes."""
        raise NotImplementedError

    def data_config_hash(self) -> str:
        raise NotImplementedError


# The per-source drop counts of a manifest without a ledger (jobs from before it) that are whole
# documents (the others count repaired bytes, truncated documents or cut tokens).
_PREBUILD_DOC_DROPS = ("filtered", "decontaminated", "exact_dup", "near_dup", "cross_split_dup", "dropped_empty", "dropped_binary",
                       "invalid_records", "empty_after_tokenize")


class ShardsMode(DataMode):
    """A prebuilt shard directory (``stacklm prebuild``) read through memmaps, in one global
    seeded permutation per epoch sliced by rank and worker (``ShardsLoader``). Its resume
    position is shape-free and kept in the datamodule's checkpoint state, so a resume may change
    world size, worker count and batch size."""

    name = "shards"

    @classmethod
    def check_arguments(cls, config: DataConfig) -> None:
        if config.data_dir is None:
            raise DataConfigError("StackDataModule(mode='shards'): pass data_dir=<prebuilt shard directory>")

    def __init__(self, args: ModeArgs) -> None:
        super().__init__(args)
        self.restored: dict[str, int] | None = None  # the checkpoint's position, until the first loader takes it
        # ``skip_steps`` resolved to stream positions: [{"steps": [a, b], "positions": [lo, hi], "step_rows": n}]
        # (global position = epoch x rows + position in the epoch's permutation), in the checkpoint
        self.skips: list[dict[str, Any]] = []
        self.restored_step_rows: int | None = None  # rows per optimizer step of the run that wrote the checkpoint
        self._delivered = None  # DeliveryCounter of the train rows taken, across epochs and loader rebuilds

    def dataset(self, split: str, tokenizer):
        return shards_dataset(self.args, split, tokenizer)

    def train_loader(self, run: Run, last: Any = None) -> ShardsLoader:
        """Starts where ``last`` stopped (``resume.shards.next_position``), else at the
        checkpoint's position."""
        position = self.restored
        if isinstance(last, ShardsLoader):
            position = next_position(last.position(), last.batches_yielded, last.num_rows)
        self.restored = None
        ds = self.dataset("train", run.tokenizer)
        self.skips = resolve_skips(self.skips, list(self.config.skip_steps), position, now=run.step,
                                   step_rows=self.restored_step_rows or run.world_size * self.config.batch_size * run.accumulate,
                                   num_rows=len(ds))
        return self._loader(ds, "train", position, run)

    def val_loader(self, run: Run) -> ShardsLoader:
        return self._loader(self.dataset("val", run.tokenizer), "val", None, run)

    def epoch_lengths(self, loader: ShardsLoader) -> tuple[int, int]:
        return len(loader), loader.full_epoch_steps()

    def skipped_steps(self, run: Run):
        """``(step, epoch, rows)`` of every skipped step: the rows it would have had (all ranks'),
        for the step log."""
        ds = self.dataset("train", run.tokenizer)
        return skipped_rows(self.skips, len(ds), self.config.seed, shard_window=self.config.shard_window, shard_rows=ds.shard_rows,
                            last_step=run.last_step)

    def position(self, loader: Any) -> dict[str, int] | None:
        """The shape-free position at ``loader`` (the current train loader), else the restored one."""
        return loader.position() if isinstance(loader, ShardsLoader) else self.restored

    def state(self, loader: Any, run: Run) -> dict[str, Any]:
        """The position, the resolved skips, the rows per step that wrote them (with ``shape``)
        and every rank's delivered counts."""
        return {
            "position": self.position(loader),
            "skips": [{k: list(v) if isinstance(v, list) else v for k, v in r.items()} for r in self.skips],
            "accumulate_grad_batches": int(run.accumulate),
            "delivered": self.delivered_state(),
        }

    def restore(self, saved: dict[str, Any]) -> None:
        self.restored = saved["position"]
        self.skips = [dict(r) for r in saved["skips"]]
        old = saved["shape"] or {}
        if old.get("world_size") and old.get("batch_size"):
            self.restored_step_rows = int(old["world_size"]) * int(old["batch_size"]) * int(saved["accumulate_grad_batches"])
        if saved["delivered"]:
            self.restore_delivered(saved["delivered"])

    def _loader(self, ds, split: str, position: dict[str, int] | None, run: Run) -> ShardsLoader:
        config = self.config
        train = split == "train"
        if not train and len(ds) < run.world_size * config.batch_size:
            raise DataConfigError(
                f"StackDataModule: {ds.path} has {len(ds)} sequences, fewer than one global batch of "
                f"{run.world_size} rank(s) x {config.batch_size}; lower batch_size or build more data"
            )
        order = ElasticSampler(ds, config.batch_size, seed=config.seed, rank=run.rank, world_size=run.world_size, shuffle=train,
                               loop=False, shard_window=config.shard_window if train else None)
        return ShardsLoader(
            ds, order, batch_size=config.batch_size, rank=run.rank, world_size=run.world_size, num_workers=config.num_workers,
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
            spans = RowSources.load(Path(self.args.data_dir) / self._manifest["splits"][split]["path"], names)
            if spans is not None:
                spans.names = names
            cache[split] = spans
        return cache[split]

    @functools.cached_property
    def _row_counts(self):
        from stacklm.data.storage.provenance import row_source_counts

        split = Path(self.args.data_dir) / self._manifest["splits"]["train"]["path"]
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
        fallback = sorted(s["name"] for s in top["sources"] if s.get("offline_fallback"))
        out: dict[str, Any] = {"offline_fallback": fallback, "dropped_docs": {}, "dropped_tokens": {}, "holdout_docs": {}}
        from stacklm.dist import rank_world

        if rank_world()[0] == 0:  # the prebuild's counts, on one rank: the callback sums the ranks' stats
            out.update(self._prebuild_drops)
            cut = {src: {"cut_by_budget": int(per["truncated_to_budget"])} for src, per in drops.items() if per.get("truncated_to_budget")}
            if cut:  # kept, but cut short by the mix budget (not drops)
                out["cut_docs"] = cut
            decontamination = (top.get("decontamination") or {}).get("train")
            if decontamination:  # per evaluation set (stacklm.data.quality.decontam)
                out["decontamination"] = decontamination
        if self._row_counts is not None:
            stats = self.delivered.stats()
            stats.pop("doc_length_hist", None)  # a document's length spans rows; not known per row
            return {**out, **stats}
        if not getattr(self, "_warned_estimate", False):
            self._warned_estimate = True
            warnings.warn(
                f"stacklm: {self.args.data_dir} has no provenance side files (built with --no-provenance or an older "
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
    def _prebuild_drops(self) -> dict[str, Any]:
        """The train split's drops as its ledger holds them (every stage and reason: filters,
        decontamination per evaluation set, exact, near and cross-split duplicates, invalid
        records by reason, empty after tokenizing; tokens cut by the budget) and its holdout; a
        manifest from jobs older than the ledger gives its drop summary under stage ``prebuild``."""
        from stacklm.data import ledger

        top = self._manifest
        if "train" in (top.get("ledger") or {}):
            return ledger.data_log_drops(top["ledger"]["train"]["sources"])
        drops = top["drops"]["train"]
        return {"dropped_docs": {"prebuild": {src: {k: int(per[k]) for k in _PREBUILD_DOC_DROPS if per.get(k)} for src, per in drops.items()}},
                "dropped_tokens": {src: {"cut_by_budget": int(per["tokens_cut_by_budget"])} for src, per in drops.items()
                                   if per.get("tokens_cut_by_budget")}}

    @functools.cached_property
    def _manifest(self) -> dict[str, Any]:
        from stacklm.data.storage.manifest import read_manifest

        return read_manifest(self.args.data_dir)  # checked: its split paths are joined to data_dir

    def data_config_hash(self) -> str:
        """Content, not place: a moved or copied shard directory has the same hash."""
        from stacklm.datamodule.resume.identity import shards_content_hash

        config = self.config
        window = f":window{config.shard_window}" if config.shard_window else ""  # another order: not the same data stream
        data = shards_content_hash(self.args.data_dir)
        return hashlib.sha256(f"shards:{data}:{config.seq_len}:{config.seed}{window}".encode()).hexdigest()


class _WorkerStreamMode(DataMode):
    """A mode whose loader workers each build their own graph (``StreamDataset``) and report
    what they delivered in summaries riding on the batches."""

    @classmethod
    def check_arguments(cls, config: DataConfig) -> None:
        if config.pipeline is None:
            raise DataConfigError(f"StackDataModule(mode={cls.name!r}): pass pipeline=<config dict>")

    def train_loader(self, run: Run, last: Any = None) -> StackDataLoader:
        # read at each pass: each epoch is its own pass
        return self._loader(self._dataset("train", run), run, epoch_source=run.current_epoch)

    def val_loader(self, run: Run) -> StackDataLoader:
        return self._loader(self._dataset("val", run), run)  # the same validation order every epoch

    def _dataset(self, split: str, run: Run) -> StreamDataset:
        """This rank's stream of ``split`` batches."""
        raise NotImplementedError

    def _loader(self, dataset: StreamDataset, run: Run, epoch_source: Callable[[], int | None] | None = None) -> StackDataLoader:
        workers = self.config.num_workers
        context = worker_context(needs_datasets=self._needs_datasets()) if workers > 0 else None
        return StackDataLoader(
            dataset,
            batch_size=None,
            num_workers=workers,
            persistent_workers=False,
            multiprocessing_context=context,
            worker_init_fn=WorkerEnv(os.environ) if workers > 0 else None,
            snapshot_every_n_steps=run.snapshot_interval,
            epoch_source=epoch_source,
            vocab_size=run.tokenizer.vocab_size,
        )

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
    """The on-the-fly node graph (``stacklm.data.pipeline``) straight from the sources, as
    ``logical_streams`` logical streams (each its own graph over its own part of every source,
    with an equal token budget) dealt to (rank x worker) at run time
    (``stacklm.datamodule.resume.logical``): a resume may change world size, workers and batch size."""

    name = "stream"

    @classmethod
    def check_arguments(cls, config: DataConfig) -> None:
        super().check_arguments(config)
        config.pipeline.check_stages_run()  # the loader workers run them: refused here, before any work

    def __init__(self, args: ModeArgs) -> None:
        super().__init__(args)
        # the checkpoint's stream record (``stream_state``) until the first train loader takes it
        self.restored: dict[str, Any] | None = None
        self.quota: int | None = None  # train windows per logical stream per epoch, fixed for the run
        self._logical_streams: int | None = args.config.logical_streams  # fixed for the run once known

    def logical_streams(self, run: Run) -> int:
        """Fixed for the run: the argument, else the checkpoint's, else this first run's readers
        (world x workers, so a fresh run reads exactly as one reader per worker would)."""
        if self._logical_streams is None:
            self._logical_streams = run.world_size * max(1, self.config.num_workers)
        return int(self._logical_streams)

    def train_loader(self, run: Run, last: Any = None) -> StackDataLoader:
        """At the checkpoint's position in its epoch, on this run's shape (its length:
        ``epoch_lengths``)."""
        loader = super().train_loader(run, last)
        if isinstance(last, StackDataLoader):  # rebuilt for a new epoch: the run's delivery counts go on
            loader.delivered.load_state_dict(last.delivered.state_dict())
        self.restored = None
        return loader

    def epoch_lengths(self, loader: StackDataLoader) -> tuple[int, int]:
        return len(loader.dataset), loader.dataset.full_epoch_len()

    def _dataset(self, split: str, run: Run) -> StreamDataset:
        config = self.config
        cfg = config.pipeline  # the ``PipelineConfig``, parsed once (``section.DataConfig``)
        world = run.world_size
        if split == "train":
            budget = cfg.mix.total_tokens
            n_total = budget // (world * cfg.batch_size * cfg.seq_len)
        else:
            budget = max(1, round(cfg.mix.total_tokens * cfg.holdout_fraction))
            n_total = config.val_batches if config.val_batches is not None else budget // (world * cfg.batch_size * cfg.seq_len)
        if n_total < 1:
            raise DataConfigError(
                f"StackDataModule: the {split} token budget ({budget:,} tokens) gives zero batches of "
                f"{cfg.batch_size} x {cfg.seq_len} tokens on {world} rank(s); raise mix.total_tokens"
                + (" or holdout_fraction, or set val_batches" if split == "val" else "")
            )
        workers = max(1, config.num_workers)
        n_total = max(workers, n_total // workers * workers)  # equal share per worker
        logical = self.logical_streams(run)
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

            ensure_index(cfg.decontaminate, announce=True)
        build = PipelineBuilder(cfg, config.tokenizer, split)
        ds = LogicalStreamDataset(
            build, logical_streams=logical, quota=quota, split=split, rank=run.rank, world_size=world,
            n_batches_total=n_total, batch_size=cfg.batch_size, seq_len=cfg.seq_len, pad_id=run.tokenizer.pad_id,
            sources=[entry.name for entry in cfg.mix.entries], target_weights=dict(cfg.mix.weights),
        )
        ds.workers = workers
        ds.planes = cfg.planes  # the batch layout its readers collate to (``logical._LogicalIterator._collate``)
        if split == "train":
            ds.mix_changes = [dict(c) for c in run.mix_changes]
            epoch = run.current_epoch()
            ds.epoch = int(epoch) if epoch is not None else 0
            ds.resume = resume_segment(self.restored, quota, run.shape(config))
        return ds

    def stream_state(self, loader: Any) -> dict[str, Any] | None:
        """The checkpoint's shape-free stream position (``logical.stream_record``) at ``loader``,
        the current train loader; ``None`` before the first (then the restored one, if any)."""
        if not isinstance(loader, StackDataLoader) or not isinstance(loader.dataset, LogicalStreamDataset):
            return self.restored
        return loader.stream_record()

    def state(self, loader: Any, run: Run) -> dict[str, Any]:
        return {"streams": self.stream_state(loader)}

    def restore(self, saved: dict[str, Any]) -> None:
        """Take the checkpoint's logical streams (``logical_streams``, quota, position) for the
        next train loader, which deals them to this run's shape."""
        rec = saved["streams"]
        if rec is None:  # saved before the first train loader: nothing was read yet
            return
        n = int(rec["logical_streams"])
        if self.config.logical_streams is not None and self.config.logical_streams != n:
            raise ResumeRefused(
                f"refusing to resume: the checkpoint reads the data as logical_streams={n} but this run sets "
                f"logical_streams={self.config.logical_streams}; the number of logical streams is fixed for a run. Drop the "
                f"argument (it is taken from the checkpoint) or set it to {n}."
            )
        self._logical_streams = n
        self.restored = dict(rec)
        self.quota = None

    def _needs_datasets(self) -> bool:
        return any(entry.kind == "hf" for entry in self.config.pipeline.mix.entries)

    def data_config_hash(self) -> str:
        return self.config.pipeline.config_hash()


def _sft_target_weights(cfg) -> dict[str, float]:
    total = sum(s.weight for s in cfg.sources)
    return {s.name: s.weight / total for s in cfg.sources}


class SFTMode(_WorkerStreamMode):
    """Chat conversations rendered and packed by ``stacklm.data.sft``."""

    name = "sft"
    builder = SFTBuilder

    def _dataset(self, split: str, run: Run) -> StreamDataset:
        """Conversations have no token budget, so the per-worker batch count comes from a
        counting pass over every (rank, worker) reader (identical on every rank); readers
        that run dry earlier pad with fully masked batches so all ranks step together.

        The counting pass reads every record of the split, so it is the one that says what was
        dropped (rank 0, once for the split); the loader's workers read the same records again,
        quietly. Without a counting pass (``train_batches`` / ``val_batches`` given) the
        workers' readers say it themselves."""
        config = self.config
        cfg = config.pipeline  # the ``SFTConfig``, parsed once (``section.DataConfig``)
        build = self.builder(cfg, config.tokenizer, split)
        workers = max(1, config.num_workers)
        world = run.world_size
        fixed = config.train_batches if split == "train" else config.val_batches
        if fixed is not None:
            per_worker = max(1, fixed // workers)
        else:
            build = self.builder(cfg, config.tokenizer, split, quiet=True)
            counts, readers = [], []
            for r in range(world):
                for w in range(workers):
                    graph = build(ShardSpec(r, world, w, workers), world * workers)
                    counts.append(sum(1 for _ in graph.batches))
                    readers.extend(graph.sources.values())
            if run.rank == 0 and split == "train":  # the val readers read the same records (the holdout hashes them)
                say_split_drops(readers, split)
            per_worker = max(counts)
            if per_worker == 0:
                raise DataConfigError(f"StackDataModule(mode={self.name!r}): the {split} split yields no batches; check the sources")
        return StreamDataset(
            build, split=split, rank=run.rank, world_size=world, n_batches_total=per_worker * workers,
            batch_size=cfg.batch_size, seq_len=cfg.seq_len, pad_id=run.tokenizer.pad_id,
            sources=[s.name for s in cfg.sources], target_weights=_sft_target_weights(cfg),
        )

    def _needs_datasets(self) -> bool:
        return any(source.kind == "hf" for source in self.config.pipeline.sources)

    def data_config_hash(self) -> str:
        return self.config.pipeline.config_hash()


class PreferenceMode(SFTMode):
    """Chosen/rejected pairs (``stacklm.data.sft.preference``) on the SFT config and loaders:
    batches of ``chosen_*``/``rejected_*`` tensors and ``pair_ids``."""

    name = "preference"
    builder = PreferenceBuilder


MODE_CLASSES: dict[str, type[DataMode]] = {mode.name: mode for mode in (ShardsMode, StreamMode, SFTMode, PreferenceMode)}
MODES = tuple(MODE_CLASSES)
