"""The datatrove executors that run ``datatrove_steps``' steps as a chain of stages, and what
runs that chain.

``prebuild_executors`` builds ``stacklm prebuild-datatrove``'s chain (the dedup stages
``signatures`` -> ``buckets`` -> ``decision`` when dedup is on, then ``main`` and ``merge``);
``dedup_index_executors`` builds ``stacklm dedup-index --executor``'s (the same dedup stages,
then ``index``). Either runs on a local, Slurm or Ray executor, each stage with its own
resources (``stacklm.scale.resources.ClusterPlan``). ``run_executors`` runs a chain stage by
stage, every task supervised (local, Ray), or submits it (Slurm); ``stage_chain`` lists its
executors, ``describe_task`` names what one task builds, for an error message.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from stacklm.atomic import atomic_write_bytes
from stacklm.data.splits import SPLITS
from stacklm.scale.datatrove_steps import (
    TASK_PRELOAD,
    StackDedupBuckets,
    StackDedupCluster,
    StackDedupIndexWriter,
    StackDedupSignatures,
    StackManifestMerger,
    StackMixedDocuments,
    StackPacker,
    StackShardWriter,
    TaskPlan,
    bucket_tasks,
)


def describe_task(executor, rank: int) -> str:
    """What datatrove task ``rank`` of one of ``prebuild_executors``' (or ``dedup_index_executors``')
    stages builds, for an error message: "split train, worker 1 of 2" (per-split stages), the key
    range (buckets), "" for the one-task stages."""
    step = executor.pipeline[0] if executor.pipeline else None
    plan = getattr(step, "plan", None)
    if isinstance(step, StackDedupBuckets):
        column, r, ranges = bucket_tasks(plan)[rank]
        return f"dedup {column}, key range {r} of {ranges}"
    if isinstance(step, (StackDedupSignatures, StackMixedDocuments)) and executor.world_size == plan.tasks_per_split * len(plan.splits):
        split, worker = plan.job_of(rank, executor.world_size)
        return f"split {split}, worker {worker} of {plan.tasks_per_split}"
    return ""


def run_executors(last) -> None:
    """Run ``prebuild_executors``' chain to the end. Local and Ray: stage by stage, each task
    supervised (``stacklm.scale.supervise.run_chain``): a task that dies or raises ends the run
    with ``TaskFailed`` naming it and its log, instead of datatrove's wait that never ends.
    Slurm: submits the jobs (``submit_chain``; their dependencies wait in Slurm)."""
    from datatrove.executor import LocalPipelineExecutor

    from stacklm.scale.supervise import run_chain

    kinds: tuple[type, ...] = (LocalPipelineExecutor,)
    try:
        from datatrove.executor.ray import RayPipelineExecutor

        kinds += (RayPipelineExecutor,)
    except ImportError:
        pass
    if getattr(last, "stacklm_complete", False):
        return
    if isinstance(last, kinds):
        run_chain(last, describe=describe_task, preload=TASK_PRELOAD)
    else:
        from stacklm.scale.slurm import submit_chain

        submit_chain(stage_chain(last))  # the CLI's --wait then watches them (stacklm.scale.slurm.wait_for_chain)


def prebuild_executors(
    config,
    tokenizer,
    out: str | Path,
    *,
    tasks: int,
    tokens_per_shard: int | None = None,
    splits: tuple[str, ...] = SPLITS,
    executor: str = "local",
    logging_dir: str | None = None,
    cluster=None,
    dedup_ranges: int = 1,
    **executor_kwargs: Any,
):
    """``(main, merge)`` executors of the given kind (``local``, ``slurm`` or ``ray``).

    ``merge`` depends on ``main``; ``run_executors(merge)`` runs them all, stage by stage, and
    fails naming the task when one dies or raises (local, Ray), or submits them all (Slurm).
    datatrove's own ``merge.run()`` also runs them, but waits forever after a killed task.
    ``tasks`` is per split (``T``): ``main`` runs ``T * len(splits)`` tasks. ``dedup_ranges``
    (``R``): key ranges per band (and digest ranges) of the dedup ``buckets`` stage, which runs
    ``13 R`` tasks; raise it to spread a large corpus over more machines (each task's memory is
    bounded either way, the decision is the same). The output
    directory is checked/claimed here, like ``stacklm prebuild`` does. Every executor of the
    chain carries its stage name (``stacklm_stage``: ``signatures``, ``buckets``, ``decision``,
    ``main``, ``merge``; ``stage_chain(merge)`` lists them) and, on Slurm and Ray, that stage's own
    resources from ``cluster`` (a ``stacklm.scale.resources.ClusterPlan``; without one, the
    built-in defaults and any ``partition``/``time``/``cpus_per_task``/``mem_per_cpu_gb``/
    ``qos``/``env_command``/``sbatch_args`` keyword). Other keywords go to every executor.
    """
    from stacklm.prebuild.build import index_pieces, resolve_tokenizer
    from stacklm.prebuild.dedup_pass import uses_global_dedup
    from stacklm.prebuild.manifests import prepare
    from stacklm.prebuild.plan import BUILD_FILE, DEFAULT_TOKENS_PER_SHARD, STATE_DIR, PrebuildPlan

    _refuse_url(out, "prebuild-datatrove")
    config.check_stages_run()  # the tasks run the user stages: refused at launch, not in a task's log
    cluster = _resolve_cluster(executor, cluster, executor_kwargs, "main")  # refused before the output directory is claimed
    tok = resolve_tokenizer(tokenizer)
    plan = PrebuildPlan(config, tok, Path(out).absolute(), int(tasks), int(tokens_per_shard or DEFAULT_TOKENS_PER_SHARD), tuple(splits))
    fresh = not (plan.out / STATE_DIR / BUILD_FILE).exists() and not (plan.out / "manifest.json").exists()
    _, complete = prepare(plan)
    if not complete and not fresh:  # a resume: the removed ids already decided must name this corpus's documents
        from stacklm.prebuild.dedup_pass import INDEX_SHARDS, check_resumed_corpus

        if (plan.out / STATE_DIR / INDEX_SHARDS).is_dir():
            check_resumed_corpus(plan, plan.out / STATE_DIR / INDEX_SHARDS)
    if not complete:  # piece indexes built once, here; the task processes find them through the environment
        index_pieces(plan.config, plan.workers, plan.out / STATE_DIR / "pieces")
    # Logs live beside OUT, not in it: the merge removes OUT/.prebuild while its own executor
    # still writes logs, and OUT must end up exactly as `stacklm prebuild` leaves it.
    logs = logging_dir or str(plan.out.with_name(plan.out.name + ".datatrove-logs"))
    task_plan = TaskPlan(config.to_dict(), tok.to_dict(), str(plan.out), plan.workers, plan.tokens_per_shard, plan.splits, logs,
                         int(dedup_ranges), int(dedup_ranges))
    if fresh and Path(logs).is_dir():  # completion marks of an older build would skip its tasks
        shutil.rmtree(logs)
    n_tasks = plan.workers * len(plan.splits)
    make = _stage_maker(executor, cluster, logs, executor_kwargs)
    # global dedup first: signatures (all tasks) -> buckets (per range) -> decision (one task)
    before = _dedup_stages(make, task_plan) if uses_global_dedup(plan.config) else None
    steps = [StackMixedDocuments(task_plan), StackPacker(task_plan), StackShardWriter(task_plan)]
    main = make("main", steps, n_tasks, "main", "stacklm-prebuild", before)
    merge = make("merge", [StackManifestMerger(task_plan)], 1, "merge", "stacklm-merge", main)
    # the same build is already in ``out``: nothing to run (``run_executors`` returns at once)
    merge.stacklm_complete = complete
    return main, merge


def dedup_index_executors(
    config,
    out_file: str | Path,
    *,
    tasks: int,
    splits: tuple[str, ...] = SPLITS,
    executor: str = "local",
    logging_dir: str | None = None,
    cluster=None,
    dedup_ranges: int = 1,
    **executor_kwargs: Any,
):
    """``stacklm dedup-index`` on datatrove: the last executor of the chain ``signatures`` (``T``
    tasks per split) -> ``buckets`` (``13 R``) -> ``decision`` (one task) -> ``index`` (one task,
    ``StackDedupIndexWriter``), the prebuild's dedup stages and then the merge of their removed
    ids into the one file ``out_file``. Run it with ``run_executors`` (local, Ray) or submit it
    (Slurm), as ``prebuild_executors``' chain; the file has the arrays and ``content_hash`` of
    ``prebuild.dedup_pass.build_dedup_index`` (the in-process ``dedup-index``) for every ``T``,
    ``R`` and executor. No tokenizer: the dedup stages only read, filter and hash documents.

    The stages work in ``<out_file>.work/`` (the signature columns, pairs and removed-id shards;
    the ``index`` task removes it once the file is written) and log to
    ``<out_file>.datatrove-logs/`` (or ``logging_dir``), both beside ``out_file`` on a
    filesystem every node sees. A re-run resumes: the tasks with a completion mark are
    skipped. A run that starts with no work folder (the first, or one after a finished run), or
    whose work folder holds another plan (config, splits, ``T``, ``R``), starts afresh.
    ``cluster`` and the keywords as for ``prebuild_executors``."""
    from stacklm.errors import PrebuildError
    from stacklm.prebuild.build import index_pieces
    from stacklm.prebuild.dedup_pass import uses_global_dedup
    from stacklm.prebuild.plan import STATE_DIR

    if not uses_global_dedup(config):
        raise PrebuildError("dedup.exact and dedup.near are both off: there is no dedup decision to index")
    if int(tasks) < 1 or int(dedup_ranges) < 1:
        raise ValueError(f"tasks and dedup_ranges must be >= 1, got {tasks} and {dedup_ranges}")
    _refuse_url(out_file, "dedup-index")
    config.check_stages_run()  # the tasks run the user stages: refused at launch, not in a task's log
    cluster = _resolve_cluster(executor, cluster, executor_kwargs, "signatures")  # refused before anything is written
    out_file = Path(out_file).absolute()  # the tasks may run in another working directory (Ray workers)
    work = out_file.with_name(out_file.name + ".work")
    logs = logging_dir or str(out_file.with_name(out_file.name + ".datatrove-logs"))
    task_plan = TaskPlan(config.to_dict(), {}, str(work), int(tasks), 0, tuple(splits), logs, int(dedup_ranges), int(dedup_ranges))
    # what a resume must match; JSON types (tuples become lists), as read back
    identity = json.loads(json.dumps({"config": task_plan.config, "splits": task_plan.splits, "tasks": task_plan.tasks_per_split,
                                      "dedup_ranges": task_plan.exact_ranges}))
    plan_file = work / "plan.json"
    resumable = plan_file.exists() and json.loads(plan_file.read_text()) == identity
    if not resumable:  # completion marks of an older run would skip its tasks, its files would be read
        shutil.rmtree(work, ignore_errors=True)
        if Path(logs).is_dir():
            shutil.rmtree(logs)
    work.mkdir(parents=True, exist_ok=True)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(plan_file, json.dumps(identity, sort_keys=True).encode())
    # piece indexes built once, here; the task processes find them through the environment
    index_pieces(config, int(tasks), work / STATE_DIR / "pieces")
    make = _stage_maker(executor, cluster, logs, executor_kwargs)
    decision = _dedup_stages(make, task_plan)
    return make("index", [StackDedupIndexWriter(task_plan, str(out_file))], 1, "dedup-index", "stacklm-dedup-index", decision)


def _refuse_url(out, command: str) -> None:
    """The tasks write local files: a URL here would be a local folder named ``s3:``. The command
    stages a URL output and uploads it (``stacklm.prebuild.url_output``); the executors take the
    local folder."""
    from stacklm.data.storage import remote
    from stacklm.errors import PrebuildError

    if remote.is_remote(out):
        raise PrebuildError(f"{out}: the executors write into a local folder every task sees, not a URL; run `stacklm {command} "
                            "--out URL` (it builds in a staging folder and uploads) or pass a local path", path=str(out))


def _resolve_cluster(executor: str, cluster, executor_kwargs: dict[str, Any], first_stage: str):
    """``cluster``, or a ``ClusterPlan`` from the built-in defaults and the legacy keywords
    (``partition``, ``time``, ... popped from ``executor_kwargs``); a Slurm run without a
    partition is refused here, before anything is written."""
    from stacklm.scale.resources import ClusterPlan

    if executor not in ("local", "slurm", "ray"):
        raise ValueError(f"executor must be 'local', 'slurm' or 'ray', got {executor!r}")
    if cluster is None:
        legacy = ("partition", "time", "cpus_per_task", "mem_per_cpu_gb", "qos", "env_command", "sbatch_args")
        cluster = ClusterPlan.resolve(**{k: executor_kwargs.pop(k) for k in legacy if k in executor_kwargs})
    if executor == "slurm":
        cluster.slurm_kwargs(first_stage)  # no partition: a PrebuildError saying how to give one
    return cluster


def _stage_maker(executor: str, cluster, logs: str, executor_kwargs: dict[str, Any]):
    """``make(stage, steps, n, log_dir, job_name, depends=None)``: the executor of one stage of
    the chain, of kind ``executor``, logging to ``logs/log_dir``, with that stage's resources
    (Slurm, Ray: ``cluster``, and a first log line saying what it asked for and got)."""
    from stacklm.scale.resources import LogTaskResources

    def make(stage: str, steps: list, n: int, log_dir: str, job_name: str, depends=None):
        if executor == "local":
            from datatrove.executor import LocalPipelineExecutor

            ex = LocalPipelineExecutor(steps, tasks=n, logging_dir=f"{logs}/{log_dir}", depends=depends, **executor_kwargs)
        elif executor == "slurm":
            from stacklm.scale.slurm import StackSlurmExecutor

            steps = [*steps, LogTaskResources(stage, cluster.resources[stage].describe())]
            ex = StackSlurmExecutor(steps, tasks=n, logging_dir=f"{logs}/{log_dir}", job_name=job_name, depends=depends,
                                    **cluster.slurm_kwargs(stage), **executor_kwargs)
        else:
            from datatrove.executor.ray import RayPipelineExecutor

            steps = [*steps, LogTaskResources(stage, cluster.ray_describe(stage))]
            ex = RayPipelineExecutor(steps, tasks=n, logging_dir=f"{logs}/{log_dir}", depends=depends, **cluster.ray_kwargs(stage), **executor_kwargs)
        ex.stacklm_stage = stage
        return ex

    return make


def _dedup_stages(make, task_plan: TaskPlan):
    """The global dedup decision as three stages (``make``'s executors): ``signatures`` (every
    (split, worker) slice) -> ``buckets`` (one task per key range) -> ``decision`` (one task,
    the removed-id shards); returns the ``decision`` executor."""
    n_tasks = task_plan.tasks_per_split * len(task_plan.splits)
    sigs = make("signatures", [StackDedupSignatures(task_plan)], n_tasks, "dedup-sig", "stacklm-dedup-sig")
    buckets = make("buckets", [StackDedupBuckets(task_plan)], len(bucket_tasks(task_plan)), "dedup-buckets", "stacklm-dedup-buckets", sigs)
    return make("decision", [StackDedupCluster(task_plan)], 1, "dedup-decide", "stacklm-dedup-decide", buckets)


def stage_chain(last) -> list:
    """The executors ``last`` depends on, first to run first, and ``last``; read it before
    ``run()`` (datatrove's Slurm executor drops ``depends`` once it has submitted)."""
    chain = []
    while last is not None:
        chain.append(last)
        last = last.depends
    return chain[::-1]
