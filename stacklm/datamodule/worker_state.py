"""The worker side of the stream loader's own state path (``loader.StackDataLoader``).

Why the project owns this (issue 34): the loader used to be ``torchdata``'s
``StatefulDataLoader``, ~2,400 lines over private ``torch.utils.data`` internals, in a project
its maintainers put in maintenance-only mode (no release since 0.11.0, broken once by a torch
nightly). What stream mode needs of it is small, and lives here and in ``loader``:

- Each loader worker plays a *role* ``r`` of ``W`` (the reader ``ShardSpec(rank, world, r, W)``).
  Its iterator (``SnapshotIterator``) attaches its stream's state to a batch, under
  ``WORKER_KEY``: its starting state (on its first batch) and, after a batch, its state when
  that batch is the role's last one at a multiple of ``snapshot_every_n_steps`` loader steps
  (``snapshot_due``). Every batch carries the role it came from, so the main process
  knows, per role, its last snapshot and how many batches it handed out since.
- On resume a role starts from its last snapshot and replays (computes and discards) the
  batches it had handed out after it; batches it had prefetched but not handed out are
  produced again, never counted.
- The snapshot travels pickled to bytes (in memory, between this process and its own
  workers, never read from disk): ``DataLoader``'s ``default_convert`` would otherwise turn its
  numpy arrays into tensors and its tuples into lists on the way.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Mapping
from typing import Any

WORKER_KEY = "stacklm_worker"  # rides on every batch: {"role", and with a snapshot "at", "state"}; the loader takes it off


def snapshot_due(produced: int, role: int, workers: int, every: int, offset: int = 0) -> bool:
    """Does role ``role`` of ``workers`` snapshot after its ``produced``-th batch of the pass?

    The loader deals round-robin (``loader.StackDataLoader``'s order rule): once that batch is
    handed out, ``offset + (produced - 1) * workers + role + 1`` loader batches are (``offset``:
    the batches trained before the pass started, elastic stream mode), and it stays this role's
    last one for ``workers`` loader batches. It snapshots when a multiple of ``every`` falls in
    that span, so at every multiple of ``every`` loader steps (a step checkpoint's interval,
    ``StackDataModule.snapshot_interval``) every role's last batch carries a fresh snapshot and a
    resume from there replays nothing; about once every ``every / workers`` of its batches."""
    handed = int(offset) + (int(produced) - 1) * int(workers) + int(role) + 1
    return (handed + int(workers) - 1) // int(every) > (handed - 1) // int(every)


class SnapshotIterator:
    """A stream iterator (``state_dict``/``load_state_dict``/``__next__``) that reports its
    state on its batches (module docstring). ``start``: ``{"state", "at", "delivered"}`` of
    its role in a loaded loader state, or ``None`` for a fresh start; its snapshot is the
    loaded one, so the sequence of snapshots a role sends does not depend on where it was
    resumed (a resumed loader's state equals an uninterrupted one's at the same batch)."""

    def __init__(self, inner: Any, role: int, start: Mapping[str, Any] | None = None, *, workers: int = 1, every: int = 1000,
                 offset: int = 0) -> None:
        self.inner, self.role, self.workers, self.every, self.offset = inner, int(role), int(workers), max(1, int(every)), int(offset)
        self.produced = 0  # this role's batches in this pass, handed out or not
        self.send_start = True
        if start is not None and start.get("state") is not None:
            inner.load_state_dict(start["state"])
            for _ in range(int(start["delivered"]) - int(start["at"])):
                next(inner)  # handed out after the snapshot: replayed, not sent again
            if hasattr(inner, "fresh"):  # its first real batch carries a summary, as at a start
                inner.fresh = True
            self.produced, self.send_start = int(start["delivered"]), False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        snap = (self.produced, self._state()) if self.send_start else None
        batch = next(self.inner)
        self.produced += 1
        if snapshot_due(self.produced, self.role, self.workers, self.every, self.offset):
            snap = (self.produced, self._state())
        self.send_start = False
        tag: dict[str, Any] = {"role": self.role}
        if snap is not None:
            tag.update(at=snap[0], state=snap[1])
        return {**batch, WORKER_KEY: tag}

    def _state(self) -> bytes:
        return pickle.dumps(self.inner.state_dict(), protocol=pickle.HIGHEST_PROTOCOL)
