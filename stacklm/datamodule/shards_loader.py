"""``ShardsLoader``: the shards-mode loader over a prebuilt directory, resumable in O(1) on any
world size, batch size or worker count."""

from __future__ import annotations

from typing import Any

import torch

class _IndexBatches(torch.utils.data.Sampler):
    """Feeds a ``DataLoader`` whole index batches from an ``ElasticSampler`` (main process)."""

    def __init__(self, sampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        return self.sampler.batches()


class _BatchFetch:
    """Picklable ``dataset[indices] -> batch`` for loader workers."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __getitem__(self, indices):
        return self.dataset.get_batch(indices)


class ShardsLoader:
    """Shards-mode loader: this rank's slice of one global seeded permutation per epoch.

    The state is ``ElasticSampler``'s ``(seed, epoch, consumed)`` as of the batches the
    consumer has taken, so resume is
    O(1) and may change world size, batch size or worker count. It has a length, so Lightning
    does not fetch ahead of the step it trains. Every rank yields the same
    number of batches per epoch: the epoch's tail shorter than one global step (``< world x
    batch`` rows) is not served that epoch and is counted in ``elastic.dropped_tail``; the next
    epoch is a fresh permutation, so no row is starved across epochs.
    """

    def __init__(self, dataset, sampler, num_workers: int = 0) -> None:
        self.dataset, self.elastic = dataset, sampler  # not ".sampler": Lightning would probe it as a DataLoader's
        self.num_workers = num_workers
        self._taken = 0
        self.batches_yielded = 0
        self.samples_yielded = 0

    def __len__(self) -> int:
        """Steps in a *whole* epoch at this shape: Lightning subtracts the steps it has already
        done when it resumes mid-epoch (the iterator itself serves only what is left, and
        ends early if a resume changed the shape)."""
        return self.elastic.num_samples // self.elastic.step_size

    def __iter__(self):
        loader = torch.utils.data.DataLoader(
            _BatchFetch(self.dataset), batch_size=None, sampler=_IndexBatches(self.elastic), num_workers=self.num_workers,
        )
        self._taken = 0
        for batch in loader:
            self._taken += 1
            self.batches_yielded += 1
            self.samples_yielded += int(batch["input_ids"].shape[0])
            yield batch

    def state_dict(self) -> dict[str, Any]:
        # counted here, not in the sampler: the DataLoader's own prefetching runs the sampler
        # ahead of what the consumer has taken
        return {"sampler": self.elastic.state_after(self._taken)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.elastic.load_state_dict(state["sampler"])
