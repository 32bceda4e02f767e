"""The tokenizing stage: text documents -> ``{"ids": int32 array, ...}``, in batches through the
tokenizer's fast path (tiktoken's Rust core, which releases the GIL and encodes a batch on
``num_threads`` threads). Text is untrusted: special-token strings encode as bytes.

Why batch-then-yield instead of ``ParallelMapper`` over single documents: the per-item thread
hand-off costs more than encoding a typical document, while one ``encode_batch`` call keeps
Python out of the hot loop. Exact resume stays cheap: the state is the source's state plus the
documents read but not yet emitted, by position (see ``TokenizeNode``).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import islice
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from stacklm.data.doc_refs import load_docs, save_docs
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
    """Stateful tokenization of a document stream, ``batch_docs`` documents per encode call.

    Overlapped: while batch k is encoded on a background thread (tiktoken releases the GIL),
    the main thread reads batch k+1 from upstream (filter, dedup: Python work) and hands the
    documents of batch k-1 downstream. Batch k+1 starts encoding as soon as it is read, on a
    second background thread, so the shared encode threads never idle at batch k's tail.

    Nothing is snapshotted per batch (upstream states hold dedup indexes: copying them every
    few hundred documents would dominate). ``get_state`` is taken only when asked: the
    source's state now, plus the documents already read but not yet emitted (the rest of
    the current batch and the encoded read-ahead batch): by position (``doc_refs``) in the
    pre-training graph, else as one compact token array.
    """

    SOURCE_KEY = "source"
    PENDING_KEY = "pending"
    AHEAD_KEY = "ahead"  # how many of the pending documents are the read-ahead batch
    STATS_KEY = "stats"

    def __init__(self, source: BaseNode, tokenizer, batch_docs: int = 256, num_threads: int = 2, refs=None) -> None:
        super().__init__()
        self.refs = refs  # a ``doc_refs.DocRefs``: pending documents are checkpointed by position
        if batch_docs < 1:
            raise ValueError(f"batch_docs must be >= 1, got {batch_docs}")
        self.source = source
        self.tokenizer = tokenizer
        self.batch_docs = batch_docs
        self.num_threads = num_threads
        self.stats = StageStats("tokenize")
        self._batch: list[dict[str, Any]] = []
        self._pos = 0
        self._ahead: Future | None = None
        self._executor: ThreadPoolExecutor | None = None

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if self._ahead is not None:
            self._ahead.result()  # let it finish before the source moves under it
        self._ahead = None
        self._batch, self._pos = [], 0
        if initial_state is None:
            self.source.reset(None)
            self.stats = StageStats("tokenize")
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        self.stats.load_dict(initial_state[self.STATS_KEY])
        self._batch = load_docs(self.refs, initial_state[self.PENDING_KEY])
        # The read-ahead batch goes back to being the read-ahead (a finished future): the node
        # then reads upstream exactly when an uninterrupted one would, so what sits in its
        # buffers (the token ledger's "buffered") is the same after a resume.
        n_ahead = int(initial_state.get(self.AHEAD_KEY, 0))
        if n_ahead:
            self._batch, ahead = self._batch[: len(self._batch) - n_ahead], self._batch[len(self._batch) - n_ahead :]
            self._ahead = Future()
            self._ahead.set_result(ahead)
            self._ahead.n_docs = len(ahead)

    # Set by the consumer (``MixNode``): tokens it still wants from this source, or None for
    # "as many as come". Why: with a budget far below the source, reading ``batch_docs``
    # documents (and as many ahead) tokenized up to 20x what the mix kept.
    demand = None
    FIRST_BATCH = 8  # documents in the first batch, before their mean length is known

    def _want(self, pending_docs: int) -> int:
        """Documents to read next: ``batch_docs``, or, when the consumer's demand is known,
        about what it still needs beyond the ``pending_docs`` already read (a quarter more, at
        this source's mean document length so far), at most ``batch_docs``; 0 when the pending
        documents already cover it. Decided from counted state only (the demand, the emitted
        documents' mean length), so a resumed run reads exactly when the uninterrupted one did."""
        if self.demand is None:
            return self.batch_docs
        emitted = self.stats.total("docs")
        if not emitted:
            return 0 if pending_docs else min(self.batch_docs, self.FIRST_BATCH)
        mean = max(1.0, self.stats.total("tokens") / emitted)
        need = int(self.demand()) - pending_docs * mean
        if need <= 0:
            return 0
        return max(1, min(self.batch_docs, int(need * 1.25 / mean) + 1))

    def _read(self, n: int | None = None) -> Future | None:
        docs = list(islice(self.source, self.batch_docs if n is None else n))
        if not docs:
            return None
        if self._executor is None:
            self._executor = ThreadPoolExecutor(2, thread_name_prefix="stacklm-tokenize")
        fut = self._executor.submit(tokenize_docs, self.tokenizer, docs, self.num_threads)
        fut.n_docs = len(docs)
        return fut

    def next(self) -> dict[str, Any]:
        if self._pos >= len(self._batch):
            current = self._ahead if self._ahead is not None else self._read(max(1, self._want(0)))
            if current is None:
                raise StopIteration
            # upstream work for the next batch overlaps this encode; not when the consumer's
            # demand is already covered (read later, should it still want more)
            ahead = self._want(current.n_docs)
            self._ahead = self._read(ahead) if ahead else None
            self._batch, self._pos = current.result(), 0
        doc = self._batch[self._pos]
        self._pos += 1
        src = doc.get("source", "?")
        self.stats.add(src, "docs")
        self.stats.add(src, "tokens", int(doc["ids"].size))
        return doc

    def buffered(self) -> list[int]:
        """``[docs, tokens]`` read and encoded but not yet emitted (the rest of the current batch
        and the read-ahead batch): the token ledger's "in buffers before the mix"."""
        pending = self._batch[self._pos :] + (self._ahead.result() if self._ahead is not None else [])
        return [len(pending), sum(int(d["ids"].size) for d in pending)]

    def get_state(self) -> dict[str, Any]:
        pending = self._batch[self._pos :]
        ahead = self._ahead.result() if self._ahead is not None else []
        return {
            self.SOURCE_KEY: self.source.state_dict(),
            self.PENDING_KEY: save_docs(self.refs, pending + ahead),
            self.AHEAD_KEY: len(ahead),
            self.STATS_KEY: self.stats.to_dict(),
        }
