"""Why a document was removed by the global dedup decision: per removed document, the kept
document it duplicates and how similar the two are.

The decision (``staged``) writes one ``DedupEvidence`` beside every removed-id index file it
writes: ``X.npz`` -> ``X.evidence.npz`` (``evidence_path``). Kept out of the index itself so
stream mode, which loads the index into every reader, never pays for the strings. Data only:
``np.savez`` of plain arrays plus a JSON meta, read with ``allow_pickle=False``.

Per split, one row per removed document:

* ``removed`` / ``kept``: the ``doc_id`` strings (``source/part/row``) of the removed document
  and of the kept document it was removed for (for ``cross_split`` the kept one is in another
  split: the split the row's ``kept_split`` names);
* ``reason``: 1 exact, 2 near, 3 cross_split (``global_index.REASONS``' order, as
  ``DedupIndex.lookup`` codes it);
* ``similarity``: the Jaccard similarity of the two documents' shingle sets as the decision
  estimated it from their MinHash signatures (the fraction of equal values; 1.0 for an exact
  copy). The exact Jaccard is not computed by the decision (no task holds the texts);
  ``stacklm inspect`` computes it from the two texts when it shows a removal.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data.dedup.global_index import read_meta_npz
from stacklm.errors import ConfigError

EVIDENCE_FORMAT = "stacklm-dedup-evidence"
EVIDENCE_VERSION = 1
COLUMNS = ("removed", "kept", "kept_split", "reason", "similarity")
REASON_NAMES = {1: "exact", 2: "near", 3: "cross_split"}
# Removal-similarity histogram bins (prebuild summary, ledger): exact copies apart, near ones by
# estimated Jaccard. The lowest edge is 0: a verified removal is at or above the threshold, but
# the histogram does not assume the threshold.
HIST_EDGES = (0.0, 0.8, 0.85, 0.9, 0.95, 1.0)


def evidence_path(index_path: str | Path) -> Path:
    """Where the evidence of the index file ``index_path`` lives: ``X.npz`` -> ``X.evidence.npz``."""
    p = Path(index_path)
    return p.with_name((p.name[:-4] if p.name.endswith(".npz") else p.name) + ".evidence.npz")


def _empty() -> dict[str, np.ndarray]:
    return {"removed": np.zeros(0, "<U1"), "kept": np.zeros(0, "<U1"), "kept_split": np.zeros(0, "<U1"),
            "reason": np.zeros(0, np.int8), "similarity": np.zeros(0, np.float64)}


class DedupEvidence:
    """Per split the rows above, sorted by ``removed`` (so ``why`` is a binary search)."""

    def __init__(self, splits: Mapping[str, Mapping[str, np.ndarray]], meta: Mapping[str, Any] | None = None) -> None:
        self.splits: dict[str, dict[str, np.ndarray]] = {}
        for s, cols in splits.items():
            got = {k: np.asarray(cols[k]) if k in cols else _empty()[k] for k in COLUMNS}
            got["reason"] = got["reason"].astype(np.int8)
            got["similarity"] = got["similarity"].astype(np.float64)  # 108/120 stays 0.9, not 0.89999998
            for k in ("removed", "kept", "kept_split"):
                got[k] = got[k].astype(str) if got[k].size else _empty()[k]
            order = np.argsort(got["removed"], kind="stable")
            self.splits[s] = {k: v[order] for k, v in got.items()}
        self.meta = dict(meta or {})

    def __len__(self) -> int:
        return sum(int(c["removed"].size) for c in self.splits.values())

    def why(self, split: str, doc_id: str) -> dict[str, Any] | None:
        """The evidence of ``doc_id`` in ``split``: ``{"reason", "kept", "kept_split",
        "similarity"}``, or ``None`` when the decision did not remove it."""
        cols = self.splits.get(split)
        if cols is None or not cols["removed"].size:
            return None
        i = int(np.searchsorted(cols["removed"], doc_id))
        if i >= cols["removed"].size or cols["removed"][i] != doc_id:
            return None
        return {"reason": REASON_NAMES[int(cols["reason"][i])], "kept": str(cols["kept"][i]),
                "kept_split": str(cols["kept_split"][i]), "similarity": float(cols["similarity"][i])}

    def histogram(self, split: str | None = None) -> dict[str, dict[str, int]]:
        """Per source (a ``doc_id``'s first component) the removals by similarity bin: ``exact``
        and the ``HIST_EDGES`` bins of the estimated Jaccard (``"0.90-0.95"``; the last bin
        holds 1.0 of a near copy that is not an exact one). Every split when ``split`` is None."""
        out: dict[str, dict[str, int]] = {}
        labels = [f"{a:.2f}-{b:.2f}" for a, b in zip(HIST_EDGES[:-1], HIST_EDGES[1:])]
        for s, cols in self.splits.items():
            if split is not None and s != split:
                continue
            sources = np.array([r.split("/", 1)[0] for r in cols["removed"].tolist()], dtype=str)
            for src in np.unique(sources).tolist():
                mine = sources == src
                row = out.setdefault(src, {"exact": 0, **{lab: 0 for lab in labels}})
                row["exact"] += int((mine & (cols["reason"] == 1)).sum())
                near = cols["similarity"][mine & (cols["reason"] != 1)]
                counts = np.histogram(np.clip(near, HIST_EDGES[0], HIST_EDGES[-1]), bins=HIST_EDGES)[0]
                for lab, c in zip(labels, counts.tolist()):
                    row[lab] += int(c)
        return out

    def save(self, path: str | Path) -> None:
        import io

        from stacklm.atomic import atomic_write_bytes

        arrays = {f"{s}__{k}": v for s, cols in sorted(self.splits.items()) for k, v in cols.items()}
        meta = {"format": EVIDENCE_FORMAT, "version": EVIDENCE_VERSION, **self.meta}
        buf = io.BytesIO()
        np.savez(buf, meta=np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8), **arrays)
        atomic_write_bytes(Path(path), buf.getvalue())

    @classmethod
    def load(cls, path: str | Path) -> DedupEvidence:
        """The evidence at ``path``; data only (``allow_pickle=False``): anything else is refused
        in one line naming the file."""
        path = Path(path)
        fix = "it is rewritten with the index (`stacklm dedup-index`, or a new prebuild)"
        meta, arrays = read_meta_npz(path, EVIDENCE_FORMAT, f"{path}: not a stacklm dedup evidence file",
                                     f"{path}: no dedup evidence beside this index (an index built before stacklm wrote evidence); {fix}", fix)
        splits: dict[str, dict[str, np.ndarray]] = {}
        for key, a in arrays.items():
            s, _, col = key.rpartition("__")
            if col not in COLUMNS or a.dtype.hasobject:
                raise ConfigError(f"{path}: not a stacklm dedup evidence file (array {key!r}); {fix}")
            splits.setdefault(s, {})[col] = a
        return cls(splits, meta)

    @classmethod
    def merge(cls, parts: Sequence[DedupEvidence]) -> DedupEvidence:
        """The evidence of several shards (the staged decision writes one per slice) as one."""
        splits: dict[str, dict[str, list[np.ndarray]]] = {}
        meta: dict[str, Any] = {}
        for p in parts:
            meta = meta or dict(p.meta)
            for s, cols in p.splits.items():
                for k, v in cols.items():
                    splits.setdefault(s, {}).setdefault(k, []).append(v)
        return cls({s: {k: np.concatenate(v) for k, v in cols.items()} for s, cols in splits.items()}, meta)


def load_evidence_shards(index_paths: Sequence[str | Path]) -> DedupEvidence:
    """The evidence beside each of ``index_paths`` (a build's ``.prebuild/dedup-index/*.npz``), merged."""
    return DedupEvidence.merge([DedupEvidence.load(evidence_path(p)) for p in index_paths])


# A finished prebuild keeps its decision's evidence in ``OUT/dedup-evidence/<job>.evidence.npz``:
# the index shards it sits beside live in the build's state folder, which goes when the build
# finishes (``prebuild.manifests.finalize`` moves the evidence out first).
BUILD_EVIDENCE_DIR = "dedup-evidence"
EVIDENCE_SUFFIX = ".evidence.npz"


def build_evidence_files(out: str | Path) -> list[Path]:
    """The evidence shards of the finished prebuild ``out``, sorted; empty when it kept none.
    Each is a regular file inside ``out`` (``datafiles``: a link out of the build is refused)."""
    from stacklm.data.storage.datafiles import check_data_dir, check_data_file

    folder = Path(out) / BUILD_EVIDENCE_DIR
    if check_data_dir(folder, out) is None:
        return []
    return [p for p in sorted(folder.glob(f"*{EVIDENCE_SUFFIX}")) if check_data_file(p, out) is not None]


def add_histograms(into: dict[str, dict[str, int]], more: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """``into`` plus ``more`` (``histogram`` results of several shards or splits), bin by bin."""
    for src, row in more.items():
        slot = into.setdefault(src, {})
        for label, n in row.items():
            slot[label] = slot.get(label, 0) + int(n)
    return into


def split_histograms(paths: Sequence[str | Path]) -> dict[str, dict[str, dict[str, int]]]:
    """Per split, per source, the removal-similarity histogram of the evidence shards ``paths``,
    read one shard at a time (a build's evidence is never held whole)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for p in paths:
        ev = DedupEvidence.load(p)
        for split in ev.splits:
            add_histograms(out.setdefault(split, {}), ev.histogram(split))
    return out


def histogram_labels() -> list[str]:
    """A histogram row's bins as shown: ``exact``, then the near bins from the most similar down."""
    return ["exact"] + [f"{a:.2f}-{b:.2f}" for a, b in zip(HIST_EDGES[-2::-1], HIST_EDGES[:0:-1])]


def compact_histogram(row: Mapping[str, int]) -> str:
    """One histogram row as ``exact 12, 0.95-1.00 3`` (empty bins left out; ``none`` if all are)."""
    return ", ".join(f"{label} {int(row[label]):,}" for label in histogram_labels() if row.get(label)) or "none"
