"""A fake Slurm for the tests: ``sbatch``, ``srun``, ``scontrol``, ``squeue``, ``sacct`` and
``scancel`` executables on ``PATH`` that run datatrove's real batch scripts on this machine.

``install(dir)`` writes the executables into ``dir/bin`` and returns a ``FakeSlurm`` whose
``env`` is what a caller puts in its environment (``PATH`` first, ``FAKE_SLURM_DIR``). Every
``sbatch`` is recorded (``FakeSlurm.jobs()``: the script, its ``#SBATCH`` directives with the
command-line options over them, ``--array``, ``--dependency``, ``--export``) and runs at once,
before ``sbatch`` returns ``Submitted batch job N`` like the real one: datatrove submits the
stages in dependency order, so each job's dependencies have ended by then. A job whose
``afterok`` dependency did not complete is never run and stays ``PENDING`` with reason
``DependencyNeverSatisfied``, as on a real cluster. The array tasks run as subprocesses
(``bash SCRIPT``, at most ``%N`` or ``FAKE_SLURM_PARALLEL`` at once, default 2) with
``SLURM_ARRAY_JOB_ID``, ``SLURM_ARRAY_TASK_ID``, ``SLURM_JOB_ID``, ``SLURM_NODELIST`` set and
their output in ``--output`` (``%A``/``%a``/``%j`` filled in); ``srun`` runs its command.
``--time`` is enforced (state ``TIMEOUT``); ``FAKE_SLURM_KILL=JOBNAME:INDEX[:SECONDS]`` kills
that array task's process group with SIGKILL after SECONDS (default 0.5), a task dying as a
node loss or the OOM killer would make it; ``sacct`` and ``squeue`` report the states. The one
node is ``FAKE_SLURM_NODE`` (default ``cpus=64,mem_gb=512``): a bigger request is refused at
submission, as a real ``sbatch`` refuses it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

TOOLS = ("sbatch", "srun", "scontrol", "squeue", "sacct", "scancel")
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL")


class FakeSlurm:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.bin = self.root / "bin"
        self.env = {"PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}", "FAKE_SLURM_DIR": str(self.root)}

    def jobs(self) -> list[dict]:
        """Every submitted job, in submission order."""
        return [json.loads(p.read_text()) for p in sorted((self.root / "jobs").glob("*.json"), key=lambda p: int(p.stem))]

    def calls(self) -> list[list[str]]:
        """Every invocation of a fake tool: ``[tool, *args]``."""
        path = self.root / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def install(root: str | os.PathLike) -> FakeSlurm:
    root = Path(root)
    (root / "bin").mkdir(parents=True, exist_ok=True)
    (root / "jobs").mkdir(exist_ok=True)
    here = Path(__file__).resolve().parent
    for tool in TOOLS:
        exe = root / "bin" / tool
        exe.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(here)!r})\nfrom fake_slurm import main\n"
                       f"sys.exit(main({tool!r}, sys.argv[1:]))\n")
        exe.chmod(0o755)
    return FakeSlurm(root)


# ---------------------------------------------------------------------------- the tools
def _root() -> Path:
    return Path(os.environ["FAKE_SLURM_DIR"])


@contextmanager
def _locked():
    with open(_root() / "lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _job_path(job_id: str) -> Path:
    return _root() / "jobs" / f"{job_id}.json"


def _load(job_id: str) -> dict | None:
    p = _job_path(str(job_id).split("_")[0])
    return json.loads(p.read_text()) if p.exists() else None


def _save(job: dict) -> None:
    tmp = _job_path(job["id"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(job, indent=1))
    tmp.replace(_job_path(job["id"]))


def main(tool: str, argv: list[str]) -> int:
    with open(_root() / "calls.jsonl", "a") as f:
        f.write(json.dumps([tool, *argv]) + "\n")
    return {"sbatch": sbatch, "srun": srun, "scontrol": scontrol, "squeue": squeue, "sacct": sacct, "scancel": scancel}[tool](argv)


def _options(tokens: list[str]) -> dict[str, str]:
    """``--key=value`` / ``--flag`` tokens as a dict (``""`` for a flag)."""
    opts = {}
    for t in tokens:
        if t.startswith("--"):
            key, _, value = t[2:].partition("=")
            opts[key] = value
    return opts


def _seconds(limit: str) -> float:
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", limit or "")
    if not m:
        return float("inf")
    d, a, b, c = (int(g) if g else None for g in m.groups())
    if d is not None:
        return d * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + b * 60 + c
    return a * 60 + (b or 0) if b is not None else a * 60


def _megabytes(mem: str) -> str:
    """``4G`` -> ``4096``: Slurm gives a task its memory in MB."""
    m = re.fullmatch(r"(\d+)([KMGT]?)", mem)
    if not m:
        return mem
    return str(int(m.group(1)) * {"K": 1 / 1024, "M": 1, "": 1, "G": 1024, "T": 1024**2}[m.group(2)])


def sbatch(argv: list[str]) -> int:
    script_file = argv[-1]
    script = Path(script_file).read_text()
    directives = _options([line.split(None, 1)[1] for line in script.splitlines() if line.startswith("#SBATCH ")])
    cli = _options(argv[:-1])
    opts = {**directives, **cli}
    node = dict(kv.split("=") for kv in os.environ.get("FAKE_SLURM_NODE", "cpus=64,mem_gb=512").split(","))
    cpus = int(opts.get("cpus-per-task", "1"))
    mem_mb = int(_megabytes(opts.get("mem-per-cpu", "1G"))) * cpus
    if cpus > int(node["cpus"]) or mem_mb > int(node["mem_gb"]) * 1024:  # what a real sbatch says for a too-big request
        print("sbatch: error: Batch job submission failed: Requested node configuration is not available", file=sys.stderr)
        return 1
    with _locked():
        counter = _root() / "next_id"
        job_id = str(int(counter.read_text()) if counter.exists() else 1000)
        counter.write_text(str(int(job_id) + 1))
    m = re.fullmatch(r"(\d+)-(\d+)(?:%(\d+))?", opts.get("array", "0-0"))
    first, last, limit = int(m.group(1)), int(m.group(2)), m.group(3)
    job = {
        "id": job_id, "name": opts.get("job-name", ""), "argv": argv, "script": script, "directives": directives, "cli": cli,
        "options": opts, "array": list(range(first, last + 1)), "dependency": opts.get("dependency", ""),
        "state": "PENDING", "reason": "", "tasks": {}, "submitted": time.time(),
    }
    (_root() / "scripts").mkdir(exist_ok=True)
    saved = _root() / "scripts" / f"{job_id}.sh"
    saved.write_text(script)
    job["script_path"] = str(saved)
    _save(job)
    print(f"Submitted batch job {job_id}", flush=True)
    if not _dependencies_met(job["dependency"]):
        job["reason"] = "DependencyNeverSatisfied"
        _save(job)
        return 0
    _run_job(job, opts, saved, int(limit) if limit else None)
    return 0


def _dependencies_met(spec: str) -> bool:
    for part in filter(None, spec.split(",")):
        kind, _, ids = part.partition(":")
        for dep_id in ids.split(":"):
            dep = _load(dep_id)
            if dep is None:
                return False
            if kind == "afterok" and dep["state"] != "COMPLETED":
                return False
            if kind == "afterany" and dep["state"] not in TERMINAL:
                return False
    return True


def _run_job(job: dict, opts: dict, script: Path, limit: int | None) -> None:
    job["state"], job["started"] = "RUNNING", time.time()
    _save(job)
    env = dict(os.environ)
    for item in opts.get("export", "ALL").split(",")[1:]:
        k, _, v = item.partition("=")
        env[k] = v
    kill = os.environ.get("FAKE_SLURM_KILL", "").split(":")
    timeout = min(_seconds(opts.get("time", "")), float(os.environ.get("FAKE_SLURM_MAX_SECONDS", "600")))
    parallel = min(limit or 10**9, int(os.environ.get("FAKE_SLURM_PARALLEL", "2")))
    results: dict[int, dict] = {}

    def run_task(idx: int) -> None:
        out_path = opts.get("output", f"slurm-%A_%a.out").replace("%A", job["id"]).replace("%a", str(idx)).replace("%j", job["id"])
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        task_env = {**env, "SLURM_JOB_ID": f"{job['id']}{idx:03d}", "SLURM_ARRAY_JOB_ID": job["id"], "SLURM_ARRAY_TASK_ID": str(idx),
                    "SLURM_JOB_NAME": job["name"], "SLURM_NODELIST": "localhost", "SLURM_NODEID": "0", "SLURM_PROCID": "0",
                    "SLURM_CPUS_PER_TASK": opts.get("cpus-per-task", "1"), "SLURM_MEM_PER_CPU": _megabytes(opts.get("mem-per-cpu", ""))}
        t0 = time.time()
        with open(out_path, "ab") as out:
            proc = subprocess.Popen(["bash", str(script)], env=task_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            killer = None
            if len(kill) >= 2 and kill[0] == job["name"] and int(kill[1]) == idx:
                def kill_it():
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
                killer = threading.Timer(float(kill[2]) if len(kill) > 2 else 0.5, kill_it)
                killer.start()
            try:
                rc = proc.wait(timeout=None if timeout == float("inf") else timeout)
                state = "COMPLETED" if rc == 0 else "FAILED"
                code = f"{rc}:0" if rc >= 0 else f"0:{-rc}"
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                state, code = "TIMEOUT", "0:15"
            if killer:
                killer.cancel()
        results[idx] = {"state": state, "exit": code, "seconds": round(time.time() - t0, 2), "output": out_path}

    pending = list(job["array"])
    threads: list[threading.Thread] = []
    while pending or threads:
        while pending and len(threads) < parallel:
            t = threading.Thread(target=run_task, args=(pending.pop(0),))
            t.start()
            threads.append(t)
        threads[0].join()
        threads = [t for t in threads if t.is_alive()]
    job["tasks"] = {str(i): results[i] for i in sorted(results)}
    states = {r["state"] for r in results.values()}
    job["state"] = "COMPLETED" if states == {"COMPLETED"} else ("TIMEOUT" if "TIMEOUT" in states else "FAILED")
    job["ended"] = time.time()
    _save(job)


def srun(argv: list[str]) -> int:
    """Run the command after srun's options (``-l``, ``-n N``, ``--key=value``)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 2 if argv[i] in ("-n", "-N", "-c", "--ntasks", "--nodes") else 1
    if i >= len(argv):
        print("srun: no command", file=sys.stderr)
        return 1
    os.execvp(argv[i], argv[i:])
    return 1


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        for host in (argv[2] if len(argv) > 2 else "localhost").split(","):
            print(host)
        return 0
    return 0  # requeue and the rest: recorded in calls.jsonl, nothing to do


def _ids(argv: list[str]) -> list[str]:
    for i, a in enumerate(argv):
        if a == "-j" and i + 1 < len(argv):
            return argv[i + 1].split(",")
        if a.startswith("--jobs="):
            return a.split("=", 1)[1].split(",")
    return [p.stem for p in (_root() / "jobs").glob("*.json")]


def _value(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


def squeue(argv: list[str]) -> int:
    fmt = _value(argv, "-o", "%i|%T|%r")
    for job_id in _ids(argv):
        job = _load(job_id)
        if job and job["state"] not in TERMINAL:
            ident = f"{job['id']}_[{job['array'][0]}-{job['array'][-1]}]"
            print(fmt.replace("%i", ident).replace("%T", job["state"]).replace("%r", job["reason"] or "None").replace("%j", job["name"]))
    return 0


def sacct(argv: list[str]) -> int:
    if os.environ.get("FAKE_SLURM_NO_SACCT"):
        print("sacct: error: Slurm accounting storage is disabled", file=sys.stderr)
        return 1
    fields = _value(argv, "-o", "JobID,State,ExitCode").split(",")
    for job_id in _ids(argv):
        job = _load(job_id)
        if not job:
            continue
        rows = ([(f"{job['id']}_{i}", t["state"], t["exit"]) for i, t in job["tasks"].items()] if job["tasks"]
                else [(f"{job['id']}_[{job['array'][0]}-{job['array'][-1]}]", job["state"], "0:0")])
        for ident, state, code in rows:
            vals = {"JobID": ident, "State": state, "ExitCode": code, "JobName": job["name"]}
            print("|".join(vals.get(f, "") for f in fields))
    return 0


def scancel(argv: list[str]) -> int:
    with _locked():
        for job_id in (a for a in argv if not a.startswith("-")):
            job = _load(job_id)
            if job and job["state"] not in TERMINAL:
                job["state"], job["reason"] = "CANCELLED", "cancelled by scancel"
                _save(job)
    return 0
