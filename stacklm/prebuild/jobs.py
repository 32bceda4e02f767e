"""One job: (split, worker) -> shards, checkpointed after every shard."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data.storage import statefile
from stacklm.data.storage.provenance import prov_path
from stacklm.data.storage.shards import atomic_write_shard_file, list_shard_files, meta_path, shard_name, tokens_path, write_shard
from stacklm.errors import PrebuildError, StateFileError
from stacklm.prebuild.plan import PrebuildPlan, job_name, state_dir_of, worker_config

PROGRESS_INTERVAL = 2.0  # seconds between progress reports of a job (besides one per shard)


def load_checkpoint(path: Path) -> dict[str, Any] | None:
    """A job's resume checkpoint, or None when there is none. Data only (``statefile``: JSON and
    arrays, never unpickled), because the output directory may be shared storage that others
    write: a crafted or foreign file is refused, naming it and the fix, and nothing in it runs."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    fix = "delete it (that job then starts over) and re-run the same command"
    try:
        ckpt = statefile.loads(data, path, fix)
    except StateFileError as e:
        raise PrebuildError(str(e), path=path) from None
    if not isinstance(ckpt, dict) or not {"shards", "state", "tracker"} <= ckpt.keys():
        raise PrebuildError(f"{path}: not a prebuild checkpoint (fields shards, state, tracker missing); {fix}", path=path)
    return ckpt


def run_job(
    plan: PrebuildPlan,
    split: str,
    worker: int,
    on_progress: Callable[[str, int, dict[str, int], int], None] | None = None,
    *,
    build: Callable | None = None,
    interval: float = PROGRESS_INTERVAL,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Run (or resume, or skip when done) job ``(split, worker)``; return its summary.

    ``on_progress(job, shards, tokens per source, docs)`` is called at the start, after every
    shard and every ``interval`` seconds of ``clock`` in between (a shard of 100M tokens takes
    minutes: progress once per shard would look stuck). ``build`` defaults to
    ``stacklm.data.pipeline.build_pipeline``.
    """
    if build is None:
        from stacklm.data.pipeline import build_pipeline as build
    name = job_name(split, worker)
    state_dir = state_dir_of(plan.out)
    done_path = state_dir / f"{name}.done.json"
    if done_path.exists():
        summary = json.loads(done_path.read_text())
        if on_progress is not None:  # a resumed build's progress counts the jobs done before too
            on_progress(name, *summary_counts(summary))
        return summary
    ckpt_path = state_dir / f"{name}.ckpt"
    split_dir = plan.out / split
    split_dir.mkdir(parents=True, exist_ok=True)

    from stacklm.data.ledger import pipeline_ledger
    from stacklm.data.quality.decontam import chain_report
    from stacklm.data.storage.provenance import source_files
    from stacklm.prebuild.shard_tracker import ShardTracker
    from stacklm.prebuild import signing

    index = job_dedup_index(plan, split, worker)
    pipe = build(*job_pipeline_args(plan, split, worker), dedup_index=index, provenance=plan.provenance)
    # a small build's dedup pass signed only a prefix of some sources: read nothing outside it
    signed = index.meta.get("signed", {}) if index is not None else {}
    signing.apply(pipe.sources, signed.get("fractions", {}).get(split, {}))
    windows = pipe.windows
    ckpt = load_checkpoint(ckpt_path)
    shards: list[dict] = list(ckpt["shards"]) if ckpt else []
    windows.reset(ckpt["state"] if ckpt else None)
    tracker = ShardTracker(windows, plan.provenance)  # delivered per source; provenance side files
    tracker.load_state(ckpt.get("tracker") if ckpt else None)
    remove_own_shards_from(split_dir, plan.workers, worker, len(shards))

    last_report = [clock()]

    def report() -> None:
        if on_progress is not None:
            realized = pipe.realized()
            on_progress(name, len(shards), {src: int(r["tokens"]) for src, r in realized.items()}, sum(int(r["docs"]) for r in realized.values()))
            last_report[0] = clock()

    def checkpoint() -> None:
        # what a resume needs and no more: the shards so far, the pipeline's state, the delivered counts
        atomic_write_shard_file(ckpt_path, statefile.dumps({"shards": shards, "state": windows.state_dict(), "tracker": tracker.state()}))
        report()

    def tick() -> None:
        if clock() - last_report[0] >= interval:
            report()

    report()
    write_job_shards(plan, split_dir, worker, windows, shards, on_shard=checkpoint, tracker=tracker,
                     on_window=tick if on_progress is not None else None)
    signing.check_budget_met(pipe.realized(), signed, split, plan.out)
    summary = {
        "split": split,
        "worker": worker,
        "workers": plan.workers,
        "budget": int(pipe.mix.mixer.total_tokens),
        "shards": shards,
        "stats": pipe.stats(),
        "realized": pipe.realized(),
        "mix_phases": pipe.phases(),
        "packing": pipe.packing(),
        "decontam": chain_report(pipe.chains),  # per evaluation set (None without decontaminate:)
        # the job's token ledger: delivered = what the shards hold (stacklm.data.ledger)
        "ledger": pipeline_ledger(pipe, tracker.delivered_by_source()),
        "read": read_summary(pipe),
    }
    if plan.provenance:
        summary["provenance"] = {"files": {name: source_files(node) for name, node in pipe.sources.items()},
                                 "bytes": sum(prov_path(split_dir, d["name"]).stat().st_size for d in shards)}
    atomic_write_shard_file(done_path, json.dumps(summary, sort_keys=True).encode())
    ckpt_path.unlink(missing_ok=True)
    return summary


def summary_counts(summary: dict[str, Any]) -> tuple[int, dict[str, int], int]:
    """``(shards, tokens per source, docs)`` of a finished job's summary: its last progress report."""
    realized = summary["realized"]
    return len(summary["shards"]), {src: int(r["tokens"]) for src, r in realized.items()}, sum(int(r["docs"]) for r in realized.values())


def read_summary(pipe) -> dict[str, dict[str, int]]:
    """The job's read volume (``manifests.read_volume``): input bytes its sources read, each
    source's size, and the bytes of its piece index (``stacklm.data.sources.pieces``)."""
    return {key: {name: int(getattr(node, attr, 0)) for name, node in pipe.sources.items()}
            for key, attr in (("bytes", "bytes_in"), ("input_bytes", "input_bytes"), ("index_bytes", "index_bytes"))}


def job_pipeline_args(plan: PrebuildPlan, split: str, worker: int) -> tuple:
    """``build_pipeline``'s arguments for job ``(split, worker)``: its budget share, and
    in-flight dedup off when the global pass decides (``dedup_pass``)."""
    from stacklm.data.sources import ShardSpec
    from stacklm.prebuild.dedup_pass import packing_config

    return packing_config(worker_config(plan.config, worker, plan.workers)), plan.tokenizer, split, ShardSpec(0, 1, worker, plan.workers)


def job_dedup_index(plan: PrebuildPlan, split: str | None = None, worker: int | None = None):
    """The build's global dedup index (saved before any packing job), or None without dedup.

    With ``split`` and ``worker``, and when the staged decision (``prebuild-datatrove``) wrote
    one shard per job (``.prebuild/dedup-index/<job>.npz``), only that job's shard: the removed
    ids among the documents this job reads, not the whole index."""
    from stacklm.prebuild.dedup_pass import INDEX_FILE, INDEX_SHARDS, load_build_index, uses_global_dedup

    if not uses_global_dedup(plan.config):
        return None
    shards = state_dir_of(plan.out) / INDEX_SHARDS
    if split is not None and shards.is_dir():
        path = shards / f"{job_name(split, worker)}.npz"
        if not path.exists():
            raise PrebuildError(f"{path} is missing: the dedup decision task wrote no shard for this job; re-run the prebuild", path=path)
        return load_build_index(path)
    path = state_dir_of(plan.out) / INDEX_FILE
    if not path.exists():
        raise PrebuildError(f"{path} is missing: the global dedup pass must run before the packing jobs; re-run the prebuild", path=path)
    return load_build_index(path)


def write_job_shards(
    plan: PrebuildPlan,
    split_dir: Path,
    worker: int,
    windows: Iterable[np.ndarray],
    shards: list[dict],
    on_shard: Callable[[], None],
    tracker=None,
    on_window: Callable[[], None] | None = None,
) -> None:
    """Write ``windows`` as job ``worker``'s next shards, ``plan.seqs_per_shard`` windows each
    (the last may be shorter). Its ``j``-th shard is global index ``j * workers + worker``, so
    jobs never collide; each one's info is appended to ``shards`` (which may already hold the
    shards of a resumed job), then ``on_shard()`` runs (checkpoint, progress). Shared by
    ``run_job`` and the datatrove writer, so both write the same set. ``tracker``
    (``stacklm.prebuild.shard_tracker.ShardTracker``) sees every window and writes each shard's
    provenance side file right before the shard. ``on_window()`` runs after every window
    (``run_job``'s timed progress)."""
    buf = np.empty((plan.seqs_per_shard, plan.config.seq_len), dtype=plan.dtype)

    def commit(n: int) -> None:
        index = len(shards) * plan.workers + worker
        if tracker is not None:
            tracker.commit(split_dir, shard_name(index))
        info = write_shard(split_dir, index, buf[:n], plan.dtype)
        shards.append(info.to_dict())
        on_shard()

    n = 0
    for window in windows:
        buf[n] = window
        if tracker is not None:
            tracker.window(window)
        n += 1
        if n == plan.seqs_per_shard:
            commit(n)
            n = 0
        if on_window is not None:
            on_window()
    if n:
        commit(n)


def remove_own_shards_from(split_dir: Path, workers: int, worker: int, keep: int) -> None:
    """Delete this job's shards at local index >= ``keep``: written after the last checkpoint
    (the job is about to rewrite them, identically) — never left looking complete meanwhile."""
    for name in list_shard_files(split_dir):
        index = int(name.rsplit("_", 1)[1])
        if index % workers == worker and index // workers >= keep:
            meta_path(split_dir, name).unlink(missing_ok=True)
            tokens_path(split_dir, name).unlink(missing_ok=True)
            prov_path(split_dir, name).unlink(missing_ok=True)


def job_budget(plan: PrebuildPlan, split: str, worker: int) -> int:
    """Tokens job ``(split, worker)`` will mix (for the progress bar's ETA)."""
    total = worker_config(plan.config, worker, plan.workers).mix.total_tokens
    return max(1, round(total * plan.config.holdout_fraction)) if split == "val" else total
