"""Worker processes that die with their parent: prebuild pool workers and loader workers.

Why: a SIGKILLed parent runs no cleanup, so nothing tells its workers to stop. A ``stacklm
prebuild --workers N`` pool worker whose parent is gone has no one to report to, yet it used to
keep running its job for seconds, writing shard files and leaving ``.tmp-*`` files behind, and
a loader worker kept reading. Each worker therefore ends itself:

* **Linux**: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set first thing in the worker (the pool's
  initializer, the loader's ``worker_init_fn``): the kernel kills it the moment its parent
  exits, whatever it is doing. The signal follows the *thread* that started the worker: start
  workers from a thread that lives as long as they do (the main thread, as here).
* **The start-up race**: a parent that died before its worker reached that call (the worker was
  still importing) is caught by comparing the parent the worker has with the one the parent
  said it is (``os.getpid()`` there, handed over). Not ``os.getppid() == 1``: under a
  subreaper (``docker --init``, tini, systemd) orphans are re-parented to it, not to PID 1.
* **Workers started through an intermediary** (the stream loaders' forkserver): the kernel
  watches the forkserver, which does *not* exit with the main process, because every worker
  holds its "alive" pipe open: after a SIGKILL of the trainer the forkserver and its workers
  waited on each other forever (and torch's own watchdog, which compares ``os.getppid()`` with
  the forkserver, never fired). Such a worker watches the main process itself: a thread
  blocked on a pidfd of it (Linux >= 5.3; else it looks every 0.1 s) exits the worker the
  moment the main process is gone. The forkserver then ends once its last worker has.
* **Before every file write and rename** (``stacklm.atomic.atomic_write_bytes``: shards,
  manifests, checkpoints) ``exit_if_orphaned()`` compares ``os.getppid()`` with the parent the
  worker started with; an orphan exits there without touching the disk. This is all there is
  where ``prctl`` is not (macOS, Windows), and it costs one system call per file.

A process that never called ``die_with_parent`` (the main process) is never treated as an
orphan. This module imports nothing heavy: a spawned worker sets the signal before it imports
the rest of stacklm (``pool_initializer``).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHAN_EXIT_STATUS = 1

_watched: int | None = None  # the parent this worker started with; None: not a worker
_main: int | None = None  # the process that started the work, when it is not the parent (a forkserver is)
POLL_SECONDS = 0.1  # the watcher's interval where there is no pidfd


def die_with_parent(parent: int | None = None) -> bool:
    """Make this worker end when its parent does (see the module docstring); call it first.

    ``parent``: the pid of the process that started the work, as that process saw itself
    (``os.getpid()`` there, passed down), so a parent that is already gone is noticed; if this
    worker was started through an intermediary (a forkserver, which exits with the main
    process), the intermediary is watched while ``parent`` is still running. ``None``: the
    current parent. Exits at once (status 1) when ``parent`` is gone. Returns whether the
    kernel will kill this process with its parent (``False`` off Linux: only the checks)."""
    global _watched, _main
    armed = _set_pdeathsig()
    now = os.getppid()
    if parent is not None and now != int(parent):
        if not _running(int(parent)):
            _exit_orphan()
        if _main != int(parent):
            _main = int(parent)
            _start_watcher(_main)
    _watched = now
    return armed


def orphaned() -> bool:
    """True in a worker whose parent has died (it was re-parented since ``die_with_parent``),
    or whose main process has, when an intermediary started it."""
    if _watched is None:
        return False
    return os.getppid() != _watched or (_main is not None and not _running(_main))


def exit_if_orphaned() -> None:
    """Exit at once, writing nothing, in a worker whose parent has died (no-op elsewhere)."""
    if orphaned():
        _exit_orphan()


def _start_watcher(pid: int) -> None:
    """A daemon thread that exits this process as soon as ``pid`` (not our parent) has exited."""
    import threading

    def wait_pidfd(fd: int) -> None:
        import select

        select.select([fd], [], [])  # a pidfd turns readable when the process exits
        _exit_orphan()

    def poll() -> None:
        import time

        while _running(pid):
            time.sleep(POLL_SECONDS)
        _exit_orphan()

    target, args = poll, ()
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (old kernel, not Linux)
        pass
    else:
        if not _running(pid):  # it exited between the check and the open (or the pid was reused)
            _exit_orphan()
        target, args = wait_pidfd, (fd,)
    threading.Thread(target=target, args=args, name="stacklm-parent-death", daemon=True).start()


def pool_initializer(parent: int, then: str | None = None, *args: Any) -> None:
    """``ProcessPoolExecutor(initializer=pool_initializer, initargs=(os.getpid(), "module:function", *args))``:
    ``die_with_parent(parent)``, then ``function(*args)``, imported by name only now, so a
    spawned worker's heavy imports come after the death signal is set (the initializer's own
    module is imported before it runs, and this one is small)."""
    die_with_parent(parent)
    if then is not None:
        module, _, name = then.partition(":")
        getattr(importlib.import_module(module), name)(*args)


class WorkerInit:
    """A ``DataLoader`` ``worker_init_fn`` that makes each worker die with the process that
    created the loader (captured here, in that process), then runs ``then(worker_id)``.
    Picklable, for spawn and forkserver workers."""

    def __init__(self, then=None) -> None:
        self.parent = os.getpid()
        self.then = then

    def __call__(self, worker_id: int) -> None:
        die_with_parent(self.parent)
        if self.then is not None:
            self.then(worker_id)


def _set_pdeathsig() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no prctl: the checks still apply
        return False


def _running(pid: int) -> bool:
    """Is ``pid`` a running process (a zombie, killed and not yet reaped, is not)?"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc: ask the kernel (a zombie counts as running there)
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exit_orphan() -> None:
    try:
        os.write(2, f"stacklm: worker {os.getpid()} exits: the process that started it is gone (killed?); nothing more is written\n".encode())
    except OSError:
        pass
    os._exit(ORPHAN_EXIT_STATUS)
