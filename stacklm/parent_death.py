"""A worker process that dies with its parent: no orphan left writing shards.

A process started to do one task (a prebuild pool worker, a datatrove task under
``stacklm.scale.supervise``, a datatrove Ray actor's pool child) writes files that a retry of the
same task also writes. If its parent is killed (SIGKILL, OOM killer, a Ray actor killed by
``ray.kill``) nothing tells the child: it keeps running as an orphan, writing the same shards as
the retry. ``die_with_parent`` asks the Linux kernel to send the process SIGKILL when its parent
dies (``prctl(PR_SET_PDEATHSIG)``, through ``ctypes``: no dependency), and closes the race where
the parent died before the call by comparing the parent pid with the one the caller saw. ``die_with(pid)`` does the same for a
process that works for someone other than its parent (a forkserver's child), by polling.

Call it only in a process that exists for its parent (a worker), never in the command-line
process itself: that one must outlive the shell that started it (``nohup``).
"""

from __future__ import annotations

import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits. Returns whether it
    is armed (False off Linux, where there is no such call; the caller's other checks hold).

    ``expected_parent``: the parent pid as the parent knew it (``os.getpid()`` there, passed to
    the child); when the parent already died before this call the child is now someone else's
    and exits at once. Without it, a parent pid of 1 (adopted by init) counts as dead.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    parent = os.getppid()
    if (expected_parent is not None and parent != expected_parent) or parent == 1:
        os.kill(os.getpid(), sig)  # the parent is gone already: the signal will never come
    return True


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a killed process nobody has reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc: os.kill said it exists


def die_with(pid: int, interval: float = 0.5, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to this process once process ``pid`` is gone, checked every ``interval`` s
    by a daemon thread. For a process whose parent is not the one it works for: a task started
    through a forkserver is the forkserver's child, and the forkserver outlives a killed
    command (so ``die_with_parent`` never fires there)."""
    import threading

    me = os.getpid()

    def watch() -> None:
        import time

        while _running(pid):
            time.sleep(interval)
        os.kill(me, sig)

    threading.Thread(target=watch, name=f"die with {pid}", daemon=True).start()


def parent_alive(expected_parent: int) -> bool:
    """Whether the process that started this one still is its parent (checked before a write
    where ``die_with_parent`` is not available)."""
    return os.getppid() == expected_parent
