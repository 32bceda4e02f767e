"""The staged decision's output: one removed-id ``DedupIndex`` per slice (``<job>.npz``) with its
evidence beside it (``<job>.evidence.npz``), and the shards merged back into one index.

Each packing task of a slice loads only its own shard; the manifest's totals and hash, and
``stacklm dedup-index``'s single file, are the shards merged (``load_shards``: the same arrays,
so the same ``content_hash`` as one file). Apart from ``staged`` (the stages that decide) so
that module stays about deciding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data.dedup.global_index import REASONS, DedupIndex
from stacklm.data.dedup.decision import Decision
from stacklm.data.dedup.staged import _col, _nodes_of, slice_meta


def _doc_ids(sig_dirs: Sequence[Path], nodes: np.ndarray) -> np.ndarray:
    """The ``doc_id`` strings of node ids (``source/part/row``, from the slice's part table and rows)."""
    f, i = _nodes_of(nodes)
    out = np.empty(nodes.size, dtype=object)
    for file in np.unique(f).tolist():
        sel = np.flatnonzero(f == file)
        table = np.asarray(_col(sig_dirs[file], "prefixes")).tolist()
        prefix = np.asarray(_col(sig_dirs[file], "prefix")[i[sel]]).tolist()
        rows = np.asarray(_col(sig_dirs[file], "row")[i[sel]]).tolist()
        out[sel] = [table[p] if r < 0 else f"{table[p]}/{r}" for p, r in zip(prefix, rows)]
    return out.astype(str) if nodes.size else np.zeros(0, "<U1")


def write_index_shards(sig_dirs: Sequence[str | Path], decision: Decision, out_dir: str | Path, config_meta: Mapping[str, Any] | None = None) -> dict[str, dict[str, int]]:
    """One ``DedupIndex`` per slice at ``out_dir/<slice dir name>.npz``: that slice's split and
    only its removed ids (``idkey`` of the removed records); beside it the slice's evidence
    (``evidence.evidence_path``: per removed document the kept one, the reason and the
    estimated similarity). Returns the removed counts per split."""
    from stacklm.data.dedup.evidence import DedupEvidence, evidence_path

    sig_dirs = [Path(d) for d in sig_dirs]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metas = [slice_meta(d) for d in sig_dirs]
    totals: dict[str, dict[str, int]] = {}
    for file, d in enumerate(sig_dirs):  # one slice's removals at a time (``Decision.rows``)
        split = metas[file]["split"]
        node, kept, reason, equal = decision.rows(file)
        local = _nodes_of(node)[1]
        idkey = _col(d, "idkey")
        arrays = {r: np.sort(np.asarray(idkey[local[reason == code]], dtype=np.uint64)) for code, r in enumerate(REASONS, start=1)}
        counts = {r: int(a.size) for r, a in arrays.items()}
        t = totals.setdefault(split, {r: 0 for r in REASONS})
        for r in REASONS:
            t[r] += counts[r]
        shard = DedupIndex({split: arrays}, {**(config_meta or {}), "docs": {split: int(metas[file]["n"])}, "removed": {split: counts}})
        shard.save(out_dir / f"{d.name}.npz")
        evidence = {
            "removed": _doc_ids(sig_dirs, node), "kept": _doc_ids(sig_dirs, kept),
            "kept_split": np.array([metas[k]["split"] for k in _nodes_of(kept)[0].tolist()], dtype=str),
            "reason": reason,
            "similarity": np.where(reason == 1, 1.0, equal / max(decision.num_perm, 1)),
        }
        # bound to its index (``index_sha256``): evidence put beside another index is refused
        meta = {"num_perm": decision.num_perm, "index_sha256": shard.content_hash, **{k: v for k, v in (config_meta or {}).items() if k == "dedup"}}
        DedupEvidence({split: evidence}, meta).save(evidence_path(out_dir / f"{d.name}.npz"))
    return totals


def index_shard_paths(shard_dir: str | Path) -> list[Path]:
    """The removed-id shards of ``shard_dir`` (``<job>.npz``), sorted; not their evidence files."""
    return sorted(p for p in Path(shard_dir).glob("*.npz") if not p.name.endswith(".evidence.npz"))


def save_merged(paths: Sequence[str | Path], out: str | Path) -> DedupIndex:
    """The shards ``paths`` merged into one index file at ``out`` (``load_shards``) and their
    evidence into one beside it (``evidence.evidence_path(out)``, written first: an index file
    present means its evidence is). Returns the index."""
    from stacklm.data.dedup.evidence import evidence_path, load_evidence_shards

    index = load_shards(paths)
    evidence = load_evidence_shards(paths)
    evidence.meta["index_sha256"] = index.content_hash  # the merged index's, not the first shard's
    evidence.save(evidence_path(out))
    index.save(out)
    return index


def load_shards(paths: Sequence[str | Path]) -> DedupIndex:
    """The index of all shards together (what ``decide_index`` would have saved in one file):
    same arrays, so the same ``content_hash``; ``meta`` sums the shards' ``docs`` and ``removed``."""
    splits: dict[str, dict[str, list[np.ndarray]]] = {}
    meta: dict[str, Any] = {"docs": {}, "removed": {}}
    for p in paths:
        shard = DedupIndex.load(p)
        meta = _add_meta(meta, shard)
        for s, per in shard.splits.items():
            for r, a in per.items():
                splits.setdefault(s, {}).setdefault(r, []).append(a)
    return DedupIndex({s: {r: np.concatenate(v) for r, v in per.items()} for s, per in splits.items()}, meta)


def _add_meta(meta: dict[str, Any], shard: DedupIndex) -> dict[str, Any]:
    """The merged meta so far plus ``shard``'s: its ``docs`` and ``removed`` counts summed per
    split (and reason), the other keys the last shard's (every shard of a decision has the same)."""
    docs, removed = meta["docs"], meta["removed"]
    for s in shard.splits:
        docs[s] = docs.get(s, 0) + int(shard.meta.get("docs", {}).get(s, 0))
        for r, c in shard.meta.get("removed", {}).get(s, {}).items():
            removed.setdefault(s, {}).setdefault(r, 0)
            removed[s][r] += int(c)
    return {**{k: v for k, v in shard.meta.items() if k not in ("docs", "removed")}, "docs": docs, "removed": removed}


@dataclass
class MergedIdentity:
    """What the merged index of a set of shards is called and counts (``content_hash``,
    ``counts()``, ``meta``: those of ``load_shards``), without its arrays."""

    content_hash: str
    removed: dict[str, dict[str, int]]
    meta: dict[str, Any]

    def counts(self) -> dict[str, dict[str, int]]:
        return self.removed


def merged_identity(paths: Sequence[str | Path], ids_per_range: int = 1 << 24) -> MergedIdentity:
    """``load_shards(paths)``'s ``content_hash``, counts and meta (the prebuild's finalize records
    them in the top manifest) without holding the merged arrays: each shard is read once and its
    sorted ids are spilled into key ranges of about ``ids_per_range`` ids (ids are hashes, so the
    ranges fill evenly), then each range is sorted and hashed in key order. The largest holding is
    one shard and one range (~128 MB), not 8 B per removed document of the corpus."""
    import hashlib
    import tempfile

    paths = [Path(p) for p in paths]
    ranges = max(1, -(-sum(p.stat().st_size for p in paths) // (8 * ids_per_range)))
    bounds = np.array([r * ((1 << 64) // ranges) for r in range(1, ranges)], dtype=np.uint64)
    splits: list[str] = []
    sizes: dict[tuple[int, str], int] = {}
    meta: dict[str, Any] = {"docs": {}, "removed": {}}
    with tempfile.TemporaryDirectory(prefix=".index-merge-", dir=paths[0].parent if paths else None) as tmp:
        for n, p in enumerate(paths):
            shard = DedupIndex.load(p)
            meta = _add_meta(meta, shard)
            for s, per in shard.splits.items():
                if s not in splits:
                    splits.append(s)
                for r, a in per.items():  # sorted (``DedupIndex``): each range a contiguous run
                    sizes[(splits.index(s), r)] = sizes.get((splits.index(s), r), 0) + int(a.size)
                    cuts = [0, *np.searchsorted(a, bounds).tolist(), a.size]
                    for k in range(ranges):
                        if cuts[k + 1] > cuts[k]:
                            np.save(Path(tmp) / f"{splits.index(s)}.{r}.{k}.{n}.npy", a[cuts[k] : cuts[k + 1]], allow_pickle=False)
        h = hashlib.sha256()  # ``DedupIndex.content_hash``'s bytes, range by range
        for s in sorted(splits):
            j = splits.index(s)
            for r in sorted(REASONS):
                h.update(f"{s}/{r}/{sizes.get((j, r), 0)};".encode())
                for k in range(ranges):
                    parts = [np.load(f, allow_pickle=False) for f in sorted(Path(tmp).glob(f"{j}.{r}.{k}.*.npy"))]
                    if parts:
                        h.update(np.sort(np.concatenate(parts)).tobytes())
    counts = {s: {r: sizes.get((splits.index(s), r), 0) for r in REASONS} for s in splits}
    return MergedIdentity(h.hexdigest(), counts, meta)
