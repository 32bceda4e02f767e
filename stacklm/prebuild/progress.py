"""The prebuild's progress on stderr: a bar on a terminal, plain lines elsewhere
(``stacklm.progress_lines``); the summary at the end is ``summary``'s."""

from __future__ import annotations

import time

from stacklm.prebuild.jobs import job_budget, summary_counts
from stacklm.prebuild.plan import PrebuildPlan, job_name
from stacklm.progress_lines import ProgressLines, count, duration, eta, percent, wants_lines


class BuildProgress:
    """One tqdm bar over all jobs: mixed tokens vs the token budget (rate, ETA), documents,
    MB/s of shard data written and the realized mix so far in the postfix. Jobs report every
    few seconds (``jobs.PROGRESS_INTERVAL``), not only per shard.

    Where stderr is not a terminal (``nohup``, Slurm) the same numbers go out as a plain line
    every 30 s (``STACKLM_PROGRESS_SECONDS``) instead of tqdm's frames::

        2026-12-07 04:22:58 prebuild pb4: tokens 482,454/1,020,000 (47%)  docs 1,371  shards 3  MB/s 0.817  elapsed 0:00:18  ETA 0:00:01  mix web=0.594 code=0.312 math=0.094

    (``STACKLM_PROGRESS_SECONDS=1 stacklm prebuild --config demo``; docs/prebuild.md).
    """

    def __init__(self, plan: PrebuildPlan, enabled: bool) -> None:
        self.budget = sum(job_budget(plan, s, w) for s in plan.splits for w in range(plan.workers))
        self.per_job: dict[str, dict[str, int]] = {}
        self.shards: dict[str, int] = {}
        self.docs: dict[str, int] = {}
        self.itemsize = plan.dtype.itemsize
        self.started = time.perf_counter()
        self.mixing_since: float | None = None  # the first job report: rates count from there, not the dedup pass
        self.updates = 0
        self.bar = None
        self.lines: ProgressLines | None = None
        self.resumed_tokens = 0
        if enabled and wants_lines():
            self.lines = ProgressLines(f"prebuild {plan.out.name}")
        elif enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.budget, unit="tok", unit_scale=True, desc=f"prebuild {plan.out.name}", dynamic_ncols=True)

    @property
    def tokens(self) -> int:
        return sum(sum(v.values()) for v in self.per_job.values())

    def __call__(self, job: str, shards: int, realized: dict[str, int], docs: int = 0, *, line: bool = True) -> None:
        before = self.tokens
        resumed = job not in self.per_job
        if self.mixing_since is None:
            self.mixing_since = time.perf_counter()
        self.per_job[job] = realized
        self.shards[job] = shards
        self.docs[job] = docs
        self.updates += 1
        if resumed:  # tokens restored from a checkpoint: not this run's throughput
            self.resumed_tokens += self.tokens - before
        if self.lines is not None:
            if line and self.lines.due():
                self.line()
            return
        if self.bar is None:
            return
        postfix = " ".join(f"{src}={share:.3f}" for src, share in self.mix().items())
        mb_s = self.mb_per_s()
        self.bar.set_postfix_str(
            f"docs={sum(self.docs.values()):,} shards={sum(self.shards.values())} {mb_s:.2f}MB/s mix: {postfix}", refresh=False
        )
        if resumed:
            self.bar.n += self.tokens - before
            self.bar.last_print_n = self.bar.n
        else:
            self.bar.update(self.tokens - before)

    def mix(self) -> dict[str, float]:
        """The train split's realized share per source so far."""
        mix: dict[str, int] = {}
        for job, per in self.per_job.items():
            if job.startswith("train"):
                for src, n in per.items():
                    mix[src] = mix.get(src, 0) + n
        total = sum(mix.values()) or 1
        return {src: n / total for src, n in mix.items()}

    def mb_per_s(self) -> float:
        """MB/s of shard data mixed by this run (tokens restored from checkpoints left out), since
        the jobs began."""
        secs = max(time.perf_counter() - (self.mixing_since or self.started), 1e-9)
        return (self.tokens - self.resumed_tokens) * self.itemsize / secs / 1e6

    def line(self, outcome: str | None = None) -> str | None:
        """Write one plain line (tokens of the budget, documents, shards, MB/s, ETA, the mix);
        with ``outcome`` the ``done`` line instead (``finish``)."""
        if self.lines is None:
            return None
        done = self.tokens
        now = time.perf_counter()
        secs = max(now - (self.mixing_since or self.started), 1e-9)
        fields = [("", "done")] if outcome else []
        fields += [("tokens", f"{count(done)}/{count(self.budget)} ({percent(done, self.budget)})"),
                   ("docs", count(sum(self.docs.values()))), ("shards", str(sum(self.shards.values()))),
                   ("MB/s", f"{self.mb_per_s():.3g}"), ("elapsed", duration(now - self.started))]
        fields.append(("", outcome) if outcome else ("ETA", eta(self.budget - done, (done - self.resumed_tokens) / secs)))
        mix = self.mix()
        if mix:
            fields.append(("mix", " ".join(f"{src}={share:.3f}" for src, share in mix.items())))
        return self.lines.write(fields)

    def finish(self, summaries: list[dict], warnings: list[dict]) -> str | None:
        """The build's totals from the jobs' own summaries, then (in lines mode) its ``done``
        line: tokens mixed, documents, shards, and whether the budget was met or sources ran
        dry (``warnings``: the top manifest's). Not the last report: a line is due only every
        ``STACKLM_PROGRESS_SECONDS``, and a job packs its last shard after its last timed
        report, so a small build's one line read ``tokens 1,499,537/5,100,000 (29%)  shards 0
        ... ETA 0:01:12`` with 15 shards written; the pool's last reports may also still be
        in its queue when the jobs' results are in."""
        for s in summaries:
            self(job_name(s["split"], s["worker"]), *summary_counts(s), line=False)
        dry = sorted({w["source"] for w in warnings if w.get("kind") == "ran_dry"})
        if self.tokens >= self.budget:
            outcome = "budget met" + (f" (ran dry: {' '.join(dry)})" if dry else "")
        else:
            outcome = "sources ran dry" + (f": {' '.join(dry)}" if dry else "")
        return self.line(outcome)

    def say(self, text: str) -> None:
        """A phase without progress of its own (the global dedup pass), as a line of its own."""
        if self.lines is not None:
            self.lines.write([("", text)])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
