"""``stacklm prebuild``: the streaming pipes, run once, written to token shards.

    stacklm prebuild --config configs/demo.yaml --out data/demo [--workers N] [--tokenizer DIR]
    stacklm verify data/demo [--tokenizer DIR]

Work is split into *jobs*, one per (split, worker). Worker ``w`` of ``N`` builds the pipeline
(``nodes.build_pipeline``) over reader ``w`` of ``N`` of every source (``ShardSpec``) with a
``1/N`` share of the token budget, and writes its shards as global indices ``w, w+N, w+2N, ...``
of ``OUT/<split>/``. So the result depends only on the config, the tokenizer and ``N``: the
same ``N`` gives byte-identical output, a different ``N`` a different (equally valid) one.

Crash safety: after each shard is renamed into place the job checkpoints the pipeline's
``state_dict()`` (``OUT/.prebuild/<split>-w<k>.ckpt``, written atomically). A re-run with the
same arguments restores every job from its checkpoint; the pipeline contract (exact resume)
makes the continuation, and so every shard, byte-identical to an uninterrupted run. Shards
written after the last checkpoint are simply rewritten. The manifests are written last, then
``.prebuild/`` is removed: a directory with a top-level ``manifest.json`` is a finished build.
A directory built from another config, tokenizer, worker count or shard size is refused with
the differences named.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data import manifest as mf
from stacklm.data.shards import (
    ShardError,
    atomic_write_bytes,
    dtype_name,
    list_shard_files,
    meta_path,
    remove_temp_files,
    token_dtype,
    tokens_path,
    write_shard,
)
from stacklm.errors import StackLMError

ARTIFACT_NAME = "tokenizer.stacklm.json"
STATE_DIR = ".prebuild"
BUILD_FILE = "build.json"
REVISIONS_FILE = "revisions.json"
DEFAULT_TOKENS_PER_SHARD = 100_000_000  # ~200 MB of uint16 per shard, as nanochat's shards
SPLITS = ("train", "val")
# Fields of the config that do not change the written tokens (left out of the identity).
_NON_CONTENT_FIELDS = ("num_threads", "batch_size", "drop_last")


class PrebuildError(ShardError, StackLMError):
    """The prebuild cannot start or continue; the message says why and what to do."""


# ---------------------------------------------------------------------------------------
# Plan: what a build is, and its identity (what a re-run must match to resume).
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PrebuildPlan:
    config: Any  # PipelineConfig
    tokenizer: Any  # StackTokenizer
    out: Path
    workers: int = 1
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD
    splits: tuple[str, ...] = SPLITS

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        if self.tokens_per_shard < self.config.seq_len:
            raise ValueError(f"tokens_per_shard ({self.tokens_per_shard}) must hold at least one sequence of seq_len {self.config.seq_len}")
        bad = [s for s in self.splits if s not in SPLITS]
        if bad or not self.splits:
            raise ValueError(f"splits must be a non-empty subset of {SPLITS}, got {self.splits}")

    @property
    def seqs_per_shard(self) -> int:
        return self.tokens_per_shard // self.config.seq_len

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.tokenizer.vocab_size)

    def content_config(self) -> dict[str, Any]:
        """The config as JSON types (tuples become lists), minus fields that do not change the tokens."""
        d = {k: v for k, v in self.config.to_dict().items() if k not in _NON_CONTENT_FIELDS}
        return json.loads(json.dumps(d))

    def identity(self) -> dict[str, Any]:
        """Everything that decides the bytes written; a resume must match it exactly."""
        return {
            "config": self.content_config(),
            "config_hash": self.config.config_hash(exclude=_NON_CONTENT_FIELDS),
            "tokenizer_hash": mf.tokenizer_hash(self.tokenizer),
            "vocab_size": self.tokenizer.vocab_size,
            "workers": self.workers,
            "tokens_per_shard": self.tokens_per_shard,
            "splits": list(self.splits),
        }


def worker_config(config, worker: int, workers: int):
    """The config of worker ``worker``: the same, with its share of the token budget
    (largest remainder, so the shares add up to the budget exactly)."""
    if workers == 1:
        return config
    from stacklm.data.mix import split_budget

    share = int(split_budget(config.mix.total_tokens, np.ones(workers))[worker])
    if share <= 0:
        raise PrebuildError(f"--workers {workers} leaves worker {worker} no tokens of the budget {config.mix.total_tokens}; use fewer workers")
    return dataclasses.replace(config, mix=dataclasses.replace(config.mix, total_tokens=share))


# ---------------------------------------------------------------------------------------
# One job: (split, worker) -> shards, checkpointed after every shard.
# ---------------------------------------------------------------------------------------
def _job_name(split: str, worker: int) -> str:
    return f"{split}-w{worker:03d}"


def _state_dir(out: Path) -> Path:
    return out / STATE_DIR


def _load_pickle(path: Path) -> Any:
    try:
        return pickle.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except Exception as e:  # a checkpoint is written atomically, so this is outside damage
        raise PrebuildError(f"{path}: unreadable checkpoint ({type(e).__name__}: {e}); delete it to redo that job from the start") from None


def run_job(
    plan: PrebuildPlan,
    split: str,
    worker: int,
    on_progress: Callable[[str, int, dict[str, int]], None] | None = None,
    *,
    build: Callable | None = None,
) -> dict[str, Any]:
    """Run (or resume, or skip when done) job ``(split, worker)``; return its summary.

    ``build`` defaults to ``stacklm.data.nodes.build_pipeline``.
    """
    from stacklm.data.sources import ShardSpec

    if build is None:
        from stacklm.data.nodes import build_pipeline as build
    name = _job_name(split, worker)
    state_dir = _state_dir(plan.out)
    done_path = state_dir / f"{name}.done.json"
    if done_path.exists():
        return json.loads(done_path.read_text())
    ckpt_path = state_dir / f"{name}.ckpt"
    split_dir = plan.out / split
    split_dir.mkdir(parents=True, exist_ok=True)

    pipe = build(worker_config(plan.config, worker, plan.workers), plan.tokenizer, split, ShardSpec(0, 1, worker, plan.workers))
    windows = pipe.windows
    ckpt = _load_pickle(ckpt_path)
    shards: list[dict] = list(ckpt["shards"]) if ckpt else []
    windows.reset(ckpt["state"] if ckpt else None)
    _remove_own_shards_from(split_dir, plan.workers, worker, len(shards))

    def realized_tokens() -> dict[str, int]:
        return {src: int(r["tokens"]) for src, r in pipe.realized().items()}

    def checkpoint() -> None:
        atomic_write_bytes(ckpt_path, pickle.dumps({"shards": shards, "state": windows.state_dict()}, protocol=5))
        if on_progress is not None:
            on_progress(name, len(shards), realized_tokens())

    if on_progress is not None:
        on_progress(name, len(shards), realized_tokens())
    write_job_shards(plan, split_dir, worker, windows, shards, on_shard=checkpoint)
    summary = {
        "split": split,
        "worker": worker,
        "workers": plan.workers,
        "budget": int(pipe.mix.mixer.total_tokens),
        "shards": shards,
        "stats": pipe.stats(),
        "realized": pipe.realized(),
        "packing": pipe.packing(),
    }
    atomic_write_bytes(done_path, json.dumps(summary, sort_keys=True).encode())
    ckpt_path.unlink(missing_ok=True)
    return summary


def write_job_shards(
    plan: PrebuildPlan, split_dir: Path, worker: int, windows: Iterable[np.ndarray], shards: list[dict], on_shard: Callable[[], None]
) -> None:
    """Write ``windows`` as job ``worker``'s next shards, ``plan.seqs_per_shard`` windows each
    (the last may be shorter). Its ``j``-th shard is global index ``j * workers + worker``, so
    jobs never collide; each one's info is appended to ``shards`` (which may already hold the
    shards of a resumed job), then ``on_shard()`` runs (checkpoint, progress). Shared by
    ``run_job`` and the datatrove writer, so both write the same set."""
    buf = np.empty((plan.seqs_per_shard, plan.config.seq_len), dtype=plan.dtype)

    def commit(n: int) -> None:
        info = write_shard(split_dir, len(shards) * plan.workers + worker, buf[:n], plan.dtype)
        shards.append(info.to_dict())
        on_shard()

    n = 0
    for window in windows:
        buf[n] = window
        n += 1
        if n == plan.seqs_per_shard:
            commit(n)
            n = 0
    if n:
        commit(n)


def _remove_own_shards_from(split_dir: Path, workers: int, worker: int, keep: int) -> None:
    """Delete this job's shards at local index >= ``keep``: written after the last checkpoint
    (the job is about to rewrite them, identically) — never left looking complete meanwhile."""
    for name in list_shard_files(split_dir):
        index = int(name.rsplit("_", 1)[1])
        if index % workers == worker and index // workers >= keep:
            meta_path(split_dir, name).unlink(missing_ok=True)
            tokens_path(split_dir, name).unlink(missing_ok=True)


def job_budget(plan: PrebuildPlan, split: str, worker: int) -> int:
    """Tokens job ``(split, worker)`` will mix (for the progress bar's ETA)."""
    total = worker_config(plan.config, worker, plan.workers).mix.total_tokens
    return max(1, round(total * plan.config.holdout_fraction)) if split == "val" else total


# ---------------------------------------------------------------------------------------
# Progress
# ---------------------------------------------------------------------------------------
class _Progress:
    """One tqdm bar over all jobs: mixed tokens vs the token budget (rate, ETA), the realized
    mix so far in the postfix."""

    def __init__(self, plan: PrebuildPlan, enabled: bool) -> None:
        self.budget = sum(job_budget(plan, s, w) for s in plan.splits for w in range(plan.workers))
        self.per_job: dict[str, dict[str, int]] = {}
        self.shards: dict[str, int] = {}
        self.bar = None
        self.resumed_tokens = 0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.budget, unit="tok", unit_scale=True, desc=f"prebuild {plan.out.name}", dynamic_ncols=True)

    @property
    def tokens(self) -> int:
        return sum(sum(v.values()) for v in self.per_job.values())

    def __call__(self, job: str, shards: int, realized: dict[str, int]) -> None:
        before = self.tokens
        resumed = job not in self.per_job
        self.per_job[job] = realized
        self.shards[job] = shards
        if resumed:  # tokens restored from a checkpoint: not this run's throughput
            self.resumed_tokens += self.tokens - before
        if self.bar is None:
            return
        mix: dict[str, int] = {}
        for job_name, per in self.per_job.items():
            if job_name.startswith("train"):
                for src, n in per.items():
                    mix[src] = mix.get(src, 0) + n
        total = sum(mix.values()) or 1
        postfix = " ".join(f"{src}={n / total:.3f}" for src, n in mix.items())
        self.bar.set_postfix_str(f"shards={sum(self.shards.values())} mix: {postfix}", refresh=False)
        if resumed:
            self.bar.n += self.tokens - before
            self.bar.last_print_n = self.bar.n
        else:
            self.bar.update(self.tokens - before)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_QUEUE = None


def _init_pool_worker(queue) -> None:
    global _QUEUE
    _QUEUE = queue


def _pool_job(plan_blob: bytes, split: str, worker: int) -> dict[str, Any]:
    from stacklm.tokenizer.bpe import StackTokenizer

    plan, tok = pickle.loads(plan_blob)
    plan = dataclasses.replace(plan, tokenizer=StackTokenizer.from_dict(tok))
    return run_job(plan, split, worker, lambda *msg: _QUEUE.put(msg))


# ---------------------------------------------------------------------------------------
# The whole build
# ---------------------------------------------------------------------------------------
def _check_out_dir(plan: PrebuildPlan, identity: dict[str, Any]) -> bool:
    """Refuse a directory built (or being built) differently; True when already complete."""
    out = plan.out
    top = mf.manifest_path(out)
    build_file = _state_dir(out) / BUILD_FILE
    if top.exists():
        found, where = mf.read_manifest(out).get("build", {}), top
    elif build_file.exists():
        found, where = json.loads(build_file.read_text()), build_file
    elif out.exists() and any(p.name != STATE_DIR for p in out.iterdir()):  # a bare .prebuild/: killed while claiming
        raise PrebuildError(
            f"{out} is not empty and holds no stacklm prebuild ({top.name} or {STATE_DIR}/{BUILD_FILE}); "
            "choose a new or empty --out directory",
            path=out,
        )
    else:
        return False
    problems = []
    if found.get("tokenizer_hash") != identity["tokenizer_hash"]:
        problems.append(
            f"tokenizer: built with sha256 {str(found.get('tokenizer_hash'))[:16]}... (vocab {found.get('vocab_size')}), "
            f"this run's tokenizer is {identity['tokenizer_hash'][:16]}... (vocab {identity['vocab_size']})"
        )
    diffs = mf.config_differences(found.get("config", {}), identity["config"])
    if diffs:
        problems.append("config: " + "; ".join(diffs[:8]) + (f"; ... {len(diffs) - 8} more" if len(diffs) > 8 else ""))
    for key in ("workers", "tokens_per_shard", "splits"):
        if found.get(key) != identity[key]:
            problems.append(f"{key}: built with {found.get(key)!r}, this run has {identity[key]!r}")
    if problems:
        raise PrebuildError(
            f"{where} belongs to a different build, refusing to mix them:\n  - " + "\n  - ".join(problems)
            + f"\nRe-run with the original settings to resume, or choose another --out (or delete {out}).",
            path=where,
        )
    return top.exists()


def _common_fields(plan: PrebuildPlan, identity: dict[str, Any]) -> dict[str, Any]:
    cfg, tok = plan.config, plan.tokenizer
    return {
        "format": mf.FORMAT,
        "version": mf.VERSION,
        "seq_len": cfg.seq_len,
        "dtype": dtype_name(plan.dtype),
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "tokenizer_hash": identity["tokenizer_hash"],
        "filter_config_hash": cfg.filters.config_hash(),
        "config_hash": identity["config_hash"],
        "seed": cfg.seed,
        "packing_strategy": cfg.strategy,
        "build": identity,
    }


# Source-stage reasons that each count one document read (the others count bytes or repairs).
_DOCS_READ = ("kept", "dropped_empty", "dropped_binary")


def split_manifest(plan: PrebuildPlan, identity: dict[str, Any], split: str, summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge the jobs of one split (prebuild workers or datatrove tasks) into its manifest."""
    shards: list[dict] = []
    for s in summaries:
        w, n = int(s["worker"]), int(s["workers"])
        shards += [{**info, "index": j * n + w} for j, info in enumerate(s["shards"])]
    shards.sort(key=lambda d: d["index"])
    for d in shards:
        del d["index"]
    stats = mf.sum_counts(s["stats"] for s in summaries)
    realized = mf.merge_realized((s["realized"] for s in summaries), plan.config.mix.weights)
    n_seq = sum(int(d["n_seq"]) for d in shards)
    holdout = stats.get("holdout", {})
    return {
        **_common_fields(plan, identity),
        "split": split,
        "n_seq": n_seq,
        "n_tokens": n_seq * plan.config.seq_len,
        "budget": sum(int(s["budget"]) for s in summaries),
        "shards": shards,
        "sources": mf.source_list(plan.config.mix.to_dict(), realized, stats, _resolved_revisions(plan.out)),
        "realized": realized,
        "drops": mf.drop_summary(stats, realized),
        "stats": stats,
        "holdout": {
            "fraction": plan.config.holdout_fraction,
            "docs_kept_for_this_split": sum(int(v.get("kept", 0)) for v in holdout.values()),
            "docs_skipped_for_the_other_split": sum(int(v.get("holdout_other_split", 0)) for v in holdout.values()),
        },
        "packing": mf.merge_packing(s["packing"] for s in summaries),
        "tasks": [
            {
                "worker": int(s["worker"]),
                "budget": int(s["budget"]),
                "shards": len(s["shards"]),
                "n_seq": sum(int(d["n_seq"]) for d in s["shards"]),
                "docs_read": {src: sum(int(per.get(r, 0)) for r in _DOCS_READ) for src, per in s["stats"].get("source", {}).items()},
            }
            for s in summaries
        ],
    }


def top_manifest(plan: PrebuildPlan, identity: dict[str, Any], splits: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    val = splits.get("val")
    return {
        **_common_fields(plan, identity),
        "splits": {
            name: {
                "path": name,
                "n_seq": m["n_seq"],
                "n_tokens": m["n_tokens"],
                "shards": len(m["shards"]),
                "packing": m["packing"],
            }
            for name, m in splits.items()
        },
        "sources": splits[plan.splits[0]]["sources"],
        "drops": {name: m["drops"] for name, m in splits.items()},
        "holdout": {
            "fraction": plan.config.holdout_fraction,
            "val_sequences": val["n_seq"] if val else 0,
            "val_tokens": val["n_tokens"] if val else 0,
            "val_docs": sum(r["docs"] for r in val["realized"].values()) if val else 0,
            "val_doc_tokens": sum(r["tokens"] for r in val["realized"].values()) if val else 0,
        },
    }


def finalize(plan: PrebuildPlan, identity: dict[str, Any], summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Write the split manifests, then the top manifest (the "finished" mark), then drop the
    resume state."""
    per_split = {}
    for split in plan.splits:
        jobs = sorted((s for s in summaries if s["split"] == split), key=lambda s: s["worker"])
        if len(jobs) != plan.workers:
            raise PrebuildError(f"split {split!r}: {len(jobs)} of {plan.workers} jobs finished; re-run to complete the rest")
        per_split[split] = split_manifest(plan, identity, split, jobs)
        mf.write_manifest(plan.out / split, per_split[split])
    top = top_manifest(plan, identity, per_split)
    mf.write_manifest(plan.out, top)
    shutil.rmtree(_state_dir(plan.out), ignore_errors=True)
    return top


def prepare(plan: PrebuildPlan) -> tuple[dict[str, Any], bool]:
    """Check/claim ``plan.out``: returns ``(identity, already_complete)``."""
    identity = plan.identity()
    complete = _check_out_dir(plan, identity)
    if complete:
        shutil.rmtree(_state_dir(plan.out), ignore_errors=True)  # killed after the manifest
        return identity, True
    state_dir = _state_dir(plan.out)
    state_dir.mkdir(parents=True, exist_ok=True)
    if not (state_dir / BUILD_FILE).exists():  # claims the directory for this build
        atomic_write_bytes(state_dir / BUILD_FILE, json.dumps(identity, sort_keys=True, indent=1).encode())
    if not (state_dir / REVISIONS_FILE).exists():  # resolved once, so a resume records the same
        revisions = mf.resolve_revisions(plan.config.mix.to_dict())
        atomic_write_bytes(state_dir / REVISIONS_FILE, json.dumps(revisions, sort_keys=True).encode())
    return identity, False


def _resolved_revisions(out: Path) -> dict[str, str | None]:
    path = _state_dir(out) / REVISIONS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def prebuild(
    config,
    tokenizer,
    out: str | os.PathLike,
    *,
    workers: int = 1,
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD,
    splits: Sequence[str] = SPLITS,
    progress: bool = True,
) -> dict[str, Any]:
    """Build (or resume, or confirm) the shard set in ``out``; returns the top manifest.

    ``config`` is a ``PipelineConfig``; ``tokenizer`` a ``StackTokenizer`` or the path of its
    artifact. ``workers > 1`` runs the jobs in that many spawned processes.
    """
    tokenizer = _load_tokenizer(tokenizer)
    plan = PrebuildPlan(config, tokenizer, Path(out), int(workers), int(tokens_per_shard), tuple(splits))
    identity, complete = prepare(plan)
    if complete:
        if progress:
            print(f"{plan.out}: already complete (same config, tokenizer and workers); nothing to do", file=sys.stderr)
        return mf.read_manifest(plan.out)
    lock = _lock(plan.out)
    bar = _Progress(plan, progress)
    t0 = time.perf_counter()
    jobs = [(s, w) for s in plan.splits for w in range(plan.workers)]
    # Leftovers of writes killed midway go now, before any job runs: a job clearing the shared
    # folders itself would delete the temporary files other jobs are writing at that moment.
    for folder in [plan.out / s for s in plan.splits] + [_state_dir(plan.out)]:
        remove_temp_files(folder)
    try:
        if plan.workers == 1:
            summaries = [run_job(plan, s, w, bar) for s, w in jobs]
        else:
            summaries = _run_pool(plan, jobs, bar)
        top = finalize(plan, identity, summaries)
    finally:
        bar.close()
        lock.close()
    if progress:
        secs = time.perf_counter() - t0
        done = bar.tokens - bar.resumed_tokens
        print(
            f"prebuild: {sum(s['n_tokens'] for s in top['splits'].values()):,} tokens in "
            f"{sum(s['shards'] for s in top['splits'].values())} shards -> {plan.out} "
            f"({done / max(secs, 1e-9):,.0f} mixed tok/s this run, {secs:.1f}s, workers={plan.workers})",
            file=sys.stderr,
        )
    return top


def _lock(out: Path):
    """An exclusive lock on ``out`` for this process (released by the kernel, even on SIGKILL),
    so two prebuilds never write the same directory at once."""
    import fcntl

    f = open(_state_dir(out) / "lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise PrebuildError(f"another `stacklm prebuild` is writing {out} right now; wait for it (or stop it) and re-run", path=out) from None
    return f


def _run_pool(plan: PrebuildPlan, jobs: list[tuple[str, int]], bar: _Progress) -> list[dict[str, Any]]:
    """Jobs in ``plan.workers`` spawned processes (spawn, not fork: the parent may hold torch's
    thread pools, which do not survive a fork); progress comes back through a queue."""
    import multiprocessing as mp
    import queue as queue_lib
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    # The tokenizer travels as its artifact dict: its caches (a tiktoken core) need not pickle.
    blob = pickle.dumps((dataclasses.replace(plan, tokenizer=None), plan.tokenizer.to_dict()))
    results = []
    with ProcessPoolExecutor(plan.workers, mp_context=ctx, initializer=_init_pool_worker, initargs=(q,)) as pool:
        pending = {pool.submit(_pool_job, blob, s, w) for s, w in jobs}
        try:
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                for fut in done:
                    results.append(fut.result())  # re-raises a job's error (e.g. ShardWriteError)
                while True:
                    try:
                        bar(*q.get_nowait())
                    except queue_lib.Empty:
                        break
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    return results


def _load_tokenizer(tokenizer):
    from stacklm.tokenizer.bpe import StackTokenizer

    if isinstance(tokenizer, (str, os.PathLike)):
        return StackTokenizer.load(tokenizer)
    return tokenizer


# ---------------------------------------------------------------------------------------
# Config file
# ---------------------------------------------------------------------------------------
def load_config(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(PipelineConfig, settings)`` from a YAML config.

    Two layouts are read. The trainer's: ``data:`` holds ``StackDataModule``'s arguments, the
    pipeline config under ``data.pipeline`` (``seq_len``/``batch_size``/``seed`` default to the
    module's), ``data.tokenizer`` and ``data.data_dir`` (the default ``--out``). Or a plain one:
    ``data:`` is the pipeline config itself, ``tokenizer:`` at the top. An optional top-level
    ``prebuild:`` section may set ``tokens_per_shard``, ``workers``, ``splits``, ``out``.
    ``settings`` has ``tokenizer``, ``out``, ``tokens_per_shard``, ``workers``, ``splits``.
    """
    import yaml

    from stacklm.data.nodes import PipelineConfig

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise PrebuildError(f"{path}: no such config file", path=path) from None
    except yaml.YAMLError as e:
        raise PrebuildError(f"{path}: not valid YAML ({e})", path=path) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise PrebuildError(f"{path}: expected a mapping with a 'data:' section (the pipeline config: seq_len, mix, ...)", path=path)
    data = doc["data"]
    section = doc.get("prebuild") or {}
    if "pipeline" in data:  # StackDataModule arguments
        if not isinstance(data["pipeline"], dict):
            raise PrebuildError(f"{path}: 'data.pipeline' must be the pipeline config (a mapping with mix, ...)", path=path)
        fields = dict(data["pipeline"])
        for key in ("seq_len", "batch_size", "seed"):
            if key in data:
                fields.setdefault(key, data[key])
        where, tokenizer, out = "data.pipeline", data.get("tokenizer", doc.get("tokenizer")), data.get("data_dir")
    else:
        fields, where, tokenizer, out = data, "data", doc.get("tokenizer"), None
    try:
        config = PipelineConfig.from_dict(fields)
    except (ValueError, TypeError) as e:
        raise PrebuildError(f"{path}: section {where!r}: {e}", path=path) from None
    settings = {
        "tokenizer": tokenizer,
        "out": section.get("out", out),
        "tokens_per_shard": int(section.get("tokens_per_shard", DEFAULT_TOKENS_PER_SHARD)),
        "workers": int(section.get("workers", 1)),
        "splits": tuple(section.get("splits", SPLITS)),
    }
    return config, settings
