"""`stacklm prebuild-datatrove` fails loudly and never hangs (issue 22 item 3): a task that dies
(SIGKILL) or raises ends the run non-zero within a bounded time, naming the stage, the task and
its log; a re-run resumes from the completed tasks and gives the clean run's bytes; a killed
worker's children die with it. Local executor and a local Ray cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.base import PipelineStep

from stacklm.scale.supervise import run_chain
from stacklm.errors import TaskFailed
from tests.helpers.prebuild import REPO, TOKENS_PER_SHARD, own_config, config, tree

BOUND_S = 120  # a failed run must end within this (it used to wait forever)


@pytest.fixture(scope="module")
def tok_dir(tokenizer_2048, saved_tokenizer_dir):
    return saved_tokenizer_dir(tokenizer_2048)


KILLED_TOTAL = 80_000  # tokens of the builds these tests kill


@pytest.fixture(scope="module")
def clean_tree(tok_dir, tmp_path_factory) -> dict[str, bytes]:
    """`stacklm prebuild --workers 2` of the killed builds' config, built once for the module:
    what every engine's resumed build must equal, byte for byte."""
    from stacklm.prebuild import prebuild

    clean = tmp_path_factory.mktemp("clean") / "clean"
    prebuild(config(total=KILLED_TOTAL), tok_dir, clean, workers=2, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    return tree(clean)


class FailAt(PipelineStep):
    """A step that fails in task ``rank`` (raises, or SIGKILLs its own process) and otherwise
    writes ``<out>/<rank>``; every other task sleeps ``sleep`` s first (a sibling still running)."""

    name = "fail at"

    def __init__(self, out: str, rank: int, how: str, sleep: float = 0.0) -> None:
        super().__init__()
        self.out, self.fail_rank, self.how, self.sleep = out, rank, how, sleep

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        if rank == self.fail_rank:
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"planted failure in task {rank}")
        time.sleep(self.sleep)
        Path(self.out, str(rank)).write_text("done")
        return
        yield


def _pids_with_open(root_pid: int, suffix: str) -> list[int]:
    """Descendants of ``root_pid`` holding a file ending in ``suffix`` open (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    found, todo = [], list(children.get(root_pid, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            if any(os.readlink(f).endswith(suffix) for f in Path(f"/proc/{pid}/fd").iterdir()):
                found.append(pid)
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_local_stage_fails_on_a_raise_and_the_next_stage_never_starts(tmp_path):
    first = LocalPipelineExecutor([FailAt(str(tmp_path), 1, "raise", sleep=3.0)], tasks=3, workers=2, logging_dir=str(tmp_path / "logs" / "first"))
    second = LocalPipelineExecutor([FailAt(str(tmp_path / "never"), -1, "raise")], tasks=1, logging_dir=str(tmp_path / "logs" / "second"), depends=first)
    t0 = time.monotonic()
    with pytest.raises(TaskFailed) as e:
        run_chain(second)
    assert time.monotonic() - t0 < BOUND_S
    log = tmp_path / "logs" / "first" / "logs" / "task_00001.log"
    assert str(e.value).startswith(f"datatrove stage 'first' task 1 raised ValueError: planted failure in task 1; its log: {log}.")
    assert (e.value.stage, e.value.rank, e.value.log) == ("first", 1, str(log)) and log.exists()
    assert not (tmp_path / "logs" / "second" / "completions").exists()
    # task 0, running beside it (3 s), was stopped, not left to finish; task 2 never started
    time.sleep(3.5)
    assert not (tmp_path / "0").exists() and not (tmp_path / "2").exists()


def test_local_stage_fails_on_a_sigkill(tmp_path):
    ex = LocalPipelineExecutor([FailAt(str(tmp_path), 0, "kill")], tasks=2, workers=2, logging_dir=str(tmp_path / "logs" / "main"))
    t0 = time.monotonic()
    with pytest.raises(TaskFailed, match=r"stage 'main' task 0 was killed by SIGKILL; its log: .*main/logs/task_00000.log"):
        run_chain(ex)
    assert time.monotonic() - t0 < BOUND_S


def _cli(cfg_file: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "stacklm", "prebuild-datatrove", "--config", str(cfg_file), "--out", str(out),
            "--tasks", "2", "--tokens-per-shard", str(TOKENS_PER_SHARD), *extra]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _kill_task_then_resume(tmp_path, tok_dir, want: dict[str, bytes], engine: list[str], log_suffix: str, shown_log: str, s3=None):
    """Start the CLI, SIGKILL the process of main task 1 (train, worker 1) once it has written a
    shard, time how long the CLI takes to fail; re-run; compare with ``want``, the tree of
    `stacklm prebuild --workers 2` (``clean_tree``). ``s3``: ``(fs, bucket)`` of moto's S3
    server: the output is a URL there, staged in the same local folder (``--stage-dir``), and
    what the re-run uploads is compared."""
    cfg_file = own_config(tmp_path, tok_dir, KILLED_TOTAL)
    out = tmp_path / "dt"  # the local output, or the URL's staging folder
    url = f"s3://{s3[1]}/dt" if s3 else None
    target = url or out
    if url:
        engine = [*engine, "--stage-dir", str(out)]
    proc = subprocess.Popen(_cli(cfg_file, target, *engine), cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed_at, deadline = None, time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        worker1 = [p for p in (out / "train").glob("*.meta.bin") if int(p.name.split("_")[1].split(".")[0]) % 2 == 1] if (out / "train").is_dir() else []
        pids = _pids_with_open(proc.pid, log_suffix) if worker1 else []
        if pids:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            break
        time.sleep(0.02)
    assert killed_at is not None, f"the run ended before task 1 could be killed: rc={proc.wait()} {proc.stderr.read()[-3000:]}"
    rc = proc.wait(timeout=BOUND_S)
    failed_after = time.monotonic() - killed_at
    err = proc.stderr.read()
    assert rc != 0 and failed_after < BOUND_S, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("stacklm prebuild-datatrove: error:")]
    assert len(lines) == 1, err[-3000:]
    assert "datatrove stage 'main' task 1 (split train, worker 1 of 2)" in lines[0] and shown_log in lines[0], lines[0]
    assert not (out / "manifest.json").exists()
    print(f"\n{engine}: failed {failed_after:.1f} s after the kill: {lines[0]}")
    if url:
        assert s3[0].find(s3[1]) == []  # nothing uploaded before every task has completed
    done = subprocess.run(_cli(cfg_file, target, *engine), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[0].startswith(f"prebuild summary: {target}")  # the table `stacklm prebuild` prints
    if url:
        from tests.helpers.s3_server import s3_tree

        assert not out.exists()  # the staging folder goes once uploaded
        got = s3_tree(s3[0], url)
    else:
        got = tree(out)
    assert sorted(set(got) ^ set(want)) == [] and [k for k in want if got[k] != want[k]] == []
    return failed_after, lines[0]


@pytest.mark.slow
def test_cli_local_task_killed_fails_then_resumes_byte_identical(tmp_path, tok_dir, clean_tree, s3_bucket):
    """Into object storage (``--out s3://...``): the build resumes in its staging folder, the
    error names the task's local log, and the re-run uploads `stacklm prebuild`'s bytes."""
    log = f"{tmp_path}/dt.datatrove-logs/main/logs/task_00001.log"
    _, line = _kill_task_then_resume(tmp_path, tok_dir, clean_tree, ["--executor", "local", "--workers", "2"], "main/logs/task_00001.log", log,
                                     s3=s3_bucket)
    assert "was killed by SIGKILL" in line


@pytest.mark.slow
def test_killing_the_cli_leaves_no_task_process(tmp_path, tok_dir):
    """The task processes die with the run that started them: no orphan keeps writing shards."""
    cfg_file = own_config(tmp_path, tok_dir, KILLED_TOTAL)
    out = tmp_path / "dt"
    proc = subprocess.Popen(_cli(cfg_file, out, "--executor", "local", "--workers", "2"), cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, tasks = time.monotonic() + 300, []
    while proc.poll() is None and time.monotonic() < deadline and len(tasks) < 2:
        tasks = _pids_with_open(proc.pid, "/logs/task_00000.log") + _pids_with_open(proc.pid, "/logs/task_00001.log")
        time.sleep(0.05)
    assert len(tasks) == 2, "the tasks did not start"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while any(map(_alive, tasks)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(map(_alive, tasks))


def test_a_pool_child_dies_with_its_killed_parent(tmp_path):
    """What a datatrove Ray actor (or local pool) does: a ``multiprocess`` pool child runs the
    task. With the parent SIGKILLed, a stacklm step's child must die, not keep writing."""
    script = f"""
import multiprocess, os, sys, time
sys.path.insert(0, {str(REPO)!r})
def task(_):
    from stacklm.scale.datatrove_steps import _die_with_parent_if_worker
    _die_with_parent_if_worker()
    open({str(tmp_path / 'child.pid')!r}, 'w').write(str(os.getpid()))
    while True:
        open({str(tmp_path / 'beat')!r}, 'a').write('.')
        time.sleep(0.05)
with multiprocess.Pool(1) as pool:
    pool.map(task, [0])
"""
    proc = subprocess.Popen([sys.executable, "-c", script], env=_env())
    pid_file = tmp_path / "child.pid"
    deadline = time.monotonic() + 120
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    size = (tmp_path / "beat").stat().st_size
    time.sleep(0.3)
    assert (tmp_path / "beat").stat().st_size == size  # nobody writes any more


@pytest.mark.slow
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_ray_stage_fails_on_a_raise_or_a_killed_worker(tmp_path, ray_cluster, how):
    """datatrove's Ray executor ends a stage with a raising task as a warning ("Only X/Y tasks
    completed") and waits forever on a killed one; supervised, both end the run at once."""
    from datatrove.executor.ray import RayPipelineExecutor

    first = RayPipelineExecutor([FailAt(str(tmp_path), 1, how, sleep=0.5)], tasks=3, logging_dir=str(tmp_path / "logs" / "first"),
                                cpus_per_task=1, mem_per_cpu_gb=0.25)
    second = RayPipelineExecutor([FailAt(str(tmp_path / "never"), -1, how)], tasks=1, logging_dir=str(tmp_path / "logs" / "second"),
                                 depends=first, cpus_per_task=1, mem_per_cpu_gb=0.25)
    t0 = time.monotonic()
    with pytest.raises(TaskFailed) as e:
        run_chain(second)
    took = time.monotonic() - t0
    assert took < BOUND_S
    log = tmp_path / "logs" / "first" / "logs" / "task_00001.log"
    if how == "raise":
        assert str(e.value).startswith(f"datatrove stage 'first' task 1 raised ValueError: planted failure in task 1; its log: {log}.")
        assert "planted failure in task 1" in log.read_text()
    else:
        assert str(e.value).startswith(f"datatrove stage 'first' task 1 died (") and "the Ray worker process was killed" in str(e.value)
        assert f"its log: {log} (not copied: the task did not end; on its node: " in str(e.value)
    assert not (tmp_path / "logs" / "second" / "completions").exists()
    print(f"\nray {how}: failed after {took:.1f} s: {e.value}")


def test_ray_refuses_a_task_the_cluster_cannot_hold(tmp_path, ray_cluster):
    """Ray queues a task that asks for more than the cluster has forever; refused up front."""
    from datatrove.executor.ray import RayPipelineExecutor

    ex = RayPipelineExecutor([FailAt(str(tmp_path), -1, "raise")], tasks=1, logging_dir=str(tmp_path / "logs" / "main"), cpus_per_task=4)
    with pytest.raises(Exception, match=r"each task asks Ray for CPU 4 .* lower --cpus-per-task"):
        run_chain(ex)


@pytest.mark.slow
def test_cli_ray_task_killed_fails_then_resumes_byte_identical(tmp_path, tok_dir, clean_tree):
    """On a local Ray cluster (the CLI starts one): the Ray worker running main task 1 is
    SIGKILLed; the run fails naming it, and the re-run equals `stacklm prebuild --workers 2`."""
    log = f"{tmp_path}/dt.datatrove-logs/main/logs/task_00001.log"
    _, line = _kill_task_then_resume(tmp_path, tok_dir, clean_tree, ["--executor", "ray", "--cpus-per-task", "1", "--mem-per-cpu-gb", "1"],
                                     "/ray_logs/logs/task_00001.log", log)
    assert "died (WorkerCrashedError" in line
