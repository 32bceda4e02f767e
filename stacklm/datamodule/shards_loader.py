"""``ShardsLoader``: the shards-mode loader over a prebuilt directory, resumable in O(1) on any
world size, batch size or worker count.

Its position is shape-free: ``(epoch, rows_served, steps)`` — the epoch, how many rows of that
epoch's global permutation have been served, and how many steps the trainer counted in it.
Whatever shape the next run has, it deals the rows left to its own ``world x batch`` steps, so
every row of an epoch is trained exactly once (docs/trainer.md, "Resume"). The position's rules
(where it starts, which positions a skipped step range takes) are in ``resume.shards``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from stacklm.datamodule.handoff import MainBlocks, worker_pack
from stacklm.datamodule.resume.shards import available_positions, start_position
from stacklm.parent_death import WorkerInit

TAILS = ("pad", "drop")


class _StepBatches(torch.utils.data.Sampler):
    """Feeds a ``DataLoader`` this rank's ``(indices, n_padding)`` per step (main process)."""

    def __init__(self, plan: list[tuple[np.ndarray, int]]) -> None:
        self.plan = plan

    def __iter__(self):
        return iter(self.plan)

    def __len__(self) -> int:
        return len(self.plan)


class _BatchFetch:
    """Picklable ``(indices, n_padding) -> batch`` for loader workers: the rows, then padding
    rows that carry no loss (every target ``IGNORE_INDEX``)."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, item):
        indices, n_pad = item
        return self.dataset.get_batch(indices, n_pad)


class ShardsLoader:
    """Shards-mode loader: this rank's share of one global seeded permutation per epoch.

    Epoch ``e`` serves the permutation ``perm(seed, e)`` (``ElasticSampler.permutation``) in
    global steps of ``world x batch`` rows; rank ``r`` takes rows ``[r*B, (r+1)*B)`` of each
    step. The epoch's last step, shorter than ``world x batch`` rows, is dealt evenly over the
    ranks and padded to ``batch`` rows (``tail="pad"``, training: every row trained exactly once,
    padding counted in ``padding_rows``) or not served (``tail="drop"``, validation: counted in
    ``dropped_tail``). Every rank yields the same number of batches, so DDP never hangs.

    Length: ``steps + ceil(rows left / (world x batch))`` from the position it starts at: a
    resume on another shape finishes the epoch at the new shape; the next epoch is a full one
    (the datamodule has Lightning rebuild the loader then, see ``ShardsMode``). An iteration that
    starts on a finished epoch moves to the next one, so each epoch draws a new order.
    """

    def __init__(
        self, dataset, order, *, batch_size: int, rank: int, world_size: int, num_workers: int = 0,
        tail: str = "pad", position: dict[str, int] | None = None, delivered=None, row_counts=None,
        skips: list[tuple[int, int]] | None = None,
    ) -> None:
        if tail not in TAILS:
            raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
        self.dataset, self.order = dataset, order  # order: an ElasticSampler, used for its permutations only
        self.batch_size, self.rank, self.world_size = int(batch_size), int(rank), int(world_size)
        self.num_workers, self.tail = num_workers, tail
        self.num_rows = len(dataset)
        self.batches_yielded = 0
        self.samples_yielded = 0  # real rows this rank served (padding excluded)
        self.padding_rows = 0
        self.dropped_tail = 0
        # What the consumer took, per source (``DeliveryCounter``), from each row's per-source
        # counts (``provenance.row_source_counts``), in the main process as batches are taken.
        self.delivered, self.row_counts = delivered, row_counts
        self.step_log = None  # a ``steplog.StepLogWriter`` (training; set by the datamodule)
        self.gate = None  # a ``gate.InFlightGate`` on the first batches (training; set by the datamodule)
        self.last_rows: tuple[np.ndarray, int] | None = None  # (global rows, padding rows) of the last batch handed out
        self.blocks = None  # a pass with workers: their shared-memory blocks (``handoff.MainBlocks``)
        # Stream positions never served (``skip_steps``): global ``[lo, hi)``, position = epoch x rows + row.
        self.skips = sorted((int(lo), int(hi)) for lo, hi in (skips or ()))
        self._set_position(position or start_position())
        # A streamed remote split (``prefetch.ShardCache``): each iteration runs a ``Prefetcher``
        # over its plan. Only with a shard-local order (``shard_window``): the global permutation
        # needs every shard at once.
        self.cache = getattr(dataset, "cache", None)
        self.prefetcher = None
        if self.cache is not None:
            from stacklm.data.storage.prefetch import check_bounds

            window = getattr(order, "shard_window", None)
            if window is None:
                raise ValueError(f"{self.cache.url}: a streamed cache needs a shard-local order (shard_window)")
            check_bounds(self.cache, dataset.shard_rows, window, self.step_size, self.cache.url)

    # -- position --------------------------------------------------------------------------
    def _set_position(self, pos: dict[str, Any]) -> None:
        epoch, rows, steps = int(pos["epoch"]), int(pos["rows_served"]), int(pos["steps"])
        if not 0 <= rows <= self.num_rows:
            raise ValueError(f"position serves {rows} rows of an epoch of {self.num_rows}")
        if rows == self.num_rows:
            # A finished epoch: the next one starts from its top. Saved at the epoch's last
            # step, Lightning resumes counting from ``steps`` unless that reaches a whole epoch
            # at this shape (then it starts the epoch at 0): count the same way, so Lightning's
            # length and this loader's agree.
            epoch, rows = epoch + 1, 0
            steps = steps if steps < self.full_epoch_steps() else 0
        self.epoch, self.rows_served, self.steps = epoch, rows, steps

    def position(self) -> dict[str, int]:
        """The position after the batches the consumer has taken (shape-free; see the module)."""
        return start_position(self.epoch, self.rows_served, self.steps)

    @property
    def step_size(self) -> int:
        return self.world_size * self.batch_size

    def _available(self) -> np.ndarray:
        """The positions of this epoch's permutation still to serve: from ``rows_served`` on,
        less the skipped ones."""
        return available_positions(self.epoch, self.rows_served, self.num_rows, self.skips)

    def _steps_left(self) -> int:
        left = len(self._available()) if self.skips else self.num_rows - self.rows_served
        return math.ceil(left / self.step_size) if self.tail == "pad" else left // self.step_size

    def full_epoch_steps(self) -> int:
        """Steps of a whole epoch at this shape."""
        n = self.num_rows
        return math.ceil(n / self.step_size) if self.tail == "pad" else n // self.step_size

    def __len__(self) -> int:
        return self.steps + self._steps_left()

    # -- iteration ---------------------------------------------------------------------------
    def _plan(self) -> list[tuple[np.ndarray, int]]:
        """This rank's ``(indices, n_padding)`` for every step left in the epoch; the position
        after each step is in ``self._after``."""
        perm = self.order.permutation(self.epoch)
        W, B, r = self.world_size, self.batch_size, self.rank
        avail = self._available()
        plan, self._after = [], []
        for t in range(self._steps_left()):
            at = avail[t * self.step_size : (t + 1) * self.step_size]
            chunk = perm[at]
            if len(chunk) == self.step_size:
                mine = chunk[r * B : (r + 1) * B]
            else:  # the epoch's short last step: dealt evenly, so few ranks get no row at all
                mine = chunk[r * len(chunk) // W : (r + 1) * len(chunk) // W]
            plan.append((mine, B - len(mine)))
            last = (t + 1) * self.step_size >= len(avail)
            self._after.append(self.num_rows if last else int(avail[(t + 1) * self.step_size]))
        return plan

    def __iter__(self):
        if self._steps_left() == 0:  # the epoch is finished (or only a dropped tail is left)
            self._set_position(start_position(self.epoch + 1))
        plan = self._plan()
        self.dropped_tail = 0
        if self.cache is not None:  # started before the workers: they wait for what it fetches
            from stacklm.data.storage.prefetch import Prefetcher

            if self.prefetcher is not None:
                self.prefetcher.close()
            self.prefetcher = Prefetcher(self.cache, [np.unique(self.dataset.locate(rows)[0]) for rows, _ in plan])
        try:
            yield from self._serve(plan)
        finally:
            if self.prefetcher is not None:
                self.prefetcher.close()
                self.prefetcher = None

    def _batches(self, plan):
        if self.num_workers == 0:
            # Why not a DataLoader here: in the main process it adds a profiler ``record_function``
            # and ``default_convert`` per batch, ~50 us, a third of a lean batch's own cost
            # (bench/loader.py, "ShardsLoader" rows), and gives nothing in return.
            fetch = _BatchFetch(self.dataset)
            return (fetch[item] for item in plan)
        blocks = self.blocks = MainBlocks()  # the workers' shared-memory blocks, for this pass (``handoff``)
        loader = torch.utils.data.DataLoader(
            _BatchFetch(self.dataset), batch_size=None, sampler=_StepBatches(plan), num_workers=self.num_workers,
            worker_init_fn=WorkerInit(),  # workers die with this process
            collate_fn=worker_pack,
        )
        return (blocks.unpack(batch) for batch in loader)

    def _serve(self, plan):
        for t, batch in enumerate(self._batches(plan), start=1):
            if self.prefetcher is not None:  # steps < t are done: their shards may go
                self.prefetcher.advance(t)
            # counted here, as the consumer takes each batch: the DataLoader fetches ahead
            self.steps += 1
            self.rows_served = self._after[t - 1]  # the next position to serve (past any skipped ones)
            if t == len(plan) and self.tail == "drop":
                self.dropped_tail = self.num_rows - self.rows_served
                self.rows_served = self.num_rows
            self.batches_yielded += 1
            self.samples_yielded += self.batch_size - plan[t - 1][1]
            self.padding_rows += plan[t - 1][1]
            self.last_rows = plan[t - 1]  # per-source loss maps them to sources (``StackDataModule.batch_sources``)
            if self.step_log is not None:  # which rows this step trains on (``steplog``)
                self.step_log.add_rows(self.epoch, self.steps - 1, plan[t - 1][0], plan[t - 1][1])
            if self.delivered is not None:
                self.delivered.add(self.batch_size * (self.dataset.seq_len - 1), self._delivery(plan[t - 1][0]),
                                   padding_rows=plan[t - 1][1])
            if self.gate is not None:  # the data gate's checks, before the batch's step
                self.gate(batch, self.steps - 1)
            yield batch

    def _delivery(self, rows: np.ndarray) -> dict[str, np.ndarray] | None:
        if self.row_counts is None:
            return None
        tokens, docs = self.row_counts
        return {"tokens": tokens[rows].sum(axis=0, dtype=np.int64), "docs": docs[rows].sum(axis=0, dtype=np.int64),
                "rows": (tokens[rows] > 0).sum(axis=0, dtype=np.int64),  # what shards mode delivers: packed rows
                "doc_lengths": np.zeros((0, 2), dtype=np.int64)}  # a document's length spans rows: not known per row

    # -- checkpoint state (Lightning's loader state; the datamodule keeps the same position) --
    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._set_position(state["position"])
