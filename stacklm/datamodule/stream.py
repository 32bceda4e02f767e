"""Streams of batches built on the fly: a rank's share of a node graph (pre-training) or of
the SFT pipeline, split across loader workers, each worker yielding a fixed batch count.

Every stream batch carries the per-source counts of what it delivers (``DELIVERY_KEY``), which
``StackDataLoader`` takes off and counts in the main process (``delivery``). With the first
batch, every ``SUMMARY_EVERY_N_BATCHES`` batches and when a source runs dry, a worker's summary
of what it has processed (drops, holdout, fallback, dry sources) rides on a batch under
``SUMMARY_KEY``; ``merge_worker_summaries`` turns the latest ones into the drop side of the
``data_stats`` protocol (``stacklm.callbacks``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from stacklm.chat import INVALID_REASONS as CHAT_INVALID_REASONS
from stacklm.data.audit import DROPPED_BINARY, DROPPED_EMPTY, INVALID_RECORDS
from stacklm.data.contract import padding_batch
from stacklm.data.pipeline import PipelineConfig
from stacklm.data.mix.schedule import merge_phase_reports
from stacklm.chat.render import DROPPED_TOO_LONG, NOTHING_TO_TRAIN, TRUNCATED, TRUNCATED_START, TURNS_CUT
from stacklm.data.sources import ShardSpec
from stacklm.data.stats import drops_by_reason
from stacklm.datamodule.worker_state import SnapshotIterator

if TYPE_CHECKING:  # pragma: no cover
    from stacklm.data.sft import SFTConfig

SUMMARY_KEY = "stacklm_summary"  # rides on a batch from a worker; the loader takes it off
SUMMARY_EVERY_N_BATCHES = 8


# Reasons of the source stage that drop a document (the others repair bytes or skip blank
# lines): empty/binary text, records that hold no document (``on_invalid: skip``), and
# conversations that cannot be trained on (SFT).
_SOURCE_DROPS = (DROPPED_EMPTY, DROPPED_BINARY, *INVALID_RECORDS, *CHAT_INVALID_REASONS)
# SFT rendering: conversations dropped, and conversations kept but cut to fit ``seq_len``.
_RENDER_DROPS = (DROPPED_TOO_LONG, NOTHING_TO_TRAIN)
_RENDER_CUTS = (TRUNCATED, TRUNCATED_START, TURNS_CUT)
FALLBACK_REASON = "fallback_offline"  # stacklm.data.sources.FALLBACK_OFFLINE, without importing the sources here
HOLDOUT_REASON = "holdout_other_split"


def graph_report(graph) -> dict[str, Any]:
    """What a worker reports of one built graph (its part of a summary): the mixer's counts
    (``mixed``), the stage counts, the packing, and for the pre-training graph its mixture
    phases, each stage's own seconds (``StageClock``), the token ledger and decontamination."""
    out = {"mixed": graph.realized(), "stats": graph.stats(), "packing": graph.packing()}
    if hasattr(graph, "phases"):  # the pre-training graph's mixture phases (stacklm.data.mix.schedule)
        out["mix_phases"] = graph.phases()
    if hasattr(graph, "stage_seconds"):  # each stage's own seconds since the worker started
        out["stage_seconds"] = graph.stage_seconds()
    if hasattr(graph, "mix"):  # the token ledger at this batch: delivered = what left the packer
        from stacklm.data.ledger import pipeline_ledger
        from stacklm.data.quality.decontam import chain_report

        out["ledger"] = pipeline_ledger(graph)
        report = chain_report(graph.chains)
        if report is not None:  # per evaluation set (stacklm.data.quality.decontam)
            out["decontam"] = report
    return out


def merge_worker_summaries(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Sum the workers' latest summaries into the drop side of the ``data_stats`` protocol.

    Drops are counted where they happen, in the workers, so they cover the documents the
    workers have processed (a summary is at most ``SUMMARY_EVERY_N_BATCHES`` batches old): in
    documents (``dropped_docs``: stage -> source -> reason) and in tokens (``dropped_tokens``:
    source -> reason, the tokens the mix budget cut). Holdout documents (the other split's
    share) are ``holdout_docs``, not drops; SFT conversations cut to fit, and documents the
    mix budget cut short (``cut_by_budget``), are ``cut_docs`` (source -> reason). What was
    *delivered* is counted in the main process (``DeliveryCounter``), never here."""
    dropped_docs: dict[str, dict[str, dict[str, int]]] = {}
    cut_docs: dict[str, dict[str, int]] = {}
    dropped_tokens: dict[str, dict[str, int]] = {}
    holdout: dict[str, int] = {}
    fallback: set[str] = set()

    def add(stage: str, src: str, reason: str, n: int) -> None:
        if n:
            slot = dropped_docs.setdefault(stage, {}).setdefault(src, {})
            slot[reason] = slot.get(reason, 0) + int(n)

    for s in summaries:
        for stage, per_src in s["stats"].items():
            for src, per_reason in per_src.items():
                for reason, n in per_reason.items():
                    if stage == "source":
                        if reason in _SOURCE_DROPS:
                            add(stage, src, reason, n)
                        elif reason == FALLBACK_REASON and n:
                            fallback.add(src)
                    elif stage == "holdout":
                        if reason == HOLDOUT_REASON:
                            holdout[src] = holdout.get(src, 0) + int(n)
                    elif (stage == "dedup" or drops_by_reason(stage)) and reason != "kept":  # filter, user stages, decontam
                        add(stage, src, reason, n)
                    elif stage == "render":
                        if reason in _RENDER_DROPS:
                            add(stage, src, reason, n)
                        elif reason in _RENDER_CUTS and n:
                            slot = cut_docs.setdefault(src, {})
                            slot[reason] = slot.get(reason, 0) + int(n)
        for src, row in (s.get("mixed") or {}).items():
            add("mix", src, "empty_after_tokenize", int(row.get("empty_docs", 0)))
            cut = int(row.get("truncated_tokens", 0))
            if cut:
                slot = dropped_tokens.setdefault(src, {})
                slot["cut_by_budget"] = slot.get("cut_by_budget", 0) + cut
            if row.get("truncated_docs"):  # kept, but cut short by the budget: the documents those tokens came off
                slot = cut_docs.setdefault(src, {})
                slot["cut_by_budget"] = slot.get("cut_by_budget", 0) + int(row["truncated_docs"])
    out = {"dropped_docs": dropped_docs, "dropped_tokens": dropped_tokens, "holdout_docs": holdout,
           "offline_fallback": sorted(fallback)}
    if cut_docs:
        out["cut_docs"] = cut_docs
    phases = [s["mix_phases"] for s in summaries if s.get("mix_phases")]
    if phases:
        out["mix_phases"] = merge_phase_reports(phases)
    decontam = [s["decontam"] for s in summaries if s.get("decontam")]
    if decontam:  # per evaluation set: docs and tokens removed, examples (stacklm.data.quality.decontam)
        from stacklm.data.quality.decontam import merge_reports

        out["decontamination"] = merge_reports(decontam)
    clocks = [s["stage_seconds"] for s in summaries if s.get("stage_seconds")]
    if clocks:  # seconds of each stage's own work, summed over the workers (stacklm.data.stage_clock)
        out["stage_seconds"] = {stage: sum(c.get(stage, 0.0) for c in clocks) for stage in {k for c in clocks for k in c}}
    ledgers = [s["ledger"] for s in summaries if s.get("ledger")]
    if ledgers:
        # each worker's ledger is exact at its own summary's batch, so the sum is exact too;
        # checked at every log step (stacklm.data.ledger.enforce: strict in tests, a warning in a run)
        from stacklm.data import ledger

        merged = ledger.merge(ledgers)
        ledger.enforce(merged, "stream loader workers")
        out["ledger"] = ledger.with_status(merged)
    return out


def first_local_batch(batch: int, worker: int, workers: int) -> int:
    """The first batch of worker ``worker``'s own stream that the loader deals at (per-rank)
    batch index ``batch`` or later: the loader deals round-robin, worker ``w``'s ``j``-th batch
    is the rank's batch ``j * workers + w``."""
    return max(0, -(-(batch - worker) // workers))


def _padding_batch(batch_size: int, seq_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """A batch of padding rows that carries no loss, in the four planes (``contract.padding_batch``)."""
    return padding_batch(batch_size, seq_len, pad_id)


class _StreamIterator:
    """One worker's stream: builds its node graph lazily, yields exactly ``n_batches``.

    Stateful (``state_dict``/``load_state_dict``) so its worker sends snapshots of it to the
    main process and a resume restores it there (``worker_state.SnapshotIterator``). Every
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
        self.dry: list[str] = []
        self.fresh = True  # no summary sent since this iterator started (not part of the state)
        self.mix_changes_applied = 0  # of ``dataset.mix_changes`` (online re-weighting)

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
        self._apply_mix_changes(graph)
        try:
            batch = next(graph.batches)
        except StopIteration:
            if self.padded == 0 and self.ds.split != "val":  # val: its holdout read to the end is expected (DeliveryCounter.note_dry)
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
        dry = self._dry_sources(graph)
        if (self.yielded % SUMMARY_EVERY_N_BATCHES == 0 or self.yielded == self.ds.n_batches or self.padded == 1
                or dry != self.dry or self.fresh):
            # also with the first batch of a start or a resume (numbers from the first logging step on)
            # and when a source runs dry
            self.dry, self.fresh = dry, False
            batch = {**batch, SUMMARY_KEY: self.summary()}
        return batch

    @staticmethod
    def _dry_sources(graph) -> list[str]:
        realized = graph.realized() if hasattr(graph, "mix") else {}
        return sorted(src for src, row in realized.items() if row.get("status") == "ran_dry")

    def _apply_mix_changes(self, graph) -> None:
        """Re-weight the mix before this worker's first batch at or after each change's
        per-rank batch index (``StackDataModule.set_mix_weights``): documents drawn for this
        batch on follow the new weights, in every worker at the same step boundary. Counted in
        the state, so a restored worker neither repeats nor skips one."""
        changes = self.ds.mix_changes
        while self.mix_changes_applied < len(changes):
            change = changes[self.mix_changes_applied]
            if first_local_batch(int(change["batch"]), self.shard.worker, self.shard.num_workers) > self.yielded:
                return
            graph.mix.set_weights(change["weights"], f"step{int(change['step'])}")
            self.mix_changes_applied += 1

    def summary(self) -> dict[str, Any]:
        """What this worker has processed so far (cumulative; restored with the state on resume):
        its drops, its mixer's counts (``mixed``: read ahead of delivery, for drops only) and
        which sources ran dry."""
        graph = self._graph()
        return {"worker": self.shard.worker, "rank": self.shard.rank, **graph_report(graph), "padding_batches": self.padded,
                "ran_dry": self._dry_sources(graph)}

    def state_dict(self) -> dict[str, Any]:
        return {"graph": self._graph().batches.state_dict(), "yielded": self.yielded, "padded": self.padded,
                "mix_changes_applied": self.mix_changes_applied}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._graph().batches.reset(state["graph"])
        self.yielded = int(state["yielded"])
        self.padded = int(state["padded"])
        self.mix_changes_applied = int(state.get("mix_changes_applied", 0))


class PipelineBuilder:
    """Picklable (spawned workers) factory of one reader's graph: the mix budget is split
    evenly over all readers (ranks x workers), each reading its own shard of the sources.
    ``config`` is the parsed ``PipelineConfig`` (a mapping is parsed here, once, in the main
    process): the workers receive the typed object and parse nothing.

    Its packers always track provenance (each window's document pieces), whether or not the
    run writes a step log (``stacklm.data.storage.steplog``): the packer's state then has one
    layout, so a run may turn its step log on or off at a resume."""

    def __init__(self, config: PipelineConfig | Mapping[str, Any], tokenizer_path: str, split: str) -> None:
        self.config, self.tokenizer_path, self.split = PipelineConfig.coerce(config), tokenizer_path, split

    def __call__(self, shard: ShardSpec, n_readers: int, epoch: int = 0):
        from dataclasses import replace

        from stacklm.tokenizer.bpe import StackTokenizer

        cfg = self.config
        per_reader = replace(cfg.mix, total_tokens=max(1, cfg.mix.total_tokens // n_readers))
        return replace(cfg, mix=per_reader).build(StackTokenizer.load(self.tokenizer_path), split=self.split, shard=shard,
                                                  epoch=epoch, provenance=True)


class SFTBuilder:
    """Picklable factory of one reader's SFT graph (``stacklm.data.sft``) from the parsed
    ``SFTConfig`` (a mapping is parsed here, once, in the main process). ``quiet``: its readers
    count rejected conversations without saying them (``stacklm.data.sft.quiet_readers``), for
    graphs whose records another reader of the run has said already."""

    def __init__(self, config: SFTConfig | Mapping[str, Any], tokenizer_path: str, split: str, *, quiet: bool = False) -> None:
        from stacklm.data.sft import SFTConfig

        self.config, self.tokenizer_path, self.split, self.quiet = SFTConfig.coerce(config), tokenizer_path, split, quiet

    def __call__(self, shard: ShardSpec, n_readers: int, epoch: int = 0):  # one order every epoch (counted once)
        from stacklm.data.sft import quiet_readers
        from stacklm.tokenizer.bpe import StackTokenizer

        graph = self._build(StackTokenizer.load(self.tokenizer_path), shard)
        return quiet_readers(graph) if self.quiet else graph

    def _build(self, tokenizer, shard: ShardSpec):
        return self.config.build(tokenizer, split=self.split, shard=shard)


class PreferenceBuilder(SFTBuilder):
    """Picklable factory of one reader's preference graph (``StackDataModule(mode="preference")``)."""

    def _build(self, tokenizer, shard: ShardSpec):  # one order every epoch
        from stacklm.data.sft.preference_pipeline import build_preference_pipeline

        return build_preference_pipeline(self.config, tokenizer, self.split, shard)


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
        sources: list[str] | None = None,
        target_weights: dict[str, float] | None = None,
    ) -> None:
        self.build, self.split = build, split
        self.rank, self.world_size = rank, world_size
        self.n_batches_total = n_batches_total
        self.batch_size, self.seq_len, self.pad_id = batch_size, seq_len, pad_id
        self.n_batches = n_batches_total
        self.epoch = 0  # the pass over the data; set by the loader before its workers start
        # the order of the per-source delivery counts on every batch (the mix entries' order)
        self.sources, self.target_weights = list(sources or []), dict(target_weights or {})
        # Online re-weighting, sorted by batch: [{"step", "batch" (per-rank loader index), "weights"}].
        # Workers read it when they start, so a change made later restarts them (StackDataLoader).
        self.mix_changes: list[dict[str, Any]] = []
        # Set by the loader just before its workers start (``loader.StackDataLoader._open``): loader
        # steps between snapshots, and where each worker role starts on a resume (None: afresh).
        self.snapshot_every = 1000
        self.worker_start: dict[str, Any] | None = None

    def __len__(self) -> int:
        return self.n_batches_total

    def builder(self, shard: ShardSpec):
        return self.build(shard, shard.count, epoch=self.epoch)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        start = self.worker_start or {}
        # the role this worker plays: a resume continues the round-robin order where it stopped
        # (``loader.StackDataLoader``'s order rule)
        role = (worker + int(start.get("offset", 0))) % workers
        roles = start.get("roles")
        return SnapshotIterator(self._iterator(role, workers), role, roles[role] if roles else None, workers=workers,
                                every=self.snapshot_every, offset=self.steps_before())

    def steps_before(self) -> int:
        """Per-rank batches trained in this epoch before this pass started (0: the pass is the epoch)."""
        return 0

    def _iterator(self, worker: int, workers: int) -> Iterator[dict[str, torch.Tensor]]:
        """Reader ``worker`` of ``workers``'s stateful iterator."""
        # each worker yields an equal share; the loader interleaves them round-robin
        self.n_batches = self.n_batches_total // workers
        return _StreamIterator(self, ShardSpec(self.rank, self.world_size, worker, workers))
