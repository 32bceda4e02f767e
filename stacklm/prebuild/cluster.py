"""The ``prebuild.cluster`` section of the config (``ClusterSettings``) and the stages' built-in
resources it overrides (``STAGES``); ``stacklm.scale.resources`` layers the flags on top and
says what each stage gets.

Here, not in ``stacklm.scale``: the prebuild config (``stacklm.prebuild.settings``) parses and
checks this section when it loads, and prebuild/ sits below scale/, which runs the build on a
cluster.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from stacklm.config import Config, did_you_mean
from stacklm.errors import ConfigError


def time_seconds(limit: str) -> int:
    """Seconds of a Slurm time limit (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``)."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(limit).strip())
    if not m:
        raise ConfigError(f"time {limit!r} is not a Slurm time limit; write HH:MM:SS (e.g. 04:00:00) or D-HH:MM:SS")
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + b * 60 + c
    if b is not None:  # MM:SS
        return a * 60 + b
    return a * 60  # MM


@dataclasses.dataclass(frozen=True)
class StageResources(Config):
    """What one task of a stage gets; ``None`` means "the next layer down decides"."""

    cpus: int | None = None
    mem_gb: float | None = None  # per task (all its CPUs together)
    time: str | None = None  # Slurm time limit: MM, HH:MM:SS or D-HH:MM:SS

    def __post_init__(self) -> None:
        if self.cpus is not None and self.cpus < 1:
            raise ConfigError(f"cpus must be >= 1, got {self.cpus}")
        if self.mem_gb is not None and not self.mem_gb > 0:
            raise ConfigError(f"mem_gb must be > 0, got {self.mem_gb}")
        if self.time is not None:
            time_seconds(self.time)  # refuses a malformed limit here, not on the cluster

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], path: str = ""):
        try:
            return super().from_dict(data, path)
        except ConfigError as e:  # a bad value from __post_init__ does not know where it sits
            if path and not str(e).startswith(("unknown field", "field", path)):
                raise ConfigError(f"{path}: {e}") from None
            raise

    def over(self, base: StageResources) -> StageResources:
        """These fields where set, ``base``'s elsewhere."""
        return StageResources(*(b if v is None else v for v, b in ((self.cpus, base.cpus), (self.mem_gb, base.mem_gb), (self.time, base.time))))

    def describe(self) -> str:
        return f"cpus:{self.cpus},mem_gb:{self.mem_gb:g},time:{self.time}"


# name: (parallel: T tasks per split rather than one task, default resources, what it holds)
STAGES: dict[str, tuple[bool, StageResources, str]] = {
    "signatures": (True, StageResources(2, 8, "04:00:00"), "one slice's documents at a time, streaming (dedup on)"),
    "buckets": (True, StageResources(1, 4, "04:00:00"), "one band's (or the digest's) key range, sorted 4M records at a time (dedup on)"),
    "decision": (False, StageResources(1, 8, "12:00:00"), "one partition of the verified pairs at a time, not every document (dedup on)"),
    "main": (True, StageResources(2, 8, "04:00:00"), "the source readers, shuffle and packing buffers of one slice"),
    "merge": (False, StageResources(1, 4, "01:00:00"), "every task's counts (small)"),
    "index": (False, StageResources(1, 4, "01:00:00"), "every slice's removed ids, merged into one index file (`stacklm dedup-index`)"),
}


def check_stage(name: str, where: str) -> str:
    if name not in STAGES:
        raise ConfigError(f"{where}: unknown stage {name!r}{did_you_mean(name, list(STAGES))} (stages: {', '.join(STAGES)})")
    return name


@dataclasses.dataclass(frozen=True)
class ClusterSettings(Config):
    """The optional ``prebuild.cluster`` section of the config file (flags override it)::

        prebuild:
          cluster:
            partition: cpu
            qos: normal                    # omitted: the cluster's default QOS
            env_command: source /shared/venv/bin/activate
            sbatch_args: {account: myproj}
            max_array_size: 1001           # the cluster's MaxArraySize: more tasks run as several arrays
            stages:
              decision: {cpus: 1, mem_gb: 64, time: "12:00:00"}
              main: {cpus: 4, mem_gb: 16}
    """

    partition: str | None = None
    qos: str | None = None
    env_command: str | None = None  # shell line the batch script runs before the task
    sbatch_args: dict[str, str] = dataclasses.field(default_factory=dict)
    stages: dict[str, StageResources] = dataclasses.field(default_factory=dict)
    max_array_size: int | None = None  # the cluster's MaxArraySize (`scontrol show config`); datatrove's default 1001

    def __post_init__(self) -> None:
        if self.max_array_size is not None and self.max_array_size < 1:
            raise ConfigError(f"prebuild.cluster.max_array_size must be >= 1, got {self.max_array_size}")
        for name in self.stages:
            check_stage(name, "prebuild.cluster.stages")
