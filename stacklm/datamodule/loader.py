"""``StackDataLoader``: a plain ``torch.utils.data.DataLoader`` with the project's own worker
state (``worker_state``), per rank and loadable with ``torch.load(weights_only=True)``; the
rank-state gather/pick it checkpoints with."""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from stacklm.data.packing.nodes import DELIVERY_KEY
from stacklm.datamodule.delivery import DeliveryCounter
from stacklm.datamodule.handoff import MainBlocks, worker_pack
from stacklm.datamodule.resume.logical import (
    LOGICAL_KEY,
    LogicalStreamDataset,
    check_loader_layout,
    resume_segment,
    stream_record,
)
from stacklm.datamodule.stream import FALLBACK_REASON, SUMMARY_KEY
from stacklm.datamodule.worker_state import WORKER_KEY
from stacklm.dist import rank_world
from stacklm.errors import DataError, ResumeRefused
from stacklm.once import first_time

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
    """Every rank's loader state, on rank 0 (the others get their own only).

    Lightning writes the checkpoint from rank 0 only, but each rank's stream position is its
    own; ``dump_checkpoint`` runs on all ranks, so gathering here puts all of them in the file.
    Gathered to rank 0 alone (``gather_object``), not to every rank: the other ranks' copies
    would be thrown away, and a rank's state can be large (shuffle and dedup buffers).
    """
    rank, world = rank_world()
    if world == 1:
        return [state]
    # pre-pickled numpy/plain containers (tensor pickling across processes is fragile here); in-memory
    # between our own ranks, never read from disk (the checkpoint holds to_checkpoint_safe's tensors)
    out: list[Any] | None = [None] * world if rank == 0 else None
    torch.distributed.gather_object(pickle.dumps(state), out, dst=0)
    if rank != 0:
        return [state]  # never written: only rank 0's checkpoint reaches the file
    return [pickle.loads(b) for b in out]


def pick_rank_state(per_rank: list[Any], mode: str) -> Any:
    rank, world = rank_world()
    if len(per_rank) != world:
        raise ResumeRefused(
            f"refusing to resume: the checkpoint's {mode}-mode loader state is from {len(per_rank)} rank(s) but this run "
            f"has {world}. A stream's position is per rank; resume with the same number of devices (shards mode "
            "resumes on any world size)."
        )
    return per_rank[rank]


class StackDataLoader(DataLoader):
    """A plain ``DataLoader`` whose checkpoint state is the project's own, per rank and
    weights_only-safe (``worker_state`` says why the project owns it and what a worker sends).

    The state (``loader`` in each rank's entry) is "after the batches handed out": per role of
    a loader worker (``roles[r]``) its last snapshot (``state``, taken after ``at`` of its
    batches; ``None`` before it sent one) and the batches it handed out (``delivered``), plus
    the batches handed out in all (``handed``), the role the next batch comes from (``next``),
    the number of roles (``workers``; the main process counts as one) and whether the pass ran
    to its end (``finished``: the next pass starts afresh). Batches prefetched but not handed
    out are in no count: a resume produces them again.

    The order rule: a plain ``DataLoader`` deals round-robin from worker 0, so on resume new
    worker ``i`` plays role ``(i + next) % W``. The rank's batch ``b`` then always comes from
    role ``b % W`` (its ``b // W``-th batch), across any number of resumes, which is what the
    re-weighting schedule (``stream.first_local_batch``) counts on. A role whose stream had
    ended replays to its end and stays dry.

    Its dataset has a length, so Lightning's fit loop does not fetch ahead: the state at a
    checkpoint is exactly "after the batches trained on". Under DDP, Lightning writes the
    checkpoint from rank 0 only, so every rank's state is gathered into it (each rank reads a
    different part of the stream) and each rank restores its own.
    """

    def __init__(
        self,
        *args: Any,
        epoch_source: Callable[[], int | None] | None = None,
        vocab_size: int | None = None,
        snapshot_every_n_steps: int = 1000,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("batch_size", 1) is None:  # each item is a whole batch: by reused shared-memory blocks
            kwargs.setdefault("collate_fn", worker_pack)
        super().__init__(*args, **kwargs)
        self.snapshot_every_n_steps = int(snapshot_every_n_steps)
        self.vocab_size = vocab_size
        self.worker_summaries: dict[int, dict[str, Any]] = {}  # worker id -> its latest summary
        self.epoch = 0  # the pass over the data: each pass draws its own order (``StreamDataset.epoch``)
        self.epoch_source = epoch_source  # e.g. the trainer's current epoch, read at each pass
        ds = self.dataset
        self.delivered = DeliveryCounter(getattr(ds, "sources", []), getattr(ds, "target_weights", None), getattr(ds, "split", None))
        self._restart_pending = False
        self.restarts = 0  # worker restarts for online re-weighting (restart_from_state)
        # rows taken from each logical stream since this iteration started (elastic stream mode,
        # ``stacklm.datamodule.resume.logical``); the datamodule's checkpoint state sums them over the ranks
        self.consumed: dict[int, int] = {}
        self._restored_consumed: dict[int, int] | None = None  # a same-shape resume continues the count
        self.step_log = None  # a ``steplog.StepLogWriter`` (stream mode training; set by the datamodule)
        self.gate = None  # a ``gate.InFlightGate`` on the first batches (training; set by the datamodule)
        self.last_pieces: tuple[list | None, int] | None = None  # (pieces per real row, rows) of the last batch handed out
        self._track: _Track | None = None  # the current (or last) pass's bookkeeping
        self._loaded: tuple[dict[str, Any], int] | None = None  # (a loaded state, its epoch) until a pass starts from it

    @property
    def roles(self) -> int:
        return max(1, self.num_workers)

    @property
    def batches_yielded(self) -> int:
        """Batches this loader has handed out in the current pass (restored on resume), counting
        those trained before a resume on another shape (elastic stream mode)."""
        # read off the bookkeeping, not ``_loader_state()``: that decodes every snapshot (per batch, with a step log)
        now = self._loaded[0]["handed"] if self._loaded is not None else (self._track.handed if self._track is not None else 0)
        segment = getattr(self.dataset, "segment", None)
        return int(now) + (int(segment()["steps_before"]) if segment is not None else 0)

    def restart_from_state(self) -> None:
        """Before the next batch, rebuild the workers from the state after the batches handed
        out so far (as a resume would): workers run ahead by the prefetch, and a change of their
        dataset (``StreamDataset.mix_changes``) reaches them only when they start. Exact: the
        rebuilt workers continue the same stream, replaying from their last snapshot."""
        self._restart_pending = True

    def _open(self, start: dict[str, Any] | None) -> Iterator[Any]:
        """A ``DataLoader`` iterator whose workers start from ``start`` (a loader state), or afresh."""
        self._track = _Track(self.roles, start)
        self._blocks = MainBlocks()  # this pass's workers' shared-memory blocks (``handoff``)
        ds = self.dataset
        ds.snapshot_every = self.snapshot_every_n_steps
        ds.worker_start = None if start is None else {"offset": int(start["next"]), "roles": start["roles"]}
        try:  # the workers take the dataset (pickled) as they start, inside this call
            self._iterator = super().__iter__()
        finally:
            ds.worker_start = None  # not kept: a later pass of this dataset starts afresh
        return self._iterator

    def _restart(self, old: Iterator[Any]) -> Iterator[Any]:
        self._restart_pending = False
        state = self._track.state()
        release_workers(old)
        self.restarts += 1
        return self._open(state)

    def _start_state(self) -> dict[str, Any] | None:
        """The loaded state this pass resumes (taken: a later pass starts afresh), if it is this
        pass's and was not finished."""
        loaded, self._loaded = self._loaded, None
        if loaded is None or loaded[1] != self.epoch or loaded[0]["finished"]:
            return None
        return loaded[0]

    def __iter__(self) -> Iterator[Any]:
        if self.epoch_source is not None and (epoch := self.epoch_source()) is not None:
            self.epoch = int(epoch)
        self.dataset.epoch = self.epoch  # before the workers start: they take the dataset with it
        self.consumed, self._restored_consumed = dict(self._restored_consumed or {}), None
        workers = [self._open(self._start_state())]  # the current worker iterator (a re-weighting restart replaces it)
        try:
            yield from self._counted(workers)
            self._track.finished = True
        finally:
            # An iteration closed early (a custom loop stops, or drops it): the loader sits in a
            # cycle with its datamodule and keeps its last iterator (``_iterator``), so the workers
            # lived on until whichever garbage collection came next, which then stalled ~5 s per
            # worker joining them (10 s with 2, measured). Shut them down now; the state stays
            # readable (tests/datamodule/test_loader_workers.py).
            release_workers(workers[0])

    def _counted(self, workers: list[Any]) -> Iterator[Any]:
        """The batches of ``workers[0]``, counted (module docstring of ``delivery``) and logged."""
        it = workers[0]
        while True:
            if self._restart_pending:
                it = workers[0] = self._restart(it)
            try:
                batch = next(it)
            except StopIteration:
                return
            batch = dict(self._blocks.unpack(batch))
            self._track.handed_out(batch.pop(WORKER_KEY))
            ids = batch_input_ids(batch)
            check_vocab(ids, self.vocab_size, f"{getattr(self.dataset, 'split', 'data')} stream")
            taken = batch.pop(LOGICAL_KEY, None)
            padding = 0
            if taken is not None:  # [[logical stream, rows taken], ..., [-1, padding rows]]
                for l, n in taken.tolist():
                    if l < 0:
                        padding += n
                    else:
                        self.consumed[l] = self.consumed.get(l, 0) + n
            delivery = batch.pop(DELIVERY_KEY, None)
            self.delivered.add(ids.numel(), delivery, padding)
            # the rows' pieces of the batch about to be trained on (a reference, no copy): per-source
            # loss reads them for this batch (``StackDataModule.batch_sources``)
            self.last_pieces = (delivery.get("pieces") if delivery is not None else None, len(ids))
            if self.step_log is not None:  # which rows this step trains on (``steplog``)
                pieces = delivery.get("pieces", []) if delivery is not None else []
                rows = len(batch["pair_ids"]) if "pair_ids" in batch else len(ids)  # a preference row: a pair, two sides in ids
                self.step_log.add_pieces(self.epoch, self.batches_yielded - 1, pieces,
                                         delivery.get("crc", []) if delivery is not None else [], rows - len(pieces))
            summary = batch.pop(SUMMARY_KEY, None)
            if summary is not None:  # after counting: the batch that carries it is delivered too
                # one summary per logical stream (elastic stream mode, keyed by it), else per worker
                for s in summary.get("streams", [summary]):
                    self.worker_summaries[s.get("stream", s["worker"])] = s
                    for source in s.get("ran_dry", ()):
                        self.delivered.note_dry(source, rank=int(s.get("rank", 0)), worker=int(s["worker"]))
                    warn_fallback(s)
            if self.gate is not None:  # the data gate's checks, before the batch's step
                self.gate(batch, self.batches_yielded - 1)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        mine = {"loader": self._loader_state(), "delivered": self.delivered.state_dict(),
                "consumed": {str(l): n for l, n in self.segment_consumed().items()}}
        out = {"per_rank": to_checkpoint_safe(gather_from_ranks(mine)), "epoch": self.epoch}
        if isinstance(self.dataset, LogicalStreamDataset):
            out["streams"] = self.stream_record()
        return out

    def stream_record(self) -> dict[str, Any]:
        """Elastic stream mode: the shape-free position (``logical.stream_record``), the same
        on every rank (a collective under DDP: call it on all ranks)."""
        return stream_record(self.dataset, gather_from_ranks(dict(self.segment_consumed())), self.batches_yielded, self._shape())

    def segment_consumed(self) -> dict[int, int]:
        """Rows taken per logical stream in this segment. A loaded count stays pending until the
        next iteration takes it over (``__iter__``), so a state taken between a load and the first
        batch is the loaded one, not an empty count."""
        return self.consumed if self._restored_consumed is None else self._restored_consumed

    def _shape(self) -> dict[str, int]:
        _, world = rank_world()
        return {"world_size": world, "num_workers": self.num_workers, "batch_size": self.dataset.batch_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict.get("epoch", 0))
        if isinstance(self.dataset, LogicalStreamDataset):
            self._load_elastic(state_dict)
            return
        mine = from_checkpoint_safe(pick_rank_state(state_dict["per_rank"], "stream"))
        self._load_own(mine["loader"])
        self.delivered.load_state_dict(mine["delivered"])

    def _load_elastic(self, state_dict: dict[str, Any]) -> None:
        """Elastic stream mode. On the checkpoint's shape the loader's own state restores the
        workers (the segment goes on exactly). On another shape the logical streams' exact
        states are computed here from every old rank's state and the new workers start from them
        (``LogicalStreamDataset.restore``): the iteration starts afresh at the resume point,
        planned by the datamodule. Delivery counts move with the ranks: rank ``r`` takes
        the sum of the old ranks ``r' % world == r``, so their total over the ranks stays true."""
        rank, world = rank_world()
        per_rank = [from_checkpoint_safe(s) for s in state_dict["per_rank"]]
        ds = self.dataset
        if ds.resume is None and state_dict.get("streams"):  # the loader restored on its own, without the datamodule
            ds.quota = int(state_dict["streams"]["quota"])
            ds.resume = resume_segment(state_dict["streams"], ds.quota, self._shape())
        if ds.resume is not None and ds.resume.get("native"):  # the checkpoint's shape: its own workers' states
            mine = pick_rank_state(per_rank, "stream")
            self._load_own(mine["loader"])
            self.delivered.load_state_dict(mine["delivered"])
            self._restored_consumed = {int(l): int(n) for l, n in mine.get("consumed", {}).items()}
            return
        counts = [s["delivered"] for r, s in enumerate(per_rank) if r % world == rank]
        self.delivered.reset()
        self.delivered.load_sum(counts)
        if ds.resume is not None:
            ds.workers = max(1, self.num_workers)
            ds.restore([s["loader"] for s in per_rank], ds.resume["shape"])

    def _loader_state(self) -> dict[str, Any]:
        """This rank's own loader state (the class docstring): a loaded one until a pass starts
        from it, else the current (or last) pass's, else a fresh start's."""
        if self._loaded is not None:
            return self._loaded[0]
        return (self._track or _Track(self.roles, None)).state()

    def _load_own(self, state: dict[str, Any]) -> None:
        check_loader_layout(state)
        if int(state["workers"]) != self.roles:
            raise ResumeRefused(
                f"refusing to resume: the checkpoint's loader state is from {state['workers']} loader worker role(s) but this "
                f"loader has {self.roles} (num_workers={self.num_workers}; 0 counts as one). Resume with the checkpoint's "
                "num_workers."
            )
        self._loaded = (state, self.epoch)


class _Track:
    """One pass's bookkeeping in the main process: per role its last snapshot (pickled bytes as
    a worker sent it, or a loaded state) and the batches it handed out, the batches handed out
    in all and the role of the next one. ``state()`` decodes a fresh copy every time, so a
    state taken never aliases what the loader goes on changing."""

    def __init__(self, roles: int, start: dict[str, Any] | None) -> None:
        if start is None:
            start = {"handed": 0, "next": 0, "roles": [{"state": None, "at": 0, "delivered": 0} for _ in range(roles)]}
        self.handed, self.next, self.finished = int(start["handed"]), int(start["next"]), False
        self.roles = [dict(r) for r in start["roles"]]

    def handed_out(self, tag: dict[str, Any]) -> None:
        role = self.roles[int(tag["role"])]
        role["delivered"] += 1
        if "state" in tag:
            role["state"], role["at"] = tag["state"], int(tag["at"])
        self.handed += 1
        self.next = (int(tag["role"]) + 1) % len(self.roles)

    def state(self) -> dict[str, Any]:
        roles = [{"state": pickle.loads(r["state"]) if isinstance(r["state"], bytes) else copy.deepcopy(r["state"]),
                  "at": int(r["at"]), "delivered": int(r["delivered"])} for r in self.roles]
        return {"workers": len(self.roles), "handed": self.handed, "next": self.next, "finished": self.finished, "roles": roles}


def release_workers(iterator: Any) -> None:
    """Shut down a multi-process loader iterator's workers now (no-op when it has none or they
    are already down: an exhausted iterator shuts them down itself)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def batch_input_ids(batch: dict[str, Any]) -> torch.Tensor:
    """A batch's token ids: ``input_ids``, or both sides' rows of a preference batch
    (``chosen_input_ids`` then ``rejected_input_ids``, ``stacklm.data.sft.preference``)."""
    if "input_ids" in batch:
        return batch["input_ids"]
    sides = [batch[k] for k in ("chosen_input_ids", "rejected_input_ids") if k in batch]
    if not sides:
        raise KeyError(f"a stream batch has no input_ids; keys: {sorted(batch)}")
    return torch.cat(sides)


def check_vocab(input_ids: torch.Tensor, vocab_size: int | None, where: str) -> None:
    """Refuse a batch holding an id outside the vocabulary before it reaches the model (where it
    would index past the embedding: a device-side assert on GPU, garbage or a crash on CPU).
    One max over the batch on the CPU, before the transfer: cheap."""
    if vocab_size is None or input_ids.numel() == 0:
        return
    top = int(input_ids.max())
    if top >= vocab_size or int(input_ids.min()) < 0:
        raise DataError(
            f"{where}: a batch holds token id {top if top >= vocab_size else int(input_ids.min())} outside the vocabulary "
            f"[0, {vocab_size}); the data was built with another tokenizer. Use the tokenizer the data was made with, "
            "or rebuild the data (`stacklm verify` checks a shard directory in full)"
        )


def warn_fallback(summary: dict[str, Any]) -> None:
    """The offline fallback of a source, from a worker's summary: once per source and process
    (a loader worker does not warn itself: it would, once per worker and per loader)."""
    for source, counts in (summary.get("stats", {}).get("source") or {}).items():
        if counts.get(FALLBACK_REASON) and first_time(FALLBACK_REASON, source):
            warnings.warn(
                f"stacklm: OFFLINE FALLBACK: source {source!r} (rank {summary.get('rank', 0)} worker {summary.get('worker')}): "
                "could not open its data; training on the synthetic corpus instead, because fallback_offline=True. The run "
                "is NOT reading the real data (recorded in data_stats()['offline_fallback'], the W&B config and the manifest).",
                RuntimeWarning,
                stacklevel=2,
            )
