"""The global dedup decision as parallel stages, in the shape of datatrove's MinHash dedup.

``decide_splits`` (``global_index``) is one process holding every record of every split:
~1-2 GB per million documents, killed for memory at 20M. Here the same decision runs as

1. **signatures** (one task per (split, reader) slice; ``write_signature_dir``): the slice's
   records as plain ``.npy`` columns in ``DIR/<job>/``: per band the band keys *sorted*, with
   the local record index beside them (``band<b>_key/_idx``), the same for the exact digest
   (``digest_key/_idx``), and per record what the kept-copy rule and the index need
   (``source``, ``prefix`` into the slice's small part table ``prefixes``, ``row``, ``idkey``).
   With near dedup on, also ``minhash`` ((n, num_perm) uint32): the whole signatures, which
   verification compares.
2. **buckets** (``run_bucket_task``; one task per (band, key range) and per digest range):
   reads from every slice only the rows of its key range (``searchsorted`` on memory-mapped
   sorted columns), orders the members of every key shared by two or more records
   canonically (split priority, mix entry, part label, row: read for those records only) and
   writes ``(file << 40 | row)`` node ids: for the digest, the exact decision itself (the
   canonical first of a set is kept, the others are removed for it); for a band, the
   *verified* edges (``verify.star_edges``: a pair counts when at least
   ``dedup.near_threshold`` of its MinHash values are equal), split into decision partitions
   by the later node. Its memory is bounded by ``chunk`` records whatever the corpus size: a
   range holding more is processed in key sub-ranges (keys are hashes, so sub-ranges split
   evenly and a bucket never straddles two).
3. **decision** (``decision.decide_partitioned``, one task): ``verify.first_fit``'s rule (a
   document is removed only for a *kept* document it is verified-similar to; no chaining) in
   passes over one partition of the edges at a time: the documents with an earlier neighbour,
   then the removals for a root, then one linear pass over the remainder (drift chains). It
   holds 4 bits per document, one partition's edges and the remainder's, and spools every
   removal to disk as it is decided, never every pair or every removal
   (``default_partitions``: one partition per 16M documents). The rule reads only the
   canonical order, never the ``file`` of a node id (which depends on the slicing), so the
   removed ids are ``decide_splits``'s and the same for every task count. A removed document
   whose kept copy is in another split (val wins) is ``cross_split``.
4. **removed ids, sharded** (``shards.write_index_shards``): one ``DedupIndex`` per slice
   (``<job>.npz``, only that slice's removed ids) and its evidence beside it (``evidence``:
   the kept document and the estimated similarity of every removal); the packing task of that
   slice, which reads exactly the documents the signature task of the same (split, reader)
   read, loads only its own shard (``shards.load_shards`` merges them back, for the manifest's
   totals and hash).

Why not datatrove's ``MinhashDedupSignature``/``Buckets``/``Cluster``/``Filter`` themselves:
(a) their signatures shingle and normalise the text their own way, and ours must be the
stream path's (``MinHasher`` with the config's ``dedup.shingle``: the offline index and in-flight dedup
decide on the same keys); (b) their cluster keeps the union-by-size root of ``(file, doc)``
ids, where ``file`` is the task rank, so the kept copy changes with the task count, and it
takes connected components of unverified candidates (it chains); (c) no rule across splits
(val wins); (d) their bucket step merges the files in a Python heap, one Python object per
document and band, where this sorts numpy arrays. The stage boundaries and the
per-band/per-range task split are theirs.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data.dedup.exact import run_starts
from stacklm.data.dedup.global_index import SPLIT_PRIORITY, _split_id, id_keys
from stacklm.data.dedup.minhash import _fmix64
from stacklm.data.dedup.verify import DEFAULT_THRESHOLD, need_equal, star_edges

FILE_SHIFT = 40  # node id = file << 40 | record: 16M slices of 1T records each
ROW_MASK = np.uint64((1 << FILE_SHIFT) - 1)
DEFAULT_CHUNK = 4_000_000  # records a bucket task sorts at once (~100 MB of temporaries)
PARTITION_DOCS = 16_000_000  # documents per decision partition (``default_partitions``)
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
    num_perm = 0
    if bands.shape[1]:  # near dedup on: the whole signatures, for verification (``verify``)
        values = np.asarray(sig["minhash"], dtype=np.uint32)
        cols["minhash"] = np.ascontiguousarray(values if values.ndim == 2 else values.reshape(n, -1 if n else 0))
        num_perm = int(cols["minhash"].shape[1])
    for name, a in cols.items():
        np.save(tmp / f"{name}.npy", a, allow_pickle=False)
    meta = {"split": split, "n": n, "exact": exact, "num_bands": int(bands.shape[1]), "num_perm": num_perm}
    (tmp / META).write_text(json.dumps(meta, sort_keys=True))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return meta


def slice_meta(d: Path) -> dict[str, Any]:
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


def _nodes_of(nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (nodes >> np.uint64(FILE_SHIFT)).astype(np.int64), (nodes & ROW_MASK).astype(np.int64)


def gather(sig_dirs: Sequence[Path], column: str, nodes: np.ndarray) -> np.ndarray:
    """Column ``column`` of each node id's record, read from the memory-mapped slice columns."""
    f, i = _nodes_of(np.asarray(nodes, dtype=np.uint64))
    out = None
    for file in np.unique(f).tolist():
        sel = np.flatnonzero(f == file)
        got = np.asarray(_col(sig_dirs[file], column)[i[sel]])
        if out is None:
            out = np.empty((nodes.size, *got.shape[1:]), dtype=got.dtype)
        out[sel] = got
    return out if out is not None else np.zeros(0, dtype=np.uint64)


def bucket_task(
    sig_dirs: Sequence[str | Path], column: str, lo: int, hi: int, threshold: float = DEFAULT_THRESHOLD,
    chunk: int = DEFAULT_CHUNK, priority: Sequence[str] = SPLIT_PRIORITY,
) -> tuple[np.ndarray, dict[str, int]]:
    """One bucket task: every key in ``[lo, hi)`` of ``column`` (``digest`` or ``band<b>``)
    shared by two or more records of the slices ``sig_dirs`` (whose position is the node's file
    number), its members in canonical order (``_canonical_ranks``). Returns ``(rows, stats)``,
    rows an ``(m, 3)`` uint64 array:

    * ``digest``: the exact decision, made here: (kept copy = the set's canonical first, removed
      copy, 0) for every other member;
    * ``band<b>``: the verified edges (``verify.star_edges``): (earlier, later, equal MinHash
      values) of the pairs with at least ``threshold`` of the values equal.

    Its memory is bounded by ``chunk`` records whatever the corpus size: a range holding more is
    processed in key sub-ranges (keys are hashes, so sub-ranges split evenly and a bucket never
    straddles two)."""
    sig_dirs = [Path(d) for d in sig_dirs]
    metas = [slice_meta(d) for d in sig_dirs]
    keys = [_col(d, f"{column}_key") if (d / f"{column}_key.npy").exists() else np.zeros(0, np.uint64) for d in sig_dirs]
    idx = [_col(d, f"{column}_idx") if k.size else None for d, k in zip(sig_dirs, keys)]
    total = sum(_count(k, lo, hi) for k in keys)
    pieces = max(1, -(-total // max(int(chunk), 1)))
    num_perm = max((int(m.get("num_perm", 0)) for m in metas), default=0)
    need = need_equal(threshold, num_perm) if num_perm else 0
    stats = {"records": 0, "candidates": 0, "rows": 0, "unverified": 0}
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
        stats["records"] += int(kk.size)
        order = np.argsort(kk, kind="stable")
        kk, nn = kk[order], nn[order]
        bucket = np.cumsum(run_starts(kk)) - 1
        multi = np.bincount(bucket)[bucket] > 1
        nn, bucket = nn[multi], bucket[multi]
        del kk, order, multi
        if not nn.size:
            continue
        stats["candidates"] += int(nn.size)
        rank, _ = _canonical_ranks(nn, sig_dirs, metas, priority)
        order = np.lexsort((rank, bucket))
        nn, bucket = nn[order], bucket[order]
        if column == "digest":
            head = run_starts(bucket)
            first = nn[np.maximum.accumulate(np.where(head, np.arange(nn.size), 0))]
            out.append(np.stack([first[~head], nn[~head], np.zeros(int((~head).sum()), np.uint64)], axis=1))
            continue

        def equal_of(x: np.ndarray, y: np.ndarray) -> np.ndarray:
            counts = np.empty(x.size, dtype=np.int64)
            for s in range(0, x.size, 1 << 16):  # 64k pairs' signatures at a time
                counts[s : s + (1 << 16)] = (gather(sig_dirs, "minhash", nn[x[s : s + (1 << 16)]])
                                             == gather(sig_dirs, "minhash", nn[y[s : s + (1 << 16)]])).sum(axis=1)
            return counts

        c, m, eq, left = star_edges(bucket, equal_of, need)
        stats["unverified"] += left
        out.append(np.stack([nn[c], nn[m], eq.astype(np.uint64)], axis=1))
    rows = np.concatenate(out) if out else np.zeros((0, 3), dtype=np.uint64)
    stats["rows"] = int(rows.shape[0])
    return rows, stats


def _bounds(k: np.ndarray, a: int, b: int) -> tuple[int, int]:
    if not k.size:
        return 0, 0
    s = int(np.searchsorted(k, np.uint64(a), side="left"))
    e = k.size if b >= 1 << 64 else int(np.searchsorted(k, np.uint64(b), side="left"))
    return s, e


def _count(k: np.ndarray, a: int, b: int) -> int:
    s, e = _bounds(k, a, b)
    return e - s


def default_partitions(docs: int) -> int:
    """Decision partitions for a corpus of ``docs`` records: one per ``PARTITION_DOCS`` (each
    decision pass then holds the verified edges of about that many documents)."""
    return max(1, -(-int(docs) // PARTITION_DOCS))


def partition_of(nodes: np.ndarray, partitions: int) -> np.ndarray:
    """The decision partition of each edge's later node (a hash of the node id: even shares)."""
    return (_fmix64(np.asarray(nodes, dtype=np.uint64).copy()) % np.uint64(partitions)).astype(np.int64)


def bucket_file(pairs_dir: str | Path, column: str, r: int, part: int | None = None) -> Path:
    """A bucket task's output: ``digest-r<r>.npy`` (exact), ``band<b>-r<r>.p<part>.npy`` (near,
    one per decision partition)."""
    return Path(pairs_dir) / (f"{column}-r{r:04d}.npy" if part is None else f"{column}-r{r:04d}.p{part:04d}.npy")


def run_bucket_task(
    sig_dirs: Sequence[str | Path], column: str, r: int, ranges: int, pairs_dir: str | Path,
    threshold: float = DEFAULT_THRESHOLD, partitions: int | None = None, chunk: int = DEFAULT_CHUNK,
) -> dict[str, int]:
    """``bucket_task`` for range ``r`` of ``ranges``, written to ``pairs_dir`` (``bucket_file``;
    near edges split by ``partition_of`` their later node): what the pool's processes and the
    datatrove bucket tasks run. Returns the task's counts."""
    partitions = partitions or default_partitions(sum(int(slice_meta(Path(d))["n"]) for d in sig_dirs))
    rows, stats = bucket_task(sig_dirs, column, *key_range(r, ranges), threshold=threshold, chunk=chunk)
    if column == "digest":
        save_pairs(rows, bucket_file(pairs_dir, column, r))
        return stats
    part = partition_of(rows[:, 1], partitions)
    for j in range(partitions):
        save_pairs(rows[part == j], bucket_file(pairs_dir, column, r, j))
    return stats


def save_pairs(pairs: np.ndarray, path: str | Path) -> None:
    import io

    from stacklm.atomic import atomic_write_bytes

    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(pairs, dtype=np.uint64), allow_pickle=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(path), buf.getvalue())


def load_pairs(path: str | Path, mmap: bool = False) -> np.ndarray:
    """A bucket task's rows (memory-mapped with ``mmap``); data only (``allow_pickle=False``),
    anything else refused naming the file."""
    try:
        a = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a stacklm dedup pair file ({type(e).__name__}: {e}); delete it and re-run the prebuild (the bucket task runs again)") from None
    if not isinstance(a, np.ndarray) or a.dtype != np.uint64:
        if not isinstance(a, np.ndarray):
            a.close()
        raise ValueError(f"{path}: not a stacklm dedup pair file (not one uint64 array); delete it and re-run the prebuild (the bucket task runs again)")
    return a.reshape(-1, 3)


def bucket_files(pairs_dir: str | Path, tasks: Sequence[tuple[str, int, int]], partitions: int) -> tuple[list[Path], list[list[Path]]]:
    """(exact files, near files per partition) of the bucket ``tasks`` ``(column, r, ranges)``;
    a missing one is refused naming it (its task has not finished)."""
    exact: list[Path] = []
    near: list[list[Path]] = [[] for _ in range(partitions)]
    for column, r, _ in tasks:
        paths = [bucket_file(pairs_dir, column, r)] if column == "digest" else [bucket_file(pairs_dir, column, r, j) for j in range(partitions)]
        for path in paths:
            if not path.exists():
                raise FileNotFoundError(f"{path} is missing: the dedup bucket task for {column} range {r} has not finished; rerun the prebuild")
        if column == "digest":
            exact += paths
        else:
            for j, path in enumerate(paths):
                near[j].append(path)
    return exact, near


# -- 3. the decision ---------------------------------------------------------------------------------
def _split_groups(metas: Sequence[Mapping], priority: Sequence[str]) -> np.ndarray:
    """Each slice's split as its rank in ``priority`` order (val first by default; other splits after, by name)."""
    names = sorted({m["split"] for m in metas}, key=lambda s: (list(priority).index(s) if s in priority else len(priority), s))
    return np.array([names.index(m["split"]) for m in metas], dtype=np.int64)


def _canonical_ranks(nodes: np.ndarray, sig_dirs: Sequence[Path], metas: Sequence[Mapping], priority: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(rank in the canonical order, split group) of each node id; the order is
    ``decide_splits``'s (split in ``priority`` order, mix entry, part label, row), read for the
    given records only (ranks are relative to them; the order is the global one)."""
    group_of_file = _split_groups(metas, priority)
    tables = [np.asarray(_col(d, "prefixes")) for d in sig_dirs]
    allp, inv = np.unique(np.concatenate(tables) if tables else np.zeros(0, str), return_inverse=True)
    inv = inv.reshape(-1)
    starts = np.cumsum([0] + [t.size for t in tables])
    f, i = _nodes_of(nodes)
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


def in_process(fn: Callable[..., Any], args: Sequence[tuple]) -> Iterator[Any]:
    """The default starmap: one call after the other, here, each result when it is asked for."""
    return (fn(*a) for a in args)


def bucket_task_list(metas: Sequence[Mapping[str, Any]], ranges: int = 1, exact_ranges: int = 1) -> list[tuple[str, int, int]]:
    """``(column, range, ranges)`` of every bucket task for slices with ``metas``."""
    nb = max((m["num_bands"] for m in metas), default=0)
    tasks = [("digest", r, exact_ranges) for r in range(exact_ranges)] if any(m["exact"] for m in metas) else []
    return tasks + [(f"band{b}", r, ranges) for b in range(nb) for r in range(ranges)]
