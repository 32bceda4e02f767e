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
