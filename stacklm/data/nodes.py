"""The node graph: one builder wires the stateful stages into a pipeline.

Per source:   source -> holdout split -> quality filter -> exact dedup -> near dedup -> tokenize
Then:         budgeted mix (over the sources) -> shuffle buffer -> pack -> batch

Each source gets its own filter/dedup/tokenize chain, so the mixer can pull tokens from
exactly the source whose budget it is filling; dedup indexes are therefore per source
(cross-source duplicates are left to the offline prebuild, where one global pass is cheap).
The loader's state is the root node's ``state_dict()``, which nests every stage's small
state; a fresh graph ``reset`` with it continues bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torchdata.nodes import BaseNode

from stacklm.data.dedup import DedupNode, ExactDeduper, NearDeduper
from stacklm.data.filters import FilterConfig, FilterNode
from stacklm.data.holdout import HoldoutNode
from stacklm.data.mix import MixNode
from stacklm.data.pack import PackNode, batch_node
from stacklm.data.registry import DataMix, get_mix
from stacklm.data.shuffle import ShuffleNode
from stacklm.data.sources import ShardSpec, open_source
from stacklm.data.splits import check_split
from stacklm.data.stats import chain_stats
from stacklm.data.tokenizing import TokenizeNode


@dataclass(frozen=True)
class DedupConfig:
    exact: bool = True
    near: bool = True
    near_max_docs: int = 2_000_000  # per source; the index warns once and stops growing when full


@dataclass(frozen=True)
class PipelineConfig:
    """Everything that decides the stream's content. ``config_hash`` guards resumes/prebuilds."""

    mix: DataMix
    seq_len: int = 2048
    batch_size: int = 8
    strategy: str = "best_fit"
    seed: int = 0
    shuffle_buffer: int = 2000
    pack_buffer_docs: int = 1000
    holdout_fraction: float = 0.001
    filters: FilterConfig = field(default_factory=FilterConfig)
    dedup: DedupConfig = field(default_factory=DedupConfig)
    tokenize_batch_docs: int = 256
    num_threads: int = 2
    fallback_offline: bool = False
    drop_last: bool = False

    def __post_init__(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"pipeline config: field 'seq_len' must be >= 2, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"pipeline config: field 'batch_size' must be >= 1, got {self.batch_size}")
        if self.strategy not in ("greedy", "best_fit"):
            raise ValueError(f"pipeline config: field 'strategy' must be 'greedy' or 'best_fit', got {self.strategy!r}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"pipeline config: field 'holdout_fraction' must be in [0, 1), got {self.holdout_fraction}")

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["mix"] = self.mix.to_dict()
        d["filters"] = self.filters.to_dict()
        d["dedup"] = dataclasses.asdict(self.dedup)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PipelineConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"pipeline config: unknown field(s) {unknown}; known: {sorted(known)}")
        if "mix" not in data:
            raise ValueError(
                "pipeline config: missing field 'mix' (a registered mix name such as 'stack-100m', or a dict with "
                "name, total_tokens, entries)"
            )
        kw = dict(data)
        mix = data["mix"]
        kw["mix"] = get_mix(mix) if isinstance(mix, str) else mix if isinstance(mix, DataMix) else DataMix.from_dict(mix)
        if "filters" in kw:
            kw["filters"] = FilterConfig.from_dict(kw["filters"] or {})
        if "dedup" in kw:
            kw["dedup"] = DedupConfig(**(kw["dedup"] or {}))
        return cls(**kw)

    def config_hash(self, exclude: tuple[str, ...] = ("num_threads",)) -> str:
        """sha256 of the canonical config (minus knobs that do not change the stream)."""
        d = {k: v for k, v in self.to_dict().items() if k not in exclude}
        return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Pipeline:
    """The built graph plus handles on its stages for stats/logging."""

    config: PipelineConfig
    split: str
    shard: ShardSpec
    sources: dict[str, BaseNode]
    chains: dict[str, dict[str, BaseNode]]
    mix: MixNode
    shuffle: ShuffleNode
    windows: PackNode
    batches: BaseNode

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """Counts by stage -> source -> reason (kept, filtered reasons, dups, audit counts)."""
        return chain_stats(self.chains)

    def realized(self) -> dict[str, dict[str, Any]]:
        return self.mix.realized()

    def phases(self) -> list[dict[str, Any]]:
        """Per mixture phase: planned vs mixed tokens per source (``TokenBudgetMixer.phases``)."""
        return self.mix.phases()

    def packing(self) -> dict[str, Any]:
        return self.windows.summary()


def _near_deduper(config: PipelineConfig):
    if not config.dedup.near:
        return None
    return NearDeduper(max_docs=config.dedup.near_max_docs)


def build_pipeline(config: PipelineConfig, tokenizer, split: str = "train", shard: ShardSpec | None = None) -> Pipeline:
    """Build the whole graph for one split and one (rank, worker) shard of the sources."""
    check_split(split)
    shard = shard or ShardSpec()
    total = config.mix.total_tokens
    if split == "val":
        total = max(1, round(total * config.holdout_fraction))
    sources: dict[str, BaseNode] = {}
    chains: dict[str, dict[str, BaseNode]] = {}
    tokenized: dict[str, BaseNode] = {}
    for entry in config.mix.entries:
        src = open_source(entry, shard=shard, fallback_offline=config.fallback_offline)
        node: BaseNode = src
        chain: dict[str, BaseNode] = {"source": src}
        if config.holdout_fraction > 0 or split == "val":
            node = chain["holdout"] = HoldoutNode(node, split, config.holdout_fraction, seed=config.seed)
        node = chain["filter"] = FilterNode(node, config.filters)
        if config.dedup.exact or config.dedup.near:
            exact = ExactDeduper() if config.dedup.exact else None
            node = chain["dedup"] = DedupNode(node, exact, _near_deduper(config))
        node = chain["tokenize"] = TokenizeNode(node, tokenizer, config.tokenize_batch_docs, config.num_threads)
        sources[entry.name] = src
        chains[entry.name] = chain
        tokenized[entry.name] = node
    # A reader mixes its own slice of the budget from its own shard of every source: the
    # schedule's caps see the sources' sizes scaled the same way (sizes are of the whole source).
    split_share = config.holdout_fraction if split == "val" else 1.0 - config.holdout_fraction
    mix = MixNode(tokenized, config.mix.weights, total, seed=config.seed, schedule=config.mix.schedule,
                  size_scale=split_share / max(1, shard.count))
    shuffle = ShuffleNode(mix, config.shuffle_buffer, seed=config.seed + 1)
    windows = PackNode(
        shuffle, config.seq_len, config.strategy, tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id, config.pack_buffer_docs
    )
    batches = batch_node(windows, config.batch_size, drop_last=config.drop_last)
    return Pipeline(config, split, shard, sources, chains, mix, shuffle, windows, batches)
