"""``open_source``: the pre-training source node for one ``SourceConfig``; ``part_documents``:
the documents of one of its parts, read back (``stacklm inspect``: a step's rows, a removal's texts).

The entry is typed ``Any`` and this module does not import the schema: ``SourceConfig.build``
calls ``open_source``, so an import back would be a circle (``tests/test_layout.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchdata.nodes import BaseNode

from stacklm.data.sources.files import LocalFileSource
from stacklm.data.sources.hub import HFStreamSource
from stacklm.data.sources.parts import DEFAULT_TEXT_COLUMN, PartNode
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


def part_documents(node: BaseNode, part: int) -> Iterator[dict]:
    """The documents of part ``part`` (a file; the one part of a synthetic source) of a source
    node opened on all its parts (``ShardSpec()``), in order from the part's start: a part
    reader starts at the part, any other node from its first document."""
    node.reset({"part": part} if isinstance(node, PartNode) else None)  # a reader of all parts: part index = file
    for doc in node:
        f = int(doc.get("file", -1))
        if f > part:
            return
        if f == part:
            yield doc
