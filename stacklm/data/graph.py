"""``BuiltPipeline``: the one shape of a built node graph, pre-training and SFT alike.

Both builders (``nodes.build_pipeline``, ``sft.build_sft_pipeline``) wire the same stages --
per source: source -> [holdout] -> per-source work; then: weighted mix -> shuffle -> pack ->
batch -- and return this, so loaders, logging and the prebuild read one interface:
``batches`` to iterate (its ``state_dict()`` is the graph's exact position), ``stats()`` by
stage -> source -> reason, ``realized()`` per source, ``packing()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchdata.nodes import BaseNode

from stacklm.data.sources import ShardSpec
from stacklm.data.stats import chain_stats


@dataclass
class BuiltPipeline:
    config: Any  # PipelineConfig or SFTConfig
    split: str
    shard: ShardSpec
    sources: dict[str, BaseNode]
    chains: dict[str, dict[str, BaseNode]]  # source -> stage -> node
    windows: BaseNode  # the packer
    batches: BaseNode

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """Counts by stage -> source -> reason (kept, each drop reason, dups, audit counts)."""
        return chain_stats(self.chains)

    def packing(self) -> dict[str, Any]:
        return self.windows.summary()

    def realized(self) -> dict[str, dict[str, Any]]:
        """Per source: what was delivered, with the target and realized share."""
        raise NotImplementedError
