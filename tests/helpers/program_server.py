"""Run the tests' runner programs (``tests/runners/*.py``) as forks of one process that has
already imported Lightning, torch and stacklm, instead of as fresh interpreters.

Why: a runner is one small fit, and a fresh interpreter spends ~7 CPU-s importing Lightning
before it; the resume tests run 4-10 such programs each (one per shape), so the suite paid that
import ~50 times. The server (``python -m tests.helpers.program_server``, one per pytest process,
started on first use) imports once and forks a child per program; the child takes the program's
argv, environment, working directory and output files, runs the script as ``__main__``, and
exits as the program would (exit handlers run, the status is the script's: a ``SystemExit``
code, 1 after a traceback, ``-9`` when it SIGKILLed itself). What a fresh interpreter does
differently is only the imports, which the tests that are about start-up or launch keep: the
re-executed DDP launch (``spawn=True``), the CLI and recipe tests, ``test_startup_imports``.

The server only imports (no torch op runs in it, no thread is started), so a fork of it is as
clean as a fresh process; it says so at start (``threads`` in its first line) and the client
refuses it otherwise. Protocol: a JSON line per request on its stdin; it answers the child's pid,
then its exit status, a JSON line each."""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNNERS = ROOT / "tests" / "runners"
PRELOAD = ["torch", "lightning", "lightning.pytorch", "stacklm.datamodule.stack_datamodule", "stacklm.datamodule.stream",
           "tests.helpers.lightning", "tests.helpers.datamodule", "tests.helpers.ddp"]


# ------------------------------------------------------------------ the server


def _child(req: dict) -> None:
    """In the fork: become the program ``req`` describes, run it, exit with its status."""
    code = 1
    try:
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0), os.dup2(out, 1), os.dup2(err, 2)
        for fd in (null, out, err):
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        script = req["argv"][0]
        sys.argv = list(req["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
        import runpy

        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if e.code is not None and not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - printed as the interpreter would, status 1
            import traceback

            traceback.print_exc()
            code = 1
        threading._shutdown()  # what the interpreter does at exit: join non-daemon threads, then exit handlers
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(code)


def serve() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)
    print(json.dumps({"ready": True, "threads": threading.active_count()}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)


# ------------------------------------------------------------------ the client (in the pytest process)


class _Server:
    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.program_server"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._pending = b""  # bytes read past the last whole line
        hello = self._line(600) or {}
        if not hello.get("ready") or hello.get("threads") != 1:
            self.proc.kill()
            raise RuntimeError(f"the program server did not start clean: {hello}")
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _line(self, timeout: float | None) -> dict | None:
        """The server's next JSON line, or ``None`` after ``timeout`` seconds. Reads the pipe's fd
        itself: a buffered ``readline`` could take the status line along with the pid line of a
        program that ended at once, and ``select`` would then wait on an empty pipe."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the program server exited")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, cmd: list[str], *, timeout: float, cwd, env, out: str, err: str) -> int:
        req = {"argv": [str(c) for c in cmd[1:]], "cwd": str(cwd or os.getcwd()), "env": dict(env if env is not None else os.environ),
               "stdout": out, "stderr": err}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        pid = self._line(60)["pid"]
        answer = self._line(timeout)
        if answer is None:
            os.kill(pid, 9)
            self._line(60)
            raise subprocess.TimeoutExpired(cmd, timeout)
        return answer["status"]

    def stop(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_server: _Server | None = None


def can_serve(cmd: list[str], env: dict | None) -> bool:
    """A runner script run by this interpreter, not asking for the re-executed DDP launch."""
    from tests.helpers.ddp import DDP_ENV

    if len(cmd) < 2 or cmd[0] != sys.executable or Path(cmd[1]).resolve().parent != RUNNERS:
        return False
    env = env if env is not None else os.environ
    return env.get(DDP_ENV) != "ddp" and env.get("STACKLM_TEST_FRESH_PROGRAMS") != "1"


def run_served(cmd: list[str], *, timeout: float, cwd=None, env=None) -> subprocess.CompletedProcess:
    global _server
    if _server is None or not _server.alive():
        _server = _Server()
        atexit.register(_server.stop)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, _server.lock:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        try:
            rc = _server.run(cmd, timeout=timeout, cwd=cwd, env=env, out=out, err=err)
        except subprocess.TimeoutExpired as e:
            e.output, e.stderr = Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace")
            raise
        return subprocess.CompletedProcess(cmd, rc, Path(out).read_text(errors="replace"), Path(err).read_text(errors="replace"))


if __name__ == "__main__":
    serve()
