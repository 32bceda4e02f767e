"""The whole build: claim the directory, lock it, run the jobs (here or in a pool of spawned
processes), then write the manifests."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import re
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stacklm.atomic import atomic_write_bytes
from stacklm.data.storage import manifest as mf
from stacklm.data.storage.shards import remove_temp_files
from stacklm.errors import PrebuildError
from stacklm.parent_death import pool_initializer
from stacklm.prebuild.dedup_pass import load_or_build, uses_global_dedup
from stacklm.prebuild.jobs import PROGRESS_INTERVAL, run_job
from stacklm.prebuild.manifests import finalize, prepare
from stacklm.prebuild.plan import DEFAULT_TOKENS_PER_SHARD, SPLITS, PrebuildPlan, state_dir_of
from stacklm.prebuild.signing import SIGN_MARGIN
from stacklm.prebuild.progress import BuildProgress
from stacklm.progress_lines import duration


def prebuild(
    config,
    tokenizer,
    out: str | os.PathLike,
    *,
    workers: int = 1,
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD,
    splits: Sequence[str] = SPLITS,
    progress: bool = True,
    provenance: bool = True,
    progress_interval: float = PROGRESS_INTERVAL,
    sign_margin: float = SIGN_MARGIN,
) -> dict[str, Any]:
    """Build (or resume, or confirm) the shard set in ``out``; returns the top manifest.

    ``out`` may be a remote URL (``s3://bucket/prefix``, any fsspec protocol): the build runs in
    a local staging directory and is uploaded, manifests last (``stacklm.data.storage.remote``).

    ``config`` is a ``PipelineConfig``; ``tokenizer`` a ``StackTokenizer`` or the path of its
    artifact. ``workers > 1`` runs the jobs in that many spawned processes. ``provenance``
    writes a side file per shard naming each row's document pieces (``stacklm.data.storage.provenance``).
    ``progress``: a live bar on stderr, updated every ``progress_interval`` seconds by each job
    (the summary table is ``stacklm.prebuild.summary``'s, printed by the CLI whatever this says).
    ``sign_margin``: a budget well under the sources signs only what it can reach, this many
    times its estimate (``stacklm.prebuild.signing``); 0 signs the whole corpus.
    """
    from stacklm.data.storage import remote

    config.check_stages_run()  # the jobs run the user stages: refused before the output is touched
    if remote.is_remote(out):  # build in a local staging dir, upload, manifests last (``remote``)
        kw = dict(workers=workers, tokens_per_shard=tokens_per_shard, splits=splits, progress=progress,
                  provenance=provenance, progress_interval=progress_interval, sign_margin=sign_margin)
        tok = resolve_tokenizer(tokenizer)
        return prebuild_remote(str(out), lambda stage: prebuild(config, tok, stage, **kw),
                               say=(lambda m: print(m, file=sys.stderr)) if progress else None)
    tokenizer = resolve_tokenizer(tokenizer)
    plan = PrebuildPlan(config, tokenizer, Path(out), int(workers), int(tokens_per_shard), tuple(splits), bool(provenance), float(sign_margin))
    # The lock is taken before the directory is even checked and held to the end: a second
    # prebuild of the same directory is refused at once, whatever phase the first is in.
    created_state = not state_dir_of(plan.out).exists()
    state_dir_of(plan.out).mkdir(parents=True, exist_ok=True)
    lock = lock_out_dir(plan.out)
    try:
        identity, complete = prepare(plan)
    except BaseException:
        if created_state:  # refused: leave the directory as we found it
            shutil.rmtree(state_dir_of(plan.out), ignore_errors=True)
        lock.close()
        raise
    if complete:
        lock.close()
        if progress:
            print(f"{plan.out}: already complete (same config, tokenizer and workers); nothing to do", file=sys.stderr)
        return mf.read_manifest(plan.out)
    bar = BuildProgress(plan, progress)
    t0 = time.perf_counter()
    jobs = [(s, w) for s in plan.splits for w in range(plan.workers)]
    # Leftovers of writes killed midway go now, before any job runs: a job clearing the shared
    # folders itself would delete the temporary files other jobs are writing at that moment.
    for folder in [plan.out / s for s in plan.splits] + [state_dir_of(plan.out)]:
        remove_temp_files(folder)
    from stacklm.data.sources.pieces import CACHE_ENV as PIECE_CACHE_ENV

    saved_cache = os.environ.get(PIECE_CACHE_ENV)
    phases: dict[str, float] = {}  # seconds per phase of this run, said in the last progress line

    def timed(phase: str, start: float) -> float:
        now = time.perf_counter()
        phases[phase] = phases.get(phase, 0.0) + now - start
        return now

    try:
        t = time.perf_counter()
        index_pieces(plan.config, plan.workers, state_dir_of(plan.out) / "pieces")
        if plan.config.decontaminate is not None:  # the evaluation sets' index, once, before any job: jobs memory-map it
            from stacklm.data.quality.decontam import ensure_index

            ensure_index(plan.config.decontaminate, announce=True)
        t = timed("index", t)
        with worker_pool(plan.workers) as (pool, progress_queue):  # one pool for the dedup pass and the jobs
            if uses_global_dedup(plan.config):
                bar.say("global dedup pass: signing and deciding (no progress lines until it ends)")
                load_or_build(plan, None if pool is None else pool_starmap(pool))
                t = timed("dedup", t)
                bar.say(f"global dedup pass done in {duration(phases['dedup'])}; packing")
            if pool is None:
                summaries = [run_job(plan, s, w, bar, interval=progress_interval) for s, w in jobs]
            else:
                summaries = _run_pool(plan, jobs, bar, progress_interval, pool=pool, progress_queue=progress_queue)
            t = timed("jobs", t)
        top = finalize(plan, identity, summaries)
        timed("merge", t)
        bar.finish(summaries, top.get("warnings", []))
    except BaseException:
        release_if_empty(plan)
        raise
    finally:
        bar.close()
        lock.close()
        if saved_cache is None:
            os.environ.pop(PIECE_CACHE_ENV, None)
        else:
            os.environ[PIECE_CACHE_ENV] = saved_cache
    for w in top.get("warnings", ()):  # loud whatever the progress setting
        warnings.warn(f"prebuild {plan.out}: {w['message']} (recorded in the manifest's 'warnings')", RuntimeWarning, stacklevel=2)
    if progress:
        secs = time.perf_counter() - t0
        done = bar.tokens - bar.resumed_tokens
        print(
            f"prebuild: {sum(s['n_tokens'] for s in top['splits'].values()):,} tokens in "
            f"{sum(s['shards'] for s in top['splits'].values())} shards -> {plan.out} "
            f"({done / max(secs, 1e-9):,.0f} mixed tok/s this run, {secs:.1f}s, workers={plan.workers}; "
            + ", ".join(f"{k} {v:.1f}s" for k, v in phases.items()) + ")",
            file=sys.stderr,
        )
    return top


def index_pieces(config, readers: int, folder: Path) -> None:
    """Build the piece index of every local source read in pieces (fewer files than
    ``readers``, or ``read_order: spread``; ``stacklm.data.sources.pieces``) here, once, into
    ``folder``, and point this process and the task processes it starts at it
    (``STACKLM_PIECE_CACHE``): each task then reads only its own pieces instead of counting
    every file's lines again."""
    from stacklm.data.pipeline import read_order_seed
    from stacklm.data.sources import ShardSpec, open_source
    from stacklm.data.sources.pieces import CACHE_ENV as PIECE_CACHE_ENV

    folder.mkdir(parents=True, exist_ok=True)
    os.environ[PIECE_CACHE_ENV] = str(folder)
    for entry in config.mix.entries:
        if entry.kind == "local":
            open_source(entry, shard=ShardSpec(0, 1, 0, readers), order_seed=read_order_seed(config, entry.name)).index_all()


def lock_out_dir(out: Path):
    """An exclusive lock on ``out`` for this process (released by the kernel, even on SIGKILL),
    so two prebuilds never write the same directory at once."""
    import fcntl

    f = open(state_dir_of(out) / "lock", "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise PrebuildError(f"another `stacklm prebuild` is writing {out} right now; wait for it (or stop it) and re-run", path=out) from None
    return f


def release_if_empty(plan: PrebuildPlan) -> bool:
    """After a failed build: when no job has finished or written a shard, drop the claim (the
    state folder and empty split folders), so a re-run with a fixed config starts afresh
    instead of being refused as "a different build". True when released."""
    state = state_dir_of(plan.out)
    progress_files = [p for p in state.glob("*") if p.name.endswith((".ckpt", ".done.json"))] if state.exists() else []
    shards = [p for s in plan.splits if (plan.out / s).is_dir() for p in (plan.out / s).iterdir()]
    if progress_files or shards:
        return False
    shutil.rmtree(state, ignore_errors=True)
    for s in plan.splits:
        if (plan.out / s).is_dir():
            (plan.out / s).rmdir()
    return True


@contextlib.contextmanager
def worker_pool(workers: int):
    """``(pool, progress_queue)``: ``workers`` spawned processes (spawn, not fork: the parent may
    hold torch's thread pools, which do not survive a fork), shared by the global dedup pass
    and the packing jobs -- each process pays its start (~2-4 s of imports: torch, torchdata,
    the tokenizer) once per build, not once per phase. ``(None, None)`` for one worker: the
    build runs in this process. Workers die with this process (``stacklm.parent_death``: the
    death signal is set before they import the rest of stacklm, and they check the parent
    again before every write)."""
    if workers <= 1:
        yield None, None
        return
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    init_args = (os.getpid(), f"{__name__}:_init_pool_worker", q)
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=pool_initializer, initargs=init_args) as pool:
        yield pool, q


def pool_starmap(pool):
    """A ``dedup_pass.Starmap`` over ``pool``: the global dedup pass's slices and bucket tasks run
    in the build's processes. Their arguments and results are small (paths, read volumes, a
    bucket task's counts: its rows go to files): each slice writes its signature columns to disk, so
    the parent never holds the signatures."""
    return lambda fn, args: pool.map(fn, *zip(*args)) if args else iter(())


def _run_pool(plan: PrebuildPlan, jobs: list[tuple[str, int]], bar: BuildProgress, interval: float = PROGRESS_INTERVAL, *,
              pool, progress_queue) -> list[dict[str, Any]]:
    """Jobs in ``pool`` (``worker_pool``); progress comes back through ``progress_queue``."""
    import queue as queue_lib
    from concurrent.futures import FIRST_COMPLETED, wait

    q = progress_queue
    # The tokenizer travels as its artifact dict: its caches (a tiktoken core) need not pickle.
    # This pickle is in-memory IPC from this process to the workers it spawns (the pool's own
    # channel pickles anyway); it never touches disk, so no file anyone else wrote is unpickled.
    blob = pickle.dumps((dataclasses.replace(plan, tokenizer=None), plan.tokenizer.to_dict()))
    results = []
    pending = {pool.submit(_pool_job, blob, s, w, interval) for s, w in jobs}
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


def resolve_tokenizer(tokenizer):
    """A ``StackTokenizer`` as given, or loaded from the path of its artifact."""
    from stacklm.tokenizer.bpe import StackTokenizer

    if isinstance(tokenizer, (str, os.PathLike)):
        return StackTokenizer.load(tokenizer)
    return tokenizer


_QUEUE = None


def _init_pool_worker(queue) -> None:
    global _QUEUE
    _QUEUE = queue


def _pool_job(plan_blob: bytes, split: str, worker: int, interval: float = PROGRESS_INTERVAL) -> dict[str, Any]:
    from stacklm.tokenizer.bpe import StackTokenizer

    plan, tok = pickle.loads(plan_blob)
    plan = dataclasses.replace(plan, tokenizer=StackTokenizer.from_dict(tok))
    return run_job(plan, split, worker, lambda *msg: _QUEUE.put(msg), interval=interval)


def prebuild_remote(url: str, build: Callable[[Path], dict[str, Any]], *, stage: Path | None = None, say=None) -> dict[str, Any]:
    """``prebuild`` into ``url``: ``build(stage)`` runs the ordinary local build, then the result
    is uploaded (``remote.upload_shard_set``) and the staging directory removed. An existing remote top
    manifest is copied into the staging directory first, so the local checks decide as they do
    for a local ``--out``: the same build is complete (nothing to do), another build is refused.
    Here, not in ``stacklm.data.storage.remote``: it drives a build (and names its errors), and
    data/ sits below prebuild/."""
    from stacklm.data.storage import remote

    stage = Path(stage or remote.staging_dir(url))
    # read first: a URL that cannot be served (no filesystem, no bucket) is refused before anything is written
    remote_top = remote.read_bytes(remote.join(url, mf.MANIFEST_NAME), missing_ok=True)
    made_stage = not stage.exists()  # a folder the user gave (--stage-dir) is never removed for being empty
    stage.mkdir(parents=True, exist_ok=True)
    copied = False
    built_here = any(p.is_dir() for p in stage.iterdir())  # split dirs or .prebuild: a local build to resume
    if remote_top is None and (stage / mf.MANIFEST_NAME).exists() and not built_here:
        (stage / mf.MANIFEST_NAME).unlink()  # a copy of a remote manifest that is gone now: nothing to trust
    if remote_top is not None and not (stage / mf.MANIFEST_NAME).exists():
        atomic_write_bytes(stage / mf.MANIFEST_NAME, remote_top)
        copied = True
    try:
        top = build(stage)
    except PrebuildError as e:  # name the URL the user gave, not the staging directory
        if copied:
            shutil.rmtree(stage, ignore_errors=True)
        # the stage itself and paths in it; not a folder beside it (a datatrove run's STAGE.datatrove-logs)
        shown = re.sub(re.escape(str(stage)) + r"(?![\w.-])", url, str(e))
        if shown == str(e):
            raise
        raise PrebuildError(shown, path=url) from None
    finally:
        if made_stage and stage.is_dir() and not any(stage.iterdir()):
            stage.rmdir()  # refused before anything was built (a bad flag, another build there): leave no empty folder
    if remote_top is not None and (stage / mf.MANIFEST_NAME).read_bytes() == remote_top and not any(p.is_dir() for p in stage.iterdir()):
        shutil.rmtree(stage, ignore_errors=True)  # already complete there
        return top
    t0 = time.perf_counter()
    n = remote.upload_shard_set(stage, url)
    if say is not None:
        say(f"prebuild: uploaded {n} files to {url} ({time.perf_counter() - t0:.1f}s; manifests last)")
    shutil.rmtree(stage, ignore_errors=True)
    return top
