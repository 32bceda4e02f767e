"""``DedupNode``: the dedup stage of the pipes (exact, then near duplicates, per source)."""

from __future__ import annotations

from collections import Counter, deque
from itertools import islice
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from stacklm.data.dedup.exact import ExactDeduper
from stacklm.data.doc_refs import load_docs, save_docs
from stacklm.data.dedup.global_index import DedupIndex, id_keys
from stacklm.data.dedup.minhash import NearDeduper
from stacklm.data.quality.normalize import normalize_text
from stacklm.data.stats import StageStats

_INDEX_REASONS = ("kept", "exact_dup", "near_dup", "cross_split_dup")  # by ``DedupIndex.lookup`` code


class DedupNode(BaseNode[dict]):
    """Drops exact duplicates (normalised text), then near duplicates (MinHash-LSH).

    Works on groups of ``batch_docs`` documents: the vectorised batch paths of both indexes
    are several times faster than one call per document and give the same decisions
    (duplicates inside a group included). The state is the source's state after the group,
    both indexes after it, and the group's kept documents not yet emitted, so a restored node
    continues exactly.

    Each decision is counted once, by the deduper that made it (``exact.stats``,
    ``near.stats``); ``stats`` is the stage's view of those counts: per source ``exact_dup``,
    ``near_dup``, ``cross_split_dup`` (a global index's copies of a document kept in another
    split) and ``kept`` (what passed the last index).
    """

    def __init__(
        self,
        source: BaseNode[dict],
        exact: ExactDeduper | None,
        near: NearDeduper | None = None,
        batch_docs: int = 64,
        *,
        removed: tuple[DedupIndex, str] | None = None,
        refs=None,
    ) -> None:
        super().__init__()
        self.refs = refs  # a ``doc_refs.DocRefs``: the pending kept documents are checkpointed by position
        if exact is None and near is None and removed is None:
            raise ValueError("DedupNode needs an exact or a near deduper or a global index; with none, leave the stage out")
        self.source, self.exact, self.near, self.batch_docs = source, exact, near, batch_docs
        # (global index, split): documents it lists are dropped first, whatever reader reads them
        self.removed = removed
        self.index_stats = StageStats("global_dedup")
        self._fresh = (exact.state_dict() if exact is not None else None, near.state_dict() if near is not None else None)
        self._pending: deque[dict] = deque()

    @property
    def stats(self) -> StageStats:
        """Per source ``exact_dup`` (exact index), ``near_dup`` and ``kept`` (the last index)."""
        out = StageStats("dedup")
        last = self.near if self.near is not None else self.exact
        for src, per in self.index_stats.to_dict().items():
            for reason in ("exact_dup", "near_dup", "cross_split_dup") + (("kept",) if last is None else ()):
                if reason in per:
                    out.add(src, reason, per[reason])
        for deduper, reasons in ((self.exact, ("exact_dup",)), (self.near, ("near_dup",)), (last, ("kept",))):
            if deduper is None:
                continue
            for src, per in deduper.stats.to_dict().items():
                for reason in reasons:
                    if reason in per:
                        out.add(src, reason, per[reason])
        return out

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        st = initial_state or {}
        self.source.reset(st.get("source"))
        if self.exact is not None:
            self.exact.load_state_dict(st["exact"] if initial_state else self._fresh[0])
        if self.near is not None:
            self.near.load_state_dict(st["near"] if initial_state else self._fresh[1])
        pending = st.get("pending", [])
        self._pending = deque(load_docs(self.refs, pending) if isinstance(pending, dict) else pending)
        self.index_stats.load_dict(st.get("index_stats", {}))

    def _fill(self) -> bool:
        docs = list(islice(self.source, self.batch_docs))
        if not docs:
            return False
        sources = [d.get("source", "?") for d in docs]
        keep = np.ones(len(docs), dtype=bool)
        if self.removed is not None:
            index, split = self.removed
            code = index.lookup(split, id_keys(d.get("doc_id", "") for d in docs))
            for (src, c), n in Counter(zip(sources, code.tolist())).items():  # one count per (source, decision), not per document
                self.index_stats.add(src, _INDEX_REASONS[c], n)
            keep &= code == 0
        if (self.exact is not None or self.near is not None) and keep.any():
            self._in_flight(docs, sources, keep)
        self._pending.extend(docs[i] for i in np.flatnonzero(keep))
        return True

    def _in_flight(self, docs: list[dict], sources: list[str], keep: np.ndarray) -> None:
        """Clear ``keep`` where this reader's exact, then near index finds a copy. Only here is the
        text normalised (once, for both indexes, and only the documents they look at): with the
        global index alone nothing reads it, and it was a quarter of the main thread's time."""
        texts = {i: normalize_text(docs[i]["text"]) for i in np.flatnonzero(keep)}
        if self.exact is not None:
            idx = np.flatnonzero(keep)
            keep[idx[self.exact.is_duplicate_batch([texts[i] for i in idx], [sources[i] for i in idx], normalized=True)]] = False
        if self.near is not None and keep.any():
            idx = np.flatnonzero(keep)
            near = self.near.is_duplicate_batch([texts[i] for i in idx], [sources[i] for i in idx], normalized=True)
            keep[idx[near]] = False

    def next(self) -> dict:
        while not self._pending:
            if not self._fill():
                raise StopIteration
        return self._pending.popleft()

    def get_state(self) -> dict[str, Any]:
        # "stats" is derived from the indexes' own counters; it stays in the state so the
        # checkpoint layout is unchanged.
        st: dict[str, Any] = {"source": self.source.state_dict(), "stats": self.stats.to_dict(), "pending": save_docs(self.refs, list(self._pending)) if self.refs is not None else list(self._pending)}
        if self.removed is not None:
            st["index_stats"] = self.index_stats.to_dict()
        if self.exact is not None:
            st["exact"] = self.exact.state_dict()
        if self.near is not None:
            st["near"] = self.near.state_dict()
        return st
