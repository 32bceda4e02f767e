"""Dedup that does not depend on parallelism: signatures per slice, one global decision, and
the list of removed document ids (``DedupIndex``) that the packing jobs and stream mode drop.

Why: a streaming deduper only sees the documents of its own reader, so with N prebuild
workers (or N datatrove tasks, or ranks x DataLoader workers) two copies read by two readers
both survive and the removed count changes with N. The global pass follows datatrove's
multi-stage MinHash (signatures -> buckets -> clusters -> filter) in three steps:

1. **signatures** (``collect_signatures``, parallel, one call per reader slice): every
   document after holdout and quality filter gets a stable id (its ``doc_id``: source, part,
   row), the 64-bit digest of its normalised text (exact dedup) and its MinHash band keys
   (``MinHasher``, the same as the streaming near deduper). Pure functions of the text, so
   the union over any slicing is the same set of records.
2. **decision** (``decide_splits`` here, one process holding every record: the reference rule;
   what the commands run is ``decision.staged_decision``/the datatrove stages, the same removed
   ids with memory bounded by a share of the verified pairs; all splits together so that no
   duplicate set keeps members in two splits: the val copy wins, train copies are
   ``cross_split``): records are put in a canonical order that does not depend on the
   slicing (split, mix entry, part label, row). Exact: sorted by (digest, canonical
   position), the first of each digest is kept. Near: for every band, documents with equal
   band keys form a bucket; each candidate pair is *verified* on the whole MinHash signature
   (``verify``: at least ``dedup.near_threshold`` of the values equal) and a document is
   removed only for an earlier *kept* document it is verified-similar to
   (``verify.first_fit``). Unlike datatrove's connected components this does not chain: with
   A~B and B~C but not A~C, B is removed for A and C stays.
3. **filter**: the ids removed are kept as sorted 64-bit xxh3 digests of the ``doc_id``
   (8 bytes per *removed* document, read-only, never part of a checkpoint); ``DedupNode``
   drops a document whose id digest is listed and counts it as ``exact_dup``/``near_dup``/
   ``cross_split_dup``.

A false drop needs a 64-bit collision between a kept document's id and a removed one's:
about n_kept * n_removed / 2^64 (2e-6 at 20M x 2M).
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from stacklm.data.dedup.exact import in_sorted, run_starts, text_digest
from stacklm.data.dedup.minhash import MinHasher
from stacklm.data.quality.normalize import normalize_text
from stacklm.errors import ConfigError

INDEX_FORMAT = "stacklm-dedup-index"
INDEX_VERSION = 2  # 2: records the corpus fingerprint and the decision's inputs (``check_bound``)
_BATCH = 256
REASONS = ("exact", "near", "cross_split")  # DedupIndex.lookup codes 1, 2, 3
# The split whose copy a cross-split duplicate set keeps comes first (``decide_splits``).
SPLIT_PRIORITY = ("val", "train")


def id_key(doc_id: str) -> int:
    """Nonzero 64-bit digest of a document id (what the index stores)."""
    return xxhash.xxh3_64_intdigest(str(doc_id).encode("utf-8", "surrogatepass")) or 1


def id_keys(doc_ids: Iterable[str]) -> np.ndarray:
    return np.fromiter((id_key(d) for d in doc_ids), dtype=np.uint64)


def _split_id(doc_id: str) -> tuple[str, int]:
    """(part prefix, row) of ``source/part/row``; ids without a numeric row sort by the id."""
    prefix, _, row = str(doc_id).rpartition("/")
    try:
        return prefix, int(row)
    except ValueError:
        return str(doc_id), -1


def collect_signatures(docs: Iterable[dict], source_index: Mapping[str, int], hasher: MinHasher | None, exact: bool = True) -> dict[str, Any]:
    """Step 1 over one reader slice: ``docs`` are the documents after holdout and filter.

    Returns plain arrays (picklable, ``np.savez``-able): ``ids`` (the doc_id strings),
    ``source`` (index in the mix), ``row``, ``digest`` (exact, 0 when off), ``bands``
    ((n, num_bands) MinHash band keys, (n, 0) when near dedup is off) and ``minhash`` ((n,
    num_perm) uint32: the low 32 bits of each MinHash value, what verification compares).
    """
    ids: list[str] = []
    src: list[int] = []
    digests: list[int] = []
    bands: list[np.ndarray] = []
    values: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        if hasher is not None and batch:
            sig = hasher.signatures(batch, normalized=True)
            bands.append(hasher.band_keys(sig))
            values.append((sig & np.uint64(0xFFFF_FFFF)).astype(np.uint32))
        batch.clear()

    for doc in docs:
        text = normalize_text(doc["text"])
        ids.append(str(doc["doc_id"]))
        src.append(int(source_index[doc["source"]]))
        digests.append(text_digest(text, normalized=True) if exact else 0)
        if hasher is not None:
            batch.append(text)
            if len(batch) >= _BATCH:
                flush()
    flush()
    nb = hasher.num_bands if hasher is not None else 0
    npm = hasher.num_perm if hasher is not None else 0
    return {
        "ids": np.array(ids, dtype=str),
        "source": np.array(src, dtype=np.int32),
        "digest": np.array(digests, dtype=np.uint64),
        "bands": np.concatenate(bands) if bands else np.zeros((len(ids), nb), dtype=np.uint64),
        "minhash": np.concatenate(values) if values else np.zeros((len(ids), npm), dtype=np.uint32),
    }


def near_edges(bands: np.ndarray, minhash: np.ndarray, threshold: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The verified edges (``verify.star_edges``) among documents in canonical order: per band,
    its buckets (equal keys, members in canonical order). Returns ``(lo, hi, equal)``, distinct."""
    from stacklm.data.dedup.verify import equal_counts, need_equal, star_edges

    need = need_equal(threshold, minhash.shape[1])
    los, his, eqs = [], [], []
    for b in range(bands.shape[1]):
        order = np.argsort(bands[:, b], kind="stable")  # stable: canonical order inside a bucket
        head = run_starts(bands[order, b])
        bucket = np.cumsum(head) - 1
        size = np.bincount(bucket)
        multi = size[bucket] > 1
        rows, bucket = order[multi], bucket[multi]
        lo, hi, eq, _ = star_edges(bucket, lambda x, y: equal_counts(minhash, rows[x], rows[y]), need)
        los.append(rows[lo])
        his.append(rows[hi])
        eqs.append(eq)
    if not los:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    lo, hi, eq = np.concatenate(los), np.concatenate(his), np.concatenate(eqs)
    _, first = np.unique(lo * (hi.max(initial=0) + 1) + hi, return_index=True)  # an edge found in several bands once
    return lo[first], hi[first], eq[first]


def decide(parts: Sequence[Mapping[str, Any]], exact: bool = True, near: bool = True, threshold: float | None = None) -> dict[str, Any]:
    """Step 2 for one split alone: ``decide_splits`` over ``{"": parts}``.

    Returns ``{"exact": ids removed as exact copies, "near": ids removed as near copies,
    "kept_of": {removed id: the id it duplicates}, "docs": records seen}`` (ids as strings).
    """
    out = decide_splits({"": parts}, exact, near, priority=("",), threshold=threshold)[""]
    return {k: out[k] for k in ("exact", "near", "kept_of", "similarity", "docs")}


def decide_splits(
    slices: Mapping[str, Sequence[Mapping[str, Any]]], exact: bool = True, near: bool = True, priority: Sequence[str] = SPLIT_PRIORITY,
    threshold: float | None = None,
) -> dict[str, dict[str, Any]]:
    """Step 2: one global decision over the signature records of every slice of every split.

    Duplicate sets are found across splits, so no set keeps members in two splits (a copy in
    train of a val document would leak the eval set into training). The kept copy of a set is
    its first record in the canonical order (split in ``priority`` order, then mix entry,
    part, row): with the default priority a set with a val member keeps a val copy and loses
    every train copy. Why val wins: the val split is the holdout's sample, and keeping it
    whole keeps the eval set the same whatever the train corpus holds; the train side loses
    only documents the model would otherwise also see at eval time. A record removed because
    its kept copy is in another split is ``cross_split`` (the ledger's
    ``dedup/cross_split_dup``), else ``exact`` or ``near``. Near copies are verified
    (``verify``): an edge needs ``threshold`` (default ``verify.DEFAULT_THRESHOLD``) of equal
    MinHash values, and a document is removed only for a *kept* document it has an edge to
    (``verify.first_fit``: no chaining). This is the reference: ``staged`` makes the same
    decision in bounded memory.

    Returns per split ``{"exact", "near", "cross_split": removed ids, "kept_of": {removed id:
    kept id}, "similarity": {removed id: estimated Jaccard with it (1.0 exact)}, "docs":
    records seen}``.
    """
    from stacklm.data.dedup.verify import DEFAULT_THRESHOLD, first_fit

    threshold = DEFAULT_THRESHOLD if threshold is None else threshold
    order_of = {s: i for i, s in enumerate(priority)}
    names = sorted(slices, key=lambda s: (order_of.get(s, len(order_of)), s))
    rank_of = {s: i for i, s in enumerate(names)}
    parts = [(rank_of[s], p) for s in names for p in slices[s]]
    n = sum(len(p["ids"]) for _, p in parts)
    if n == 0:
        return {s: {"exact": [], "near": [], "cross_split": [], "kept_of": {}, "similarity": {}, "docs": 0} for s in names}
    ids = np.concatenate([np.asarray(p["ids"], dtype=str) for _, p in parts])
    group = np.concatenate([np.full(len(p["ids"]), r, dtype=np.int32) for r, p in parts])
    source = np.concatenate([np.asarray(p["source"]) for _, p in parts])
    digest = np.concatenate([np.asarray(p["digest"], dtype=np.uint64) for _, p in parts])
    bands = np.concatenate([np.asarray(p["bands"], dtype=np.uint64) for _, p in parts])
    minhash = np.concatenate([np.asarray(p["minhash"], dtype=np.uint32).reshape(len(p["ids"]), -1) for _, p in parts]) if near else None
    split = [_split_id(d) for d in ids.tolist()]
    prefixes = np.array([s[0] for s in split], dtype=str)
    rows = np.array([s[1] for s in split], dtype=np.int64)
    _, prefix_rank = np.unique(prefixes, return_inverse=True)
    canon = np.lexsort((rows, prefix_rank, source, group))  # canonical order: split, mix entry, part, row
    ids, group, digest, bands = ids[canon], group[canon], digest[canon], bands[canon]
    minhash = minhash[canon] if minhash is not None else None
    for r in range(len(names)):
        mine = ids[group == r]
        if np.unique(mine).size != mine.size:
            raise ValueError(f"dedup signatures: a document id was recorded twice in split {names[r]!r}; the slices overlap (check the shard specs)")
    kept_of = np.arange(n)
    similarity = np.ones(n, dtype=np.float64)
    removed_exact = np.zeros(n, dtype=bool)
    if exact:
        order = np.argsort(digest, kind="stable")  # stable: canonical order within a digest
        head = run_starts(digest[order])
        first = order[np.maximum.accumulate(np.where(head, np.arange(n), 0))]
        dup = order[~head]
        removed_exact[dup] = True
        kept_of[order] = first
    removed_near = np.zeros(n, dtype=bool)
    if near and bands.shape[1]:
        # exact copies are in every bucket of the copy they keep, never before it: they are
        # bucketed like any document and never kept (``removed_before``)
        lo, hi, eq = near_edges(bands, minhash, threshold)
        idkey = id_keys(ids.tolist())
        removed_near, _, _ = first_fit(n, lo, hi, eq, removed_exact, tiebreak=idkey)
        # the kept document a removal names (and so its reason, when it is in another split):
        # a *root* (no earlier verified neighbour at all) when it has one, else the best kept
        # one: the one with the most equal values, ties the smallest id digest. ``staged``
        # names the same: it removes for roots first, then decides the rest.
        live = ~removed_exact[lo] & ~removed_exact[hi]
        root = np.ones(n, dtype=bool)
        root[hi[live]] = False
        take = live & removed_near[hi] & ~removed_near[lo]
        order = np.lexsort((idkey[lo[take]], -eq[take], ~root[lo[take]], hi[take]))
        first = run_starts(hi[take][order])
        d, c, e = hi[take][order][first], lo[take][order][first], eq[take][order][first]
        kept_of[d] = c
        similarity[d] = e / minhash.shape[1]
        # an exact copy whose kept copy is itself removed as a near copy is removed for what
        # that one was removed for (kept, and at the same similarity): a near removal
        moved = removed_exact & removed_near[kept_of]
        kept_of[moved], similarity[moved] = kept_of[kept_of[moved]], similarity[kept_of[moved]]
        removed_exact &= ~moved
        removed_near |= moved
    removed = removed_exact | removed_near
    cross = removed & (group[kept_of] != group)
    out = {}
    for r, name in enumerate(names):
        here = group == r
        sel = np.flatnonzero(here & removed)
        out[name] = {
            "exact": ids[here & removed_exact & ~cross].tolist(),
            "near": ids[here & removed_near & ~cross].tolist(),
            "cross_split": ids[here & cross].tolist(),
            "kept_of": {ids[i]: ids[kept_of[i]] for i in sel.tolist()},
            "similarity": {ids[i]: float(similarity[i]) for i in sel.tolist()},
            "docs": int(here.sum()),
        }
    return out


def read_meta_npz(path: Path, fmt: str, what: str, missing: str, fix: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(the JSON ``meta`` member without format and version, the other arrays) of an ``.npz``
    written as the index and its evidence are; data only (``allow_pickle=False``). A missing file
    is the ``ConfigError`` ``missing``; anything but a ``fmt`` file is ``"{what} (detail); {fix}"``."""
    import json

    from stacklm.data.storage.statefile import load_error_detail

    try:
        with np.load(path, allow_pickle=False) as z:
            meta, arrays = json.loads(bytes(z["meta"]).decode()), {k: z[k] for k in z.files if k != "meta"}
    except FileNotFoundError:
        raise ConfigError(missing) from None
    except Exception as e:
        raise ConfigError(f"{what} ({load_error_detail(e, path)}); {fix}") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ConfigError(f"{what} (format {found!r}); {fix}")
    return {k: v for k, v in meta.items() if k not in ("format", "version")}, arrays


class DedupIndex:
    """The removed document ids of a global dedup pass, per split: sorted ``uint64`` digests of
    the ids removed as exact and as near duplicates, plus what built them (``meta``).

    Read-only at run time, so it never goes into a checkpoint; ``content_hash`` names it.
    """

    def __init__(self, splits: Mapping[str, Mapping[str, np.ndarray]], meta: Mapping[str, Any] | None = None) -> None:
        self.splits = {
            s: {r: np.sort(np.asarray(per.get(r, np.zeros(0, np.uint64)), dtype=np.uint64)) for r in REASONS}
            for s, per in splits.items()
        }
        self.meta = dict(meta or {})

    @classmethod
    def from_decisions(cls, decisions: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any] | None = None) -> DedupIndex:
        return cls({s: {r: id_keys(d.get(r, ())) for r in REASONS} for s, d in decisions.items()}, meta)

    def lookup(self, split: str, keys: np.ndarray) -> np.ndarray:
        """Per id digest: 0 kept, 1 removed as an exact copy, 2 as a near copy, 3 as a copy of a
        document kept in another split (``cross_split``)."""
        keys = np.asarray(keys, dtype=np.uint64)
        out = np.zeros(keys.size, dtype=np.int8)
        per = self.splits.get(split)
        if per is None:
            raise KeyError(f"dedup index has no split {split!r} (it holds {sorted(self.splits)}); rebuild it with that split")
        for code, reason in enumerate(REASONS, start=1):
            table = per[reason]
            out[in_sorted(keys, table)] = code
        return out

    def counts(self) -> dict[str, dict[str, int]]:
        return {s: {r: int(a.size) for r, a in per.items()} for s, per in self.splits.items()}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for per in self.splits.values() for a in per.values())

    def to_bytes(self) -> bytes:
        import json

        buf = io.BytesIO()
        arrays = {f"{s}__{r}": a for s, per in sorted(self.splits.items()) for r, a in sorted(per.items())}
        meta = {"format": INDEX_FORMAT, "version": INDEX_VERSION, **self.meta}
        np.savez(buf, meta=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8), **arrays)
        return buf.getvalue()

    @property
    def content_hash(self) -> str:
        h = hashlib.sha256()
        for s, per in sorted(self.splits.items()):
            for r, a in sorted(per.items()):
                h.update(f"{s}/{r}/{a.size};".encode())
                h.update(a.tobytes())
        return h.hexdigest()

    def save(self, path: str | Path) -> None:
        from stacklm.atomic import atomic_write_bytes

        atomic_write_bytes(Path(path), self.to_bytes())

    @classmethod
    def load(cls, path: str | Path, fix: str | None = None) -> DedupIndex:
        """The index at ``path`` (data only: ``allow_pickle=False``, so a pickle or an object
        array in its place is refused, never run). ``fix`` ends the error of an unreadable file
        (default: rebuild it with ``stacklm dedup-index``, for the ``dedup.index`` setting)."""
        path = Path(path)
        fix = fix or "rebuild it with `stacklm dedup-index`"
        meta, arrays = read_meta_npz(path, INDEX_FORMAT, f"dedup.index: {path} is not a stacklm dedup index",
                                     f"dedup.index: {path} does not exist; build it with `stacklm dedup-index --config C.yaml --out {path}`", fix)
        splits: dict[str, dict[str, np.ndarray]] = {}
        for key, a in arrays.items():
            s, _, r = key.partition("__")
            splits.setdefault(s, {})[r] = a
        return cls(splits, meta)


def decision_inputs(config) -> dict[str, Any]:
    """What, besides the corpus, decides which documents a dedup pass sees at which id: the
    split assignment (``seed``, ``holdout_fraction``), the quality filter (the config's and
    each source's rule set) and decontamination. JSON-normalised (what the index's meta holds)."""
    import json

    inputs = {
        "seed": config.seed,
        "holdout_fraction": config.holdout_fraction,
        "filters": config.filters.to_dict(),
        "source_filters": {e.name: e.filter_rules() for e in config.mix.entries},
        "decontaminate": None if config.decontaminate is None else config.decontaminate.to_dict(),
    }
    return json.loads(json.dumps(inputs, sort_keys=True))


def binding_meta(config) -> dict[str, Any]:
    """The meta a stream-mode index records to be bound to its inputs (``check_bound``):
    ``corpus`` (``sources.fingerprint.corpus_fingerprint``) and ``inputs`` (``decision_inputs``)."""
    from stacklm.data.sources.fingerprint import corpus_fingerprint

    return {"corpus": corpus_fingerprint(config.mix.entries), "inputs": decision_inputs(config)}


def check_bound(index: DedupIndex, config, path: str | Path, what: str | None = None, fix: str | None = None) -> None:
    """Refuse, in one line naming the source and file (or the setting), an index built from
    another corpus or with other decision inputs than ``config`` has: its ids are positions
    (``source/part/row``), so applied to anything else it drops the wrong documents. Cost: a
    stat per corpus file, and at most 32 small reads of each the first time a process sees it
    (``sources.fingerprint``)."""
    from stacklm.data.sources.fingerprint import check_corpus

    fix = fix or f"rebuild it for this config (`stacklm dedup-index --config C.yaml --out {path}`)"
    what = what or f"dedup.index: {path}"
    check_corpus(index.meta.get("corpus"), config.mix.entries, what, fix)
    recorded, now = index.meta.get("inputs") or {}, decision_inputs(config)
    for name in sorted(now):
        if recorded.get(name) != now[name]:
            setting = name if name in ("seed", "holdout_fraction") else {"source_filters": "a source's filters"}.get(name, name)
            raise ConfigError(f"{what} was built with {setting} {recorded.get(name)!r}, this config has {now[name]!r} "
                              f"(it decides which documents the index's ids name); {fix}")


def load_bound(path: str | Path, config) -> DedupIndex:
    """``DedupIndex.load(path)`` checked against ``config`` (``check_bound``): what stream mode's
    ``dedup.index`` setting loads."""
    index = DedupIndex.load(path)
    check_bound(index, config, path)
    return index
