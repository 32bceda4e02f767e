"""Which rank this process is, of how many: the one helper every module asks.

``torch.distributed`` when a process group is initialised (Lightning's DDP, ``torchrun`` after
``init_process_group``); before that, the launcher's environment (``RANK`` / ``WORLD_SIZE``, as
set by ``torchrun``, Lightning's launchers and most Slurm wrappers), so a dataset built before
the process group exists already knows its slice. A single process without either is rank 0
of 1. Three helpers that disagreed on this (one ignored the environment) would give ranks
overlapping data under a launcher; hence one.
"""

from __future__ import annotations

import os

from stacklm.errors import ConfigError


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer; unset it or fix the launcher") from None


def rank_world() -> tuple[int, int]:
    """``(rank, world_size)`` of this process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None and world is None:
        return 0, 1
    rank, world = rank or 0, world or 1
    if not 0 <= rank < world:
        raise ConfigError(f"launcher environment has RANK={rank} but WORLD_SIZE={world}; need 0 <= RANK < WORLD_SIZE")
    return rank, world
