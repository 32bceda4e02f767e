"""Stage 3 of the staged dedup (``staged``): the decision, in passes that hold bits per
document, one partition of the verified edges and the remainder's edges, never every removal.

The rule is ``verify.first_fit``'s (a document is removed only for a *kept* document it is
verified-similar to, in canonical order; no chaining), computed from the bucket tasks' files:

0. exact: the digest tasks decided it; their rows are spooled (below) and marked in two bit
   sets, *exact-removed* (never kept) and *exact-kept*;
1. per partition (``near_files[j]``: the edges whose later node hashes to ``j``): its rows
   read once, the edges of exact copies dropped, each edge once; written back deduplicated
   (24 B per edge, ~20x fewer rows than the bucket tasks wrote: a pair is found in every band
   it shares) and the later ends marked *has-earlier* (the others are *roots*: kept whatever
   else happens);
2. per partition: a later node with an edge from a root is removed for it (the root with the
   most equal values, ties: the smallest id digest), spooled and marked *near-removed*; the
   other edges of undecided nodes are kept for
3. the remainder (drift chains, whose links all point to non-roots): ``first_fit`` in
   canonical order, one pass linear in its edges.

The spool: every removal is written as it is decided, ``(node, kept, equal, reason)`` rows
sorted by slice with each slice's bounds beside them, so ``Decision.rows(file)`` reads one
slice's removals (what its index shard and evidence need) and no process holds them all.
An exact copy whose kept copy is then removed as a near copy is removed for what that one was
removed for (the small *reclassified* map: near removals of exact-kept documents only); a
removal whose kept copy is in another split (val wins) is ``cross_split``; both are applied
when a slice's rows are read.

Largest holding: 4 bits per document (the bit sets, on dense document numbers: slice offset +
record), one partition's rows while they are deduplicated, and the remainder's edges.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data.dedup.exact import in_sorted, run_starts
from stacklm.data.dedup.global_index import REASONS, SPLIT_PRIORITY
from stacklm.data.dedup.staged import (
    DEFAULT_CHUNK, _canonical_ranks, _nodes_of, _split_groups, bucket_files, bucket_task_list, default_partitions,
    gather, in_process, load_pairs, run_bucket_task, save_pairs, slice_meta,
)
from stacklm.data.dedup.verify import DEFAULT_THRESHOLD, first_fit

EXACT, NEAR, CROSS_SPLIT = 1, 2, 3  # reason codes, in ``REASONS`` order
EXACT_CHUNK = 4_000_000  # exact rows read at once (~100 MB): a digest range file can hold every exact copy


class _Bits:
    """One bit per document (dense numbers ``0..n``): what the decision holds per document."""

    def __init__(self, n: int) -> None:
        self.bytes = np.zeros((n + 7) // 8, dtype=np.uint8)

    def set(self, i: np.ndarray) -> None:
        np.bitwise_or.at(self.bytes, i >> 3, (1 << (i & 7)).astype(np.uint8))

    def get(self, i: np.ndarray) -> np.ndarray:
        return ((self.bytes[i >> 3] >> (i & 7).astype(np.uint8)) & 1).astype(bool)


class _Spool:
    """Removal rows ``(node, kept, equal, reason)`` written as they are decided: one file per
    batch, sorted by slice; each batch's slice bounds stay here (8 B per slice and batch)."""

    def __init__(self, folder: Path, files: int) -> None:
        self.folder, self.files = folder, files
        self.bounds: list[np.ndarray] = []  # per batch: where each slice's rows start, and the end

    def add(self, node: np.ndarray, kept: np.ndarray, equal: np.ndarray | int, reason: int) -> None:
        if not node.size:
            return
        f = _nodes_of(node)[0]
        order = np.argsort(f, kind="stable")
        rows = np.stack([node, kept, np.broadcast_to(np.asarray(equal, dtype=np.uint64), node.shape),
                         np.full(node.size, reason, np.uint64)], axis=1)[order]
        save_pairs(rows, self.folder / f"removed.{len(self.bounds):05d}.npy")
        self.bounds.append(np.searchsorted(f[order], np.arange(self.files + 1)))

    def rows(self, file: int) -> np.ndarray:
        out = []
        for b, bounds in enumerate(self.bounds):
            if bounds[file + 1] > bounds[file]:
                out.append(np.load(self.folder / f"removed.{b:05d}.npy", mmap_mode="r", allow_pickle=False).reshape(-1, 4)[bounds[file] : bounds[file + 1]])
        return np.concatenate(out) if out else np.zeros((0, 4), np.uint64)


@dataclass
class Decision:
    """The staged decision, spooled in ``folder`` (removed with the object, or by ``close``;
    use it as a context manager): per slice (file number) ``rows(file)``, the removed node ids
    with the kept node each duplicates, the reason code (1 exact, 2 near, 3 cross_split) and
    the equal MinHash values of the pair (of ``num_perm``; ``num_perm`` for exact copies)."""

    folder: Path
    sig_dirs: list[Path]
    num_perm: int
    groups: np.ndarray  # each slice's split, as its rank in the priority order
    reclassified: np.ndarray  # (k, 3): near-removed exact-kept node, its kept node, equal values; sorted
    spool: _Spool
    stats: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.folder), True)

    def __enter__(self) -> Decision:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._cleanup()

    def rows(self, file: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(node, kept, reason, equal)`` of slice ``file``'s removals, by node id."""
        r = self.spool.rows(file)
        r = r[np.argsort(r[:, 0], kind="stable")]
        node, kept, equal, reason = r[:, 0].copy(), r[:, 1].copy(), r[:, 2].astype(np.int64), r[:, 3].astype(np.int8)
        fix = self.reclassified
        if fix.shape[0]:  # an exact copy of a near-removed document: removed for what that one was
            pos = np.minimum(np.searchsorted(fix[:, 0], kept), fix.shape[0] - 1)
            hit = (reason == EXACT) & (fix[pos, 0] == kept)
            kept[hit], equal[hit], reason[hit] = fix[pos[hit], 1], fix[pos[hit], 2].astype(np.int64), NEAR
        reason[self.groups[file] != self.groups[_nodes_of(kept)[0]]] = CROSS_SPLIT
        return node, kept, reason, equal

    @property
    def removed(self) -> dict[int, dict[str, np.ndarray]]:
        """Per slice with removals, per reason present, its sorted local record indices."""
        out: dict[int, dict[str, np.ndarray]] = {}
        for file in range(len(self.sig_dirs)):
            node, _, reason, _ = self.rows(file)
            i = _nodes_of(node)[1]
            for code, name in enumerate(REASONS, start=1):
                if (reason == code).any():
                    out.setdefault(file, {})[name] = np.sort(i[reason == code])
        return out


def _work_base(work_dir: str | Path | None, sig_dirs: Sequence[str | Path]) -> Path:
    """Where the decision's working folders go: ``work_dir``, else beside the first signature directory."""
    if work_dir is not None:
        return Path(work_dir)
    return Path(sig_dirs[0]).parent if sig_dirs else Path(tempfile.gettempdir())


def _dense(offsets: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    f, i = _nodes_of(nodes)
    return offsets[f] + i


def _dedup_edges(paths: Sequence[Path], exact_removed: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """One partition's verified edges, each once (an edge is found in every band its pair shares),
    without the edges of exact copies (never kept, and removed already)."""
    parts = [e[~(exact_removed(e[:, 0]) | exact_removed(e[:, 1]))] for e in map(load_pairs, paths)]
    e = np.concatenate(parts) if parts else np.zeros((0, 3), np.uint64)
    del parts
    if e.shape[0] < 2:
        return e
    e = e[np.lexsort((e[:, 0], e[:, 1]))]
    keep = np.ones(e.shape[0], dtype=bool)
    keep[1:] = (e[1:, :2] != e[:-1, :2]).any(axis=1)
    return e[keep]


def decide_partitioned(
    sig_dirs: Sequence[str | Path], exact_files: Sequence[Path], near_files: Sequence[Sequence[Path]],
    priority: Sequence[str] = SPLIT_PRIORITY, work_dir: str | Path | None = None,
) -> Decision:
    """The decision from the bucket tasks' files (the module docstring's passes), spooled in a
    new folder under ``work_dir`` (default: beside the first signature directory). Its removed
    set is ``first_fit`` over all edges, so the reference ``decide_splits``'s, reasons included."""
    sig_dirs = [Path(d) for d in sig_dirs]
    metas = [slice_meta(d) for d in sig_dirs]
    num_perm = max((int(m.get("num_perm", 0)) for m in metas), default=0)
    offsets = np.cumsum([0] + [int(m["n"]) for m in metas]).astype(np.int64)
    n = int(offsets[-1])
    folder = Path(tempfile.mkdtemp(prefix=".dedup-decision-", dir=_work_base(work_dir, sig_dirs)))
    try:
        return _decide(sig_dirs, metas, num_perm, offsets, n, folder, exact_files, near_files, priority)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def _decide(sig_dirs, metas, num_perm, offsets, n, folder, exact_files, near_files, priority) -> Decision:
    dense = lambda nodes: _dense(offsets, nodes)  # noqa: E731
    spool = _Spool(folder, len(sig_dirs))
    exact_removed, exact_kept, has_earlier, near_removed = _Bits(n), _Bits(n), _Bits(n), _Bits(n)
    stats = {"exact_removed": 0, "edges": 0, "near_removed": 0}
    for path in exact_files:  # 0. the digest tasks' decision, spooled as it is read, a chunk at a time
        rows = load_pairs(path, mmap=True)
        for s in range(0, rows.shape[0], EXACT_CHUNK):
            ex = np.asarray(rows[s : s + EXACT_CHUNK])
            exact_removed.set(dense(ex[:, 1]))
            exact_kept.set(dense(ex[:, 0]))
            spool.add(ex[:, 1], ex[:, 0], num_perm, EXACT)
            stats["exact_removed"] += int(ex.shape[0])
        del rows
    is_exact = lambda nodes: exact_removed.get(dense(nodes))  # noqa: E731
    for j, paths in enumerate(near_files):  # 1. each edge once; the documents with an earlier neighbour
        e = _dedup_edges(paths, is_exact)
        has_earlier.set(dense(e[:, 1]))
        save_pairs(e, folder / f"edges.p{j:04d}.npy")
        stats["edges"] += int(e.shape[0])
    reclassified: list[np.ndarray] = []

    def remove(node: np.ndarray, kept: np.ndarray, equal: np.ndarray) -> None:
        d = dense(node)
        near_removed.set(d)
        spool.add(node, kept, equal, NEAR)
        mine = exact_kept.get(d)  # exact copies of this one are removed for ``kept`` too
        reclassified.append(np.stack([node[mine], kept[mine], equal[mine]], axis=1))
        stats["near_removed"] += int(node.size)

    for j in range(len(near_files)):  # 2. removals for a root; the rest kept for the remainder
        e = load_pairs(folder / f"edges.p{j:04d}.npy")
        root = ~has_earlier.get(dense(e[:, 0]))
        r = e[root]
        if r.shape[0]:
            r = r[np.lexsort((gather(sig_dirs, "idkey", r[:, 0]), -r[:, 2].astype(np.int64), r[:, 1]))]
            r = r[run_starts(r[:, 1])]
            remove(r[:, 1], r[:, 0], r[:, 2])
        save_pairs(e[~root & ~in_sorted(e[:, 1], np.sort(r[:, 1]))], folder / f"rest.p{j:04d}.npy")
        (folder / f"edges.p{j:04d}.npy").unlink()
    rest = [load_pairs(folder / f"rest.p{j:04d}.npy") for j in range(len(near_files))]
    e = np.concatenate(rest) if rest else np.zeros((0, 3), np.uint64)
    del rest
    e = e[~near_removed.get(dense(e[:, 0]))]  # an earlier end removed in pass 2 is never kept
    stats["remainder_edges"] = int(e.shape[0])
    if e.shape[0]:  # 3. the remainder: one linear pass
        nodes, inv = np.unique(e[:, :2].ravel(), return_inverse=True)
        rank, _ = _canonical_ranks(nodes, sig_dirs, metas, priority)
        node_of_rank = nodes[np.argsort(rank)]
        lo, hi = rank[inv.reshape(-1, 2)[:, 0]], rank[inv.reshape(-1, 2)[:, 1]]
        removed, kept_of, equal = first_fit(nodes.size, lo, hi, e[:, 2].astype(np.int64), tiebreak=gather(sig_dirs, "idkey", node_of_rank))
        sel = np.flatnonzero(removed)
        remove(node_of_rank[sel], node_of_rank[kept_of[sel]], equal[sel].astype(np.uint64))
    fix = np.concatenate(reclassified) if reclassified else np.zeros((0, 3), np.uint64)
    fix = fix[np.argsort(fix[:, 0])] if fix.shape[0] else np.zeros((0, 3), np.uint64)
    stats["reclassified"] = int(fix.shape[0])
    return Decision(folder, list(sig_dirs), num_perm, _split_groups(metas, priority), fix, spool, stats)


def staged_decision(
    sig_dirs: Sequence[str | Path], ranges: int = 1, exact_ranges: int = 1, chunk: int = DEFAULT_CHUNK, priority: Sequence[str] = SPLIT_PRIORITY,
    starmap: Callable[[Callable[..., Any], Sequence[tuple]], Iterable[Any]] | None = None,
    threshold: float = DEFAULT_THRESHOLD, partitions: int | None = None, work_dir: str | Path | None = None,
) -> Decision:
    """Stages 2 and 3 on one machine (``stacklm prebuild``'s pool and ``stacklm dedup-index``, through
    ``prebuild.dedup_pass.build_index_shards``; tests, ``bench/dedup_scale.py``): every bucket task
    through ``starmap(fn, arg_tuples)`` (the build's process pool: one task per band or digest
    range, run in parallel; default: one after the other, here), each writing its rows to a
    folder beside the signatures (``work_dir``), then the partitioned decision here."""
    dirs = [str(d) for d in sig_dirs]
    metas = [slice_meta(Path(d)) for d in dirs]
    partitions = partitions or default_partitions(sum(int(m["n"]) for m in metas))
    starmap = starmap or in_process
    tasks = bucket_task_list(metas, ranges, exact_ranges)
    base = _work_base(work_dir, dirs)
    pairs_dir = Path(tempfile.mkdtemp(prefix=".dedup-pairs-", dir=base))
    try:
        stats: dict[str, int] = {}
        args = [(dirs, column, r, n, str(pairs_dir), threshold, partitions, chunk) for column, r, n in tasks]
        for got in starmap(run_bucket_task, args):
            for k, v in got.items():
                stats[k] = stats.get(k, 0) + v
        exact, near = bucket_files(pairs_dir, tasks, partitions)
        decision = decide_partitioned(sig_dirs, exact, near, priority, work_dir=base)
        decision.stats.update(stats, partitions=partitions)
        return decision
    finally:
        shutil.rmtree(pairs_dir, ignore_errors=True)
