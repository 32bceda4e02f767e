"""Run a chain of datatrove executors stage by stage, and end the run the moment a task fails.

datatrove's own ``run()`` waits in ways that never end when a task dies:

- ``LocalPipelineExecutor`` with ``workers > 1`` hands the tasks to a ``multiprocess`` pool
  (``imap_unordered``); a pool worker killed by a signal (SIGKILL, the OOM killer) is replaced
  and its task's result never comes, so the run waits forever;
- ``RayPipelineExecutor`` runs each task in a pool child of a Ray actor: a killed child leaves
  the actor's ``starmap`` waiting forever, and a task that raises ends the stage with a
  warning ("Only X/Y tasks completed"), not an error;
- a dependent executor (``depends=``) polls the dependency's completion files every two
  minutes until they are all there, which after a failure is never.

So ``run_chain`` does not call an executor's ``run``. It runs the stages of the ``depends``
chain in order, and each stage's incomplete tasks as its own processes (local) or its own Ray
tasks (``max_retries=0``), through datatrove's per-task entry (``_run_for_rank``: task log,
stats, completion file, exactly as datatrove writes them). It watches every task's exit: a
task that exits non-zero (raised, or was killed by a signal), or exits without its completion
file, stops the others and raises ``TaskFailed``, one line naming the stage, the task and its
log. A stage starts only when every task of the one before it has its completion file, so a
re-run resumes: completed tasks are skipped (datatrove's ``completions/``), the rest rerun from
their start.

Slurm stays datatrove's: ``sbatch`` dependencies, not a process of ours, wait there.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stacklm.errors import PrebuildError, TaskFailed


Describe = Callable[[Any, int], str]


def chain_of(last) -> list:
    """The executors of ``last``'s ``depends`` chain, first to run first."""
    out = []
    while last is not None:
        out.append(last)
        last = getattr(last, "depends", None)
    return out[::-1]


def stage_name(executor) -> str:
    """A stage's name: ``stacklm_stage`` (``prebuild_executors``: ``signatures``, ``buckets``, ``decision``,
    ``main``, ``merge``; ``dedup_index_executors``: the three dedup stages, ``index``), else its logging folder."""
    return getattr(executor, "stacklm_stage", None) or Path(executor.logging_dir.path.rstrip("/")).name


def task_log(executor, rank: int) -> str:
    return executor.logging_dir.resolve_paths(f"logs/task_{rank:05d}.log")


def completed(executor, rank: int) -> bool:
    return executor.logging_dir.isfile(f"completions/{rank:05d}")


def _last_error(log: str) -> str:
    """The message of the last ERROR line of a task log (datatrove logs the exception there)."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for i in range(len(lines) - 1, -1, -1):
        if "| ERROR" in lines[i]:
            # loguru: "... | ERROR    | module:function:line - message"; the traceback follows, its last line is "Type: message"
            tail = [line for line in lines[i + 1:] if line and not line.startswith((" ", "Traceback", "\u2502", "\u2514", "\u251c", "\u2570", "\u256d", ">"))]
            last = (tail[-1] if tail else lines[i].split(" - ", 1)[-1]).strip()
            return re.sub(r"^(?:\w+\.)+(?=\w+: )", "", last)  # "stacklm.data.ledger.LedgerError: ..." -> "LedgerError: ..."
    return ""


def _why(exitcode: int | None) -> str:
    if exitcode is None:
        return "did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with status {exitcode}"


def failure(executor, rank: int, what: str, describe: Describe | None = None, log: str | None = None) -> TaskFailed:
    """The ``TaskFailed`` of task ``rank``: stage, task (and what it was building), why, its log,
    and how to resume."""
    stage = stage_name(executor)
    log = log or task_log(executor, rank)
    about = describe(executor, rank) if describe else ""
    done = executor.world_size - len(executor.get_incomplete_ranks(skip_completed=True))
    return TaskFailed(
        f"datatrove stage {stage!r} task {rank}{f' ({about})' if about else ''} {what}; its log: {log}. "
        f"The run stopped ({done} of {executor.world_size} tasks of {stage!r} completed); fix the cause and re-run "
        "the same command: completed tasks are skipped, the failed one reruns from its start",
        stage=stage, rank=rank, log=log,
    )


def run_chain(last, *, describe: Describe | None = None, poll_s: float = 0.5, grace_s: float = 10.0,
              preload: Sequence[str] = ()) -> None:
    """Run every stage of ``last``'s ``depends`` chain in order (local or Ray executors), each
    stage's incomplete tasks supervised; raises ``TaskFailed`` for the first task that fails.

    ``describe(executor, rank)``: what a task builds, for the message (e.g. "split train, worker 1").
    ``preload``: modules the local tasks import, imported once by the forkserver they are forked
    from (``forkserver_preload``), not again by every task.
    """
    from datatrove.executor import LocalPipelineExecutor

    try:
        from datatrove.executor.ray import RayPipelineExecutor
    except ImportError:  # datatrove without its Ray module
        RayPipelineExecutor = ()  # noqa: N806
    from datatrove.utils.logging import logger

    for ex in chain_of(last):
        ex._launched = True  # a datatrove run() of a later stage must not launch this one again
        ranks = ex.get_incomplete_ranks()
        if not ranks:
            logger.info(f"stage {stage_name(ex)!r}: all {ex.world_size} tasks completed already")
            continue
        ex.save_executor_as_json()
        if isinstance(ex, LocalPipelineExecutor):
            _run_local(ex, ranks, describe, poll_s, grace_s, forkserver_preload(chain_of(last), preload))
        elif RayPipelineExecutor and isinstance(ex, RayPipelineExecutor):
            _run_ray(ex, ranks, describe, poll_s)
        else:
            raise TypeError(f"run_chain runs local and Ray executors, not {type(ex).__name__} (Slurm: submit with .run())")
        missing = ex.get_incomplete_ranks(skip_completed=True)
        if missing:  # every task exited cleanly and still one has no completion file
            raise failure(ex, missing[0], "ended without its completion file", describe)
        logger.info(f"stage {stage_name(ex)!r}: {ex.world_size} tasks completed")


def forkserver_preload(chain: list, extra: Sequence[str] = ()) -> list[str]:
    """What the local executor's forkserver (datatrove's default ``start_method``) imports before
    it forks the first task: ``__main__`` (datatrove's default; Python 3.11's forkserver skips it,
    so each task still re-runs the main script: ``TASK_PRELOAD`` names what the ``stacklm``
    script imports), the executor's module and every step's module (a task unpickles them first), then
    ``extra`` (the modules the steps import when they run: ``datatrove_steps.TASK_PRELOAD``).
    Each task is a fork of that server, so its fixed cost is its own work, not ~2-3 CPU-s of
    imports (torch, datatrove's executor) per task (bench/startup.py). The server is single-
    threaded and only imports, so forking it is safe with torch loaded (as the stream loaders'
    server, ``stacklm.datamodule.workers``); a module missing there is skipped and imported by
    the task itself. The executors' and steps' modules are taken only when this process has
    imported them already (so they import cleanly: a module that raised in the server would
    end it, and every task with it)."""
    import sys

    modules = ["__main__"]
    for ex in chain:
        for m in (type(ex).__module__, *(type(step).__module__ for step in getattr(ex, "pipeline", ()) or ())):
            if m in sys.modules and m not in ("__main__", "builtins"):
                modules.append(m)
    modules += list(extra)
    return list(dict.fromkeys(modules))


def _local_task(executor, rank: int, local_rank: int, supervisor: int) -> None:
    """A local task's process: dies with the supervising process (its parent, or with datatrove's
    default start method the forkserver's child, which outlives a killed command), runs
    datatrove's task entry. datatrove has already logged an exception to the task log; the
    exit status says it failed."""
    from stacklm.parent_death import die_with, die_with_parent

    die_with_parent()
    die_with(supervisor)
    try:
        executor._run_for_rank(rank, local_rank)
    except BaseException:  # noqa: BLE001 - logged by _run_for_rank; the supervisor reads the status
        os._exit(1)


def _stop(procs, grace_s: float) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(5)


def _run_local(ex, ranks: list[int], describe: Describe | None, poll_s: float, grace_s: float,
               preload: Sequence[str] = ("__main__",)) -> None:
    import multiprocess
    from multiprocess.connection import wait

    ctx = multiprocess.get_context(ex.start_method)
    if ex.start_method == "forkserver":
        # Applies when the server starts (the first stage's first task); later stages reuse it.
        ctx.set_forkserver_preload(list(preload))
    todo, slots, running = deque(ranks), list(range(max(1, ex.workers))), {}
    try:
        while todo or running:
            while todo and slots:
                rank, slot = todo.popleft(), slots.pop(0)
                p = ctx.Process(target=_local_task, args=(ex, rank, slot, os.getpid()), name=f"datatrove {stage_name(ex)} task {rank}")
                p.start()
                running[p.sentinel] = (p, rank, slot)
            for sentinel in wait(list(running), timeout=poll_s):
                p, rank, slot = running.pop(sentinel)
                p.join()
                slots.append(slot)
                if p.exitcode != 0:
                    what = _why(p.exitcode)
                    if p.exitcode == 1 and (err := _last_error(task_log(ex, rank))):
                        what = f"raised {err}"
                    raise failure(ex, rank, what, describe)
                if not completed(ex, rank):
                    raise failure(ex, rank, "exited without its completion file", describe)
    finally:
        _stop([p for p, _, _ in running.values()], grace_s)


def _ray_task(executor, rank: int, local_rank: int) -> int:
    executor._run_for_rank(rank, local_rank)
    return rank


def _run_ray(ex, ranks: list[int], describe: Describe | None, poll_s: float) -> None:
    import tempfile

    from stacklm.optional import require

    ray = require("ray", "ray", "prebuild-datatrove --executor ray")
    from ray.exceptions import RayTaskError

    if not ray.is_initialized():
        ray.init()  # RAY_ADDRESS, else the cluster started on this node, else a new local one
    memory = int(ex.mem_per_cpu_gb * ex.cpus_per_task * 1024**3)  # 0: none reserved
    opts: dict[str, Any] = {"num_cpus": ex.cpus_per_task, "num_gpus": ex.gpus_per_task, **({"memory": memory} if memory else {}),
                            **(ex.ray_remote_kwargs or {}), "max_retries": 0}
    have = ray.cluster_resources()
    short = [f"{key} {opts[opt]}" for key, opt in (("CPU", "num_cpus"), ("memory", "memory")) if opts.get(opt, 0) > have.get(key, 0)]
    if short:  # Ray would queue the task forever
        raise PrebuildError(
            f"datatrove stage {stage_name(ex)!r}: each task asks Ray for {', '.join(short)} but the cluster has only "
            f"{have.get('CPU', 0):g} CPUs and {have.get('memory', 0) / 1024**3:.1f} GB: lower --cpus-per-task / --mem-per-cpu-gb"
        )
    remote = ray.remote(_ray_task).options(**opts)
    ex_ref = ray.put(ex)
    local_rank = 0 if ex.log_first else 1  # datatrove's Ray executor: only a log_first task logs to the console
    todo, pending, started = deque(ranks), {}, {}
    try:
        while todo or pending:
            while todo and len(pending) < max(1, ex.workers):
                rank = todo.popleft()
                pending[remote.remote(ex_ref, rank, local_rank)] = rank
                started[rank] = time.monotonic()
            done, _ = ray.wait(list(pending), num_returns=1, timeout=poll_s)
            for ref in done:
                rank = pending.pop(ref)
                try:
                    ray.get(ref)
                except RayTaskError as e:
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    raise failure(ex, rank, f"raised {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}", describe) from None
                except Exception as e:  # noqa: BLE001 - WorkerCrashedError, ObjectLostError, ...: the task's process died
                    log = task_log(ex, rank)
                    if not Path(log).exists():  # datatrove's Ray task copies its log there only when it ends
                        log = f"{log} (not copied: the task did not end; on its node: {tempfile.gettempdir()}/ray_logs/logs/task_{rank:05d}.log)"
                    raise failure(ex, rank, f"died ({type(e).__name__}: the Ray worker process was killed)", describe, log=log) from None
                if not completed(ex, rank):
                    raise failure(ex, rank, "ended without its completion file", describe)
            if ex.time:  # datatrove's per-task time limit (seconds)
                for ref, rank in pending.items():
                    if time.monotonic() - started[rank] > ex.time:
                        raise failure(ex, rank, f"ran past its time limit of {ex.time} s", describe)
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)  # kills the worker process: no writer left behind
