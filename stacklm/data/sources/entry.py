"""``open_source``: the pre-training source node for one ``SourceConfig``.

The entry is typed ``Any`` and this module does not import the schema: ``SourceConfig.build``
calls ``open_source``, so an import back would be a circle (``tests/test_layout.py``)."""

from __future__ import annotations

from typing import Any

from torchdata.nodes import BaseNode

from stacklm.data.sources.files import LocalFileSource
from stacklm.data.sources.hub import HFStreamSource
from stacklm.data.sources.parts import DEFAULT_TEXT_COLUMN
from stacklm.data.sources.sharding import ShardSpec
from stacklm.data.sources.synthetic import SyntheticSource


def open_source(entry: Any, *, shard: ShardSpec | None = None, fallback_offline: bool = False,
                order_seed: int | None = None) -> BaseNode:
    """The source node for one registry entry. ``order_seed``: local files are read in a seeded
    order of pieces spread over every file (``LocalFileSource``), not file by file from the start."""
    if entry.kind == "hf":
        return HFStreamSource.from_entry(entry, shard=shard, fallback_offline=fallback_offline)
    if entry.kind == "local":
        return LocalFileSource(entry.name, entry.paths, entry.domain, text_column=entry.text_column or DEFAULT_TEXT_COLUMN,
                               shard=shard, on_invalid=entry.invalid_policy(), order_seed=order_seed)
    return SyntheticSource(entry.name, entry.domain, seed=entry.seed, num_docs=entry.num_docs, shard=shard)
