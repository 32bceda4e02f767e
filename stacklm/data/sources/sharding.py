"""Which rows of every source a (rank, worker) reader takes.

A (rank, worker) pair reads whole parts (files, hub shards) when there are at least as many
parts as readers, else every part with a row stride; either way the readers together see
every row exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass

from stacklm.dist import rank_world


@dataclass(frozen=True)
class ShardSpec:
    """Which slice of every source this reader takes: reader ``index`` of ``count``."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.num_workers < 1:
            raise ValueError(f"ShardSpec: world_size and num_workers must be >= 1, got {self}")
        if not (0 <= self.rank < self.world_size and 0 <= self.worker < self.num_workers):
            raise ValueError(f"ShardSpec: need 0 <= rank < world_size and 0 <= worker < num_workers, got {self}")

    @property
    def index(self) -> int:
        return self.rank * self.num_workers + self.worker

    @property
    def count(self) -> int:
        return self.world_size * self.num_workers

    @classmethod
    def current(cls) -> ShardSpec:
        """This process's shard: rank and world size from ``stacklm.dist.rank_world`` (the
        process group, else the launcher's RANK/WORLD_SIZE), worker from the DataLoader worker
        info (a single reader when neither is set)."""
        import torch

        rank, world = rank_world()
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return cls(rank, world, worker, num_workers)


def assign_parts(num_parts: int, shard: ShardSpec) -> tuple[list[int], bool]:
    """``(parts this reader opens, strided)``.

    With at least as many parts as readers, reader ``i`` owns parts ``i, i+count, ...`` whole
    (no wasted reads). Otherwise every reader opens every part and keeps global rows
    ``r % count == i`` (``strided``): always correct, at the cost of each reader scanning the
    rows it skips. Either way every row belongs to exactly one reader.
    """
    if num_parts >= shard.count:
        return list(range(shard.index, num_parts, shard.count)), False
    return list(range(num_parts)), shard.count > 1


def owns_row(global_row: int, shard: ShardSpec) -> bool:
    """In strided mode: does this reader keep the stream's ``global_row``?"""
    return global_row % shard.count == shard.index


def assign_pieces(pieces: list[list], shard: ShardSpec) -> tuple[list, bool]:
    """``(pieces this reader reads, strided)`` over ``pieces[part]`` (``sources.pieces.Piece``).

    With at least as many parts as readers: reader ``i`` reads parts ``i, i+count, ...`` whole,
    as ``assign_parts``. Otherwise the pieces of all parts, in order, are dealt out in
    contiguous runs of about ``1/count`` of the bytes each (a run ends once it reaches its
    share, or when the pieces left are just enough for the readers left), so each input byte
    is read by one reader. Only when there are fewer pieces than readers (a tiny source, or
    one made of unsplittable pieces: one ``.gz`` file, one row group) does every reader read
    every piece and keep every ``count``-th row (``strided``), as before.
    """
    parts, strided = assign_parts(len(pieces), shard)
    if not strided:
        return [p for part in parts for p in pieces[part]], False
    flat = [p for per_part in pieces for p in per_part]
    n, count = len(flat), shard.count
    if n < count:
        return flat, True
    total = sum(max(0, p.nbytes) for p in flat)
    mine, reader, acc = [], 0, 0
    for j, p in enumerate(flat):
        if reader == shard.index:
            mine.append(p)
        acc += max(0, p.nbytes)
        if reader < count - 1 and (acc * count >= (reader + 1) * total or n - j - 1 == count - reader - 1):
            reader += 1
    return mine, False
