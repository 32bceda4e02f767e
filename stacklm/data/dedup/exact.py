"""Exact deduplication on normalised text, with a store of <= 16 bytes per unique document.

Two documents are the same when their ``stacklm.data.quality.normalize.normalize_text`` forms are
equal (NFKC, casefolded, whitespace runs collapsed, stripped): ``"Foo  Bar\\n"`` and
``"foo bar"`` are one document. Empty and whitespace-only documents all normalise to ``""``
(the first is kept, the rest are duplicates).

The store is ``U64HashSet``: one numpy ``uint64`` array used as an open-addressing (linear
probing) table of 64-bit xxh3 digests, grown x1.5 by rehashing when it passes 75% load. Its load
therefore stays in (0.5, 0.75] once it has grown, i.e. 10.7-16 bytes per unique document, against
~90 bytes per entry for a Python ``set`` of digests; and the checkpoint state *is* the array.
We write this table ourselves because no maintained library offers a numpy-backed,
vectorised, picklable-as-one-array hash set. The price of storing digests instead of texts is a
false "duplicate" when two different texts share a 64-bit digest: about n^2 / 2^65, i.e. 1e-5
for 20M documents.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import xxhash

from stacklm.data.quality.normalize import normalize_text
from stacklm.data.stats import StageStats


def text_digest(text: str, normalized: bool = False) -> int:
    """Nonzero 64-bit xxh3 digest of ``normalize_text(text)`` (0 is the table's empty marker);
    ``normalized=True`` when ``text`` already is."""
    norm = text if normalized else normalize_text(text)
    return xxhash.xxh3_64_intdigest(norm.encode("utf-8", "surrogatepass")) or 1


def text_digests(texts: Iterable[str], normalized: bool = False) -> np.ndarray:
    """``text_digest`` of each text, as a ``uint64`` array."""
    return np.fromiter((text_digest(t, normalized) for t in texts), dtype=np.uint64)


# ---------------------------------------------------------------------------------------
# Compact set of 64-bit keys
# ---------------------------------------------------------------------------------------
_GOLDEN_INT = 0x9E3779B97F4A7C15
_GOLDEN = np.uint64(_GOLDEN_INT)
_MASK64 = (1 << 64) - 1
_SCALAR_BATCH = 48  # up to this many keys, probe in plain Python


def in_sorted(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """Membership of each of ``values`` in the sorted array ``sorted_set`` (a binary search each)."""
    values = np.asarray(values)
    if not sorted_set.size:
        return np.zeros(values.size, dtype=bool)
    return sorted_set[np.minimum(np.searchsorted(sorted_set, values), sorted_set.size - 1)] == values


def run_starts(sorted_values: np.ndarray) -> np.ndarray:
    """Mask of the first element of each run of equal values in a sorted array."""
    head = np.empty(sorted_values.size, dtype=bool)
    head[:1] = True
    np.not_equal(sorted_values[1:], sorted_values[:-1], out=head[1:])
    return head


class U64HashSet:
    """Set of nonzero ``uint64`` keys in one open-addressing numpy array (linear probing).

    The home slot is ``((key * golden) >> 32) * capacity >> 32`` (Fibonacci hashing, then a
    multiply-shift range reduction, so the capacity need not be a power of two and can grow by
    x1.5). 0 marks an empty slot; callers map a 0 key to 1. Vectorised: a batch probes all its
    keys at once, one numpy step per probe distance, so the Python loop length is the longest
    probe run (short at <= 75% load), not the batch size.
    """

    MAX_LOAD = 0.75
    GROWTH = 1.5
    MIN_CAPACITY = 16

    def __init__(self, capacity: int = MIN_CAPACITY) -> None:
        self.table = np.zeros(max(int(capacity), self.MIN_CAPACITY), dtype=np.uint64)
        self.size = 0

    def __len__(self) -> int:
        return self.size

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)

    @property
    def capacity(self) -> int:
        return int(self.table.size)

    # -- probing ------------------------------------------------------------------------
    def _home(self, keys: np.ndarray) -> np.ndarray:
        # Fibonacci-multiply first so keys with unevenly used high bits still spread out.
        high = (keys * _GOLDEN) >> np.uint64(32)
        return ((high * np.uint64(self.table.size)) >> np.uint64(32)).astype(np.int64)

    def _probe(self, key: int) -> int:
        """Scalar probe: the slot holding ``key``, or the empty slot where it would go."""
        table, cap = self.table, self.table.size
        pos = ((((key * _GOLDEN_INT) & _MASK64) >> 32) * cap) >> 32
        while True:
            slot = table.item(pos)
            if slot == key or slot == 0:
                return pos
            pos += 1
            if pos == cap:
                pos = 0

    def contains(self, keys: np.ndarray) -> np.ndarray:
        """Boolean array: which of ``keys`` (nonzero uint64) are in the set."""
        keys = _as_keys(keys)
        if keys.size <= _SCALAR_BATCH:  # a few keys: plain Python beats numpy's per-call cost
            return np.array([self.table.item(self._probe(k)) != 0 for k in keys.tolist()], dtype=bool)
        found = np.zeros(keys.size, dtype=bool)
        pos = self._home(keys)
        active = np.arange(keys.size)
        cap = self.table.size
        while active.size:
            slot = self.table[pos]
            hit = slot == keys[active]
            found[active[hit]] = True
            go_on = ~hit & (slot != 0)
            active = active[go_on]
            pos = pos[go_on] + 1
            pos[pos == cap] = 0
        return found

    def add(self, keys: np.ndarray) -> np.ndarray:
        """Insert ``keys``; return a mask of the ones that were new (first occurrence in the
        batch and not already present), i.e. exactly what inserting them one by one would say."""
        keys = _as_keys(keys)
        if keys.size <= _SCALAR_BATCH:
            is_new = np.zeros(keys.size, dtype=bool)
            for i, key in enumerate(keys.tolist()):
                pos = self._probe(key)
                if self.table.item(pos) == 0:
                    if self.size + 1 > self.MAX_LOAD * self.table.size:
                        self._reserve(self.size + 1)
                        pos = self._probe(key)
                    self.table[pos] = key
                    self.size += 1
                    is_new[i] = True
            return is_new
        is_new = np.zeros(keys.size, dtype=bool)
        # first occurrence of each distinct key (np.unique(return_index=True) is ~4x slower)
        order = np.argsort(keys, kind="stable")
        sorted_keys = keys[order]
        head = run_starts(sorted_keys)
        uniq, first = sorted_keys[head], order[head]
        absent = ~self.contains(uniq)
        new_keys = uniq[absent]
        is_new[first[absent]] = True
        if new_keys.size:
            self._reserve(self.size + new_keys.size)
            self._insert_absent(new_keys)
        return is_new

    def _insert_absent(self, keys: np.ndarray) -> None:
        """Place keys known to be absent and distinct; several may race for one empty slot, the
        first wins and the others probe on."""
        cap = self.table.size
        pos = self._home(keys)
        pending = np.arange(keys.size)
        while pending.size:
            empty = self.table[pos] == 0
            cand = np.flatnonzero(empty)
            if cand.size:
                order = np.argsort(pos[cand])
                won = cand[order[run_starts(pos[cand][order])]]  # one key per slot
                self.table[pos[won]] = keys[pending[won]]
                keep = np.ones(pending.size, dtype=bool)
                keep[won] = False
                pending, pos = pending[keep], pos[keep]
            pos = pos + 1
            pos[pos == cap] = 0
        self.size += keys.size

    def _reserve(self, n_keys: int) -> None:
        cap = self.table.size
        if n_keys <= self.MAX_LOAD * cap:
            return
        while n_keys > self.MAX_LOAD * cap:
            cap = int(cap * self.GROWTH)
        old = self.table[self.table != 0]
        self.table = np.zeros(cap, dtype=np.uint64)
        self.size = 0
        self._insert_absent(old)

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"table": self.table.copy(), "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        table = np.asarray(state["table"])
        if table.dtype != np.uint64 or table.ndim != 1:
            raise ValueError(f"hash-set state 'table' must be a 1-D uint64 array, got {table.dtype} {table.shape}")
        size = int(state["size"])
        if size != int(np.count_nonzero(table)):
            raise ValueError(f"hash-set state is inconsistent: 'size' says {size}, table holds {np.count_nonzero(table)} keys")
        self.table = table.copy()
        self.size = size


def _as_keys(keys: Any) -> np.ndarray:
    keys = np.ascontiguousarray(keys, dtype=np.uint64).ravel()
    if keys.size and not keys.all():
        raise ValueError("U64HashSet keys must be nonzero (0 marks an empty slot); map 0 to 1 first")
    return keys


# ---------------------------------------------------------------------------------------
# Exact deduper
# ---------------------------------------------------------------------------------------
def per_doc_sources(sources: Sequence[str] | str | None, n: int) -> Sequence[str]:
    """One source name per document: ``None`` -> "default", a string -> repeated."""
    if sources is None:
        return ["default"] * n
    if isinstance(sources, str):
        return [sources] * n
    if len(sources) != n:
        raise ValueError(f"got {n} texts but {len(sources)} sources; pass one source per text or a single string")
    return sources


def count_by_source(stats: StageStats, sources: Sequence[str], mask: np.ndarray, reason: str) -> None:
    """Count the documents selected by ``mask`` under ``reason``, per source."""
    if not mask.any():
        return
    if len(set(sources)) == 1:
        stats.add(sources[0], reason, int(mask.sum()))
        return
    for i in np.flatnonzero(mask):
        stats.add(sources[i], reason)


DEFAULT_EXACT_MAX_DOCS = 20_000_000  # at most 20M * 16 B = 320 MB of table per deduper


class ExactDeduper:
    """Streaming exact dedup: a document is a duplicate when its normalised text was seen before.

    ``stats`` (a ``StageStats("exact_dedup")``) counts ``kept`` and ``exact_dup`` per source,
    and ``index_full``: kept documents not remembered because the table already held
    ``max_docs`` digests. That is the policy at the bound, the same as ``NearDeduper``'s:
    the state never exceeds ``max_docs`` x 16 bytes; past it, documents are still checked
    against everything remembered, but a later copy of an unremembered one passes. It warns
    once (``warnings`` + ``logging``) and every such document is counted.
    """

    def __init__(self, max_docs: int = DEFAULT_EXACT_MAX_DOCS) -> None:
        if int(max_docs) < 1:
            raise ValueError(f"ExactDeduper max_docs must be >= 1, got {max_docs}")
        self.max_docs = int(max_docs)
        self._seen = U64HashSet()
        self._warned_full = False
        self.stats = StageStats("exact_dedup")

    def __len__(self) -> int:
        """Number of unique documents stored."""
        return len(self._seen)

    @property
    def nbytes(self) -> int:
        """Bytes of the store (the hash table array)."""
        return self._seen.nbytes

    @property
    def bytes_per_doc(self) -> float:
        return self.nbytes / max(1, len(self._seen))

    def is_duplicate(self, text: str, source: str = "default") -> bool:
        """True if an equal (after normalisation) text was seen; otherwise remember it."""
        return bool(self.is_duplicate_batch([text], source)[0])

    def is_duplicate_batch(
        self, texts: Sequence[str], sources: Sequence[str] | str | None = None, *, normalized: bool = False
    ) -> np.ndarray:
        """Vectorised ``is_duplicate`` over a batch, in order (a later copy of an earlier text in
        the same batch is a duplicate). Returns a bool array. ``normalized=True``: the texts are
        already ``normalize_text``-ed."""
        srcs = per_doc_sources(sources, len(texts))
        keys = text_digests(texts, normalized)
        room = self.max_docs - len(self._seen)
        if keys.size <= room:
            dup = ~self._seen.add(keys)
            full = np.zeros(keys.size, dtype=bool)
        else:  # at the bound: one-by-one semantics, only the first `room` new digests are remembered
            dup = self._seen.contains(keys)
            new = np.flatnonzero(~dup)
            _, first = np.unique(keys[new], return_index=True)
            remembered = keys[np.sort(new[first])[: max(room, 0)]]
            self._seen.add(remembered)
            later = np.isin(keys[new], remembered)
            later[np.searchsorted(new, np.sort(new[first])[: max(room, 0)])] = False  # the remembered copy itself
            dup[new[later]] = True
            full = np.zeros(keys.size, dtype=bool)
            full[new[~np.isin(keys[new], remembered)]] = True
        count_by_source(self.stats, srcs, ~dup, "kept")
        count_by_source(self.stats, srcs, dup, "exact_dup")
        if full.any():
            count_by_source(self.stats, srcs, full, "index_full")
            self._warn_full()
        return dup

    def _warn_full(self) -> None:
        if self._warned_full:
            return
        self._warned_full = True
        import logging
        import warnings

        msg = (
            f"ExactDeduper index is full ({self.max_docs:,} documents, {self.nbytes / 2**20:.0f} MiB): later documents "
            "are still checked against it but no longer added, so copies among them will pass (counted as "
            "'index_full'). Raise dedup.exact_max_docs, or use a global index (`stacklm dedup-index`, dedup.index)."
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        logging.getLogger(__name__).warning(msg)

    def query_batch(self, texts: Sequence[str]) -> np.ndarray:
        """Which texts would be duplicates (nothing is added, nothing counted)."""
        return self._seen.contains(text_digests(texts))

    def state_dict(self) -> dict[str, Any]:
        """The table (one ``uint64`` array), its size and the small per-source counters."""
        return {**self._seen.state_dict(), "stats": self.stats.to_dict(), "warned_full": self._warned_full}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._seen.load_state_dict(state)
        self.stats.load_dict(state.get("stats", {}))
        self._warned_full = bool(state.get("warned_full", False))
