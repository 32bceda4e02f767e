"""Worker processes that die with their parent: no orphan left writing shards or reading data.

Why: a process started to do one task (a prebuild pool worker, a datatrove task under
``stacklm.scale.supervise``, a datatrove Ray actor's pool child, a loader worker) works for its
parent. If the parent is killed (SIGKILL, OOM killer, ``ray.kill``) it runs no cleanup, so
nothing tells the child: it used to keep running as an orphan, writing the shards a retry also
writes and leaving ``.tmp-*`` files behind, or reading data for no one. So each worker ends
itself:

* **Linux**: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` through ``ctypes`` (no dependency), set first
  thing in the worker (a pool initializer, a loader ``worker_init_fn``): the kernel kills it
  as soon as its parent has exited, whatever it is doing. The signal follows the *thread* that
  started the worker: start workers from a thread that lives as long as they do (the main
  thread, as here). Not inherited by a worker's own forked children.
* **The start-up race**: a parent that died before its worker reached that call (the worker
  was still importing) is caught by comparing the parent the worker has with the pid the
  parent handed it (``os.getpid()`` there). Without one, a parent pid of 1 counts as dead; but
  under a subreaper (``docker --init``, tini, systemd) orphans are re-parented to it, not to
  PID 1, so hand the pid over.
* **Workers started through an intermediary** (a forkserver: the stream loaders', datatrove's
  local executor's): the kernel watches the forkserver, which does *not* exit with the main
  process, because every worker holds its "alive" pipe open; after a SIGKILL of the trainer the
  forkserver and its workers used to wait on each other forever (torch's own watchdog compares
  ``os.getppid()`` with the forkserver and never fired). Such a worker watches the main process
  itself (``die_with``): a thread blocked on a pidfd of it (Linux >= 5.3; else it looks every
  ``interval`` s) ends the worker the moment the main process is gone.
* **Before every file write and rename** (``stacklm.atomic.atomic_write_bytes``: shards,
  provenance, checkpoints, manifests) ``exit_if_orphaned()`` checks the parent (and any process
  given to ``die_with``) is still there; an orphan exits without touching the disk. It is all
  there is where ``prctl`` is not (macOS, Windows), and costs a system call per file.

A process that never called ``die_with_parent`` (the command-line process itself, which must
outlive the shell that started it, ``nohup``) is never treated as an orphan; neither is a
child that a worker forks (it registers for itself if it is a worker). The module imports
nothing heavy, so a spawned worker can arm the signal before it imports the rest of stacklm
(``pool_initializer``).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
ORPHAN_EXIT_STATUS = 1

_watched: int | None = None  # the parent this worker started with; None: not a worker
_others: set[int] = set()  # processes this worker also dies with (``die_with``)


def _forget() -> None:
    """A worker's own forked child is not a worker (the kernel drops its death signal too)."""
    global _watched
    _watched = None
    _others.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget)


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Make this worker end when its parent does (module docstring); call it first thing.

    ``expected_parent``: the pid of the process that started the work, as it saw itself
    (``os.getpid()`` there, passed to the child). If this process's parent is another one,
    either that process is gone already (this one was re-parented: exit at once) or this one
    was started through an intermediary such as a forkserver (then it also dies with
    ``expected_parent``, ``die_with``). Without it, a parent pid of 1 counts as dead. Returns
    whether the kernel will signal this process when its parent exits (False off Linux: the
    checks before every write still hold)."""
    global _watched
    armed = _set_pdeathsig(sig)
    parent = os.getppid()
    if expected_parent is not None and parent != int(expected_parent):
        if not _running(int(expected_parent)):
            _exit_orphan()
        die_with(int(expected_parent), sig=sig)
    elif expected_parent is None and parent == 1:
        _exit_orphan()
    _watched = parent
    return armed


def die_with(pid: int, interval: float = 0.1, sig: int = signal.SIGKILL) -> None:
    """End this process with ``sig`` once process ``pid`` is gone: for a process whose parent is
    not the one it works for (a forkserver's child). A daemon thread waits on a pidfd of ``pid``
    (it turns readable when ``pid`` exits), or checks every ``interval`` s where there is none.
    ``exit_if_orphaned`` checks ``pid`` too from now on."""
    import threading

    pid = int(pid)
    if pid in _others:
        return
    _others.add(pid)
    me = os.getpid()

    def end() -> None:
        if os.getpid() == me:  # not in a forked child of this process
            _exit_orphan(sig)

    def wait_pidfd(fd: int) -> None:
        import select

        select.select([fd], [], [])
        end()

    def poll() -> None:
        import time

        while _running(pid):
            time.sleep(interval)
        end()

    target, args = poll, ()
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (not Linux, kernel < 5.3)
        pass
    else:
        if not _running(pid):  # it exited between the caller's check and the open
            _exit_orphan(sig)
        target, args = wait_pidfd, (fd,)
    threading.Thread(target=target, args=args, name=f"die with {pid}", daemon=True).start()


def parent_alive(expected_parent: int) -> bool:
    """Whether the process that started this one still is its parent."""
    return os.getppid() == expected_parent


def orphaned() -> bool:
    """True in a worker (``die_with_parent`` was called) whose parent has died since, or one of
    the processes given to ``die_with``; always False elsewhere."""
    if _watched is None:
        return False
    return os.getppid() != _watched or any(not _running(p) for p in _others)


def exit_if_orphaned() -> None:
    """Exit at once, writing nothing, in a worker whose parent has died (no-op elsewhere)."""
    if orphaned():
        _exit_orphan()


def pool_initializer(parent: int, then: str | None = None, *args: Any) -> None:
    """``ProcessPoolExecutor(initializer=pool_initializer, initargs=(os.getpid(), "module:function", *args))``:
    ``die_with_parent(parent)``, then ``function(*args)``, imported by name only now, so a
    spawned worker's heavy imports come after the signal is armed (the initializer's own module
    is imported before it runs, and this one is small)."""
    die_with_parent(parent)
    if then is not None:
        module, _, name = then.partition(":")
        getattr(importlib.import_module(module), name)(*args)


class WorkerInit:
    """A ``DataLoader`` ``worker_init_fn`` that makes each worker die with the process that
    created the loader (its pid is taken here, in that process), then runs ``then(worker_id)``.
    Picklable, for spawn and forkserver workers."""

    def __init__(self, then=None) -> None:
        self.parent = os.getpid()
        self.then = then

    def __call__(self, worker_id: int) -> None:
        die_with_parent(self.parent)
        if self.then is not None:
            self.then(worker_id)


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no prctl: the checks still apply
        return False


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a killed process nobody has reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return True  # no /proc: os.kill said it exists


def _exit_orphan(sig: int | None = None) -> None:
    """Say so on stderr (one line, if anyone still reads it), then end: ``sig`` to itself, or
    ``os._exit``; no cleanup runs, nothing more is written."""
    try:
        os.write(2, f"stacklm: worker {os.getpid()} exits: the process it works for is gone (killed?); nothing more is written\n".encode())
    except OSError:
        pass
    if sig is not None:
        os.kill(os.getpid(), sig)
    os._exit(ORPHAN_EXIT_STATUS)
