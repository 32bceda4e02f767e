"""The prebuild's progress bar (stderr); the summary at the end is ``summary``'s."""

from __future__ import annotations

import time

from stacklm.prebuild.jobs import job_budget
from stacklm.prebuild.plan import PrebuildPlan


class BuildProgress:
    """One tqdm bar over all jobs: mixed tokens vs the token budget (rate, ETA), documents,
    MB/s of shard data written and the realized mix so far in the postfix. Jobs report every
    few seconds (``jobs.PROGRESS_INTERVAL``), not only per shard."""

    def __init__(self, plan: PrebuildPlan, enabled: bool) -> None:
        self.budget = sum(job_budget(plan, s, w) for s in plan.splits for w in range(plan.workers))
        self.per_job: dict[str, dict[str, int]] = {}
        self.shards: dict[str, int] = {}
        self.docs: dict[str, int] = {}
        self.itemsize = plan.dtype.itemsize
        self.started = time.perf_counter()
        self.updates = 0
        self.bar = None
        self.resumed_tokens = 0
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.budget, unit="tok", unit_scale=True, desc=f"prebuild {plan.out.name}", dynamic_ncols=True)

    @property
    def tokens(self) -> int:
        return sum(sum(v.values()) for v in self.per_job.values())

    def __call__(self, job: str, shards: int, realized: dict[str, int], docs: int = 0) -> None:
        before = self.tokens
        resumed = job not in self.per_job
        self.per_job[job] = realized
        self.shards[job] = shards
        self.docs[job] = docs
        self.updates += 1
        if resumed:  # tokens restored from a checkpoint: not this run's throughput
            self.resumed_tokens += self.tokens - before
        if self.bar is None:
            return
        mix: dict[str, int] = {}
        for job_name, per in self.per_job.items():
            if job_name.startswith("train"):
                for src, n in per.items():
                    mix[src] = mix.get(src, 0) + n
        total = sum(mix.values()) or 1
        postfix = " ".join(f"{src}={n / total:.3f}" for src, n in mix.items())
        secs = max(time.perf_counter() - self.started, 1e-9)
        mb_s = (self.tokens - self.resumed_tokens) * self.itemsize / secs / 1e6
        self.bar.set_postfix_str(
            f"docs={sum(self.docs.values()):,} shards={sum(self.shards.values())} {mb_s:.2f}MB/s mix: {postfix}", refresh=False
        )
        if resumed:
            self.bar.n += self.tokens - before
            self.bar.last_print_n = self.bar.n
        else:
            self.bar.update(self.tokens - before)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
