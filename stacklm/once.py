"""One warning per event per process run.

Why: one event is seen by several readers of the same process -- every split reads every
record (the holdout hashes them), the global dedup pass reads them before the jobs do, a
train and a val loader each open the same sources, a callback reports what the loader
already said. Each of them counts the event in its stats (the counts stay exact); only the
first to see it in this process says so. The key names the event (kind, source, where).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_SEEN: set[tuple] = set()
_UNSAID = [0]  # depth of ``unsaid()`` blocks


def first_time(*key) -> bool:
    """``True`` the first time this process sees ``key`` (and remembers it), ``False`` after;
    ``False`` without remembering inside ``unsaid()``."""
    if _UNSAID[0] or key in _SEEN:
        return False
    _SEEN.add(key)
    return True


@contextlib.contextmanager
def unsaid() -> Iterator[None]:
    """Check something that may never run without saying what it would say (and without using
    up the one time each event is said): e.g. the trainer's command line checks each
    ``--config``'s pipeline as it reads it, and a later ``--config`` may replace it; only the
    pipeline the run builds then says its notices (the mix's normalized weights, ...)."""
    _UNSAID[0] += 1
    try:
        yield
    finally:
        _UNSAID[0] -= 1


def say_once(key: tuple, message: str) -> None:
    """Information, not a warning: ``message`` as one line on stderr, the first time this
    process sees ``key`` (``first_time``).

    Why not ``warnings.warn``: some events are expected and need no action (a validation split
    reading its small holdout to the end); a warning, with advice meant for the case where the
    event is a problem, sends a user looking for a fault that is not there. Not ``logging``
    either: an ``info`` record is shown by no handler unless the application configured one."""
    if first_time("said", *key):
        import sys

        print(message, file=sys.stderr, flush=True)


def in_loader_worker() -> bool:
    """Inside a torch ``DataLoader`` worker process: its warnings would repeat once per worker
    and per loader, so the main process says them, from the workers' summaries."""
    import torch.utils.data

    return torch.utils.data.get_worker_info() is not None


def forget() -> None:
    """Forget every event: a new run in the same process (tests run many) says them again."""
    _SEEN.clear()


def one_line_warnings() -> None:
    """Show stacklm's own warnings on the command line as the one line they are.

    Why: Python's default format adds the warning's file path and echoes the source line of the
    ``warnings.warn(`` call, two lines of our code that say nothing to a user, beside each "ran
    dry", padding or data-gate warning. The programs (``stacklm``, ``stacklm-train``) install this;
    a library import does not change how the caller's process shows warnings. Warnings are still
    raised as warnings (filters and ``pytest.warns`` see them); other packages' keep their format.
    """
    import warnings

    if getattr(warnings.formatwarning, "_stacklm", False):
        return
    default = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        text = str(message)
        if text.startswith("stacklm") or _ours(filename):
            text = text if text.startswith("stacklm") else f"stacklm: {text}"
            return f"{text}\n"
        return default(message, category, filename, lineno, line)

    formatwarning._stacklm = True
    warnings.formatwarning = formatwarning


def _ours(filename: str) -> bool:
    import os

    package = os.path.dirname(os.path.abspath(__file__))
    return os.path.abspath(str(filename)).startswith(package + os.sep)
