"""Shards mode's resume rules: the shape-free position and the skipped step ranges.

A position is ``{"epoch", "rows_served", "steps"}``: ``rows_served`` rows of epoch ``epoch``'s
global permutation (``ElasticSampler.permutation``, seeded by seed x epoch) are served, in
``steps`` trainer steps. Nothing in it depends on the world size, workers or batch size, so a
resume deals the rows left to its own shape (``ShardsLoader``). A global stream position is
``epoch x rows + position in the epoch's permutation``; ``skip_steps`` ranges are resolved to
intervals of those once (``resolve_skips``) and passed over from then on, on any shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from stacklm.errors import DataConfigError


def start_position(epoch: int = 0, rows_served: int = 0, steps: int = 0) -> dict[str, int]:
    """A loader position: ``rows_served`` rows of epoch ``epoch``'s permutation are served, in
    ``steps`` trainer steps (the steps matter only to tell Lightning the epoch's length)."""
    return {"epoch": int(epoch), "rows_served": int(rows_served), "steps": int(steps)}


def available_positions(epoch: int, rows_served: int, num_rows: int, skips: list[tuple[int, int]]) -> np.ndarray:
    """Positions ``rows_served..num_rows`` of epoch ``epoch``'s permutation, less those in the
    skipped global intervals ``skips`` (global position = epoch x num_rows + position)."""
    keep = np.ones(num_rows - rows_served, dtype=bool)
    base = epoch * num_rows
    for lo, hi in skips:
        a, b = max(lo - base, rows_served), min(hi - base, num_rows)
        if a < b:
            keep[a - rows_served : b - rows_served] = False
    return np.flatnonzero(keep) + rows_served


def walk_steps(position: int, steps: int, step_rows: int, num_rows: int, skips: list[tuple[int, int]]):
    """Yield ``(positions, position after)`` for each of ``steps`` global steps of ``step_rows``
    rows from global stream position ``position``, as ``ShardsLoader`` serves them: skipped
    positions passed over, an epoch's last step short, the next starting the next epoch."""
    epoch, row = divmod(int(position), num_rows)
    avail, i = available_positions(epoch, row, num_rows, skips), 0
    for _ in range(steps):
        empty = 0
        while i >= len(avail):
            epoch, i, empty = epoch + 1, 0, empty + 1
            if empty > len(skips) + 1:
                raise ValueError("skip_steps pass over every row of the data")
            avail = available_positions(epoch, 0, num_rows, skips)
        take = avail[i : i + step_rows]
        i += len(take)
        after = epoch * num_rows + int(avail[i]) if i < len(avail) else (epoch + 1) * num_rows
        yield epoch * num_rows + take, after


def next_position(last: dict[str, int], batches_yielded: int, num_rows: int) -> dict[str, int]:
    """Where a train loader rebuilt after ``last`` (the previous loader's ``position()``) starts.

    Rebuilt at the start of the next epoch after serving batches: Lightning counts that epoch's
    steps from 0, so the steps restart (and a finished epoch moves to the next one). Rebuilt
    before serving anything (Lightning moved on to the next epoch while restoring a checkpoint
    saved at an epoch's last step): the same position."""
    if not batches_yielded:
        return last
    return start_position(last["epoch"] + 1) if last["rows_served"] >= num_rows else {**last, "steps": 0}


def step_span(position: int, first: int, count: int, step_rows: int, num_rows: int, skips: list[tuple[int, int]]) -> tuple[int, int]:
    """``(first position of step first, position after step first + count - 1)``, steps counted
    from 0 at global stream position ``position`` as ``walk_steps`` serves them. Jumps over whole
    steps by arithmetic within an epoch and over whole epochs, so time and memory depend on the
    epochs crossed, not on the steps (``skip_steps: [[5, 100000000]]`` took gigabytes and kept
    growing when every step was listed)."""
    epoch, row = divmod(int(position), num_rows)
    avail, i, empty = available_positions(epoch, row, num_rows, skips), 0, 0

    def next_epoch() -> None:
        nonlocal epoch, avail, i, empty
        epoch, i = epoch + 1, 0
        avail = available_positions(epoch, 0, num_rows, skips)
        empty = empty + 1 if not len(avail) else 0
        if empty > len(skips) + 1:
            raise ValueError("skip_steps pass over every row of the data")

    gaps_end = max((hi for _, hi in skips), default=0)
    full_epoch_steps = -(-num_rows // step_rows)

    def advance(k: int) -> None:
        nonlocal i, epoch
        while k > 0:
            if i >= len(avail):
                if gaps_end <= (epoch + 1) * num_rows:  # every epoch from here on is whole: jump over them
                    m = (k - 1) // full_epoch_steps
                    epoch, k = epoch + m, k - m * full_epoch_steps
                next_epoch()
                continue
            left = -(-(len(avail) - i) // step_rows)  # steps left in this epoch (its last one short)
            if k < left:
                i += k * step_rows
                return
            k, i = k - left, len(avail)

    advance(first)
    while i >= len(avail):
        next_epoch()
    lo = epoch * num_rows + int(avail[i])
    advance(count)
    after = epoch * num_rows + int(avail[i]) if i < len(avail) else (epoch + 1) * num_rows
    return lo, after


def resolve_skips(skips: list[dict[str, Any]], skip_steps: list[tuple[int, int]], position: dict[str, int] | None, *,
                  now: int, step_rows: int, num_rows: int) -> list[dict[str, Any]]:
    """``skips`` with every ``skip_steps`` range not yet in it resolved to the stream positions
    its steps consume, walking from ``position`` (at trainer step ``now``) as the loader serves,
    ``step_rows`` rows per step (the run that wrote the checkpoint's, else this run's). Each
    entry is ``{"steps": [a, b], "positions": [lo, hi], "step_rows": n}``; shape-free from then
    on and kept in the checkpoint, so a resume on any shape passes over exactly those rows.
    The walk is ``step_span``'s arithmetic, so a range of 10^8 steps costs what one of 10 does.
    Sorted by position."""
    out = [dict(r) for r in skips]
    done = {tuple(r["steps"]) for r in out}
    todo = sorted(tuple(r) for r in skip_steps if tuple(r) not in done)
    if not todo:
        return out
    pos = position or {"epoch": 0, "rows_served": 0}
    start = int(pos["epoch"]) * num_rows + int(pos["rows_served"])
    for a, b in todo:
        if a < now:
            raise DataConfigError(
                f"StackDataModule: skip_steps ({a}, {b}) starts before this run's step {now} (the checkpoint's): the "
                f"steps from {a} on are already trained; resume from a checkpoint at or before step {a}"
            )
        gaps = [tuple(r["positions"]) for r in out]
        lo, hi = step_span(start, a - now, b + 1 - a, step_rows, num_rows, gaps)
        out.append({"steps": [a, b], "positions": [lo, hi], "step_rows": int(step_rows)})
    out.sort(key=lambda r: r["positions"][0])
    return out


LISTED_SKIPPED_STEPS = 10_000  # skipped steps the step log lists per range without a step limit


def skipped_rows(skips: list[dict[str, Any]], num_rows: int, seed: int, *, shard_window: int | None = None,
                 shard_rows=None, last_step: int | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(step, epoch, rows)`` of the skipped steps the run can reach (up to ``last_step``, the
    run's last step; without one, the first ``LISTED_SKIPPED_STEPS`` of each range): the rows each
    would have had (all ranks'), for the step log. Bounded so that a huge range costs the step log
    what the run trains, not what the range spans; the range itself is resolved whole."""
    from stacklm.datamodule.resume.sampler import ElasticSampler

    order = ElasticSampler(num_rows, 1, seed=seed, rank=0, world_size=1, shuffle=True, loop=False,
                           shard_window=shard_window, shard_rows=shard_rows)
    for r in skips:
        a, b = r["steps"]
        others = [tuple(o["positions"]) for o in skips if o is not r]
        last = b if last_step is None else min(b, last_step)
        listed = min(last - a + 1, LISTED_SKIPPED_STEPS if last_step is None else last - a + 1)
        if listed <= 0:
            continue
        for k, (positions, _) in enumerate(walk_steps(r["positions"][0], listed, r["step_rows"], num_rows, others)):
            epoch = int(positions[0]) // num_rows if len(positions) else 0
            yield a + k, epoch, order.permutation(epoch)[positions - epoch * num_rows]
