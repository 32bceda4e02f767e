"""The global dedup decision as parallel stages, in the shape of datatrove's MinHash dedup.

``decide_splits`` (``global_index``) is one process holding every record of every split:
~1-2 GB per million documents, killed for memory at 20M. Here the same decision runs as

1. **signatures** (one task per (split, reader) slice; ``write_signature_dir``): the slice's
   records as plain ``.npy`` columns in ``DIR/<job>/``: per band the band keys *sorted*, with
   the local record index beside them (``band<b>_key/_idx``), the same for the exact digest
   (``digest_key/_idx``), and per record what the kept-copy rule and the index need
   (``source``, ``prefix`` into the slice's small part table ``prefixes``, ``row``, ``idkey``).
2. **buckets** (``bucket_pairs``; one task per (band, key range) and per digest range): reads
   from every slice only the rows of its key range (``searchsorted`` on memory-mapped sorted
   columns) and writes, for every key shared by two or more records, the duplicate pairs
   (first member, other member) as ``(file << 40 | row)`` node ids. Its memory is bounded by
   ``chunk`` records whatever the corpus size: a range holding more is processed in key
   sub-ranges (keys are hashes, so sub-ranges split evenly and a bucket never straddles two).
3. **cluster** (``cluster_pairs``, one task): union-find over the pairs only (vectorised
   min-label propagation with pointer jumping), so it holds the distinct duplicate pairs
   (``load_pair_files``: a set seen in several bands is held once) and the documents in them,
   never every document. The kept copy of a set is its smallest
   *canonical* key (split priority, mix entry, part label, row), looked up for the paired
   documents only from the memory-mapped slice columns: the same rule as ``decide_splits``,
   so the removed ids are identical to the single-process decision and to each other for
   every task count (the ``file`` of a node id depends on the slicing; the rule never looks
   at it). A set with members in two splits keeps its val copy, the others are
   ``cross_split``.
4. **removed ids, sharded**: the cluster writes one ``DedupIndex`` per slice
   (``<job>.npz``, only that slice's removed ids), and the packing task of that slice, which
   reads exactly the documents the signature task of the same (split, reader) read, loads only
   its own shard (``load_shards`` merges them back, for the manifest's totals and hash).

Exact dedup by digest ranges the same way: each digest-range task writes the pairs of equal
digests; the cluster keeps the canonical first of each digest set (exact) and runs the near
clusters over the band pairs, where an exact copy shares every band with its kept copy, so
the near sets over all documents are those ``decide_splits`` finds among the exact survivors.

Why not datatrove's ``MinhashDedupSignature``/``Buckets``/``Cluster``/``Filter`` themselves:
(a) their signatures shingle and normalise the text their own way, and ours must be the
stream path's (``MinHasher`` with the config's ``dedup.shingle``: the offline index and in-flight dedup
decide on the same keys); (b) their cluster keeps the union-by-size root of ``(file, doc)``
ids, where ``file`` is the task rank, so the kept copy changes with the task count; (c) no
rule across splits (val wins); (d) their bucket step merges the files in a Python heap, one
Python object per document and band, where this sorts numpy arrays. The stage boundaries,
the per-band/per-range task split and the pairs-only cluster are theirs.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data.dedup.exact import run_starts
from stacklm.data.dedup.global_index import REASONS, SPLIT_PRIORITY, DedupIndex, _split_id, id_keys

FILE_SHIFT = 40  # node id = file << 40 | record: 16M slices of 1T records each
ROW_MASK = np.uint64((1 << FILE_SHIFT) - 1)
DEFAULT_CHUNK = 4_000_000  # records a bucket task sorts at once (~100 MB of temporaries)
META = "meta.json"


# -- 1. signatures ---------------------------------------------------------------------------------
def write_signature_dir(sig: Mapping[str, Any], split: str, out: str | Path) -> dict[str, Any]:
    """Write one slice's signature records (``collect_signatures`` output) as ``out/``; atomic
    (written beside, then renamed), so a rerun task replaces a half-written one."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ids = np.asarray(sig["ids"], dtype=str)
    n = int(ids.size)
    split_ids = [_split_id(d) for d in ids.tolist()]
    prefixes, prefix = np.unique(np.array([p for p, _ in split_ids], dtype=str), return_inverse=True)
    if np.unique(ids).size != n:
        raise ValueError(f"dedup signatures of split {split!r}: a document id was recorded twice in one slice; check the shard specs")
    cols = {
        "prefixes": prefixes.astype(str) if prefixes.size else np.zeros(0, dtype="<U1"),
        "prefix": prefix.astype(np.int32).reshape(-1),
        "row": np.array([r for _, r in split_ids], dtype=np.int64),
        "source": np.asarray(sig["source"], dtype=np.int32),
        "idkey": id_keys(ids.tolist()),
    }
    local = np.arange(n, dtype=np.uint64)
    digest = np.asarray(sig["digest"], dtype=np.uint64)
    exact = bool(n and digest.any())
    if exact:
        order = np.argsort(digest, kind="stable")
        cols["digest_key"], cols["digest_idx"] = digest[order], local[order]
    bands = np.asarray(sig["bands"], dtype=np.uint64)
    bands = bands if bands.ndim == 2 else bands.reshape(n, -1)  # (0, num_bands) for an empty slice: no -1 to infer
    for b in range(bands.shape[1]):
        order = np.argsort(bands[:, b], kind="stable")
        cols[f"band{b}_key"], cols[f"band{b}_idx"] = bands[order, b], local[order]
    for name, a in cols.items():
        np.save(tmp / f"{name}.npy", a, allow_pickle=False)
    meta = {"split": split, "n": n, "exact": exact, "num_bands": int(bands.shape[1])}
    (tmp / META).write_text(json.dumps(meta, sort_keys=True))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return meta


def _meta(d: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(d) / META).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{d}: not a stacklm dedup signature directory ({type(e).__name__}: {e}); re-run the signature step") from None


def _col(d: Path, name: str) -> np.ndarray:
    """One signature column, memory-mapped; data only (``allow_pickle=False``): a file that is
    not a plain ``.npy`` array is refused naming it."""
    path = Path(d) / f"{name}.npy"
    try:
        a = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a stacklm dedup signature column ({type(e).__name__}: {e}); delete it and re-run the prebuild (the dedup stages run again)") from None
    if not isinstance(a, np.ndarray) or a.dtype.hasobject:
        raise ValueError(f"{path}: not a stacklm dedup signature column (not one plain array); delete it and re-run the prebuild (the dedup stages run again)")
    return a


# -- 2. buckets --------------------------------------------------------------------------------------
def key_range(r: int, ranges: int) -> tuple[int, int]:
    """Range ``r`` of ``ranges`` equal ranges of the 64-bit key space, as ``[lo, hi)`` (hi may be 2^64)."""
    step = (1 << 64) // ranges
    return r * step, (1 << 64) if r == ranges - 1 else (r + 1) * step


def bucket_pairs(sig_dirs: Sequence[str | Path], column: str, lo: int, hi: int, chunk: int = DEFAULT_CHUNK) -> np.ndarray:
    """The duplicate pairs ``(m, 2)`` uint64 node ids of every key in ``[lo, hi)`` of ``column``
    (``digest`` or ``band<b>``) shared by two or more records of the slices ``sig_dirs`` (whose
    position is the node's file number). Each pair is (first member, other member) of its
    bucket, so a bucket of k records gives k - 1 pairs."""
    keys = [_col(d, f"{column}_key") if (Path(d) / f"{column}_key.npy").exists() else np.zeros(0, np.uint64) for d in sig_dirs]
    idx = [_col(d, f"{column}_idx") if k.size else None for d, k in zip(sig_dirs, keys)]
    total = sum(_count(k, lo, hi) for k in keys)
    pieces = max(1, -(-total // max(int(chunk), 1)))
    out = []
    edges = [lo + (hi - lo) * j // pieces for j in range(pieces + 1)]
    for a, b in zip(edges[:-1], edges[1:]):
        got_k, got_n = [], []
        for f, (k, ix) in enumerate(zip(keys, idx)):
            s, e = _bounds(k, a, b)
            if e > s:
                got_k.append(np.asarray(k[s:e]))
                got_n.append(np.asarray(ix[s:e], dtype=np.uint64) | np.uint64(f << FILE_SHIFT))
        if not got_k:
            continue
        kk, nn = np.concatenate(got_k), np.concatenate(got_n)
        del got_k, got_n
        order = np.argsort(kk, kind="stable")
        kk, nn = kk[order], nn[order]
        del order
        head = run_starts(kk)
        first = np.maximum.accumulate(np.where(head, np.arange(kk.size), 0))
        dup = np.flatnonzero(~head)
        if dup.size:
            out.append(np.stack([nn[first[dup]], nn[dup]], axis=1))
    return np.concatenate(out) if out else np.zeros((0, 2), dtype=np.uint64)


def _bounds(k: np.ndarray, a: int, b: int) -> tuple[int, int]:
    if not k.size:
        return 0, 0
    s = int(np.searchsorted(k, np.uint64(a), side="left"))
    e = k.size if b >= 1 << 64 else int(np.searchsorted(k, np.uint64(b), side="left"))
    return s, e


def _count(k: np.ndarray, a: int, b: int) -> int:
    s, e = _bounds(k, a, b)
    return e - s


def save_pairs(pairs: np.ndarray, path: str | Path) -> None:
    import io

    from stacklm.atomic import atomic_write_bytes

    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(pairs, dtype=np.uint64), allow_pickle=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(path), buf.getvalue())


def load_pairs(path: str | Path) -> np.ndarray:
    """A bucket task's pairs; data only (``allow_pickle=False``), anything else refused naming the file."""
    try:
        a = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a stacklm dedup pair file ({type(e).__name__}: {e}); delete it and re-run the prebuild (the bucket task runs again)") from None
    if not isinstance(a, np.ndarray) or a.dtype != np.uint64:
        if not isinstance(a, np.ndarray):
            a.close()
        raise ValueError(f"{path}: not a stacklm dedup pair file (not one uint64 array); delete it and re-run the prebuild (the bucket task runs again)")
    return a.reshape(-1, 2)


def unique_pairs(pairs: np.ndarray) -> np.ndarray:
    """``pairs`` without repeated rows (sorted)."""
    pairs = np.ascontiguousarray(pairs, dtype=np.uint64).reshape(-1, 2)
    if pairs.shape[0] < 2:
        return pairs
    order = np.lexsort((pairs[:, 1], pairs[:, 0]))
    pairs = pairs[order]
    keep = np.ones(pairs.shape[0], dtype=bool)
    keep[1:] = (pairs[1:] != pairs[:-1]).any(axis=1)
    return pairs[keep]


def load_pair_files(paths: Sequence[str | Path]) -> np.ndarray:
    """The distinct pairs of all ``paths``, read one file at a time: a duplicate set shows up
    in many bands (an exact copy in all 12, a near copy in most), always as the same (first,
    other) pair, so the cluster holds each pair once, not once per band."""
    acc = np.zeros((0, 2), dtype=np.uint64)
    for p in paths:
        acc = unique_pairs(np.concatenate([acc, load_pairs(p)]))
    return acc


# -- 3. cluster ---------------------------------------------------------------------------------------
def _components(u: np.ndarray, v: np.ndarray, label: np.ndarray) -> np.ndarray:
    """Smallest ``label`` of each node's connected component over the edges ``u``-``v``
    (node indices); ``label`` must be a permutation of ``0..n-1`` (the canonical ranks).
    Min-label propagation with pointer jumping: a few rounds, each O(edges)."""
    label = label.copy()
    node_of = np.empty_like(label)
    node_of[label] = np.arange(label.size)
    while True:
        low = np.minimum(label[u], label[v])
        before = label.copy()
        np.minimum.at(label, u, low)
        np.minimum.at(label, v, low)
        while True:  # pointer jumping: take the label of the node that holds my label
            jumped = label[node_of[label]]
            if np.array_equal(jumped, label):
                break
            label = jumped
        if np.array_equal(before, label):
            return label


def _canonical_ranks(nodes: np.ndarray, sig_dirs: Sequence[Path], metas: Sequence[Mapping], priority: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(rank in the canonical order, split group) of each node id; the order is
    ``decide_splits``'s (split in ``priority`` order, mix entry, part label, row), read for the
    paired records only."""
    names = sorted({m["split"] for m in metas}, key=lambda s: (list(priority).index(s) if s in priority else len(priority), s))
    group_of_file = np.array([names.index(m["split"]) for m in metas], dtype=np.int64)
    tables = [np.asarray(_col(d, "prefixes")) for d in sig_dirs]
    allp, inv = np.unique(np.concatenate(tables) if tables else np.zeros(0, str), return_inverse=True)
    inv = inv.reshape(-1)
    starts = np.cumsum([0] + [t.size for t in tables])
    f = (nodes >> np.uint64(FILE_SHIFT)).astype(np.int64)
    i = (nodes & ROW_MASK).astype(np.int64)
    source = np.empty(nodes.size, np.int64)
    prank = np.empty(nodes.size, np.int64)
    row = np.empty(nodes.size, np.int64)
    for file in np.unique(f).tolist():
        sel = np.flatnonzero(f == file)
        d, rows = sig_dirs[file], i[sel]
        source[sel] = _col(d, "source")[rows]
        prank[sel] = inv[starts[file] + np.asarray(_col(d, "prefix")[rows], dtype=np.int64)]
        row[sel] = _col(d, "row")[rows]
    order = np.lexsort((row, prank, source, group_of_file[f]))
    rank = np.empty(nodes.size, np.int64)
    rank[order] = np.arange(nodes.size)
    return rank, group_of_file[f]


def cluster_pairs(
    sig_dirs: Sequence[str | Path], exact_pairs: Sequence[np.ndarray], near_pairs: Sequence[np.ndarray],
    priority: Sequence[str] = SPLIT_PRIORITY,
) -> dict[int, dict[str, np.ndarray]]:
    """The decision from the pairs: per slice (file number) the local record indices removed,
    by reason (``exact``, ``near``, ``cross_split``), with the rule of ``decide_splits``."""
    sig_dirs = [Path(d) for d in sig_dirs]
    metas = [_meta(d) for d in sig_dirs]
    ex = np.concatenate([p.reshape(-1, 2) for p in exact_pairs]) if exact_pairs else np.zeros((0, 2), np.uint64)
    nr = np.concatenate([p.reshape(-1, 2) for p in near_pairs]) if near_pairs else np.zeros((0, 2), np.uint64)
    nodes, inv = np.unique(np.concatenate([ex.ravel(), nr.ravel()]), return_inverse=True)
    inv = inv.reshape(-1)
    out: dict[int, dict[str, np.ndarray]] = {}
    if nodes.size == 0:
        return out
    rank, group = _canonical_ranks(nodes, sig_dirs, metas, priority)
    node_of_rank = np.empty_like(rank)
    node_of_rank[rank] = np.arange(rank.size)
    n_ex = ex.size
    eu, ev = inv[:n_ex:2], inv[1:n_ex:2]
    nu, nv = inv[n_ex::2], inv[n_ex + 1 :: 2]
    exact_min = _components(eu, ev, rank)
    near_min = _components(nu, nv, rank)
    removed_exact = exact_min != rank
    removed_near = ~removed_exact & (near_min != rank)
    kept = np.where(removed_exact, node_of_rank[exact_min], node_of_rank[near_min])
    removed = removed_exact | removed_near
    cross = removed & (group[kept] != group)
    f = (nodes >> np.uint64(FILE_SHIFT)).astype(np.int64)
    i = (nodes & ROW_MASK).astype(np.int64)
    for reason, mask in (("exact", removed_exact & ~cross), ("near", removed_near & ~cross), ("cross_split", cross)):
        for file in np.unique(f[mask]).tolist():
            out.setdefault(file, {})[reason] = i[mask & (f == file)]
    return out


def write_index_shards(sig_dirs: Sequence[str | Path], removed: Mapping[int, Mapping[str, np.ndarray]], out_dir: str | Path, config_meta: Mapping[str, Any] | None = None) -> dict[str, dict[str, int]]:
    """One ``DedupIndex`` per slice at ``out_dir/<slice dir name>.npz``: that slice's split and
    only its removed ids (``idkey`` of the removed records). Returns the removed counts per split."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    totals: dict[str, dict[str, int]] = {}
    for file, d in enumerate(sig_dirs):
        d = Path(d)
        meta = _meta(d)
        split = meta["split"]
        per = removed.get(file, {})
        idkey = _col(d, "idkey")
        arrays = {r: np.asarray(idkey[np.sort(per[r])], dtype=np.uint64) if r in per else np.zeros(0, np.uint64) for r in REASONS}
        counts = {r: int(a.size) for r, a in arrays.items()}
        t = totals.setdefault(split, {r: 0 for r in REASONS})
        for r in REASONS:
            t[r] += counts[r]
        DedupIndex({split: arrays}, {**(config_meta or {}), "docs": {split: int(meta["n"])}, "removed": {split: counts}}).save(out_dir / f"{d.name}.npz")
    return totals


def load_shards(paths: Sequence[str | Path]) -> DedupIndex:
    """The index of all shards together (what ``decide_index`` would have saved in one file):
    same arrays, so the same ``content_hash``; ``meta`` sums the shards' ``docs`` and ``removed``."""
    splits: dict[str, dict[str, list[np.ndarray]]] = {}
    docs: dict[str, int] = {}
    removed: dict[str, dict[str, int]] = {}
    meta: dict[str, Any] = {}
    for p in paths:
        shard = DedupIndex.load(p)
        meta = {k: v for k, v in shard.meta.items() if k not in ("docs", "removed")}
        for s, per in shard.splits.items():
            for r, a in per.items():
                splits.setdefault(s, {}).setdefault(r, []).append(a)
            docs[s] = docs.get(s, 0) + int(shard.meta.get("docs", {}).get(s, 0))
            for r, c in shard.meta.get("removed", {}).get(s, {}).items():
                removed.setdefault(s, {}).setdefault(r, 0)
                removed[s][r] += int(c)
    return DedupIndex({s: {r: np.concatenate(v) for r, v in per.items()} for s, per in splits.items()}, {**meta, "docs": docs, "removed": removed})


def in_process(fn: Callable[..., Any], args: Sequence[tuple]) -> Iterator[Any]:
    """The default starmap: one call after the other, here, each result when it is asked for."""
    return (fn(*a) for a in args)


def staged_decision(
    sig_dirs: Sequence[str | Path], ranges: int = 1, exact_ranges: int = 1, chunk: int = DEFAULT_CHUNK, priority: Sequence[str] = SPLIT_PRIORITY,
    starmap: Callable[[Callable[..., Any], Sequence[tuple]], Iterable[Any]] | None = None,
) -> dict[int, dict[str, np.ndarray]]:
    """Stages 2 and 3 on one machine (``stacklm prebuild``'s pool and ``stacklm dedup-index``, through
    ``prebuild.dedup_pass.build_index_shards``; tests, ``bench/dedup_scale.py``): every bucket task
    through ``starmap(fn, arg_tuples)`` (the build's process pool: one task per band or digest
    range, run in parallel; default: one after the other, here), then the cluster here. Each
    bucket task holds one bucket chunk (``chunk`` records) and returns only its pairs, which are
    merged as they come (``unique_pairs``), so this process holds the distinct duplicate pairs
    and at most the pairs of the tasks finished and not yet merged, as on the engine."""
    metas = [_meta(d) for d in sig_dirs]
    nb = max((m["num_bands"] for m in metas), default=0)
    starmap = starmap or in_process
    dirs = [str(d) for d in sig_dirs]

    tasks = [("digest", r, exact_ranges) for r in range(exact_ranges)] if any(m["exact"] for m in metas) else []
    tasks += [(f"band{b}", r, ranges) for b in range(nb) for r in range(ranges)]
    merged = {"exact": np.zeros((0, 2), dtype=np.uint64), "near": np.zeros((0, 2), dtype=np.uint64)}
    # one starmap over every task (exact and near together keep a pool busy), merged as they come
    for (column, _, _), got in zip(tasks, starmap(bucket_pairs, [(dirs, column, *key_range(r, n), chunk) for column, r, n in tasks])):
        kind = "exact" if column == "digest" else "near"
        merged[kind] = unique_pairs(np.concatenate([merged[kind], got]))
    exact = [merged["exact"]] if any(m["exact"] for m in metas) else []
    near = [merged["near"]] if nb else []
    return cluster_pairs(sig_dirs, exact, near, priority)
