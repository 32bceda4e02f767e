"""Elastic stream mode: a fixed number of logical streams, dealt to (rank x worker) at run time.

Why: a stream's position used to belong to a physical reader (rank r, worker w of this run),
so a resume on another world size, worker count or batch size had nowhere to put it. Here the
state belongs to ``L`` *logical* streams fixed for the whole run (``logical_streams``, recorded
in the checkpoint): logical stream ``l`` reads its own part of every source
(``ShardSpec(0, 1, l, L)``: reader ``l`` of ``L``) with ``1/L`` of the token budget, and owes a
fixed *quota* of ``Q`` windows per epoch (padding windows, every target ``IGNORE_INDEX``, once it
runs dry). Physical reader ``p`` of ``P = world x workers`` takes the logical streams
``l % P == p`` (``deal``) and fills its batches row by row, round-robin over those with quota
left; when all are done it pads. Every physical reader yields the same batch count
(``batches_per_reader``), so every rank takes the same number of steps.

So what an epoch delivers is, whatever the shape and however often it changed, the first ``Q``
windows of every logical stream: a resume re-deals the logical streams and nothing is dropped
or repeated. Each batch carries the rows it took from each logical stream (``LOGICAL_KEY``);
the loader counts them in the main process, and the checkpoint records the rows consumed per
logical stream (``StackDataModule.state_dict``), from which a resume plans its batches before
the loader exists (Lightning takes the epoch's length first).

The exact state of each logical stream at the delivered position is computed at load time in
the main process (``replay_logical_states``): the loader's state holds each worker role's last
snapshot plus the batches it delivered since (``loader.StackDataLoader``), so each old worker's
iterator is rebuilt from its snapshot, fast-forwarded by those batches, and its logical streams'
states are read off. The new workers start from them (``LogicalStreamDataset.initial``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from stacklm.data.contract import padding_batch
from stacklm.data.packing.nodes import DELIVERY_KEY
from stacklm.data.packing.origins import delivery_counts
from stacklm.data.packing.pack import Collate
from stacklm.data.sources import ShardSpec
from stacklm.datamodule.worker_state import SnapshotIterator
from stacklm.datamodule.stream import (
    SUMMARY_EVERY_N_BATCHES,
    SUMMARY_KEY,
    StreamDataset,
    first_local_batch,
    graph_report,
)
from stacklm.errors import ResumeRefused

LOGICAL_KEY = "stacklm_logical"  # rides on a batch: [[logical stream, rows taken], ..., [-1, padding rows]]; the loader takes it off


def deal(logical_streams: int, readers: int, reader: int) -> list[int]:
    """The logical streams physical reader ``reader`` of ``readers`` serves: ``l % readers == reader``."""
    return list(range(reader, logical_streams, readers))


def batches_per_reader(left: Mapping[int, int], logical_streams: int, readers: int, batch_size: int) -> int:
    """Batches every physical reader yields so that the reader with the most rows left finishes
    (the others pad): ``max over readers of ceil(rows left of its logical streams / batch_size)``."""
    most = max(sum(int(left[l]) for l in deal(logical_streams, readers, p)) for p in range(readers))
    return -(-most // batch_size)


class _LogicalIterator:
    """One physical reader's batches, drawn row by row from its logical streams.

    State (``state_dict``): per logical stream its graph position (the pack node's state), the
    rows of its quota left, whether it ran dry and how many re-weightings it applied; plus the
    round-robin cursor, the batches yielded in this segment and the segment's plan (batch
    count, batch size, steps before it), so an iterator rebuilt from a snapshot alone replays
    exactly (``replay_logical_states``)."""

    def __init__(self, ds: LogicalStreamDataset, rank: int, worker: int, workers: int) -> None:
        self.ds, self.rank, self.worker, self.workers = ds, rank, worker, workers
        readers = ds.world_size * workers
        self.mine = deal(ds.logical_streams, readers, rank * workers + worker)
        plan = ds.plan(workers)
        self.n_batches, self.steps_before, self.batch_size = plan["n_batches"], plan["steps_before"], ds.batch_size
        self.graphs: dict[int, Any] = {}
        self.streams: dict[int, dict[str, Any]] = {}
        self._pending: dict[int, Any] = {}  # logical -> graph state to reset to when first built
        for l in self.mine:
            init = plan["initial"].get(l)
            if init is None:
                self.streams[l] = {"left": int(plan["left"][l]), "dry": False, "mix_changes_applied": 0}
            else:
                self.streams[l] = {k: init[k] for k in ("left", "dry", "mix_changes_applied")}
                if init.get("graph") is not None:  # None: never read yet, starts from its top
                    self._pending[l] = init["graph"]
        self.cursor = 0
        self.yielded = 0
        self.padded_rows = 0
        self.fresh = True  # no summary sent since this iterator started (not part of the state)
        self._dry_seen: list[int] = []

    # -- graphs ----------------------------------------------------------------------------
    def _graph(self, l: int):
        if l not in self.graphs:
            graph = self.ds.build(ShardSpec(0, 1, l, self.ds.logical_streams), self.ds.logical_streams, epoch=self.ds.epoch)
            if l in self._pending:
                graph.windows.reset(self._pending.pop(l))
            self.graphs[l] = graph
        return self.graphs[l]

    def _apply_mix_changes(self, l: int) -> None:
        """Re-weight logical stream ``l`` before this reader's first batch at or after each
        change's per-rank batch index (``StackDataModule.set_mix_weights``), counted per stream."""
        changes, st = self.ds.mix_changes, self.streams[l]
        while st["mix_changes_applied"] < len(changes):
            change = changes[st["mix_changes_applied"]]
            if first_local_batch(int(change["batch"]) - self.steps_before, self.worker, self.workers) > self.yielded:
                return
            self._graph(l).mix.set_weights(change["weights"], f"step{int(change['step'])}")
            st["mix_changes_applied"] += 1

    def _next_stream(self) -> int | None:
        n = len(self.mine)
        for i in range(n):
            k = (self.cursor + i) % n
            if self.streams[self.mine[k]]["left"] > 0:
                self.cursor = (k + 1) % n
                return self.mine[k]
        return None

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> _LogicalIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        if self.yielded >= self.n_batches:
            raise StopIteration
        for l in self.mine:
            if self.streams[l]["left"] > 0 and not self.streams[l]["dry"]:
                self._apply_mix_changes(l)
        windows, origins, taken, n_pad, used = [], [], {}, 0, None
        for _ in range(self.batch_size):
            l = self._next_stream()
            if l is None:  # every logical stream of this reader met its quota: the others still owe rows
                n_pad += 1
                continue
            st = self.streams[l]
            st["left"] -= 1
            taken[l] = taken.get(l, 0) + 1
            if not st["dry"]:
                graph = self._graph(l)
                try:
                    windows.append(next(graph.windows))
                    origins.append(graph.windows.last_origin)
                    used = graph
                    continue
                except StopIteration:
                    st["dry"] = True
                    if self.ds.split != "val":  # val: its holdout read to the end is expected, said once by the loader (note_dry)
                        warnings.warn(
                            f"stacklm: logical stream {l} of the {self.ds.split} stream ran dry with {st['left'] + 1} of its "
                            f"{self.ds.quota} windows left; padding them with fully masked rows so every rank takes the same "
                            "number of steps. Give the mix more data or lower the token budget.",
                            stacklevel=2,
                        )
            n_pad += 1
        self.padded_rows += n_pad
        batch = self._collate(windows, origins, n_pad, used)
        batch[LOGICAL_KEY] = torch.tensor(sorted(taken.items()) + [(-1, n_pad)], dtype=torch.int64).reshape(-1, 2)
        self.yielded += 1
        dry = [l for l in self.mine if self.streams[l]["dry"]]
        if (self.yielded % SUMMARY_EVERY_N_BATCHES == 0 or self.yielded == self.n_batches or dry != self._dry_seen
                or self.fresh):
            self._dry_seen, self.fresh = dry, False
            batch[SUMMARY_KEY] = self.summary()
        return batch

    def _collate(self, windows: list, origins: list, n_pad: int, graph) -> dict[str, Any]:
        """The real windows collated to the batch contract with their delivery counts, then
        ``n_pad`` padding rows (no loss)."""
        ds = self.ds
        planes = getattr(ds, "planes", "full")  # the batch layout (stacklm.data.contract), set by the stream mode
        if not windows:
            return padding_batch(n_pad, ds.seq_len, ds.pad_id, planes)
        p = graph.windows.packer
        # the padding rows collated with the real ones: a lean batch's cu_seqlens do not concatenate row-wise
        pad_rows = [np.full(ds.seq_len, ds.pad_id, dtype=np.int64)] * n_pad
        batch = Collate(p.bos_id, p.eos_id, p.pad_id, planes)(list(windows) + pad_rows)
        batch[DELIVERY_KEY] = delivery_counts(origins, len(ds.sources), windows if p.provenance else None)
        return batch

    # -- reporting -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Per logical stream this reader serves: what it processed so far (cumulative, restored
        with its state), under ``streams``; the loader keeps the latest per logical stream."""
        streams = []
        for l in self.mine:
            if l not in self.graphs and l not in self._pending and self.streams[l]["left"] == 0:
                continue  # an untouched finished stream (after a reshape): another reader reported it
            graph = self._graph(l)
            report = graph_report(graph)
            streams.append({"stream": l, "worker": self.worker, "rank": self.rank, **report,
                            "ran_dry": sorted(src for src, row in report["mixed"].items() if row.get("status") == "ran_dry")})
        return {"worker": self.worker, "rank": self.rank, "streams": streams, "padding_rows": self.padded_rows}

    # -- state -----------------------------------------------------------------------------
    def logical_state(self, l: int) -> dict[str, Any]:
        """Logical stream ``l``'s exact state: what a reader of any shape restarts it from."""
        st = dict(self.streams[l])
        if l in self._pending:
            st["graph"] = self._pending[l]
        elif l in self.graphs:
            st["graph"] = self.graphs[l].windows.state_dict()
        else:
            st["graph"] = None  # never read: starts from its top
        return st

    def state_dict(self) -> dict[str, Any]:
        return {"streams": {str(l): self.logical_state(l) for l in self.mine}, "cursor": self.cursor, "yielded": self.yielded,
                "padded_rows": self.padded_rows, "n_batches": self.n_batches, "steps_before": self.steps_before,
                "batch_size": self.batch_size}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.graphs, self._pending = {}, {}
        for key, st in state["streams"].items():
            l = int(key)
            self.streams[l] = {k: st[k] for k in ("left", "dry", "mix_changes_applied")}
            if st.get("graph") is not None:
                self._pending[l] = st["graph"]
        self.cursor, self.yielded, self.padded_rows = int(state["cursor"]), int(state["yielded"]), int(state["padded_rows"])
        self.n_batches, self.steps_before = int(state["n_batches"]), int(state["steps_before"])
        self.batch_size = int(state["batch_size"])


class LogicalStreamDataset(StreamDataset):
    """A rank's physical readers over ``logical_streams`` logical streams (see the module).

    ``resume`` (set by ``StreamMode`` from the checkpoint): for epoch ``resume["epoch"]``, the
    rows left per logical stream (``left``) and the per-rank batches already trained in that
    epoch (``steps_before``); ``initial`` holds the logical streams' exact states once the loader
    state is loaded (``restore``). Any other epoch starts every logical stream afresh."""

    def __init__(self, build, *, logical_streams: int, quota: int, **kwargs: Any) -> None:
        super().__init__(build, **kwargs)
        self.logical_streams, self.quota = int(logical_streams), int(quota)
        self.resume: dict[str, Any] | None = None
        self.initial: dict[int, dict[str, Any]] = {}
        self.workers = 1  # this run's loader workers (0 counts as one reader: the main process)

    def segment(self) -> dict[str, Any]:
        """Where this epoch starts: the resume point in its epoch, else the top."""
        if self.resume is not None and int(self.resume["epoch"]) == self.epoch:
            return {"left": {int(l): int(n) for l, n in self.resume["left"].items()},
                    "steps_before": int(self.resume["steps_before"]), "initial": self.initial}
        return {"left": dict.fromkeys(range(self.logical_streams), self.quota), "steps_before": 0, "initial": {}}

    def plan(self, workers: int) -> dict[str, Any]:
        seg = self.segment()
        seg["n_batches"] = batches_per_reader(seg["left"], self.logical_streams, self.world_size * workers, self.batch_size)
        return seg

    def __len__(self) -> int:
        plan = self.plan(self.workers)
        return plan["steps_before"] + plan["n_batches"] * self.workers

    def full_epoch_len(self) -> int:
        left = dict.fromkeys(range(self.logical_streams), self.quota)
        return batches_per_reader(left, self.logical_streams, self.world_size * self.workers, self.batch_size) * self.workers

    def steps_before(self) -> int:
        return int(self.segment()["steps_before"])

    def _iterator(self, worker: int, workers: int) -> _LogicalIterator:
        return _LogicalIterator(self, self.rank, worker, workers)

    # -- resume ----------------------------------------------------------------------------
    def restore(self, per_rank_loader: list[Any], old_shape: Mapping[str, int]) -> None:
        """Compute this rank's logical streams' exact states from the checkpoint's per-rank
        loader states (written on ``old_shape``) into ``initial``, checking each against the
        consumed rows the checkpoint recorded."""
        if self.resume is None or int(self.resume["epoch"]) != self.epoch or self.resume.get("native"):
            return
        readers = self.world_size * self.workers
        needed = {l for w in range(self.workers) for l in deal(self.logical_streams, readers, self.rank * self.workers + w)}
        states = replay_logical_states(self, per_rank_loader, old_shape, needed)
        for l, st in states.items():
            if int(st["left"]) != int(self.resume["left"][l]):
                raise ResumeRefused(
                    f"refusing to resume: logical stream {l} replays to {st['left']} windows left but the checkpoint counted "
                    f"{self.resume['left'][l]}; the checkpoint's loader state and data state disagree (written by another "
                    "stacklm version?). Resume on the checkpoint's shape, or start a new run."
                )
        self.initial = states


def stream_record(ds: LogicalStreamDataset, segment_consumed: list[Mapping[int, int]], steps: int,
                  shape: Mapping[str, int]) -> dict[str, Any]:
    """The shape-free position a checkpoint records: rows consumed per logical stream in the
    current epoch (the segment's start plus every rank's rows since), the per-rank batches
    trained in the epoch, the epoch, ``logical_streams``, the quota, the shape that wrote it and
    where its segment started (a resume on the same shape continues that segment natively)."""
    seg = ds.segment()
    consumed = {l: ds.quota - int(seg["left"][l]) for l in range(ds.logical_streams)}
    for per_rank in segment_consumed:
        for l, n in per_rank.items():
            consumed[int(l)] += int(n)
    return {"logical_streams": ds.logical_streams, "quota": ds.quota, "epoch": ds.epoch, "steps": int(steps),
            "consumed": {str(l): n for l, n in consumed.items()}, "shape": dict(shape),
            "segment": {"left": {str(l): int(n) for l, n in seg["left"].items()}, "steps_before": int(seg["steps_before"])}}


def resume_segment(record: Mapping[str, Any] | None, quota: int, shape: Mapping[str, int]) -> dict[str, Any] | None:
    """``LogicalStreamDataset.resume`` from a checkpoint's ``stream_record``; ``None`` when there
    is no record or its epoch was finished (the next one starts from its top).

    On the checkpoint's own ``shape`` the segment it was in goes on (``native``: the loader's
    own state restores the workers, exactly as an uninterrupted run); on another shape a new
    segment starts at the checkpoint: rows left per logical stream, batches trained before."""
    if not record or record.get("consumed") is None:
        return None
    consumed = {int(l): int(n) for l, n in record["consumed"].items()}
    left = {l: quota - consumed.get(l, 0) for l in range(int(record["logical_streams"]))}
    if any(n < 0 for n in left.values()):
        raise ResumeRefused(f"refusing to resume: the checkpoint consumed more windows than the quota {quota}: {left}")
    if sum(left.values()) == 0:
        return None
    out = {"epoch": int(record["epoch"]), "left": left, "steps_before": int(record["steps"]), "shape": dict(record["shape"]),
           "native": dict(record["shape"]) == dict(shape)}
    if out["native"]:
        seg = record["segment"]
        out.update(left={int(l): int(n) for l, n in seg["left"].items()}, steps_before=int(seg["steps_before"]))
    return out


def check_loader_layout(loader_state: Mapping[str, Any]) -> None:
    """Refuse a rank's loader state that is not ``loader.StackDataLoader``'s own layout."""
    if "roles" not in loader_state:
        raise ResumeRefused(
            "refusing to resume: the checkpoint's stream loader state is torchdata's StatefulDataLoader's (a stacklm "
            "before issue 34), which this loader does not read. Resume it with that stacklm, or start a new run."
        )


def role_start(loader_state: Mapping[str, Any], role: int) -> dict[str, Any]:
    """Role ``role``'s entry of one rank's loader state (``loader.StackDataLoader``): its last
    snapshot (``state``), the batches it had produced at it (``at``) and handed out (``delivered``)."""
    check_loader_layout(loader_state)
    return loader_state["roles"][role]


def replay_logical_states(ds: LogicalStreamDataset, per_rank_loader: list[Any], old_shape: Mapping[str, int],
                          needed: set[int]) -> dict[int, dict[str, Any]]:
    """The exact state of each logical stream in ``needed`` after the batches the checkpointed
    run delivered: each old reader serving one is rebuilt in this process from its last
    snapshot and fast-forwarded by the batches it delivered since (its batches are computed
    and discarded; at most the snapshot interval)."""
    old_world, old_workers = len(per_rank_loader), int(old_shape["num_workers"])
    readers = old_world * max(1, old_workers)
    out: dict[int, dict[str, Any]] = {}
    for rank, loader_state in enumerate(per_rank_loader):
        for w in range(max(1, old_workers)):
            mine = deal(ds.logical_streams, readers, rank * max(1, old_workers) + w)
            if not needed.intersection(mine):
                continue
            old = copy.copy(ds)
            old.world_size, old.rank, old.batch_size, old.initial = old_world, rank, int(old_shape["batch_size"]), {}
            old.resume = None  # the snapshot carries the old segment's plan
            it = _LogicalIterator(old, rank, w, max(1, old_workers))
            start = role_start(loader_state, w)
            if start["state"] is None and int(start["delivered"]) == 0:
                continue  # never started: its logical streams start from their top
            if start["state"] is None or int(start["delivered"]) < int(start["at"]):
                raise ResumeRefused(
                    f"refusing to resume: rank {rank} worker {w}'s loader state has no snapshot at or before its "
                    f"{start['delivered']} delivered batches (snapshot at {start['at']}); the checkpoint's loader state is "
                    "inconsistent. Resume from another checkpoint."
                )
            SnapshotIterator(it, w, start)  # restores the snapshot and replays the batches delivered since
            for l in mine:
                if l in needed:
                    out[l] = _plain(it.logical_state(l))
    return out


def _plain(state: Any) -> Any:
    """A deep copy with arrays copied (states of a replayed iterator must not alias its buffers)."""
    if isinstance(state, np.ndarray):
        return state.copy()
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_plain(v) for v in state]
    return state
