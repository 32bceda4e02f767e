"""Per-stage resources and cluster options of ``stacklm prebuild-datatrove`` and ``stacklm dedup-index``
(Slurm and Ray).

The build is a chain of datatrove executors, one per stage, and the stages need very different
machines: the per-document stages (``signatures``, ``main``) run ``T`` small tasks each, the
dedup ``buckets`` 13 tasks per ``--dedup-ranges`` (one key range each, bounded memory), the
dedup ``decision`` is one task whose memory grows with a share of the verified pairs (``staged``) and the
``merge`` (``stacklm dedup-index``: the ``index`` stage, which merges the removed ids into one
file) is one small task. One ``--cpus-per-task``/``--mem-per-cpu-gb`` for all of them
either starves the one-task stages or wastes a big allocation on every small task, so each
stage gets its own CPUs, memory and time limit:

* built-in defaults (``STAGES``), then
* the config file's ``prebuild.cluster.stages`` (``ClusterSettings``, in
  ``stacklm.prebuild.cluster``: the prebuild config holds it, and prebuild/ sits below scale/), then
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
from collections.abc import Mapping, Sequence
from typing import Any

from stacklm.config import did_you_mean
from stacklm.errors import ConfigError, PrebuildError
from stacklm.prebuild.cluster import STAGES, ClusterSettings, StageResources, check_stage, time_seconds


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

    def table(self, executor: str = "slurm", stages: Sequence[str] | None = None) -> str:
        """Every stage's request (or only ``stages``', the chain's) on one line, for the submission log."""
        return "; ".join(f"{name} {self.ray_describe(name) if executor == 'ray' else self.resources[name].describe()}" for name in stages or STAGES)


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
        import sys

        from datatrove.utils.logging import logger

        given: dict[str, Any] = {k: os.environ[k] for k in ("SLURM_JOB_ID", "SLURM_CPUS_PER_TASK", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_NODE") if k in os.environ}
        # a Ray worker has imported Ray before it runs a task; importing it here only to find
        # it uninitialised cost every Slurm task ~1 CPU-s
        ray = sys.modules.get("ray")
        try:
            if ray is not None and ray.is_initialized():
                given["ray"] = dict(sorted((k, v) for k, v in ray.get_runtime_context().get_assigned_resources().items() if not k.startswith("bundle_group")))
        except Exception:  # noqa: BLE001 - no ray, or not in a ray worker: nothing more to say
            pass
        logger.info(f"stacklm stage {self.stage!r} task {rank}: asked for {self.asked}; given {given or 'nothing the scheduler reports here'}")
        return data
