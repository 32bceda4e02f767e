"""Peak memory and wall time of the global dedup decision at corpus scale: the staged decision
(``stacklm.data.dedup.staged``, what ``prebuild-datatrove`` runs) side by side with the old
single-process ``decide_splits``, on synthetic signatures.

    python3 bench/dedup_scale.py --docs 1000000 2000000 --old 1000000 2000000 [--inproc 1000000] [--slices 8] [--dup 0.1]

Signatures are synthetic (no text): document ``j`` of the corpus gets random 64-bit band keys
and digest from a hash of ``j``; a ``--dup`` fraction of documents copies an earlier document
(chosen by hash): half of them exactly (same digest and every band key: the same normalised
text) and half near (one band key shared). A ``--val`` fraction is in the val split, so
copies straddle train and val. Documents are dealt to ``--slices`` slices per split (the
signature tasks), ids ``s<source>/part<p>/<row>`` like a real source's.

Every stage task runs as its own process, one after the other (``os.wait4`` gives its peak
RSS, ``ru_maxrss``): ``sig`` (one per slice: generate and write the slice's signature columns,
and the old format when ``--old`` includes this size), ``buckets`` (1 digest range + 12 bands
x ``--ranges``), ``cluster`` (one: the pairs -> sharded removed ids), ``inproc`` (one, sizes in
``--inproc``: every bucket task and the cluster in one process, ``staged.staged_decision``, the
decision ``stacklm prebuild`` and ``stacklm dedup-index`` make in their parent process) and ``old`` (one: load
every slice and run ``decide_splits``, what ``StackDedupDecision`` did); ``base`` is a task
that only imports (every task's floor: numpy, torch via stacklm.data). CPU seconds are
printed beside wall seconds: on a shared machine the wall time includes waiting for a core.
Where both ran, the
removed ids are checked to be identical (``content_hash``). Prints one table row per stage and
size, and writes the rows as JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NUM_BANDS = 12
C1, C2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD6E8FEB86659FD93)


def _mix(x: np.ndarray) -> np.ndarray:
    from stacklm.data.dedup.minhash import _fmix64

    return _fmix64(np.asarray(x, dtype=np.uint64).copy())


def _original(j: np.ndarray, dup: float) -> np.ndarray:
    """Whether document ``j`` is an original (not a planted copy): a function of ``j`` alone."""
    return (_mix(j * C2 + np.uint64(7)) % np.uint64(1_000_000)).astype(np.int64) >= int(dup * 1_000_000)


def slice_records(n: int, slices: int, split: str, w: int, dup: float, val: float) -> dict:
    """The records of slice ``w`` of ``split``: every document ``j < n`` whose split is
    ``split`` and ``j % slices == w``; vectorised, no state shared between slices. A copy's
    base is an earlier *original* (so an exact copy has exactly its base's band keys, as the
    same normalised text does); a copy whose few tries find none stays an original."""
    with np.errstate(over="ignore"):
        j = np.arange(w, n, slices, dtype=np.uint64)
        u = _mix(j * C1 + np.uint64(1))
        in_val = (u % np.uint64(10_000)) < np.uint64(int(val * 10_000))
        j = j[in_val == (split == "val")]
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
    source = (j % np.uint64(3)).astype(np.int32)
    part = (j // np.uint64(3)) % np.uint64(16)
    row = j // np.uint64(48)
    ids = np.char.add(np.char.add(np.char.add(np.char.add("s", source.astype(str)), "/part"), np.char.add(part.astype(str), "/")), row.astype(str))
    return {"ids": ids, "source": source, "digest": digest, "bands": bands}


def jobs(slices: int) -> list[tuple[str, int]]:
    return [(s, w) for s in ("val", "train") for w in range(slices)]


# -- one stage task, in its own process ------------------------------------------------------------
def task(args) -> None:
    from stacklm.data.dedup import staged

    root = Path(args.root)
    dirs = [root / "sig" / f"{s}-w{w:03d}" for s, w in jobs(args.slices)]
    if args.task == "base":  # the imports alone: every task's floor
        pass
    elif args.task == "sig":
        s, w = jobs(args.slices)[args.index]
        rec = slice_records(args.docs, args.slices, s, w, args.dup, args.val)
        staged.write_signature_dir(rec, s, dirs[args.index])
        if args.write_old:
            (root / "old").mkdir(exist_ok=True)
            np.savez(root / "old" / f"{s}-w{w:03d}.npz", **rec)
    elif args.task == "buckets":
        columns = ["digest"] + [f"band{b}" for b in range(NUM_BANDS)]
        column = columns[args.index // args.ranges]
        r = args.index % args.ranges
        pairs = staged.bucket_pairs(dirs, column, *staged.key_range(r, args.ranges))
        staged.save_pairs(pairs, root / "pairs" / f"{column}-r{r:04d}.npy")
    elif args.task == "cluster":
        files = sorted((root / "pairs").glob("*.npy"))
        ex = [staged.load_pair_files([p for p in files if p.name.startswith("digest")])]
        nr = [staged.load_pair_files([p for p in files if not p.name.startswith("digest")])]
        removed = staged.cluster_pairs(dirs, ex, nr)
        staged.write_index_shards(dirs, removed, root / "index")
        (root / "new.json").write_text(json.dumps({"hash": staged.load_shards(sorted((root / "index").glob("*.npz"))).content_hash,
                                                   "pairs": int(sum(p.shape[0] for p in ex + nr)),
                                                   "pairs_written": int(sum(staged.load_pairs(p).shape[0] for p in files))}))
    elif args.task == "inproc":  # stages 2 and 3 in one process: `stacklm prebuild`'s and `dedup-index`'s decision
        removed = staged.staged_decision(dirs, args.ranges, args.ranges)
        staged.write_index_shards(dirs, removed, root / "index-inproc")
        (root / "inproc.json").write_text(json.dumps({"hash": staged.load_shards(sorted((root / "index-inproc").glob("*.npz"))).content_hash}))
    elif args.task == "old":
        from stacklm.data.dedup.global_index import DedupIndex, decide_splits

        slices = {s: [] for s in ("val", "train")}
        for s, w in jobs(args.slices):
            with np.load(root / "old" / f"{s}-w{w:03d}.npz", allow_pickle=False) as z:
                slices[s].append({k: z[k] for k in ("ids", "source", "digest", "bands")})
        index = DedupIndex.from_decisions(decide_splits(slices))
        (root / "old.json").write_text(json.dumps({"hash": index.content_hash, "counts": index.counts()}))


def run_task(args, name: str, index: int, write_old: bool = False) -> tuple[float, float, float]:
    """(wall s, peak RSS MB, CPU s) of one stage task in a fresh process."""
    cmd = [sys.executable, __file__, "--task", name, "--index", str(index), "--root", args.root, "--docs", str(args.n),
           "--slices", str(args.slices), "--ranges", str(args.ranges), "--dup", str(args.dup), "--val", str(args.val)]
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--old", type=int, nargs="*", default=[], help="sizes at which to also run the old single-process decision")
    ap.add_argument("--inproc", type=int, nargs="*", default=[], help="sizes at which to also run the buckets and cluster in one process (what `stacklm prebuild` and `dedup-index` do)")
    ap.add_argument("--slices", type=int, default=8, help="signature tasks per split")
    ap.add_argument("--ranges", type=int, default=1, help="key ranges per band (and digest ranges)")
    ap.add_argument("--dup", type=float, default=0.1)
    ap.add_argument("--val", type=float, default=0.05)
    ap.add_argument("--root", default="/tmp/dedup_scale")
    ap.add_argument("--json", default=None)
    ap.add_argument("--task", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--write-old", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.task:
        args.docs = args.docs[0]
        return task(args)
    base, rows = args.root, []
    print(f"{'docs':>11} {'stage':>8} {'tasks':>5} {'max RSS MB':>10} {'max wall s':>10} {'sum wall s':>10} {'max CPU s':>9} {'sum CPU s':>9}")
    for n in args.docs:
        args.n, args.root = n, f"{base}/{n}"
        shutil.rmtree(args.root, ignore_errors=True)
        Path(args.root).mkdir(parents=True)
        old = n in args.old
        stages = [("base", 1), ("sig", len(jobs(args.slices))), ("buckets", (1 + NUM_BANDS) * args.ranges), ("cluster", 1)] + ([("inproc", 1)] if n in args.inproc else []) + ([("old", 1)] if old else [])
        for name, count in stages:
            got = [run_task(args, name, i, write_old=old) for i in range(count)]
            row = {"docs": n, "stage": name, "tasks": count, "max_rss_mb": round(max(g[1] for g in got), 1),
                   "max_wall_s": round(max(g[0] for g in got), 2), "sum_wall_s": round(sum(g[0] for g in got), 2),
                   "max_cpu_s": round(max(g[2] for g in got), 2), "sum_cpu_s": round(sum(g[2] for g in got), 2)}
            rows.append(row)
            print(f"{n:>11,} {name:>8} {count:>5} {row['max_rss_mb']:>10,.1f} {row['max_wall_s']:>10.2f} {row['sum_wall_s']:>10.2f}"
                  f" {row['max_cpu_s']:>9.2f} {row['sum_cpu_s']:>9.2f}", flush=True)
        new = json.loads((Path(args.root) / "new.json").read_text())
        line = f"{n:>11,} pairs {new['pairs_written']:,} written by the bucket tasks, {new['pairs']:,} distinct (held by the cluster)"
        if old:
            ref = json.loads((Path(args.root) / "old.json").read_text())
            if ref["hash"] != new["hash"]:
                raise SystemExit(f"bench/dedup_scale.py: at {n:,} docs the staged decision removed other ids than decide_splits")
            line += f"; removed ids identical to decide_splits ({json.dumps(ref['counts'], sort_keys=True)})"
        if n in args.inproc:
            if json.loads((Path(args.root) / "inproc.json").read_text())["hash"] != new["hash"]:
                raise SystemExit(f"bench/dedup_scale.py: at {n:,} docs the in-process staged decision removed other ids than the staged tasks")
            line += "; in-process staged decision identical"
        print(line, flush=True)
        rows.append({"docs": n, "pairs": new["pairs"], "pairs_written": new["pairs_written"], "identical_to_old": old or None})
        shutil.rmtree(args.root, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
