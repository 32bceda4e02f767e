"""One warning per event per process run.

Why: one event is seen by several readers of the same process -- every split reads every
record (the holdout hashes them), the global dedup pass reads them before the jobs do, a
train and a val loader each open the same sources, a callback reports what the loader
already said. Each of them counts the event in its stats (the counts stay exact); only the
first to see it in this process says so. The key names the event (kind, source, where).
"""

from __future__ import annotations

_SEEN: set[tuple] = set()


def first_time(*key) -> bool:
    """``True`` the first time this process sees ``key`` (and remembers it), ``False`` after."""
    if key in _SEEN:
        return False
    _SEEN.add(key)
    return True


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
