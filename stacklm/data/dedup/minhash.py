"""Near-duplicate detection: streaming MinHash + LSH banding over shingles.

What is compared: by default the set of character ``shingle_size``-grams of
``normalize_text(text)`` (the exact-dedup normalisation: NFKC, casefolded, whitespace
collapsed); with ``shingle="word"`` the set of word 5-grams as datatrove/FineWeb take them.
``stacklm.data.dedup.shingles`` says how each is formed and hashed (vectorised) and how short
documents are padded to one shingle (so empty documents are near-duplicates of each other).
The numbers below are for the default char 7-grams.

Defaults and their S-curve. ``num_bands=12`` x ``rows_per_band=10`` = 120 min-hashes over
7-character shingles. Two documents with Jaccard similarity J become candidates (and the later
one is dropped) with probability 1 - (1 - J^10)^12:

    J      0.30    0.40    0.50    0.60    0.70    0.75    0.80    0.85    0.90    0.95
    P   0.00007  0.0013  0.0117   0.070    0.29    0.50    0.74    0.93   0.994  0.99998

so pairs with J >= 0.9 are caught (>= 99.4%) and pairs with J < 0.5 are not (< 1.2%, 0.5% on
average over 0.4 <= J < 0.5); the 50% point is J = 0.75. Measured on stdlib documents with
injected edits (``bench/dedup.py``, edits from ``tests/helpers/synthetic_edits.py``), the candidate rate per J bin follows this curve, for short
documents too.

Why these numbers: 12 bands of 64-bit keys is what fits the 200 bytes/document index budget
(12 x 8 B at 50-75% table load = 128-192 B), and 10 rows is the shortest band that keeps
J = 0.5 near 1%. 7-character shingles (about a word and a half) keep unrelated documents far
apart: on random stdlib file pairs J is 0.01 at the median and < 0.07 at the 99th percentile
(5-grams: 0.03 / 0.10), where a pair becomes a candidate with probability ~3e-11.

Why not ``datasketch``: it hashes every shingle with SHA-1 in a Python loop and then evaluates
all ``num_perm`` permutations per shingle (O(n * num_perm)). Here, per batch of documents:

1. all texts are UTF-32 encoded into one ``uint32`` array and every shingle is hashed at once
   (``shingles``: a polynomial rolling hash, or word hashes combined per n-gram, then the
   murmur3 64-bit finaliser), in cache-sized chunks;
2. one-permutation hashing (OPH): the high 32 bits of a shingle's hash pick one of the 120
   bins and ``np.minimum.at`` keeps each bin's smallest hash, so the cost is O(n), not
   O(n * num_perm);
3. bins left empty (documents with fewer than ~600 shingles) are filled by re-hashing the
   document's shingles in ``_ROUNDS`` further rounds (all computed at once), each round's
   values ranked after the previous round's; then every shingle is hashed into every
   still-empty bin.
   Per bin this is a min-hash over the same expanded set for both documents, so
   P[bin values equal] = J exactly, and unlike copy-from-a-neighbour densification the bins of
   a short document stay nearly independent (so the S-curve above holds for short documents);
4. each band's 10 values are folded into one 64-bit key; the index is one ``U64HashSet`` of
   band keys (bands are salted, so one table serves all of them).

The index stores no document ids and no signatures: a kept document adds its 12 band keys and
a later document is a near-duplicate when any of its band keys is present. It is bounded by
``max_docs``: when full it warns once (``warnings`` + ``logging``), keeps answering queries,
stops inserting and counts every kept-but-not-indexed document as ``index_full``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from stacklm.data.dedup.exact import U64HashSet, count_by_source, per_doc_sources, run_starts
from stacklm.data.dedup.shingles import SHINGLES, _fmix64, default_shingle_size, make_shingles
from stacklm.data.stats import StageStats

logger = logging.getLogger(__name__)

DEFAULT_SHINGLE_SIZE = default_shingle_size("char")
DEFAULT_NUM_BANDS = 12
DEFAULT_ROWS_PER_BAND = 10
# Per worker: 2M kept documents cost at most 2M * 192 B = 384 MB of index.
DEFAULT_MAX_DOCS = 2_000_000

_EMPTY = np.uint64(0xFFFF_FFFF_FFFF_FFFF)  # an unfilled bin (a real hash equals it with p = 2^-64)
# Re-hash rounds for empty bins before the final every-shingle-to-every-bin round: enough that a
# 40-character document has ~15 empty bins left, few enough that the (rounds x shingles) array of
# a batch's short documents stays small.
_ROUNDS = 10
_CHUNK = 1 << 16  # (row, element) pairs per densification step: keeps temporaries small
_KEEP_SHINGLES = 1 << 20  # a batch with fewer shingles keeps them for densification instead of rehashing


def candidate_probability(jaccard: float | np.ndarray, num_bands: int = DEFAULT_NUM_BANDS, rows_per_band: int = DEFAULT_ROWS_PER_BAND):
    """The LSH S-curve: P[two documents with this Jaccard similarity share a band]."""
    return 1.0 - (1.0 - np.asarray(jaccard, dtype=np.float64) ** rows_per_band) ** num_bands


class MinHasher:
    """Shingle hashing, OPH signatures and band keys for one configuration (pure functions of
    the text and ``seed``: the same text gives the same keys in every process)."""

    def __init__(
        self,
        shingle_size: int | None = None,
        num_bands: int = DEFAULT_NUM_BANDS,
        rows_per_band: int = DEFAULT_ROWS_PER_BAND,
        seed: int = 0,
        shingle: str = "char",
    ) -> None:
        if shingle not in SHINGLES:
            raise ValueError(f"MinHasher shingle must be one of {SHINGLES}, got {shingle!r}")
        shingle_size = default_shingle_size(shingle) if shingle_size is None else shingle_size
        for name, value in (("shingle_size", shingle_size), ("num_bands", num_bands), ("rows_per_band", rows_per_band)):
            if int(value) < 1:
                raise ValueError(f"MinHasher {name} must be >= 1, got {value}")
        self.shingle = shingle
        self.shingle_size = int(shingle_size)
        self.num_bands = int(num_bands)
        self.rows_per_band = int(rows_per_band)
        self.num_perm = self.num_bands * self.rows_per_band
        self.seed = int(seed)
        rng = np.random.default_rng([0x5EED, self.seed])

        def draw(n: int) -> np.ndarray:  # random odd 64-bit constants
            return rng.integers(0, 2**63, size=n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)

        base = int(draw(1)[0])  # the char path's rolling-hash base; drawn first for both kinds, so the draws below are the same
        self.shingles = make_shingles(shingle, self.shingle_size, base)
        self._round_salt = draw(_ROUNDS + 2)  # [0] tags rows when deduplicating elements
        self._bin_salt = draw(self.num_perm)
        self._band_salt = draw(self.num_bands)
        self._row_mult = draw(self.num_perm).reshape(self.num_bands, self.rows_per_band)

    def config(self) -> dict[str, int | str]:
        return {"shingle": self.shingle, "shingle_size": self.shingle_size, "num_bands": self.num_bands,
                "rows_per_band": self.rows_per_band, "seed": self.seed}

    # -- shingles ------------------------------------------------------------------------
    def prepare(self, text: str, normalized: bool = False) -> str:
        """The text as its shingles are taken (``shingles``): normalised, padded to one shingle."""
        return self.shingles.prepare(text, normalized)

    def _passes(self, texts: Sequence[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(row, shingle hash) arrays of prepared texts, a bounded number of characters at a time."""
        return self.shingles.passes(texts)

    def shingle_set(self, text: str) -> np.ndarray:
        """Sorted unique 64-bit shingle hashes of ``text``: the set the signatures estimate
        (use with ``jaccard`` for ground truth)."""
        hashes = np.sort(np.concatenate([h for _, h in self._passes([self.prepare(text)])]))
        return hashes[run_starts(hashes)]

    # -- signatures ----------------------------------------------------------------------
    def signatures(self, texts: Sequence[str], normalized: bool = False) -> np.ndarray:
        """(len(texts), num_perm) ``uint64`` OPH signatures (see module docstring). A bin holds
        the minimum 64-bit shingle hash among the shingles the high bits sent there."""
        prepared = [self.prepare(t, normalized) for t in texts]
        n_docs, n_bins = len(prepared), self.num_perm
        sig = np.full(n_docs * n_bins, _EMPTY, dtype=np.uint64)
        cached: list[tuple[np.ndarray, np.ndarray]] | None = []  # shingles, reused by _densify
        n_cached = 0
        for rows, hashes in self._passes(prepared):
            np.minimum.at(sig, self._flat_bins(hashes, rows), hashes)
            if cached is not None:
                n_cached += hashes.size
                if n_cached <= _KEEP_SHINGLES:
                    cached.append((rows, hashes))
                else:
                    cached = None
        sig = sig.reshape(n_docs, n_bins)
        sparse = np.flatnonzero((sig == _EMPTY).any(axis=1))
        if sparse.size:
            if cached is None:  # too big a batch to cache: hash the short documents again
                shingles = list(self._passes([prepared[i] for i in sparse]))
            else:
                renumber = np.full(n_docs, -1, dtype=np.int64)
                renumber[sparse] = np.arange(sparse.size)
                shingles = []
                for rows, hashes in cached:
                    mine = renumber[rows]
                    shingles.append((mine[mine >= 0], hashes[mine >= 0]))
            self._densify(sig, sparse, shingles)
        return sig

    def _flat_bins(self, hashes: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Index into a flat (rows, num_perm) array: bin = high 32 bits * num_perm >> 32."""
        flat = hashes >> np.uint64(32)
        np.multiply(flat, np.uint64(self.num_perm), out=flat)
        np.right_shift(flat, np.uint64(32), out=flat)
        flat = flat.view(np.int64)  # < 2^32, so the reinterpretation is exact
        flat += rows * self.num_perm  # rows broadcasts over leading axes
        return flat

    def _densify(self, sig: np.ndarray, sparse_rows: np.ndarray, shingles: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Fill empty bins of short documents (step 3 of the module docstring); ``shingles`` are
        their (row in ``sparse_rows``, hash) arrays. Only bins that are still empty are written,
        so earlier stages always take precedence."""
        n_rows = sparse_rows.size
        sub = sig[sparse_rows].reshape(-1)  # a copy; written back at the end
        # unique (row, shingle) elements, sorted by row
        rows_l, hashes_l = [], []
        for rows, hashes in shingles:
            # XOR-ing in row * odd constant makes (row, hash) pairs one sortable key (a false
            # match needs a 64-bit hash coincidence); one argsort is ~10x faster than a lexsort.
            keyed = hashes ^ (rows.astype(np.uint64) * self._round_salt[0])
            order = np.argsort(keyed)
            fresh = np.sort(order[run_starts(keyed[order])])  # back in row order
            rows_l.append(rows[fresh])
            hashes_l.append(hashes[fresh])
        rows, hashes = np.concatenate(rows_l), np.concatenate(hashes_l)
        # All re-hash rounds at once: bin i takes the lexicographically smallest (round, hash),
        # i.e. exactly what running the rounds one after the other until it fills would give.
        empty = sub == _EMPTY
        fill = np.full(sub.size, _EMPTY, dtype=np.uint64)
        round_rank = np.arange(_ROUNDS, dtype=np.uint64)[:, None] << np.uint64(59)
        step = _CHUNK // 2  # elements per step: keeps the (rounds x elements) temporaries small
        for s in range(0, hashes.size, step):
            h = hashes[None, s : s + step] ^ self._round_salt[1 : _ROUNDS + 1, None]  # (rounds, elements)
            _fmix64(h)
            flat = self._flat_bins(h, rows[s : s + step])
            h >>= np.uint64(5)
            h |= round_rank
            np.minimum.at(fill, flat.ravel(), h.ravel())
        sub[empty] = fill[empty]
        empty = sub == _EMPTY
        er, eb = np.divmod(np.flatnonzero(empty), self.num_perm)
        if er.size:  # every element of the row into every still-empty bin
            counts = np.bincount(rows, minlength=n_rows)
            starts = np.cumsum(counts) - counts
            per_pair = counts[er]
            pair_of = np.repeat(np.arange(er.size), per_pair)
            offset = np.arange(pair_of.size) - np.repeat(np.cumsum(per_pair) - per_pair, per_pair)
            elem = starts[er][pair_of] + offset
            bins = eb[pair_of]
            h = _fmix64(hashes[elem] ^ self._bin_salt[bins])
            fill = np.full(sub.size, _EMPTY, dtype=np.uint64)
            np.minimum.at(fill, er[pair_of] * self.num_perm + bins, h)
            sub[empty] = fill[empty]
        sig[sparse_rows] = sub.reshape(n_rows, -1)

    def band_keys(self, sig: np.ndarray) -> np.ndarray:
        """(n_docs, num_bands) nonzero ``uint64`` keys. A band's values are combined with random
        odd multipliers (a universal hash of the tuple, mod 2^64), salted per band so one table
        serves all bands, then avalanched."""
        bands = sig.reshape(sig.shape[0], self.num_bands, self.rows_per_band)
        keys = (bands * self._row_mult).sum(axis=2, dtype=np.uint64) + self._band_salt
        _fmix64(keys)
        keys[keys == 0] = 1
        return keys

    def keys(self, texts: Sequence[str], normalized: bool = False) -> np.ndarray:
        return self.band_keys(self.signatures(texts, normalized))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Exact Jaccard similarity of two sorted unique arrays (e.g. ``MinHasher.shingle_set``)."""
    inter = np.intersect1d(a, b, assume_unique=True).size
    union = a.size + b.size - inter
    return inter / union if union else 1.0


def share_a_band(keys_a: np.ndarray, keys_b: np.ndarray) -> np.ndarray:
    """Row-wise: do two documents' band keys collide in any band (LSH candidates)?"""
    return (np.asarray(keys_a) == np.asarray(keys_b)).any(axis=-1)


class NearDeduper:
    """Streaming near dedup: a document is a near-duplicate when it shares an LSH band with a
    previously kept document; kept documents are added to a bounded index.

    ``stats`` (``StageStats("near_dedup")``) counts per source ``kept``, ``near_dup`` and
    ``index_full`` (kept documents that could not be indexed because the index held
    ``max_docs``; they are part of ``kept``, not a drop).
    """

    def __init__(
        self,
        shingle_size: int | None = None,
        num_bands: int = DEFAULT_NUM_BANDS,
        rows_per_band: int = DEFAULT_ROWS_PER_BAND,
        max_docs: int = DEFAULT_MAX_DOCS,
        seed: int = 0,
        shingle: str = "char",
    ) -> None:
        if int(max_docs) < 1:
            raise ValueError(f"NearDeduper max_docs must be >= 1, got {max_docs}")
        self.hasher = MinHasher(shingle_size, num_bands, rows_per_band, seed, shingle=shingle)
        self.max_docs = int(max_docs)
        self._index = U64HashSet()
        self.n_indexed = 0
        self.n_unindexed = 0
        self._warned_full = False
        self.stats = StageStats("near_dedup")

    def __len__(self) -> int:
        """Documents in the index."""
        return self.n_indexed

    @property
    def nbytes(self) -> int:
        return self._index.nbytes

    @property
    def bytes_per_doc(self) -> float:
        """Index bytes per indexed (kept) document."""
        return self.nbytes / max(1, self.n_indexed)

    @property
    def is_full(self) -> bool:
        return self.n_indexed >= self.max_docs

    def is_duplicate(self, text: str, source: str = "default") -> bool:
        """Query, then index the document if it is not a near-duplicate."""
        return bool(self.is_duplicate_batch([text], source)[0])

    def query_batch(self, texts: Sequence[str]) -> np.ndarray:
        """Which texts would be near-duplicates of indexed documents (nothing inserted or counted)."""
        keys = self.hasher.keys(texts)
        return self._index.contains(keys.ravel()).reshape(keys.shape).any(axis=1)

    def is_duplicate_batch(
        self, texts: Sequence[str], sources: Sequence[str] | str | None = None, *, normalized: bool = False
    ) -> np.ndarray:
        """Vectorised ``is_duplicate``: the same decisions as calling it on each text in order
        (a text is also checked against earlier texts of the batch that were indexed).
        ``normalized=True``: the texts are already ``normalize_text``-ed (saves a second pass
        when exact dedup normalised them first)."""
        srcs = per_doc_sources(sources, len(texts))
        if not len(texts):
            return np.zeros(0, dtype=bool)
        keys = self.hasher.keys(texts, normalized)
        dup, indexed = self._decide(keys)
        unindexed = ~dup & ~indexed
        if indexed.any():
            self._index.add(keys[indexed].ravel())
            self.n_indexed += int(indexed.sum())
        count_by_source(self.stats, srcs, ~dup, "kept")
        count_by_source(self.stats, srcs, dup, "near_dup")
        if unindexed.any():
            self.n_unindexed += int(unindexed.sum())
            count_by_source(self.stats, srcs, unindexed, "index_full")
            self._warn_full()
        return dup

    def _decide(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(duplicate, to_index) masks with one-by-one semantics."""
        n_docs = keys.shape[0]
        dup = self._index.contains(keys.ravel()).reshape(keys.shape).any(axis=1)
        room = self.max_docs - self.n_indexed
        earlier = _earlier_sharing(keys, np.flatnonzero(~dup))
        if not earlier:  # no two new documents of the batch share a band: no ordering effects
            kept = np.flatnonzero(~dup)
            indexed = np.zeros(n_docs, dtype=bool)
            indexed[kept[: max(room, 0)]] = True
            return dup, indexed
        indexed = np.zeros(n_docs, dtype=bool)
        for j in np.flatnonzero(~dup):
            if any(indexed[i] for i in earlier.get(int(j), ())):
                dup[j] = True
            elif room > 0:
                indexed[j] = True
                room -= 1
        return dup, indexed

    def _warn_full(self) -> None:
        if self._warned_full:
            return
        self._warned_full = True
        msg = (
            f"NearDeduper index is full ({self.max_docs:,} documents, {self.nbytes / 2**20:.0f} MiB): "
            "later documents are still checked against it but no longer added, so near-duplicates "
            "among them will pass (counted as 'index_full' in the stats). Raise max_docs or shard "
            "the stream over more workers."
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        logger.warning(msg)

    def state_dict(self) -> dict[str, Any]:
        """The index (one ``uint64`` array), a few ints, the hashing config and the counters."""
        return {
            **self._index.state_dict(),
            "config": self.hasher.config(),
            "n_indexed": self.n_indexed,
            "n_unindexed": self.n_unindexed,
            "warned_full": self._warned_full,
            "stats": self.stats.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; the hashing configuration must match (``max_docs`` is this object's own)."""
        # a state saved before word shingles existed has no "shingle": it was made with char shingles
        saved = {k: v if k == "shingle" else int(v) for k, v in {"shingle": "char", **state["config"]}.items()}
        mine = self.hasher.config()
        if saved != mine:
            diff = ", ".join(f"{k}={saved.get(k)} (this deduper: {v})" for k, v in mine.items() if saved.get(k) != v)
            args = ", ".join(f"{k}={v}" for k, v in saved.items())
            raise ValueError(f"NearDeduper state was made with {diff}; construct NearDeduper({args}) to resume it")
        self._index.load_state_dict(state)
        self.n_indexed = int(state["n_indexed"])
        self.n_unindexed = int(state["n_unindexed"])
        self._warned_full = bool(state["warned_full"])
        self.stats.load_dict(state.get("stats", {}))


def _earlier_sharing(keys: np.ndarray, rows: np.ndarray) -> dict[int, set[int]]:
    """For each of ``rows`` that shares a band key with an earlier one of ``rows``: those
    earlier rows. Empty in the common case (no near-duplicates inside the batch)."""
    if rows.size < 2:
        return {}
    flat = keys[rows].ravel()
    owner = np.repeat(rows, keys.shape[1])
    order = np.argsort(flat, kind="stable")  # stable: owners stay in batch order per key
    flat, owner = flat[order], owner[order]
    head = run_starts(flat)
    if head.all():
        return {}
    earlier: dict[int, set[int]] = {}
    starts = np.flatnonzero(head)
    ends = np.append(starts[1:], flat.size)
    for s, e in zip(starts[ends - starts > 1], ends[ends - starts > 1]):
        group = [int(o) for o in owner[s:e]]
        for i, j in enumerate(group):
            if i:
                earlier.setdefault(j, set()).update(o for o in group[:i] if o != j)
    return earlier
