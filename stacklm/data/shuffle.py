"""Seeded buffer shuffle of tokenized documents.

A bounded buffer (the classic streaming "shuffle buffer"): keep ``buffer_size``
documents, emit a uniformly chosen one and put the next incoming document in its slot. It
breaks up the source order (files, shards, the mixer's runs) at O(buffer) memory. Its state
is the RNG state plus the buffer: by position in the pre-training graph (``doc_refs``), else
as compact columnar content (``doc_refs.encode_docs``); restoring it continues the stream bit
for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from stacklm.data.doc_refs import load_docs, save_docs


# ---------------------------------------------------------------------------------------
# Shuffle buffer
# ---------------------------------------------------------------------------------------
class ShuffleBuffer:
    """Plain seeded buffer shuffle: ``push`` documents while ``wants_more``; ``pop`` one."""

    def __init__(self, buffer_size: int, seed: int = 0) -> None:
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1, got {buffer_size}")
        self.buffer_size = int(buffer_size)
        self.seed = int(seed)
        self.reset()

    def reset(self) -> None:
        self.rng = np.random.Generator(np.random.PCG64(self.seed))
        self.buffer: list[dict] = []

    @property
    def wants_more(self) -> bool:
        return len(self.buffer) < self.buffer_size

    def push(self, doc: dict) -> None:
        self.buffer.append(doc)

    def pop(self) -> dict:
        """A uniformly chosen buffered document; the last one fills its slot (O(1))."""
        j = int(self.rng.integers(len(self.buffer)))
        doc = self.buffer[j]
        last = self.buffer.pop()
        if j < len(self.buffer):
            self.buffer[j] = last
        return doc

    def __len__(self) -> int:
        return len(self.buffer)

    def state(self, refs=None) -> dict[str, Any]:
        """RNG + buffer; with ``refs`` (a ``doc_refs.DocRefs``) the buffer by position."""
        return {"rng": self.rng.bit_generator.state, "buffer": save_docs(refs, self.buffer)}

    def load_state(self, state: dict[str, Any], refs=None) -> None:
        self.reset()
        self.rng.bit_generator.state = state["rng"]
        self.buffer = load_docs(refs, state["buffer"])

    def __call__(self, docs: Iterable[dict]) -> Iterator[dict]:
        for doc in docs:
            self.push(doc)
            if not self.wants_more:
                yield self.pop()
        while self.buffer:
            yield self.pop()


def shuffle_docs(docs: Iterable[dict], buffer_size: int, seed: int = 0) -> Iterator[dict]:
    """Convenience: buffer-shuffle an iterable of tokenized documents."""
    return ShuffleBuffer(buffer_size, seed)(docs)


class ShuffleNode(BaseNode[dict]):
    """Stateful wrapper of ``ShuffleBuffer``; state = source state + RNG + the buffer, by position
    (``stacklm.data.doc_refs``) when the graph gives ``refs``, else compact content."""

    SOURCE_KEY = "source"

    def __init__(self, source: BaseNode[dict], buffer_size: int, seed: int = 0, refs=None) -> None:
        super().__init__()
        self.source = source
        self.refs = refs  # a ``doc_refs.DocRefs``: the buffer is checkpointed by position
        self.shuffler = ShuffleBuffer(buffer_size, seed)
        self._source_done = False

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset()
            self.shuffler.reset()
            self._source_done = False
        else:
            self.source.reset(initial_state[self.SOURCE_KEY])
            self.shuffler.load_state(initial_state["shuffle"], self.refs)
            self._source_done = bool(initial_state["source_done"])

    def next(self) -> dict:
        while not self._source_done and self.shuffler.wants_more:
            try:
                self.shuffler.push(next(self.source))
            except StopIteration:
                self._source_done = True
        if not len(self.shuffler):
            raise StopIteration
        return self.shuffler.pop()

    def buffered(self) -> dict[str, list[int]]:
        """Per source ``[docs, tokens]`` waiting in the buffer (the token ledger's remainder)."""
        out: dict[str, list[int]] = {}
        for doc in self.shuffler.buffer:
            slot = out.setdefault(doc.get("source", "?"), [0, 0])
            slot[0] += 1
            slot[1] += len(doc["ids"])
        return out

    def get_state(self) -> dict[str, Any]:
        return {
            self.SOURCE_KEY: self.source.state_dict(),
            "shuffle": self.shuffler.state(self.refs),
            "source_done": self._source_done,
        }
