"""The elastic order of ``shards`` mode: ``ElasticSampler`` and its ``torchdata.nodes`` source.

``ElasticSampler`` orders the epoch by one global seeded permutation, consumed in global steps
of ``world_size x batch_size`` samples; its whole state is ``(seed, epoch, consumed)``. Resuming
is O(1) and the world size, worker count and batch size may change between runs without a
sample being dropped or repeated. ``ShardsLoader`` uses it for its permutations
(``permutation(epoch)``); ``resume.shards`` walks positions in them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
from torchdata.nodes import BaseNode

from stacklm.dist import rank_world


class ElasticSampler(torch.utils.data.Sampler[int]):
    """One seeded permutation per epoch, consumed in global steps; state ``(seed, epoch, consumed)``.

    The global order is the concatenation of the epochs' permutations (position ``p`` holds
    ``perm(p // N)[p % N]``). Global step ``t`` after the saved position ``c`` covers
    ``[c + t*W*B, c + (t+1)*W*B)``; rank ``r`` takes its ``B`` positions at offset ``r*B``, and with
    ``num_workers`` iterators per rank (``batches(worker, num_workers)``) worker ``k`` takes the
    steps ``t % num_workers == k`` — the round-robin order in which ``DataLoader`` collects them.
    Every rank derives the same positions from the same three numbers, so the state needs nothing
    else, resuming is O(1), and W, B and the worker count may change at a resume: the next run
    starts at position ``c`` whatever the new shape, so nothing is dropped or repeated.

    ``loop=True`` (training): the stream runs on into the next epoch's permutation, never
    dropping the tail of an epoch; the sampler has no length (use ``max_steps``). ``loop=False``
    (a single pass, e.g. evaluation): stops at the end of the current epoch; the last global
    step is split rank-major, so late ranks may get a short or empty batch unless
    ``drop_last=True`` (which drops that tail, ``< W*B`` samples, and says how many in
    ``dropped_tail``).

    As a torch ``Sampler`` it yields the rank's indices (use ``DataLoader(batch_size=B)``; its
    workers are fed by the main process, so no worker slicing is needed there). For
    ``torchdata.nodes`` use ``ElasticBatchNode``. Checkpoint at batch boundaries with
    ``state_dict()`` (position after the batches this sampler has yielded) or, when the loader
    prefetches, ``state_after(steps_consumed)``.
    """

    def __init__(
        self,
        data_source: Sized | int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        loop: bool = True,
        drop_last: bool = False,
    ) -> None:
        self.num_samples = int(data_source if isinstance(data_source, int) else len(data_source))
        if self.num_samples <= 0:
            raise ValueError("ElasticSampler needs at least one sample")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if rank is None or world_size is None:
            r, w = rank_world()
            rank = r if rank is None else rank
            world_size = w if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self.batch_size, self.rank, self.world_size = int(batch_size), int(rank), int(world_size)
        self.seed, self.shuffle, self.loop, self.drop_last = int(seed), bool(shuffle), bool(loop), bool(drop_last)
        self.epoch = 0
        self.consumed = 0
        self._base = 0  # global position where the current iteration started
        self._steps = 0  # rank steps taken since ``_base``
        self._perm_cache: tuple[int, np.ndarray] | None = None

    # -- global order --------------------------------------------------------------------
    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order of the sample indices (identical on every rank and worker)."""
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1]
        if self.shuffle:
            perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.num_samples)
        else:
            perm = np.arange(self.num_samples, dtype=np.int64)
        self._perm_cache = (epoch, perm)
        return perm

    def positions_to_indices(self, start: int, stop: int) -> np.ndarray:
        """Sample indices at global stream positions ``[start, stop)`` (may span epochs)."""
        N = self.num_samples
        parts = []
        while start < stop:
            epoch, offset = divmod(start, N)
            take = min(stop - start, N - offset)
            parts.append(self.permutation(epoch)[offset : offset + take])
            start += take
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    @property
    def step_size(self) -> int:
        """Samples consumed by one global step (all ranks)."""
        return self.world_size * self.batch_size

    def _position(self) -> int:
        return self.epoch * self.num_samples + self.consumed

    def _epoch_end(self, base: int) -> int:
        return (base // self.num_samples + 1) * self.num_samples

    def _steps_left(self, base: int) -> int | None:
        if self.loop:
            return None
        left = self._epoch_end(base) - base
        return left // self.step_size if self.drop_last else math.ceil(left / self.step_size)

    def batch_at(self, base: int, step: int) -> np.ndarray:
        """This rank's indices for global step ``step`` counted from position ``base``."""
        lo = base + step * self.step_size + self.rank * self.batch_size
        hi = lo + self.batch_size
        if not self.loop:
            end = self._epoch_end(base)
            lo, hi = min(lo, end), min(hi, end)
        return self.positions_to_indices(lo, hi)

    # -- iteration -----------------------------------------------------------------------
    def batches(self, worker: int = 0, num_workers: int = 1) -> Iterator[np.ndarray]:
        """This rank's batches from the current state; worker ``k`` of ``num_workers`` yields the
        global steps ``t % num_workers == k``. State follows the last yielded step."""
        if not 0 <= worker < num_workers:
            raise ValueError(f"need 0 <= worker < num_workers, got {worker}, {num_workers}")
        base = self._base = self._position()
        self._steps = 0
        limit = self._steps_left(base)
        step = worker
        while limit is None or step < limit:
            batch = self.batch_at(base, step)
            self._steps = step + 1
            yield batch
            step += num_workers
        self._finish(base, limit)

    def _finish(self, base: int, limit: int | None) -> None:
        self.dropped_tail = 0
        if limit is not None:  # single pass done: the next iteration starts the next epoch
            end = self._epoch_end(base)
            self.dropped_tail = max(0, end - (base + limit * self.step_size))
            self.epoch, self.consumed = divmod(end, self.num_samples)
            self._base, self._steps = end, 0

    def __iter__(self) -> Iterator[int]:
        for batch in self.batches():
            yield from batch.tolist()

    def __len__(self) -> int:
        if self.loop:
            raise TypeError("ElasticSampler(loop=True) is endless (it runs on into the next epoch); bound training with max_steps")
        base = self._position()
        limit = self._steps_left(base)
        return self.batch_size * (limit - 1) + len(self.batch_at(base, limit - 1)) if limit else 0

    # -- state ---------------------------------------------------------------------------
    def state_after(self, steps: int) -> dict[str, int]:
        """The state once ``steps`` rank steps of the current iteration have been consumed."""
        pos = self._base + steps * self.step_size
        if not self.loop:
            pos = min(pos, self._epoch_end(self._base))
        epoch, consumed = divmod(pos, self.num_samples)
        return {"seed": self.seed, "epoch": epoch, "consumed": consumed, "num_samples": self.num_samples}

    def state_dict(self) -> dict[str, int]:
        return self.state_after(self._steps)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"ElasticSampler state is for {state['num_samples']} samples but this dataset has {self.num_samples}: the "
                "shard set changed since the checkpoint; resume on the same shards"
            )
        if int(state["seed"]) != self.seed:
            raise ValueError(f"ElasticSampler state has seed {state['seed']} but this sampler uses seed {self.seed}; resume with the same seed")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self._base, self._steps = self._position(), 0

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler-compatible. Moving to another epoch starts it from the top;
        the same epoch (a resume) keeps the position. No-op with ``loop=True``, where the
        epoch is part of the stream position."""
        if self.loop or epoch == self.epoch:
            return
        self.epoch, self.consumed = int(epoch), 0
        self._base, self._steps = self._position(), 0


class ElasticBatchNode(BaseNode[np.ndarray]):
    """``torchdata.nodes`` source of this rank's index batches (``np.ndarray`` of B indices).

    State: the sampler's ``(seed, epoch, consumed)`` after the last yielded batch. Chain it
    with ``Mapper(node, dataset.get_batch)`` for batch-contract dicts.
    """

    def __init__(self, sampler: ElasticSampler, worker: int = 0, num_workers: int = 1) -> None:
        super().__init__()
        self.sampler, self.worker, self.num_workers = sampler, worker, num_workers
        self._it: Iterator[np.ndarray] | None = None

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is not None:
            self.sampler.load_state_dict(initial_state)
        self._it = self.sampler.batches(self.worker, self.num_workers)

    def next(self) -> np.ndarray:
        return next(self._it)

    def get_state(self) -> dict[str, int]:
        return self.sampler.state_dict()
