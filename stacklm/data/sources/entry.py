"""``open_source``: the source node for one data-mix registry entry."""

from __future__ import annotations

from torchdata.nodes import BaseNode

from stacklm.data.registry import DataMixEntry
from stacklm.data.sources.files import LocalFileSource
from stacklm.data.sources.hub import HFStreamSource
from stacklm.data.sources.sharding import ShardSpec
from stacklm.data.sources.synthetic import SyntheticSource


def open_source(entry: DataMixEntry, *, shard: ShardSpec | None = None, fallback_offline: bool = False) -> BaseNode:
    """The source node for one registry entry."""
    if entry.kind == "hf":
        return HFStreamSource.from_entry(entry, shard=shard, fallback_offline=fallback_offline)
    if entry.kind == "local":
        return LocalFileSource(entry.name, list(entry.data_files or [entry.path]), entry.domain, text_column=entry.text_column, shard=shard,
                               on_invalid=entry.on_invalid)
    return SyntheticSource(entry.name, entry.domain, seed=entry.seed, num_docs=entry.num_docs, shard=shard)
