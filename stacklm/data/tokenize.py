"""Tokenize stage: text documents -> ``{"ids": int32 array, ...}``, in batches through the
tokenizer's fast path (tiktoken's Rust core, which releases the GIL and encodes a batch on
``num_threads`` threads). Text is untrusted: special-token strings encode as bytes.

Why batch-then-yield instead of ``ParallelMapper`` over single documents: the per-item thread
hand-off costs more than encoding a typical document, while one ``encode_batch`` call keeps
Python out of the hot loop. Exact resume stays cheap: the state is the source's state at
the start of the current batch plus how many of that batch were already emitted; restoring
re-reads and re-encodes that one batch, deterministically.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from stacklm.data.stats import StageStats


def tokenize_docs(tokenizer, docs: Sequence[dict[str, Any]], num_threads: int = 2) -> list[dict[str, Any]]:
    """Encode a batch of documents; each output keeps ``source``/``domain``/``doc_id``."""
    texts = [d["text"] for d in docs]
    if hasattr(tokenizer, "encode_batch_numpy"):
        arrays = tokenizer.encode_batch_numpy(texts, num_threads=num_threads)
    else:  # any tokenizer with encode_batch (e.g. an imported foreign one)
        arrays = [np.asarray(t, dtype=np.int32) for t in tokenizer.encode_batch(texts, num_threads=num_threads)]
    out = []
    for d, ids in zip(docs, arrays):
        doc = {k: v for k, v in d.items() if k != "text"}
        doc["ids"] = ids
        out.append(doc)
    return out


class TokenizeNode(BaseNode):
    """Stateful tokenization of a document stream, ``batch_docs`` documents per encode call."""

    SOURCE_KEY = "source"
    BATCH_START_KEY = "batch_start_state"
    EMITTED_KEY = "emitted_in_batch"
    STATS_KEY = "stats"

    def __init__(self, source: BaseNode, tokenizer, batch_docs: int = 256, num_threads: int = 2) -> None:
        super().__init__()
        if batch_docs < 1:
            raise ValueError(f"batch_docs must be >= 1, got {batch_docs}")
        self.source = source
        self.tokenizer = tokenizer
        self.batch_docs = batch_docs
        self.num_threads = num_threads
        self.stats = StageStats("tokenize")
        self._batch: list[dict[str, Any]] = []
        self._pos = 0
        self._batch_start_state: dict | None = None

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._batch, self._pos = [], 0
        if initial_state is None:
            self.source.reset(None)
            self.stats = StageStats("tokenize")
            self._batch_start_state = self.source.state_dict()
            return
        self.stats.load_dict(initial_state[self.STATS_KEY])
        start = initial_state[self.BATCH_START_KEY]
        self.source.reset(start)
        self._batch_start_state = start
        skip = initial_state[self.EMITTED_KEY]
        if skip:
            self._fill()
            self._count_batch()
            self._pos = skip

    def _fill(self) -> None:
        docs = list(islice(self.source, self.batch_docs))
        self._batch = tokenize_docs(self.tokenizer, docs, self.num_threads) if docs else []
        self._pos = 0

    def next(self) -> dict[str, Any]:
        if self._pos >= len(self._batch):
            self._batch_start_state = self.source.state_dict()
            self._fill()
            if not self._batch:
                raise StopIteration
            self._count_batch()
        doc = self._batch[self._pos]
        self._pos += 1
        return doc

    def _count_batch(self) -> None:
        for d in self._batch:
            self.stats.add(d.get("source", "?"), "docs")
            self.stats.add(d.get("source", "?"), "tokens", int(d["ids"].size))

    def get_state(self) -> dict[str, Any]:
        return {
            self.BATCH_START_KEY: self._batch_start_state,
            self.EMITTED_KEY: self._pos if self._batch else 0,
            self.STATS_KEY: self._stats_at_batch_start(),
        }

    def _stats_at_batch_start(self) -> dict:
        """Counters as of the batch start: the restored node re-counts the batch when it re-reads it."""
        data = self.stats.to_dict()
        for d in self._batch:
            per = data.get(d.get("source", "?"))
            if per is not None:
                per["docs"] -= 1
                per["tokens"] -= int(d["ids"].size)
        return data
