"""Peak memory and time of the global dedup decision at corpus scale: the staged, verified
decision (``stacklm.data.dedup.staged``, what ``prebuild-datatrove`` runs) on synthetic
signatures, every stage task its own process; optionally beside the one-process reference
``decide_splits``.

    python3 bench/dedup_scale.py --docs 1000000 10000000 [--chain 100000] [--partitions 1 4]
        [--old 1000000] [--inproc 1000000] [--count-pairs] [--slices 8]

Signatures are synthetic (no text). By default (``--gen web``, ``WebLayout``) they have web-like
duplicate structure: power-law cluster sizes (a cluster has copies with probability
``--web-dup`` 0.3, then 1 + Zipf(``--alpha`` 2.3) members: 70 % of them 2, the largest
thousands), copies of copies (a copy's parent is a random earlier member of its cluster),
``--exact`` 0.4 of the copies exact (same digest and MinHash values), the others near copies
that keep each of their parent's 120 MinHash values with probability J ~ U(``--jmin`` 0.7, 1)
and draw a fresh one otherwise, so they share only some of its 12 bands (folded by
``MinHasher.band_keys``, the library's keys); ``--chain N`` plants one drift chain of N links.
With the defaults the banding proposes 0.57 (1M documents) to 0.59 (10M) distinct candidate
pairs per document (``--count-pairs`` prints it). Every value is a function of the document number (and a seeded per-block draw of
the cluster sizes), so each signature task generates its own slice without holding the corpus.
``--gen dup`` is the older, gentler generator: a ``--dup`` fraction of documents copies an
earlier original (chosen by hash), half exactly and half near (one band key shared): ~0.15
pairs per document. A ``--val`` fraction is in the val split, so copies straddle train and val.
Documents are dealt to ``--slices`` slices per split (the signature tasks), ids
``s<source>/part<p>/<row>`` like a real source's.

Every stage task runs as its own process, one after the other (``os.wait4`` gives its peak
RSS, ``ru_maxrss``): ``sig`` (one per slice: generate and write the slice's signature columns,
``minhash`` included, and the reference's format when ``--old`` includes this size);
``pairs`` (``--count-pairs``: one task counting the distinct candidate pairs, the pairs the
banding proposes); then per ``--partitions`` count P: ``buckets`` (1 digest range + 12 bands x
``--ranges``: ``staged.run_bucket_task``, the exact decision and the verified edges, written
per decision partition), ``decision`` (one: ``decision.decide_partitioned``, its passes over
one partition of the edges at a time and the remainder pass, every removal spooled to disk,
then ``shards.write_index_shards``: the removed-id shards and their evidence, one slice at a
time) and ``merge`` (one: ``shards.merged_identity``, the merged shards' hash and counts for
the manifest, as the prebuild's finalize computes them: one key range at a time); ``inproc`` (one,
sizes in ``--inproc``: every bucket task and the decision in one process,
``decision.staged_decision``, what ``stacklm prebuild`` and ``stacklm dedup-index`` do in their
parent process) and ``old`` (one: load every slice and run ``decide_splits``); ``base`` is a
task that only imports (every task's floor: numpy, torch via stacklm.data). CPU seconds are
printed beside wall seconds: on a shared machine the wall time includes waiting for a core.
The removed ids of every partition count and of ``inproc`` are checked to be identical
(``content_hash``); against ``decide_splits`` the removed set must be the same, and removals
filed under another reason (near vs cross_split: the two name another kept copy) are counted.
Prints one table row per stage and size and a summary line (records in shared buckets,
verified edges, the remainder pass, removed counts, cluster statistics), and writes them as
JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_BANDS = 12
ROWS_PER_BAND = 10
NUM_PERM = NUM_BANDS * ROWS_PER_BAND  # MinHasher's defaults
C1, C2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD6E8FEB86659FD93)


def _mix(x: np.ndarray) -> np.ndarray:
    from stacklm.data.dedup.minhash import _fmix64

    return _fmix64(np.asarray(x, dtype=np.uint64).copy())


def _unit(x: np.ndarray, salt: int) -> np.ndarray:
    """A uniform draw in [0, 1) per element of ``x``: a function of (x, salt) alone."""
    with np.errstate(over="ignore"):
        return (_mix(np.asarray(x, dtype=np.uint64) * C1 + np.uint64(salt)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _ids(j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(ids, source) of documents ``j``: ``s<source>/part<p>/<row>`` like a real source's."""
    source = (j % np.uint64(3)).astype(np.int32)
    part = (j // np.uint64(3)) % np.uint64(16)
    row = j // np.uint64(48)
    ids = np.char.add(np.char.add(np.char.add(np.char.add("s", source.astype(str)), "/part"), np.char.add(part.astype(str), "/")), row.astype(str))
    return ids, source


def _slice_docs(n: int, slices: int, split: str, w: int, val: float) -> np.ndarray:
    """Document numbers of slice ``w`` of ``split``: ``j % slices == w``, in val by a hash of ``j``."""
    with np.errstate(over="ignore"):
        j = np.arange(w, n, slices, dtype=np.uint64)
        in_val = (_mix(j * C1 + np.uint64(1)) % np.uint64(10_000)) < np.uint64(int(val * 10_000))
    return j[in_val == (split == "val")]


# -- the web-like generator (the default) ---------------------------------------------------------------
class WebLayout:
    """Web-like duplicate structure over ``n`` documents, every fact about a document a function
    of its number alone (plus a per-block draw), so a slice generates its own records.

    Documents are laid out on positions (``pos_of`` / ``doc_of``: an affine bijection of
    ``0..n-1``, so the members of a cluster are spread over slices, sources and splits).
    Positions ``0..chain-1`` are one drift chain (``--chain``): each link a near copy of the one
    before it with J = ``CHAIN_J`` that keeps one whole band of it (so every link is a candidate
    pair, the chain one connected run of pairs, and a link's similarity (10 + 110 J) / 120 = 0.86). The rest are cut into blocks of ``BLOCK`` positions, each cut
    into consecutive clusters by its own seeded draw: a cluster has copies with probability
    ``dup``, and then 1 + Zipf(``alpha``) members (P(size = s) proportional to (s - 1)^-alpha,
    capped at ``cap``): most have 2, a few thousands. Member 0 of a cluster is its original
    (fresh random 64-bit MinHash values); member m > 0 copies a uniformly drawn earlier member
    (so copies of copies: a random recursive tree), exactly with probability ``exact`` (same
    digest and values: the same normalised text), else as a near copy that takes each of its
    parent's values with probability J ~ U(``jmin``, 1) and draws a fresh one otherwise, so it
    shares some bands with its parent (P = 1 - (1 - J^10)^12) and fewer with its grand-parent."""

    BLOCK = 1 << 18
    CHAIN_J = 0.85
    ROOT, EXACT, NEAR = 0, 1, 2

    def __init__(self, n: int, chain: int = 0, dup: float = 0.3, alpha: float = 2.3, exact: float = 0.4, jmin: float = 0.7,
                 cap: int = 1 << 16, seed: int = 0) -> None:
        if not 0 <= chain <= n:
            raise SystemExit(f"bench/dedup_scale.py: --chain {chain} must be between 0 and --docs {n}")
        self.n, self.chain, self.dup, self.alpha, self.exact, self.jmin, self.cap, self.seed = n, chain, dup, alpha, exact, jmin, cap, seed
        a = int(n * 0.6180339887) | 1  # the golden-ratio step: neighbours in a cluster land far apart
        while np.gcd(a, n) != 1:
            a += 2
        self.a, self.c = a % n if n > 1 else 0, int(n * 0.37)
        self.a_inv = pow(self.a, -1, n) if n > 1 else 0

    def doc_of(self, pos: np.ndarray) -> np.ndarray:
        n = np.uint64(self.n)  # products stay below n^2: exact up to 4e9 documents
        return (np.asarray(pos, np.uint64) * np.uint64(self.a) + np.uint64(self.c)) % n

    def pos_of(self, j: np.ndarray) -> np.ndarray:
        n = np.uint64(self.n)
        return (((np.asarray(j, np.uint64) + n - np.uint64(self.c % self.n)) % n) * np.uint64(self.a_inv)) % n

    def block_starts(self, b: int) -> np.ndarray:
        """First position (within the block) of each cluster of block ``b``."""
        rng = np.random.default_rng([0xD0C5, self.seed, b])
        parts, total = [], 0
        while total < self.BLOCK:
            m = max(1024, (self.BLOCK - total) // 2)
            sizes = np.where(rng.random(m) < self.dup, np.minimum(1 + rng.zipf(self.alpha, m), self.cap), 1)
            parts.append(sizes)
            total += int(sizes.sum())
        ends = np.cumsum(np.concatenate(parts))
        return np.concatenate([[0], ends[: int(np.searchsorted(ends, self.BLOCK))]]).astype(np.int64)

    def groups(self, pos: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """(indices into ``pos``, block starts or None for the chain): every ancestor of a
        position is in its group, so a group is generated with one block's layout in memory."""
        pos = np.asarray(pos, np.int64)
        block = np.where(pos < self.chain, -1, (pos - self.chain) // self.BLOCK)
        order = np.argsort(block, kind="stable")
        bounds = np.flatnonzero(np.diff(block[order])) + 1
        for sel in np.split(order, bounds):
            if sel.size:
                b = int(block[sel[0]])
                yield sel, (None if b < 0 else self.block_starts(b))

    def info(self, pos: np.ndarray, starts: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(parent position, kind, J) of positions of one group."""
        pos = np.asarray(pos, np.int64)
        if starts is None:  # the chain
            kind = np.where(pos == 0, self.ROOT, self.NEAR)
            return np.maximum(pos - 1, 0), kind, np.full(pos.size, self.CHAIN_J)
        r = (pos - self.chain) % self.BLOCK
        member = r - starts[np.searchsorted(starts, r, side="right") - 1]
        u = pos.astype(np.uint64)
        parent = pos - member + np.floor(_unit(u, 21) * member).astype(np.int64)
        kind = np.where(member == 0, self.ROOT, np.where(_unit(u, 22) < self.exact, self.EXACT, self.NEAR))
        return parent, kind, self.jmin + (1.0 - self.jmin) * _unit(u, 23)

    def values(self, pos: np.ndarray, starts: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(values (k, NUM_PERM) uint64, digest (k,)) of positions of one group: walk up the
        ancestry; value p of a document is the fresh value of the first ancestor (itself
        included) that drew a fresh one at p, the original's at the top; the digest is that of
        the first ancestor that is not an exact copy."""
        pos = np.asarray(pos, np.int64)
        perm = np.arange(NUM_PERM, dtype=np.uint64)
        vals = np.zeros((pos.size, NUM_PERM), dtype=np.uint64)
        open_ = np.ones((pos.size, NUM_PERM), dtype=bool)
        digest = np.zeros(pos.size, dtype=np.uint64)
        cur, rows, need_digest = pos.copy(), np.arange(pos.size), np.ones(pos.size, dtype=bool)
        with np.errstate(over="ignore"):
            while rows.size:
                c = cur[rows]
                parent, kind, jv = self.info(c, starts)
                cell = c.astype(np.uint64)[:, None] * np.uint64(NUM_PERM) + perm[None, :]
                fresh = open_[rows] & ((kind == self.ROOT)[:, None] | ((kind == self.NEAR)[:, None] & (_unit(cell, 24) >= jv[:, None])))
                if starts is None:  # a chain link keeps one whole band of the link before it: a candidate pair, so the chain is connected
                    forced = np.floor(_unit(c.astype(np.uint64), 25) * NUM_BANDS).astype(np.int64)
                    fresh &= ((perm.astype(np.int64)[None, :] // ROWS_PER_BAND) != forced[:, None]) | (kind == self.ROOT)[:, None]
                r, p = np.nonzero(fresh)
                vals[rows[r], p] = _mix(cell[r, p] * C2 + np.uint64(13))
                open_[rows[r], p] = False
                d = need_digest[rows] & (kind != self.EXACT)
                digest[rows[d]] = _mix(c[d].astype(np.uint64) * C2 + np.uint64(11)) | np.uint64(1)
                need_digest[rows[d]] = False
                cur[rows] = parent
                rows = rows[open_[rows].any(axis=1) | need_digest[rows]]
        return vals, digest

    def cluster_sizes(self) -> np.ndarray:
        """Sizes of every cluster of the corpus (the chain one cluster), for the printed statistics."""
        sizes = [np.array([self.chain])] if self.chain else []
        rest = self.n - self.chain
        for b in range(-(-rest // self.BLOCK)):
            starts = self.block_starts(b)
            ends = np.minimum(np.append(starts[1:], self.BLOCK), rest - b * self.BLOCK)
            sizes.append((ends - starts)[ends > starts])
        return np.concatenate(sizes) if sizes else np.zeros(0, np.int64)


def web_records(layout: WebLayout, slices: int, split: str, w: int, val: float, chunk: int = 100_000) -> dict:
    """The records of slice ``w`` of ``split`` under ``layout``, a group and ``chunk`` documents at a time."""
    from stacklm.data.dedup.minhash import MinHasher

    hasher = MinHasher()
    j = _slice_docs(layout.n, slices, split, w, val)
    pos = layout.pos_of(j).astype(np.int64)
    bands = np.zeros((j.size, hasher.num_bands), dtype=np.uint64)
    minhash = np.zeros((j.size, NUM_PERM), dtype=np.uint32)
    digest = np.zeros(j.size, dtype=np.uint64)
    for sel, starts in layout.groups(pos):
        for s in range(0, sel.size, chunk):
            rows = sel[s : s + chunk]
            vals, digest[rows] = layout.values(pos[rows], starts)
            bands[rows] = hasher.band_keys(vals)
            minhash[rows] = vals.astype(np.uint32)  # the low 32 bits, as the signature columns keep them
    ids, source = _ids(j)
    return {"ids": ids, "source": source, "digest": digest, "bands": bands, "minhash": minhash}


# -- the older, gentler generator (``--gen dup``) ----------------------------------------------------
def _original(j: np.ndarray, dup: float) -> np.ndarray:
    """Whether document ``j`` is an original (not a planted copy): a function of ``j`` alone."""
    return (_mix(j * C2 + np.uint64(7)) % np.uint64(1_000_000)).astype(np.int64) >= int(dup * 1_000_000)


def slice_records(n: int, slices: int, split: str, w: int, dup: float, val: float) -> dict:
    """The records of slice ``w`` of ``split``: every document ``j < n`` whose split is
    ``split`` and ``j % slices == w``; vectorised, no state shared between slices. A copy's
    base is an earlier *original* (so an exact copy has exactly its base's band keys, as the
    same normalised text does); a copy whose few tries find none stays an original."""
    with np.errstate(over="ignore"):
        j = _slice_docs(n, slices, split, w, val)
        r = _mix(j * C2 + np.uint64(7))
        copy = ~_original(j, dup) & (j > 0)
        base = j.copy()
        found = np.zeros(j.size, dtype=bool)
        for t in range(8):  # earlier originals, by hash
            todo = np.flatnonzero(copy & ~found)
            cand = _mix(j[todo] * C1 + np.uint64(3 + t)) % j[todo]
            ok = _original(cand, dup)
            base[todo[ok]] = cand[ok]
            found[todo[ok]] = True
        exact = found & ((r >> np.uint64(20)) % np.uint64(2) == 0)
        near = found & ~exact
        text = np.where(exact, base, j)  # an exact copy has its base's normalised text
        digest = _mix(text * C2 + np.uint64(11)) | np.uint64(1)
        bands = _mix(text[:, None] * C1 + np.arange(1, NUM_BANDS + 1, dtype=np.uint64)[None, :])
        k = (r >> np.uint64(40)) % np.uint64(NUM_BANDS)
        shared = _mix(base * C1 + k + np.uint64(1))  # the base's band k
        rows = np.flatnonzero(near)
        bands[rows, k[rows].astype(np.int64)] = shared[rows]
        # MinHash values (what verification compares): the text's own; a near copy takes ~85 % of its base's
        perm = np.arange(NUM_PERM, dtype=np.uint64)[None, :]
        values = _mix(text[:, None] * C2 + perm + np.uint64(100)).astype(np.uint32)
        take = _unit(j[rows, None] * np.uint64(NUM_PERM) + perm, 26) < 0.85
        values[rows] = np.where(take, _mix(base[rows, None] * C2 + perm + np.uint64(100)).astype(np.uint32), values[rows])
    ids, source = _ids(j)
    return {"ids": ids, "source": source, "digest": digest, "bands": bands, "minhash": values}


def jobs(slices: int) -> list[tuple[str, int]]:
    return [(s, w) for s in ("val", "train") for w in range(slices)]


def layout(args, n: int | None = None) -> WebLayout:
    return WebLayout(args.docs if n is None else n, chain=args.chain, dup=args.web_dup, alpha=args.alpha,
                     exact=args.exact, jmin=args.jmin)


# -- one stage task, in its own process ------------------------------------------------------------
def task(args) -> None:
    from stacklm.data.dedup import staged

    root = Path(args.root)
    dirs = [root / "sig" / f"{s}-w{w:03d}" for s, w in jobs(args.slices)]
    if args.task == "base":  # the imports alone: every task's floor
        pass
    elif args.task == "sig":
        s, w = jobs(args.slices)[args.index]
        rec = web_records(layout(args), args.slices, s, w, args.val) if args.gen == "web" else slice_records(args.docs, args.slices, s, w, args.dup, args.val)
        staged.write_signature_dir(rec, s, dirs[args.index])
        if args.write_old:
            (root / "old").mkdir(exist_ok=True)
            np.savez(root / "old" / f"{s}-w{w:03d}.npz", **rec)
    elif args.task == "buckets":  # one bucket task: a band (or the digest) x key range, its verified edges per partition
        column, r = bucket_tasks(args.ranges)[args.index][:2]
        out = root / f"p{args.partitions}"
        stats = staged.run_bucket_task(dirs, column, r, args.ranges, out / "pairs", args.threshold, args.partitions)
        (out / f"{column}-r{r:04d}.json").write_text(json.dumps(stats))
    elif args.task == "decision":  # the partitioned passes and the remainder pass, then the shards and their evidence
        from stacklm.data.dedup.decision import decide_partitioned
        from stacklm.data.dedup.shards import write_index_shards

        import tracemalloc

        out = root / f"p{args.partitions}"
        exact, near = staged.bucket_files(out / "pairs", bucket_tasks(args.ranges), args.partitions)
        tracemalloc.start()  # numpy reports its buffers to it: the arrays held, not the memory-mapped columns' pages
        with decide_partitioned(dirs, exact, near, work_dir=out) as decision:
            held = tracemalloc.get_traced_memory()[1]
            write_index_shards(dirs, decision, out / "index")
        decision.stats.update(held_mb=round(held / 2**20, 1), held_with_shards_mb=round(tracemalloc.get_traced_memory()[1] / 2**20, 1))
        tracemalloc.stop()
        buckets = {}
        for f in out.glob("*.json"):
            if f.name.startswith(("band", "digest")):
                for k, v in json.loads(f.read_text()).items():
                    buckets[k] = buckets.get(k, 0) + v
        (out / "stats.json").write_text(json.dumps({"stats": decision.stats, "buckets": buckets}))
    elif args.task == "merge":  # the shards' merged identity (the prebuild's finalize: the manifest's hash and counts)
        from stacklm.data.dedup.shards import index_shard_paths, merged_identity

        out = root / f"p{args.partitions}"
        index = merged_identity(index_shard_paths(out / "index"))
        (out / "decision.json").write_text(json.dumps({"hash": index.content_hash, "counts": index.counts(), **json.loads((out / "stats.json").read_text())}))
    elif args.task == "pairs":  # --count-pairs: the distinct candidate pairs (shared digest or band), what the verification checks
        (root / "pairs.json").write_text(json.dumps({"candidates": candidate_pairs(dirs)}))
    elif args.task == "inproc":  # stages 2 and 3 in one process: `stacklm prebuild`'s and `dedup-index`'s decision
        from stacklm.data.dedup.decision import staged_decision
        from stacklm.data.dedup.shards import index_shard_paths, load_shards, write_index_shards

        with staged_decision(dirs, args.ranges, args.ranges, threshold=args.threshold, partitions=args.partitions, work_dir=root) as decision:
            write_index_shards(dirs, decision, root / "index-inproc")
        (root / "inproc.json").write_text(json.dumps({"hash": load_shards(index_shard_paths(root / "index-inproc")).content_hash}))
    elif args.task == "old":
        from stacklm.data.dedup.global_index import DedupIndex, decide_splits

        slices = {s: [] for s in ("val", "train")}
        for s, w in jobs(args.slices):
            with np.load(root / "old" / f"{s}-w{w:03d}.npz", allow_pickle=False) as z:
                slices[s].append({k: z[k] for k in ("ids", "source", "digest", "bands", "minhash")})
        DedupIndex.from_decisions(decide_splits(slices, threshold=args.threshold)).save(root / "old.npz")


def compare_with_reference(root: Path, n: int, parts: int) -> str:
    """The staged decision's removed ids against ``decide_splits``'s: the removed set must be the
    same (else the bench stops); the reason of a removal (``near`` or ``cross_split``) follows the
    kept copy it names, so where the two name different kept copies it is counted and said."""
    from stacklm.data.dedup.global_index import DedupIndex
    from stacklm.data.dedup.shards import load_shards

    ref, new = DedupIndex.load(root / "old.npz"), load_shards(sorted((root / f"p{parts}" / "index").glob("*[0-9].npz")))
    moved = 0
    for split in sorted(set(ref.splits) | set(new.splits)):
        def ids(index, reason):
            return index.splits.get(split, {}).get(reason, np.zeros(0, np.uint64))
        whole = [np.sort(np.concatenate([ids(x, r) for r in ("exact", "near", "cross_split")])) for x in (ref, new)]
        if not np.array_equal(*whole):
            raise SystemExit(f"bench/dedup_scale.py: at {n:,} docs the staged decision removed other {split} ids than decide_splits")
        moved += sum(int(np.setdiff1d(ids(new, r), ids(ref, r)).size) for r in ("exact", "near", "cross_split"))
    if not moved:
        return "removed ids identical to decide_splits (same ids, same reasons)"
    return (f"removed ids the same set as decide_splits', but {moved:,} of them with another reason (near <-> cross_split:"
            f" the two name another kept copy for them)")


def bucket_tasks(ranges: int) -> list[tuple[str, int, int]]:
    """(column, range, ranges) of every bucket task: the digest and every band, ``ranges`` key ranges each."""
    return [(c, r, ranges) for c in ["digest"] + [f"band{b}" for b in range(NUM_BANDS)] for r in range(ranges)]


def candidate_pairs(dirs: list[Path]) -> int:
    """Distinct (first member, other member) pairs of every digest and band bucket of two or
    more records over all slices: the candidate pairs the old cluster held, counted one column
    at a time (a pair shared by several bands counts once)."""
    from stacklm.data.dedup.exact import run_starts
    from stacklm.data.dedup.staged import FILE_SHIFT

    def unique_pairs(pairs: np.ndarray) -> np.ndarray:
        pairs = pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]
        keep = np.ones(pairs.shape[0], dtype=bool)
        keep[1:] = (pairs[1:] != pairs[:-1]).any(axis=1)
        return pairs[keep]

    acc = np.zeros((0, 2), dtype=np.uint64)
    for column in ["digest"] + [f"band{b}" for b in range(NUM_BANDS)]:
        keys = [np.load(d / f"{column}_key.npy", mmap_mode="r", allow_pickle=False) for d in dirs if (d / f"{column}_key.npy").exists()]
        nodes = [np.load(d / f"{column}_idx.npy", allow_pickle=False) | np.uint64(f << FILE_SHIFT) for f, d in enumerate(dirs) if (d / f"{column}_key.npy").exists()]
        kk, nn = np.concatenate(keys), np.concatenate(nodes)
        order = np.argsort(kk, kind="stable")
        kk, nn = kk[order], nn[order]
        head = run_starts(kk)
        first = np.maximum.accumulate(np.where(head, np.arange(kk.size), 0))
        dup = np.flatnonzero(~head)
        acc = unique_pairs(np.concatenate([acc, np.sort(np.stack([nn[first[dup]], nn[dup]], axis=1), axis=1)]))
    return int(acc.shape[0])


def run_task(args, name: str, index: int, partitions: int = 0, write_old: bool = False) -> tuple[float, float, float]:
    """(wall s, peak RSS MB, CPU s) of one stage task in a fresh process."""
    cmd = [sys.executable, __file__, "--task", name, "--index", str(index), "--root", args.root, "--docs", str(args.n),
           "--slices", str(args.slices), "--ranges", str(args.ranges), "--partitions", str(partitions or args.partitions[0]),
           "--threshold", str(args.threshold), "--dup", str(args.dup), "--val", str(args.val),
           "--gen", args.gen, "--chain", str(args.chain), "--web-dup", str(args.web_dup), "--alpha", str(args.alpha),
           "--exact", str(args.exact), "--jmin", str(args.jmin)]
    if write_old:
        cmd.append("--write-old")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)})
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"bench/dedup_scale.py: stage {name} task {index} at {args.n:,} docs failed (status {status})")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def main() -> None:
    from stacklm.data.dedup.verify import DEFAULT_THRESHOLD

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--old", type=int, nargs="*", default=[], help="sizes at which to also run the one-process reference decide_splits (~1.7 GB per million documents)")
    ap.add_argument("--inproc", type=int, nargs="*", default=[], help="sizes at which to also run the buckets and the decision in one process (staged_decision: what `stacklm prebuild` and `dedup-index` do)")
    ap.add_argument("--slices", type=int, default=8, help="signature tasks per split")
    ap.add_argument("--ranges", type=int, default=1, help="key ranges per band (and digest ranges)")
    ap.add_argument("--partitions", type=int, nargs="+", default=[1], help="decision partitions; several: the bucket and decision stages run once per count")
    ap.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="dedup.near_threshold: the fraction of equal MinHash values a verified pair needs")
    ap.add_argument("--count-pairs", action="store_true", help="also count the distinct candidate pairs (one more task, ~the old cluster's memory)")
    ap.add_argument("--gen", choices=("web", "dup"), default="web", help="web: web-like clusters (WebLayout); dup: the older --dup generator")
    ap.add_argument("--chain", type=int, default=0, help="web: plant one drift chain of this many documents (each link J 0.85 from the one before)")
    ap.add_argument("--web-dup", type=float, default=0.3, help="web: probability that a cluster has copies")
    ap.add_argument("--alpha", type=float, default=2.3, help="web: Zipf exponent of the copies per cluster")
    ap.add_argument("--exact", type=float, default=0.4, help="web: share of copies that are exact")
    ap.add_argument("--jmin", type=float, default=0.7, help="web: a near copy keeps each parent value with probability J ~ U(jmin, 1)")
    ap.add_argument("--dup", type=float, default=0.1, help="dup: fraction of planted copies (half exact, half near: one band and ~85 %% of the values shared)")
    ap.add_argument("--val", type=float, default=0.05)
    ap.add_argument("--root", default="/tmp/dedup_scale")
    ap.add_argument("--json", default=None)
    ap.add_argument("--task", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--write-old", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.task:
        args.docs, args.partitions = args.docs[0], args.partitions[0]
        return task(args)
    base, rows = args.root, []
    print(f"{'docs':>11} {'stage':>11} {'tasks':>5} {'max RSS MB':>10} {'max wall s':>10} {'sum wall s':>10} {'max CPU s':>9} {'sum CPU s':>9}")
    for n in args.docs:
        args.n, args.root = n, f"{base}/{n}"
        shutil.rmtree(args.root, ignore_errors=True)
        Path(args.root).mkdir(parents=True)
        old = n in args.old
        stages = [("base", 1, 0), ("sig", len(jobs(args.slices)), 0)] + ([("pairs", 1, 0)] if args.count_pairs else [])
        for parts in args.partitions:
            stages += [("buckets", len(bucket_tasks(args.ranges)), parts), ("decision", 1, parts), ("merge", 1, parts)]
        stages += ([("inproc", 1, 0)] if n in args.inproc else []) + ([("old", 1, 0)] if old else [])
        for name, count, parts in stages:
            got = [run_task(args, name, i, parts, write_old=old) for i in range(count)]
            label = f"{name} P={parts}" if parts else name
            row = {"docs": n, "stage": label, "tasks": count, "max_rss_mb": round(max(g[1] for g in got), 1),
                   "max_wall_s": round(max(g[0] for g in got), 2), "sum_wall_s": round(sum(g[0] for g in got), 2),
                   "max_cpu_s": round(max(g[2] for g in got), 2), "sum_cpu_s": round(sum(g[2] for g in got), 2)}
            rows.append(row)
            print(f"{n:>11,} {label:>11} {count:>5} {row['max_rss_mb']:>10,.1f} {row['max_wall_s']:>10.2f} {row['sum_wall_s']:>10.2f}"
                  f" {row['max_cpu_s']:>9.2f} {row['sum_cpu_s']:>9.2f}", flush=True)
        results = {parts: json.loads((Path(args.root) / f"p{parts}" / "decision.json").read_text()) for parts in args.partitions}
        new = results[args.partitions[0]]
        b, st = new["buckets"], new["stats"]
        line = (f"{n:>11,} bucket tasks: {b['candidates']:,} records in shared buckets, {b['rows']:,} rows written ({b['unverified']:,} left unverified);"
                f" decision: {st['edges']:,} distinct verified edges ({st['edges'] / n:.3f} per document), {st['remainder_edges']:,} in the remainder pass,"
                f" arrays held at peak {st['held_mb']:,} MB ({st['held_with_shards_mb']:,} MB with the shards written; tracemalloc);"
                f" removed {json.dumps(new['counts'], sort_keys=True)}")
        summary = {"docs": n, "counts": new["counts"], "stats": st, "buckets": b, "held_mb": {p: r["stats"]["held_mb"] for p, r in results.items()}}
        if args.count_pairs:
            cand = json.loads((Path(args.root) / "pairs.json").read_text())["candidates"]
            line += f"; {cand:,} distinct candidate pairs ({cand / n:.3f} per document)"
            summary["candidates"] = cand
        if args.gen == "web":
            sizes = layout(args, n).cluster_sizes()
            line += (f"; clusters: {sizes.size:,} ({(sizes > 1).sum():,} with copies, {(sizes[sizes > 1] == 2).mean():.0%} of those of size 2,"
                     f" largest {sizes.max():,}), {sizes[sizes > 1].sum() / n:.1%} of documents in one with copies")
        if any(r["hash"] != new["hash"] for r in results.values()):
            raise SystemExit(f"bench/dedup_scale.py: at {n:,} docs the decision removed other ids with --partitions {args.partitions}")
        if len(results) > 1:
            line += f"; removed ids identical for partitions {args.partitions}"
            line += "; arrays held at peak per P: " + ", ".join(f"P={p} {r['stats']['held_mb']:,} MB" for p, r in results.items())
        if old:
            line += "; " + compare_with_reference(Path(args.root), n, args.partitions[0])
        if n in args.inproc:
            if json.loads((Path(args.root) / "inproc.json").read_text())["hash"] != new["hash"]:
                raise SystemExit(f"bench/dedup_scale.py: at {n:,} docs the in-process staged_decision removed other ids than the staged tasks")
            line += "; in-process staged_decision identical"
        print(line, flush=True)
        rows.append(summary)
        shutil.rmtree(args.root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
