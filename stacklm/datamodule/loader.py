"""``StackDataLoader``: torchdata's ``StatefulDataLoader`` whose state is per rank and loads
with ``torch.load(weights_only=True)``; the rank-state gather/pick it checkpoints with."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from stacklm.datamodule.errors import DataConfigError
from stacklm.datamodule.stream import SUMMARY_KEY
from stacklm.dist import rank_world

_ND = "__ndarray__"


def to_checkpoint_safe(obj: Any) -> Any:
    """numpy arrays/scalars -> tensors/ints, so the loader state loads with ``torch.load``'s
    default ``weights_only=True`` (a checkpoint must not need pickle trust to resume)."""
    import numpy as np

    if isinstance(obj, np.ndarray):
        return {_ND: torch.from_numpy(np.ascontiguousarray(obj).copy())}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: to_checkpoint_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_checkpoint_safe(v) for v in obj)
    return obj


def from_checkpoint_safe(obj: Any) -> Any:
    if isinstance(obj, dict):
        if len(obj) == 1 and _ND in obj:
            return obj[_ND].numpy()
        return {k: from_checkpoint_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(from_checkpoint_safe(v) for v in obj)
    return obj


def gather_from_ranks(state: Any) -> list[Any]:
    """Every rank's loader state, on every rank.

    Lightning writes the checkpoint from rank 0 only, but each rank's stream position is its
    own; ``dump_checkpoint`` runs on all ranks, so gathering here puts all of them in the file.
    """
    rank, world = rank_world()
    if world == 1:
        return [state]
    # pre-pickled numpy/plain containers (tensor pickling across processes is fragile here)
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, pickle.dumps(state))
    return [pickle.loads(b) for b in out]


def pick_rank_state(per_rank: list[Any], mode: str) -> Any:
    rank, world = rank_world()
    if len(per_rank) != world:
        raise DataConfigError(
            f"refusing to resume: the checkpoint's {mode}-mode loader state is from {len(per_rank)} rank(s) but this run "
            f"has {world}. A stream's position is per rank; resume with the same number of devices (shards mode "
            "resumes on any world size)."
        )
    return per_rank[rank]


class StackDataLoader(StatefulDataLoader):
    """``StatefulDataLoader`` whose checkpoint state is per rank and weights_only-safe.

    Its dataset has a length, so Lightning's fit loop does not fetch ahead: the state at a
    checkpoint is exactly "after the batches trained on". Under DDP, Lightning writes the
    checkpoint from rank 0 only, so every rank's state is gathered into it (each rank reads a
    different part of the stream) and each rank restores its own.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.worker_summaries: dict[int, dict[str, Any]] = {}  # worker id -> its latest summary
        self._restart_pending = False
        self.restarts = 0  # worker restarts for online re-weighting (restart_from_state)

    @property
    def batches_yielded(self) -> int:
        """Batches this loader has handed out in the current pass (restored on resume)."""
        return int(getattr(self._iterator, "_num_yielded", 0) or 0) if self._iterator is not None else 0

    def restart_from_state(self) -> None:
        """Before the next batch, rebuild the workers from the state after the batches handed
        out so far (as a resume would): workers run ahead by the prefetch, and a change of their
        dataset (``StreamDataset.mix_changes``) reaches them only when they start. Exact: the
        rebuilt workers continue the same stream, replaying from their last snapshot."""
        self._restart_pending = True

    def _restart(self) -> Iterator[Any]:
        self._restart_pending = False
        old = self._iterator
        state = StatefulDataLoader.state_dict(self)
        StatefulDataLoader.load_state_dict(self, state)
        shutdown = getattr(old, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.restarts += 1
        return StatefulDataLoader.__iter__(self)

    def __iter__(self) -> Iterator[Any]:
        it = super().__iter__()
        while True:
            if self._restart_pending:
                it = self._restart()
            try:
                batch = next(it)
            except StopIteration:
                return
            if isinstance(batch, dict) and SUMMARY_KEY in batch:
                batch = dict(batch)
                summary = batch.pop(SUMMARY_KEY)
                self.worker_summaries[summary["worker"]] = summary
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"per_rank": to_checkpoint_safe(gather_from_ranks(super().state_dict()))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(from_checkpoint_safe(pick_rank_state(state_dict["per_rank"], "stream")))
