"""The prebuild's Slurm chain: datatrove's executor, plus a wait that fails loudly.

datatrove submits the stages as job arrays chained with ``--dependency=afterok`` and returns.
When a task fails, Slurm never starts the jobs after it: they stay ``PENDING`` with reason
``DependencyNeverSatisfied`` for good, and nothing says which task failed or where its log is.
``wait_for_chain`` (``stacklm prebuild-datatrove`` or ``stacklm dedup-index``, ``--executor slurm --wait``) polls the chain,
and on the first failed task cancels the jobs that can now never run and raises one line
naming the stage, the task, its Slurm state and its two logs; a re-run of the same command
resubmits only the tasks without a completion mark.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from datatrove.executor.slurm import SlurmPipelineExecutor, default_job_id_retriever, launch_slurm_job

from stacklm.errors import PrebuildError, TaskFailed


# sacct states after which an array task never completes
FAILED_STATES = ("FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED")
# final unless Slurm requeues the task (datatrove submits with --requeue): a failure only once its
# job has also left the queue, so a requeued task is waited for, not reported
REQUEUED_STATES = ("PREEMPTED", "NODE_FAIL")
DONE_STATES = ("COMPLETED",) + FAILED_STATES + REQUEUED_STATES


class StackSlurmExecutor(SlurmPipelineExecutor):
    """datatrove's ``SlurmPipelineExecutor`` that keeps the id of its stats-merge job.

    datatrove submits a small ``merge_stats`` job after every stage (``afterok`` on it) and
    drops its id; when the stage fails that job would sit in the queue forever, so
    ``wait_for_chain`` has to know it to cancel it. Everything else is datatrove's.
    """

    merge_stats_job_id: str | None = None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.array_job_ids: list[str] = []  # datatrove keeps only the last when tasks > max_array_size
        self.job_id_retriever = self._record_array_job

    def launch_job(self):
        if self.depends is not None:
            if not self.depends.job_id:
                self.depends.launch_job()
            self._upstream_arrays = [str(j) for j in getattr(self.depends, "array_job_ids", [])]
        super().launch_job()

    @property
    def dependency(self) -> str:
        """datatrove's, with ``afterok`` on every array of the stage before, not only its last:
        datatrove chains a stage's arrays with ``afterany``, so the next stage started after a
        failed task of an earlier array."""
        dep = super().dependency
        upstream = getattr(self, "_upstream_arrays", [])
        if len(upstream) > 1 and self.depends_job_id and str(self.depends_job_id) == upstream[-1]:
            dep = dep.replace(f"afterok:{self.depends_job_id}", "afterok:" + ":".join(upstream), 1)
        return dep

    def _record_array_job(self, sbatch_output: str) -> str:
        job_id = default_job_id_retriever(sbatch_output, self.job_id_position)
        self.array_job_ids.append(job_id)
        return job_id

    def launch_merge_stats(self):
        self.merge_stats_job_id = launch_slurm_job(
            self.get_launch_file_contents(
                {**self.get_sbatch_args(), "cpus-per-task": 1, "mem-per-cpu": "1G", "dependency": "afterok:" + ":".join(self.array_job_ids or [str(self.job_id)])},
                f"merge_stats {self.logging_dir.resolve_paths('stats')} -o {self.logging_dir.resolve_paths('stats.json')}",
            ),
            partial(default_job_id_retriever, job_id_position=self.job_id_position),
        )


def submit_chain(chain: Sequence[SlurmPipelineExecutor]) -> None:
    """Submit every stage (``chain[-1].run()``: datatrove submits the ones it depends on first).
    ``sbatch`` refusing a job (a request no node of the partition can hold, an unknown QOS or
    account) is one line naming the stage and what to check, not a ``CalledProcessError``."""
    try:
        chain[-1].run()
    except subprocess.CalledProcessError as e:
        stage = next((ex for ex in chain if ex.job_id is None), chain[-1])
        done = [f"{ex.stacklm_stage} {ex.job_id}" for ex in chain if ex.job_id not in (None, -1)]
        raise PrebuildError(
            f"sbatch refused the job of stage {stage.stacklm_stage!r} (exit {e.returncode}; its message is above): check "
            f"--partition {stage.partition!r}, --qos, --sbatch-arg and --stage-resources {stage.stacklm_stage}=cpus:N,mem_gb:G,time:T "
            f"(asked: {stage.cpus_per_task} CPUs x {stage.mem_per_cpu_gb}G, {stage.time}) against `sinfo -o '%P %c %m %l'`"
            + (f"; already submitted: {', '.join(done)} (scancel them, or let them run: a rerun skips what completes)" if done else "")
        ) from None


def _run(cmd: Sequence[str]) -> str | None:
    """stdout of a Slurm command, or ``None`` when it is missing or fails (then the caller
    falls back on what the others say)."""
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def array_states(job_ids: Sequence[str]) -> dict[tuple[str, int], tuple[str, str]] | None:
    """``{(job, array index): (state, exit code)}`` from ``sacct`` (``None`` without accounting).
    A pending array shows as ``JOB_[0-3]`` and is left out: it has no task state yet."""
    out = _run(["sacct", "-n", "-P", "-X", "-o", "JobID,State,ExitCode", "-j", ",".join(job_ids)])
    if out is None:
        return None
    states = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        m = re.fullmatch(r"(\d+)_(\d+)", parts[0]) if len(parts) >= 2 else None
        if m:
            states[(m.group(1), int(m.group(2)))] = (parts[1].split()[0], parts[2] if len(parts) > 2 else "")
    return states


def queued_jobs(job_ids: Sequence[str]) -> dict[str, str] | None:
    """``{job: reason}`` of the chain's jobs still in the queue (``squeue``), or ``None``."""
    out = _run(["squeue", "-h", "-o", "%i|%T|%r", "-j", ",".join(job_ids)])
    if out is None:
        return None
    queued = {}
    for line in out.splitlines():
        parts = line.strip().split("|")
        if parts and parts[0]:
            queued[parts[0].split("_")[0]] = parts[2] if len(parts) > 2 else ""
    return queued


def _arrays(ex: SlurmPipelineExecutor) -> list[tuple[str, int]]:
    """``(job id, first index into ranks_to_run.json)`` of each job array of a stage: datatrove
    splits more than ``max_array_size`` tasks into arrays run one after the other (``RUN_OFFSET``)."""
    ids = getattr(ex, "array_job_ids", None) or [str(ex.job_id)]
    return [(str(j), k * ex.max_array_size) for k, j in enumerate(ids)]


def _ranks_to_run(ex: SlurmPipelineExecutor) -> list[int]:
    with ex.logging_dir.open("ranks_to_run.json", "r") as f:
        return json.load(f)


def _last_error(log: Path) -> str:
    """The last line of a task's log that looks like the error (for the one-line report)."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line) or "Killed" in line or "CANCELLED" in line:
            return line[:300]
    return ""


def _exit(code: str) -> str:
    """sacct's ``ExitCode`` (``RC:SIGNAL``) in words."""
    rc, _, sig = code.partition(":")
    if sig.isdigit() and int(sig):
        return f", killed by signal {sig}"
    return f", exit status {rc}" if rc.isdigit() and int(rc) else ""


def wait_for_chain(chain: Sequence[SlurmPipelineExecutor], poll_seconds: float = 30.0,
                   say: Callable[[str], None] = print, sleep: Callable[[float], None] = time.sleep) -> None:
    """Wait until every task of ``chain`` (``stage_chain(merge)``, after ``merge.run()``) has
    completed; raise ``TaskFailed`` as soon as one cannot.

    A task has failed when ``sacct`` reports it in a final state other than ``COMPLETED``, or
    (without accounting) when its job has left ``squeue`` and the task left no completion
    mark. Then the jobs of the chain that have not started are cancelled (``scancel``): with
    ``afterok`` they could never run. Tasks of the failed stage that are running go on; their
    completion marks count for the re-run.
    """
    live = [ex for ex in chain if ex.job_id not in (None, -1, "-1")]
    last_note = ""
    while True:
        ids = [j for ex in live for j, _ in _arrays(ex)]
        states = array_states(ids) if ids else {}
        queued = queued_jobs(ids) if ids else {}
        pending = 0
        for ex in live:
            incomplete = set(ex.get_incomplete_ranks(skip_completed=True))
            if not incomplete:
                continue
            pending += len(incomplete)
            ranks = _ranks_to_run(ex)
            arrays = _arrays(ex)
            failed = [
                (job, idx, st) for job, offset in arrays for (j, idx), st in sorted((states or {}).items())
                if j == job and st[0] in FAILED_STATES and offset + idx < len(ranks) and ranks[offset + idx] in incomplete
            ]
            gone = queued is not None and all(job not in queued for job, _ in arrays) and (states is None or all(
                st[0] in DONE_STATES for (j, _), st in states.items() if j in dict(arrays)))
            if failed or gone:
                if failed:
                    job, idx, (state, code) = failed[0]
                    rank = ranks[dict(arrays)[job] + idx]
                    what = f"task {rank} (job {job}_{idx}, {state}{_exit(code)}) failed"
                    slurm_log = Path(ex.slurm_logs_folder) / f"{job}_{idx}.out"
                else:
                    rank = min(incomplete)
                    where = ranks.index(rank) if rank in ranks else -1
                    k, idx = divmod(where, ex.max_array_size) if ex.max_array_size != -1 else (0, where)
                    job = arrays[min(k, len(arrays) - 1)][0]
                    state = (states or {}).get((job, idx))
                    what = f"task {rank} (job {job}_{idx}{f', {state[0]}{_exit(state[1])}' if state else ''}) left the queue without completing it"
                    what += " (no sacct to say why)" if states is None else ""
                    slurm_log = Path(ex.slurm_logs_folder) / f"{job}_{idx}.out"
                task_log = Path(ex.logging_dir.resolve_paths(f"logs/task_{rank:05d}.log"))
                cancelled = cancel_after(chain, ex)
                error = _last_error(task_log) or (_last_error(slurm_log) if slurm_log.is_file() else "")
                more = len(failed) - 1
                raise TaskFailed(
                    f"slurm stage {ex.stacklm_stage!r}: {what}"
                    + (f" ({more} more task(s) of the stage failed too)" if more > 0 else "")
                    + (f": {error}" if error else "")
                    + f"; logs: {task_log} and {slurm_log}; cancelled {cancelled} job(s) that depended on it; "
                    "fix the cause and rerun the same command: completed tasks are skipped"
                )
        if pending == 0:
            return
        note = f"waiting for {pending} slurm task(s): " + ", ".join(
            f"{ex.stacklm_stage} job {ex.job_id}" + (f" ({queued[str(ex.job_id)]})" if queued and queued.get(str(ex.job_id)) else "")
            for ex in live if ex.get_incomplete_ranks(skip_completed=True))
        if note != last_note:
            say(note)
            last_note = note
        sleep(poll_seconds)


def cancel_after(chain: Sequence[SlurmPipelineExecutor], failed: SlurmPipelineExecutor) -> int:
    """``scancel`` the jobs that wait on ``failed`` (the later stages) and every stats-merge job
    from ``failed`` on; returns how many were cancelled."""
    ids = []
    after = False
    for ex in chain:
        if ex is failed:
            after = True
        elif after and ex.job_id not in (None, -1, "-1"):
            ids.extend(j for j, _ in _arrays(ex))
        if after and getattr(ex, "merge_stats_job_id", None):
            ids.append(str(ex.merge_stats_job_id))
    if ids:
        _run(["scancel", *ids])
    return len(ids)
