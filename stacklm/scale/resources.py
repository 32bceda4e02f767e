"""Per-stage resources and cluster options of ``stacklm prebuild-datatrove`` (Slurm and Ray).

The build is a chain of datatrove executors, one per stage, and the stages need very different
machines: the per-document stages (``signatures``, ``main``) run ``T`` small tasks each, the
dedup ``buckets`` 13 tasks per ``--dedup-ranges`` (one key range each, bounded memory), the
dedup ``decision`` is one task whose memory grows with the duplicate pairs (``staged``) and the
``merge`` is one small task. One ``--cpus-per-task``/``--mem-per-cpu-gb`` for all of them
either starves the one-task stages or wastes a big allocation on every small task, so each
stage gets its own CPUs, memory and time limit:

* built-in defaults (``STAGES``), then
* the config file's ``prebuild.cluster.stages`` (``ClusterSettings``), then
* ``--cpus-per-task`` / ``--mem-per-cpu-gb`` / ``--time`` for the parallel stages, then
* ``--stage-resources STAGE=cpus:N,mem_gb:G,time:HH:MM:SS`` (any stage, repeatable).

Memory is given per task (``mem_gb``), the way a user sizes a job; datatrove asks Slurm for it
per CPU, so a stage gets ``ceil(mem_gb / cpus)`` GB per CPU (never less than asked). On Ray
only what the user set is reserved for memory and time (a built-in memory default a small
machine cannot offer would leave the tasks unscheduled); the CPUs always are.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from stacklm.config import Config, did_you_mean
from stacklm.errors import ConfigError, PrebuildError


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
    "decision": (False, StageResources(1, 8, "12:00:00"), "the duplicate pairs only, not every document (dedup on)"),
    "main": (True, StageResources(2, 8, "04:00:00"), "the source readers, shuffle and packing buffers of one slice"),
    "merge": (False, StageResources(1, 4, "01:00:00"), "every task's counts (small)"),
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


def parse_stage_resources(specs: Sequence[str], flag: str = "--stage-resources") -> dict[str, StageResources]:
    """``["decision=cpus:4,mem_gb:32,time:08:00:00", ...]`` -> per-stage resources (later wins)."""
    out: dict[str, StageResources] = {}
    for spec in specs:
        name, sep, body = spec.partition("=")
        if not sep or not body:
            raise ConfigError(f"{flag} {spec!r}: write STAGE=cpus:N,mem_gb:G,time:HH:MM:SS (stages: {', '.join(STAGES)})")
        check_stage(name.strip(), f"{flag} {spec!r}")
        fields: dict[str, Any] = {}
        for item in body.split(","):
            key, sep, value = item.partition(":")
            key = key.strip()
            if not sep or key not in ("cpus", "mem_gb", "time"):
                raise ConfigError(f"{flag} {spec!r}: {item!r} is not cpus:N, mem_gb:G or time:HH:MM:SS{did_you_mean(key, ['cpus', 'mem_gb', 'time'])}")
            try:
                fields[key] = int(value) if key == "cpus" else float(value) if key == "mem_gb" else value.strip()
            except ValueError:
                raise ConfigError(f"{flag} {spec!r}: {key} must be a number, got {value!r}") from None
        try:
            res = StageResources(**fields)
        except ConfigError as e:
            raise ConfigError(f"{flag} {spec!r}: {e}") from None
        out[name.strip()] = res.over(out.get(name.strip(), StageResources()))
    return out


def parse_sbatch_args(specs: Sequence[str], flag: str = "--sbatch-arg") -> dict[str, str]:
    """``["account=proj", "constraint=amd"]`` -> ``{"account": "proj", ...}`` (``#SBATCH --KEY=VALUE``)."""
    out = {}
    for spec in specs:
        key, sep, value = spec.partition("=")
        if not sep or not key.strip() or key.strip().startswith("-"):
            raise ConfigError(f"{flag} {spec!r}: write KEY=VALUE without dashes (e.g. {flag} account=myproj for #SBATCH --account=myproj)")
        out[key.strip()] = value
    return out


@dataclasses.dataclass(frozen=True)
class ClusterPlan:
    """Everything the executors of a build get, resolved: what each stage asks for, and the
    Slurm options. ``user`` holds only what the config file and the flags set (Ray reserves
    memory and time from it alone)."""

    resources: dict[str, StageResources]
    user: dict[str, StageResources]
    partition: str | None = None
    qos: str | None = None
    env_command: str | None = None
    sbatch_args: Mapping[str, str] = dataclasses.field(default_factory=dict)
    max_array_size: int | None = None

    @classmethod
    def resolve(
        cls,
        settings: ClusterSettings | None = None,
        *,
        stage_flags: Mapping[str, StageResources] | None = None,
        cpus_per_task: int | None = None,
        mem_per_cpu_gb: float | None = None,
        time: str | None = None,
        partition: str | None = None,
        qos: str | None = None,
        env_command: str | None = None,
        sbatch_args: Mapping[str, str] | None = None,
        max_array_size: int | None = None,
    ) -> ClusterPlan:
        """Layers, last wins: ``STAGES`` defaults < ``settings.stages`` < the legacy per-task
        flags (parallel stages only) < ``stage_flags``."""
        settings = settings or ClusterSettings()
        if time is not None:
            time_seconds(time)
        user: dict[str, StageResources] = {}
        for name, (parallel, _, _) in STAGES.items():
            layer = settings.stages.get(name, StageResources())
            if parallel:
                cpus = cpus_per_task or layer.cpus
                mem = mem_per_cpu_gb * (cpus or STAGES[name][1].cpus) if mem_per_cpu_gb else None
                layer = StageResources(cpus_per_task, mem, time).over(layer)
            layer = (stage_flags or {}).get(name, StageResources()).over(layer)
            user[name] = layer
        return cls(
            resources={name: user[name].over(default) for name, (_, default, _) in STAGES.items()},
            user=user,
            partition=partition or settings.partition,
            qos=qos or settings.qos,
            env_command=env_command or settings.env_command,
            sbatch_args={**settings.sbatch_args, **(sbatch_args or {})},
            max_array_size=max_array_size or settings.max_array_size,
        )

    def slurm_kwargs(self, stage: str) -> dict[str, Any]:
        """``SlurmPipelineExecutor`` arguments of ``stage``."""

        if not self.partition:
            raise PrebuildError(
                "--executor slurm needs a partition: pass --partition NAME (`sinfo -s` lists them) "
                "or set prebuild.cluster.partition in the config"
            )
        r = self.resources[stage]
        return {
            "partition": self.partition, "time": r.time, "cpus_per_task": r.cpus, "mem_per_cpu_gb": math.ceil(r.mem_gb / r.cpus),
            "qos": self.qos or "",  # "": no --qos line, the cluster's default QOS (datatrove's own default "normal" may not exist)
            "env_command": self.env_command, "sbatch_args": dict(self.sbatch_args),
            **({"max_array_size": self.max_array_size} if self.max_array_size else {}),
        }

    def ray_kwargs(self, stage: str) -> dict[str, Any]:
        """``RayPipelineExecutor`` arguments of ``stage``: CPUs always, memory and time only if set."""
        r, u = self.resources[stage], self.user[stage]
        return {
            "cpus_per_task": r.cpus,
            "mem_per_cpu_gb": (u.mem_gb / r.cpus) if u.mem_gb else 0,  # 0: no memory reserved
            "time": time_seconds(u.time) if u.time else None,
        }

    def ray_describe(self, stage: str) -> str:
        kw = self.ray_kwargs(stage)
        mem = kw["mem_per_cpu_gb"] * kw["cpus_per_task"]
        return f"cpus:{kw['cpus_per_task']},mem_gb:{f'{mem:g}' if mem else 'not reserved'},time:{kw['time'] or 'none'}"

    def table(self, executor: str = "slurm") -> str:
        """Every stage's request on one line, for the submission log."""
        return "; ".join(f"{name} {self.ray_describe(name) if executor == 'ray' else self.resources[name].describe()}" for name in STAGES)


class LogTaskResources:
    """The last callable of every Slurm/Ray stage's pipeline: the task's log says what its
    stage asked for and what the scheduler gave it (``SLURM_CPUS_PER_TASK``/``SLURM_MEM_PER_CPU``,
    Ray's assigned resources), so a task killed for memory or running slow can be checked
    against its request without the cluster's accounting. datatrove calls the pipeline's
    callables before any document flows (the steps are generators), so it logs at the start."""

    def __init__(self, stage: str, asked: str) -> None:
        self.stage, self.asked = stage, asked

    def __repr__(self) -> str:
        return f"stacklm task resources ({self.stage})"

    def __call__(self, data=None, rank: int = 0, world_size: int = 1):
        import os

        from datatrove.utils.logging import logger

        given: dict[str, Any] = {k: os.environ[k] for k in ("SLURM_JOB_ID", "SLURM_CPUS_PER_TASK", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_NODE") if k in os.environ}
        try:
            import ray

            if ray.is_initialized():
                given["ray"] = dict(sorted((k, v) for k, v in ray.get_runtime_context().get_assigned_resources().items() if not k.startswith("bundle_group")))
        except Exception:  # noqa: BLE001 - no ray, or not in a ray worker: nothing more to say
            pass
        logger.info(f"stacklm stage {self.stage!r} task {rank}: asked for {self.asked}; given {given or 'nothing the scheduler reports here'}")
        return data
