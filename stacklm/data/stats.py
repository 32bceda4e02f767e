"""Uniform per-stage accounting, datatrove-style: every stage counts what it kept and what it
dropped, and why, per source. These counters flow unchanged into the prebuild manifest and the
W&B callback, so "nothing silently lost" is checkable end to end.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any


# The stage names of the built graphs (chain keys, the shared tail, the prebuild's summary
# stage): a user stage (``stacklm.data.quality.user_stages``) may take none of them.
BUILT_IN_STAGES = frozenset({"source", "holdout", "filter", "decontam", "dedup", "tokenize", "mix", "shuffle", "pack",
                             "batch", "render", "prebuild"})


def drops_by_reason(stage: str) -> bool:
    """Whether every reason of ``stage`` but ``kept`` is a dropped document: the quality filter,
    decontamination (reason: the evaluation set) and every user stage (a name not built in).
    The one rule the ledger, the manifest's drop summary and the workers' summaries read."""
    return stage in ("filter", "decontam") or stage not in BUILT_IN_STAGES


class StageStats:
    """Counters keyed by (source, reason). ``kept`` is a reason like any other.

    Kept as plain nested dicts of ints so the object is cheap to snapshot into a node's
    ``get_state()`` and to merge across workers/tasks (``merge``).
    """

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def add(self, source: str, reason: str, n: int = 1) -> None:
        self.counts[source][reason] += n

    def get(self, source: str, reason: str) -> int:
        return self.counts.get(source, {}).get(reason, 0)

    def total(self, reason: str) -> int:
        return sum(per.get(reason, 0) for per in self.counts.values())

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {src: dict(per) for src, per in self.counts.items()}

    def load_dict(self, data: dict[str, dict[str, int]]) -> None:
        self.counts = defaultdict(lambda: defaultdict(int))
        for src, per in data.items():
            for reason, n in per.items():
                self.counts[src][reason] = int(n)

    def merge(self, other: "StageStats | dict[str, Any]") -> None:
        data = other.to_dict() if isinstance(other, StageStats) else other
        for src, per in data.items():
            for reason, n in per.items():
                self.counts[src][reason] += int(n)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"StageStats({self.stage!r}, {self.to_dict()})"


def chain_stats(chains: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, dict[str, int]]]:
    """Stage -> source -> reason counts of every node in ``chains`` (source -> stage -> node)
    that keeps a ``StageStats`` in ``.stats``: what a built pipeline reports."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for chain in chains.values():
        for stage, node in chain.items():
            st = getattr(node, "stats", None)
            if isinstance(st, StageStats):
                for src, per in st.to_dict().items():
                    out.setdefault(stage, {}).setdefault(src, {}).update(per)
    return out
