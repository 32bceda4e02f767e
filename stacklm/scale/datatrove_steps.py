"""The prebuild as datatrove pipeline steps, for a cluster (Slurm, Ray) or one machine.

    stacklm prebuild-datatrove --config C.yaml --out DIR --tasks 64 \\
        --executor slurm --partition cpu --time 04:00:00 --cpus-per-task 4

Each datatrove task is one prebuild job: with ``T = --tasks`` per split, task ``r`` builds split
``splits[r // T]`` as reader ``r % T`` of ``T`` (its ``ShardSpec``) with a ``1/T`` share of the
budget, exactly like ``stacklm prebuild --workers T``. When dedup is on, three executors run
first, in the shape of datatrove's MinHash dedup (``stacklm.data.dedup.staged``):
``StackDedupSignatures`` (every task: its slice's signature columns), ``StackDedupBuckets``
(one task per band and key range, and per digest range: the exact decision and the verified
near pairs) and ``StackDedupCluster`` (the ``decision`` stage, one task holding one partition
of the verified pairs at a time: the removed ids, one shard per packing task, with evidence); each packing task drops the ids of its own shard. The
decision is the one ``stacklm prebuild`` makes in one process (``decide_splits``: the same
removed ids), and it does not depend on ``T``. Three steps run in each packing task:

1. ``StackMixedDocuments`` (reader): source -> holdout -> filter -> dedup -> tokenize -> mix
   -> shuffle, yielding tokenized documents;
2. ``StackPacker``: document-aware packing into ``seq_len`` windows;
3. ``StackShardWriter``: crash-safe shard files at the global indices of that task, plus the
   task's counts (``.prebuild/<split>-w<k>.done.json``).

A one-task job (``StackManifestMerger``) then merges the tasks' counts into the manifests. The
executors that chain these steps, and run them, are ``stacklm.scale.datatrove_executors``'.
The merged output is byte-identical to ``stacklm prebuild --workers T`` (tested), so a shard
set can be built on a cluster and checked against a local run of a small config. Resume is
datatrove's: finished tasks are skipped (``logging_dir/completions``), a failed task reruns
from its start and rewrites its own shards.

``stacklm dedup-index --executor local|slurm|ray`` (``datatrove_executors.dedup_index_executors``)
runs the same three dedup stages, then a one-task ``index`` stage (``StackDedupIndexWriter``)
that merges the removed-id shards into stream mode's one index file: the file ``dedup-index``
writes in its own process (same arrays, same ``content_hash``) for every ``T`` and engine. No tokenizer is
needed: the dedup steps read only the config and their folder, never ``TaskPlan.prebuild_plan``.

Why the stages are grouped into three steps and not one per node: the mixer draws from all
sources at once (one budget), and the shuffle and packer keep buffers across documents, so
the reader owns the per-source chains up to the shuffle; each step still counts what it
kept (datatrove ``stat_update``), and the drop counts go into the manifest.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stacklm.atomic import atomic_write_bytes
from stacklm.data.splits import SPLITS
from stacklm.errors import PrebuildError
from stacklm.optional import require

require("datatrove", "scale", "the datatrove prebuild (stacklm.scale)")  # missing: an error naming the extra

from datatrove.data import Document, DocumentsPipeline  # noqa: E402
from datatrove.pipeline.base import PipelineStep  # noqa: E402

SUMMARY_KEY = "stacklm_task_summary"

# What the steps import when a task runs them (inside ``run``, so that naming a step stays light),
# imported once by the local executor's forkserver instead of by every task
# (``supervise.forkserver_preload``): torch and torchdata through the pipeline, the tokenizer, the
# prebuild's job and dedup code; and ``stacklm.cli.app``, which the ``stacklm`` console script
# imports: each task re-runs the main script as ``__mp_main__`` (Python 3.11's forkserver does not
# preload ``__main__`` itself). Nothing here imports Lightning, wandb or the trainer.
TASK_PRELOAD = ["stacklm.cli.app", "numpy", "torch", "torchdata.nodes", "stacklm.tokenizer.bpe", "stacklm.data.pipeline",
                "stacklm.data.dedup.staged", "stacklm.prebuild.jobs", "stacklm.prebuild.dedup_pass",
                "stacklm.prebuild.manifests", "stacklm.prebuild.shard_tracker", "stacklm.data.packing.nodes"]


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    """Plain, picklable description of the build every step rebuilds its objects from."""

    config: dict[str, Any]  # PipelineConfig.to_dict()
    tokenizer: dict[str, Any]  # StackTokenizer.to_dict(); {} for dedup-index (its stages never tokenize)
    out: str
    tasks_per_split: int
    tokens_per_shard: int
    splits: tuple[str, ...] = SPLITS
    logs: str = ""  # the chain's datatrove logging folder (error messages name a task's log in it)
    exact_ranges: int = 1  # dedup bucket tasks: digest ranges (exact) and key ranges per band (near)
    near_ranges: int = 1

    def prebuild_plan(self):
        from stacklm.data.pipeline import PipelineConfig
        from stacklm.prebuild.plan import PrebuildPlan
        from stacklm.tokenizer.bpe import StackTokenizer

        return PrebuildPlan(
            PipelineConfig.from_dict(self.config), StackTokenizer.from_dict(self.tokenizer), Path(self.out),
            self.tasks_per_split, self.tokens_per_shard, self.splits,
        )

    def job_of(self, rank: int, world_size: int) -> tuple[str, int]:
        """(split, worker) of datatrove task ``rank``."""
        if world_size != self.tasks_per_split * len(self.splits):
            raise ValueError(
                f"the executor runs {world_size} tasks but the plan has {self.tasks_per_split} per split x "
                f"{len(self.splits)} splits; build the executors with `prebuild_executors`"
            )
        return self.splits[rank // self.tasks_per_split], rank % self.tasks_per_split


class _StackStep(PipelineStep):
    def __init__(self, plan: TaskPlan) -> None:
        super().__init__()
        self.plan = plan

    def __call__(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        _die_with_parent_if_worker()
        return super().__call__(data, rank, world_size)

    def built(self):
        """The live objects, rebuilt inside each task and never kept on the step: datatrove
        pickles and deep-copies steps, and a tokenizer's tiktoken core does not copy."""
        return self.plan.prebuild_plan()


def _die_with_parent_if_worker() -> None:
    """A task running in a process started for it (a ``multiprocess`` pool worker of datatrove's
    local executor, the pool child of a datatrove Ray actor, a ``run_chain`` task process) dies
    with its parent, so a killed worker or actor leaves no orphan writing the shards its retry
    writes. A task run in the command's own process (``workers=1``, a Ray worker) is left alone."""
    import multiprocessing

    import multiprocess

    if multiprocess.parent_process() is not None or multiprocessing.parent_process() is not None:
        from stacklm.parent_death import die_with_parent

        die_with_parent()


def _without_summary(data: DocumentsPipeline, summary: dict[str, Any]) -> Iterator[Document]:
    """The documents of ``data`` less the previous step's summary, which goes into ``summary``
    (a step passes its counts down the pipeline as one last document)."""
    for doc in data:
        if SUMMARY_KEY in doc.metadata:
            summary.update(doc.metadata[SUMMARY_KEY])
        else:
            yield doc


class StackMixedDocuments(_StackStep):
    """Reader: this task's slice of every source through holdout, filter, dedup, tokenize,
    the budgeted mix and the shuffle buffer. Ends with one summary document (the counts)."""

    name = "stacklm mixed documents"
    type = "📖 - READER"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from stacklm.data.ledger import pipeline_ledger
        from stacklm.data.pipeline import build_pipeline
        from stacklm.data.quality.decontam import chain_report
        from stacklm.data.storage.provenance import source_files
        from stacklm.prebuild.jobs import job_dedup_index, job_pipeline_args, read_summary

        split, worker = self.plan.job_of(rank, world_size)
        plan = self.built()
        pipe = build_pipeline(*job_pipeline_args(plan, split, worker), dedup_index=job_dedup_index(plan, split, worker))
        for doc in pipe.shuffle:
            self.stat_update("docs")
            self.stat_update("tokens", value=int(doc["ids"].size))
            meta = {k: v for k, v in doc.items() if k != "doc_id"}
            yield Document(text="", id=str(doc.get("doc_id", "")), metadata=meta)
        summary = {
            "split": split, "worker": worker, "workers": plan.workers, "budget": int(pipe.mix.mixer.total_tokens),
            "stats": pipe.stats(), "realized": pipe.realized(), "mix_phases": pipe.phases(),
            # the ledger up to the shuffle; the writer fills in what the shards deliver
            "ledger": pipeline_ledger(pipe, {}),
            "decontam": chain_report(pipe.chains),  # per evaluation set (None without decontaminate:)
            "provenance_files": {name: source_files(node) for name, node in pipe.sources.items()},
            "read": read_summary(pipe),
        }
        yield Document(text="", id=f"{split}/{worker}/summary", metadata={SUMMARY_KEY: summary})


SIG_DIR, PAIRS_DIR = "dedup-sig", "dedup-pairs"  # under OUT/.prebuild, beside INDEX_SHARDS


def _sig_dirs(plan) -> list[Path]:
    """Every slice's signature directory, in file-number order (split, worker): the order the
    bucket tasks number their nodes by (the kept-copy rule never looks at it)."""
    from stacklm.prebuild.jobs import job_name
    from stacklm.prebuild.plan import STATE_DIR

    return [Path(plan.out) / STATE_DIR / SIG_DIR / job_name(s, w) for s in plan.splits for w in range(plan.tasks_per_split)]


def bucket_tasks(plan: TaskPlan) -> list[tuple[str, int, int]]:
    """``(column, range, ranges)`` of every bucket task: ``exact_ranges`` digest ranges (when exact
    dedup is on), then ``near_ranges`` key ranges of each band (when near dedup is on)."""
    from stacklm.data.dedup.config import DedupConfig
    from stacklm.data.dedup.minhash import MinHasher

    dedup = DedupConfig.from_dict(plan.config.get("dedup", {}), "dedup")  # not PipelineConfig: that imports torch
    out = [("digest", r, plan.exact_ranges) for r in range(plan.exact_ranges)] if dedup.exact else []
    if dedup.near:
        out += [(f"band{b}", r, plan.near_ranges) for b in range(MinHasher().num_bands) for r in range(plan.near_ranges)]
    return out


class StackDedupSignatures(_StackStep):
    """Global dedup, stage 1 (``T`` tasks per split, datatrove's ``MinhashDedupSignature``): this
    task's slice of every source through holdout and filter, as signature columns in
    ``.prebuild/dedup-sig/<job>/`` (``staged.write_signature_dir``: band keys and digests sorted,
    plain ``.npy`` read back with ``allow_pickle=False``). Our own step, not datatrove's: the
    keys must be the stream path's (``DedupConfig.min_hasher``: char or word shingles, as configured)."""

    name = "stacklm dedup signatures"
    type = "🫂 - DEDUP"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from stacklm.data.dedup.staged import write_signature_dir
        from stacklm.prebuild.dedup_pass import signature_slice

        split, worker = self.plan.job_of(rank, world_size)
        sig = signature_slice(self.plan.config, split, worker, self.plan.tasks_per_split)
        meta = write_signature_dir(sig, split, _sig_dirs(self.plan)[rank])
        # this task's read volume per source (the cluster step sums it into the index's meta)
        read = _sig_dirs(self.plan)[rank].with_suffix(".read.json")
        names = [e["name"] for e in self.plan.config["mix"]["entries"]]
        atomic_write_bytes(read, json.dumps({"split": split, "bytes": dict(zip(names, map(int, sig["bytes_in"])))}).encode())
        self.stat_update("docs", value=meta["n"])
        return
        yield


class StackDedupBuckets(_StackStep):
    """Global dedup, stage 2 (datatrove's ``MinhashDedupBuckets``: one task per band and key
    range; here also one per digest range for exact dedup): ``staged.run_bucket_task`` over every
    slice, to ``.prebuild/dedup-pairs/`` (the exact decision of its digest range, or the
    verified edges of its band range, one file per decision partition). It reads only its
    range of each slice's sorted columns, sorting at most ``staged.DEFAULT_CHUNK`` records at
    once, so its memory does not grow with the corpus."""

    name = "stacklm dedup buckets"
    type = "🫂 - DEDUP"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        # nothing here may import torch (stacklm.data.pipeline does): ~3 CPU-s of every bucket task
        from stacklm.data.dedup.config import DedupConfig
        from stacklm.data.dedup.staged import run_bucket_task
        from stacklm.prebuild.plan import STATE_DIR

        tasks = bucket_tasks(self.plan)
        if world_size != len(tasks):
            raise ValueError(f"the bucket executor runs {world_size} tasks but the plan has {len(tasks)}; build the executors with `prebuild_executors`")
        column, r, ranges = tasks[rank]
        threshold = DedupConfig.from_dict(self.plan.config.get("dedup", {}), "dedup").near_threshold
        stats = run_bucket_task(_sig_dirs(self.plan), column, r, ranges, Path(self.plan.out) / STATE_DIR / PAIRS_DIR, threshold)
        self.stat_update("pairs", value=stats["rows"])
        return
        yield


class StackDedupCluster(_StackStep):
    """Global dedup, stages 3 and 4 (one task; datatrove's ``MinhashDedupCluster`` then the
    removed ids ``MinhashDedupFilter`` reads): ``decision.decide_partitioned`` over the verified
    edges, one decision partition at a time (a document is removed only for a kept document it
    is verified-similar to, in canonical order: split priority, val wins, then mix entry, part,
    row: the rule of ``decide_splits``, so the same for every ``T``), then one removed-id shard
    per packing task (``.prebuild/dedup-index/<job>.npz``, which that task alone loads) with its
    evidence beside it. Our own cluster, not datatrove's: its root is the union-by-size one of
    task-rank ids (changes with ``T``), its components chain, and it has no cross-split rule."""

    name = "stacklm dedup cluster"
    type = "🫂 - DEDUP"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from stacklm.data.dedup.global_index import binding_meta
        from stacklm.data.dedup.shards import write_index_shards
        from stacklm.data.dedup.decision import decide_partitioned
        from stacklm.data.dedup.staged import bucket_files, default_partitions, slice_meta
        from stacklm.data.pipeline import PipelineConfig
        from stacklm.prebuild.dedup_pass import INDEX_SHARDS
        from stacklm.prebuild.plan import STATE_DIR

        # the config and the folder only, not ``self.built()``: that loads a tokenizer, and
        # ``stacklm dedup-index`` has none (the dedup stages never tokenize)
        state = Path(self.plan.out) / STATE_DIR
        dirs = _sig_dirs(self.plan)
        partitions = default_partitions(sum(int(slice_meta(d)["n"]) for d in dirs))  # what the bucket tasks split by
        exact, near = bucket_files(state / PAIRS_DIR, bucket_tasks(self.plan), partitions)
        with decide_partitioned(dirs, exact, near) as decision:  # its spool is removed on leaving
            bytes_read: dict[str, dict[str, int]] = {}  # the signature pass's read volume, as decide_index records it
            for d in dirs:
                rec = json.loads(d.with_suffix(".read.json").read_text())
                per = bytes_read.setdefault(rec["split"], {})
                for src, n in rec["bytes"].items():
                    per[src] = per.get(src, 0) + int(n)
            config = PipelineConfig.from_dict(self.plan.config)
            # bound to the corpus the signature tasks read (``global_index.check_bound``): the same
            # globs, from the same working directory
            totals = write_index_shards(dirs, decision, state / INDEX_SHARDS,
                                        {"dedup": config.dedup.index_meta(), "bytes_read": bytes_read, **binding_meta(config)})
        for split, counts in totals.items():
            for reason, n in counts.items():
                self.stat_update(f"{split}/{reason}", value=n)
        shutil.rmtree(state / SIG_DIR, ignore_errors=True)
        shutil.rmtree(state / PAIRS_DIR, ignore_errors=True)
        return
        yield


class StackDedupIndexWriter(_StackStep):
    """``stacklm dedup-index`` on an executor, the last stage (``index``, one task): the cluster's
    removed-id shards (``.prebuild/dedup-index/<job>.npz`` in the work folder), merged in (split,
    worker) order (``shards.load_shards``: the arrays, ``content_hash`` and counts of the one
    file ``build_dedup_index`` makes in one process, for any ``T``), saved at ``out_file``
    (written beside and renamed: a reader never sees half a file), then the work folder removed."""

    name = "stacklm dedup index"
    type = "💽 - WRITER"

    def __init__(self, plan: TaskPlan, out_file: str) -> None:
        super().__init__(plan)
        self.out_file = str(out_file)

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from stacklm.data.dedup.shards import save_merged
        from stacklm.prebuild.dedup_pass import INDEX_SHARDS
        from stacklm.prebuild.plan import STATE_DIR, job_name

        shards = Path(self.plan.out) / STATE_DIR / INDEX_SHARDS
        paths = [shards / f"{job_name(s, w)}.npz" for s in self.plan.splits for w in range(self.plan.tasks_per_split)]
        missing = [p for p in paths if not p.exists()]
        if missing:
            raise FileNotFoundError(f"{missing[0]} is missing: the dedup decision task has not finished; rerun the same command")
        index = save_merged(paths, self.out_file)  # atomic (``atomic_write_bytes``), its evidence beside it
        for split, counts in index.counts().items():
            for reason, n in counts.items():
                self.stat_update(f"{split}/{reason}", value=n)
        shutil.rmtree(self.plan.out, ignore_errors=True)
        return
        yield


class StackPacker(_StackStep):
    """Packs the documents into ``seq_len`` windows (``PackNode``, same strategy and buffer)."""

    name = "stacklm packer"
    type = "🔢 - TOKENIZER"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from torchdata.nodes import IterableWrapper

        from stacklm.data.packing.nodes import PackNode

        plan = self.built()
        cfg, tok = plan.config, plan.tokenizer
        summary: dict[str, Any] = {}
        docs = ({**d.metadata, "doc_id": d.id} for d in _without_summary(data, summary))
        node = PackNode(IterableWrapper(docs), cfg.seq_len, cfg.strategy, tok.bos_id, tok.eos_id, tok.pad_id, cfg.pack_buffer_docs,
                        sources=[e.name for e in cfg.mix.entries], provenance=plan.provenance)
        for i, window in enumerate(node):
            self.stat_update("windows")
            yield Document(text="", id=str(i), metadata={"window": window, "origin": node.last_origin})
        packing = node.summary()
        self.stat_update("docs_cut", value=int(packing["docs_cut"]))
        self.stat_update("pad_tokens", value=int(packing["pad_tokens"]))
        yield Document(text="", id="summary", metadata={SUMMARY_KEY: {**summary, "packing": packing}})


class StackShardWriter(_StackStep):
    """Writes the task's windows as shards ``j * T + worker`` and its summary for the merge."""

    name = "stacklm shard writer"
    type = "💽 - WRITER"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from types import SimpleNamespace

        from stacklm.data.storage.provenance import prov_path
        from stacklm.data.storage.shards import atomic_write_shard_file
        from stacklm.prebuild.jobs import job_name, remove_own_shards_from, write_job_shards
        from stacklm.prebuild.plan import STATE_DIR
        from stacklm.prebuild.shard_tracker import ShardTracker

        split, worker = self.plan.job_of(rank, world_size)
        plan = self.built()
        split_dir = plan.out / split
        split_dir.mkdir(parents=True, exist_ok=True)
        remove_own_shards_from(split_dir, plan.workers, worker, 0)  # a rerun task rewrites them all
        summary: dict[str, Any] = {}
        tok = plan.tokenizer
        # what ShardTracker reads from a PackNode: the origin of the window being written
        holder = SimpleNamespace(last_origin=None, packer=SimpleNamespace(
            sources=[e.name for e in plan.config.mix.entries], bos_id=tok.bos_id, eos_id=tok.eos_id))
        tracker = ShardTracker(holder, plan.provenance)

        def windows():
            for d in _without_summary(data, summary):
                holder.last_origin = d.metadata["origin"]
                yield d.metadata["window"]

        shards: list[dict] = []
        progress = TaskProgress(f"stacklm {split} task {worker}", plan.config.seq_len, shards)
        write_job_shards(plan, split_dir, worker, windows(), shards, on_shard=lambda: self.stat_update("shards"), tracker=tracker,
                         on_window=progress.window)
        progress.report(final=True)
        if not summary:
            raise RuntimeError(f"task {rank}: the packer sent no summary; run StackMixedDocuments -> StackPacker -> StackShardWriter in that order")
        summary["shards"] = shards
        for name, (docs, tokens) in tracker.delivered_by_source().items():  # the ledger's delivered: what the shards hold
            summary["ledger"][name]["docs"]["delivered"], summary["ledger"][name]["tokens"]["delivered"] = docs, tokens
        files = summary.pop("provenance_files")
        if plan.provenance:
            summary["provenance"] = {"files": files, "bytes": sum(prov_path(split_dir, d["name"]).stat().st_size for d in shards)}
        state_dir = plan.out / STATE_DIR
        state_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_shard_file(state_dir / f"{job_name(split, worker)}.done.json", json.dumps(summary, sort_keys=True).encode())
        return
        yield  # a generator step that yields nothing: the writer ends the pipeline


class TaskProgress:
    """A shard-writing task's progress in its datatrove log every ``PROGRESS_INTERVAL`` seconds
    (windows, tokens, shards, rate), as ``stacklm prebuild`` reports it: datatrove's own stats
    come only when a task ends, and a task of a large split runs for hours."""

    def __init__(self, name: str, seq_len: int, shards: list, interval: float | None = None, clock=None) -> None:
        import time

        from stacklm.prebuild.jobs import PROGRESS_INTERVAL

        self.name, self.seq_len, self.shards = name, int(seq_len), shards
        self.interval = PROGRESS_INTERVAL if interval is None else float(interval)
        self.clock = clock or time.monotonic
        self.start = self.last = self.clock()
        self.windows = 0

    def window(self) -> None:
        self.windows += 1
        if self.clock() - self.last >= self.interval:
            self.report()

    def report(self, final: bool = False) -> None:
        from datatrove.utils.logging import logger

        self.last = now = self.clock()
        secs = max(now - self.start, 1e-9)
        logger.info(f"{self.name}: {'done, ' if final else ''}{self.windows:,} windows of {self.seq_len} tokens, "
                    f"{len(self.shards)} shard(s) written, {secs:,.0f} s, {self.windows * self.seq_len / secs:,.0f} tokens/s")


class StackManifestMerger(_StackStep):
    """One task, after all the others: merge their counts into the split and top manifests,
    refusing a task whose ledger does not add up or that wrote nothing from its input
    (``manifests.check_tasks``: the message names the task's rank and log)."""

    name = "stacklm manifest merge"
    type = "💽 - WRITER"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        from stacklm.prebuild.jobs import job_name
        from stacklm.prebuild.manifests import finalize
        from stacklm.prebuild.plan import STATE_DIR

        from stacklm.data.storage.shards import remove_temp_files

        plan = self.built()
        for split in plan.splits:  # leftovers of writes killed midway; every writer has finished now
            remove_temp_files(plan.out / split)
        summaries = []
        for split in plan.splits:
            for worker in range(plan.workers):
                path = plan.out / STATE_DIR / f"{job_name(split, worker)}.done.json"
                if not path.exists():
                    raise PrebuildError(f"{path} is missing: task for split {split!r}, worker {worker} has not finished; rerun the main job first", path=path)
                summaries.append(json.loads(path.read_text()))
        def name_task(split: str, worker: int) -> str:  # the main stage's rank of (split, worker), and its log
            rank = plan.splits.index(split) * plan.workers + worker
            return f"split {split!r} worker {worker} (datatrove stage 'main' task {rank}, log {self.plan.logs}/main/logs/task_{rank:05d}.log)"

        top = finalize(plan, plan.identity(), summaries, name_task)
        self.stat_update("sequences", value=sum(s["n_seq"] for s in top["splits"].values()))
        return
        yield
