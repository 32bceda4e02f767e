"""The prebuild's global dedup pass: signatures per (split, reader) slice, then one decision over
all splits (no duplicate set keeps members in two splits), saved as
``OUT/.prebuild/dedup_index.npz`` before any packing job starts.

The packing jobs then run with in-flight dedup off and drop the ids the index lists, so the
documents removed (and, unless the token budget binds, the documents kept) are the same for
every ``--workers N`` and every number of datatrove tasks (docs/prebuild.md says exactly what
is invariant; ``stacklm.data.dedup.global_index`` explains the design). Also the
engine of ``stacklm dedup-index`` (stream mode's offline index).
"""

from __future__ import annotations

import dataclasses
import io
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.errors import ConfigError, PrebuildError

INDEX_FILE = "dedup_index.npz"
INDEX_SHARDS = "dedup-index"  # the staged decision's removed ids, one DedupIndex per job (``staged``)


def uses_global_dedup(config) -> bool:
    return bool(config.dedup.exact or config.dedup.near)


def packing_config(config):
    """The config the packing jobs run: in-flight dedup off (the global index replaces it)."""
    if not uses_global_dedup(config):
        return config
    return dataclasses.replace(config, dedup=dataclasses.replace(config.dedup, exact=False, near=False, index=None))


def signature_slice(config_dict: dict[str, Any], split: str, reader: int, readers: int) -> dict[str, Any]:
    """Step 1 for reader ``reader`` of ``readers``: every source's documents after holdout and
    filter, as signature records (``collect_signatures``). A plain function of plain
    arguments, so it runs in a spawned process or a datatrove task alike."""
    from stacklm.data.dedup.global_index import collect_signatures
    from stacklm.data.dedup.minhash import MinHasher
    from stacklm.data.pipeline import PipelineConfig, document_chain, last_document_node
    from stacklm.data.sources import ShardSpec

    config = PipelineConfig.from_dict(config_dict)
    hasher = MinHasher() if config.dedup.near else None
    source_index = {e.name: i for i, e in enumerate(config.mix.entries)}

    bytes_in = np.zeros(len(config.mix.entries), dtype=np.int64)  # input bytes read, per source

    def docs():
        for i, entry in enumerate(config.mix.entries):
            chain = document_chain(config, entry, split, ShardSpec(0, 1, reader, readers))
            node = last_document_node(chain)
            node.reset(None)
            yield from node
            bytes_in[i] = getattr(chain["source"], "bytes_in", 0)

    return {**collect_signatures(docs(), source_index, hasher, exact=config.dedup.exact), "bytes_in": bytes_in}


def decide_index(config, slices: dict[str, Sequence[dict[str, Any]]]):
    """Step 2, one decision over all splits together (``decide_splits``: a duplicate set with
    members in two splits keeps its val copy); a ``DedupIndex`` of the removed ids with the
    counts in its meta."""
    from stacklm.data.dedup.global_index import REASONS, DedupIndex, decide_splits

    decisions = decide_splits(slices, exact=config.dedup.exact, near=config.dedup.near)
    meta = {
        "dedup": dataclasses.asdict(config.dedup),
        "docs": {s: d["docs"] for s, d in decisions.items()},
        "removed": {s: {r: len(d[r]) for r in REASONS} for s, d in decisions.items()},
        # the signature pass's read volume (input bytes read, per split and source): not in
        # the index's content hash, reported in the top manifest's ``read_volume``
        "bytes_read": {s: {e.name: int(sum(int(x["bytes_in"][i]) for x in per if "bytes_in" in x))
                           for i, e in enumerate(config.mix.entries)} for s, per in slices.items()},
    }
    return DedupIndex.from_decisions(decisions, meta)


def build_dedup_index(
    config, splits: Sequence[str], readers: int, run_all: Callable[[list[tuple]], list[Any]] | None = None
):
    """Steps 1 and 2 over ``readers`` slices per split. ``run_all`` maps a list of
    ``(config_dict, split, reader, readers)`` to results (e.g. in a process pool); default: here."""
    cfg = config.to_dict()
    jobs = [(cfg, split, r, readers) for split in splits for r in range(readers)]
    results = run_all(jobs) if run_all is not None else [signature_slice(*j) for j in jobs]
    slices: dict[str, list[dict[str, Any]]] = {s: [] for s in splits}
    for (_, split, _, _), res in zip(jobs, results):
        slices[split].append(res)
    return decide_index(config, slices)


def load_build_index(path: Path):
    """A build's own ``.prebuild/dedup_index.npz`` (data only, ``allow_pickle=False``); a file that
    is not one is refused, naming it and saying to delete it (the next run rebuilds it)."""
    from stacklm.data.dedup.global_index import DedupIndex

    try:
        return DedupIndex.load(path, fix="delete it and re-run the same command (the dedup pass runs again)")
    except ConfigError as e:  # not the user's `dedup.index` setting: the build's own state
        raise PrebuildError(str(e).removeprefix("dedup.index: "), path=path) from None


def load_or_build(plan, run_all=None):
    """The build's index: read back on a resume (it was saved before any packing job), else built
    and saved atomically."""
    from stacklm.prebuild.plan import state_dir_of

    path = state_dir_of(plan.out) / INDEX_FILE
    if Path(path).exists():
        return load_build_index(path)
    index = build_dedup_index(plan.config, plan.splits, plan.workers, run_all)
    index.save(path)
    return index


SLICE_FIELDS = ("ids", "source", "digest", "bands", "bytes_in")


def slice_bytes(args: tuple) -> bytes:
    """``signature_slice`` as an ``.npz`` (plain arrays: ids as fixed-width unicode, never
    objects), what a pool returns and a datatrove task writes to disk: data only, so reading
    it back (``slice_from_bytes``) runs no code."""
    res = signature_slice(*args)
    buf = io.BytesIO()
    np.savez(buf, **{k: np.asarray(res[k]) for k in SLICE_FIELDS})
    return buf.getvalue()


def slice_from_bytes(blob: bytes, where: str = "dedup signatures") -> dict[str, Any]:
    """A ``slice_bytes`` result; ``allow_pickle=False``, so an object array (or a pickle) is refused."""
    try:
        with np.load(io.BytesIO(blob), allow_pickle=False) as z:
            return {k: z[k] for k in SLICE_FIELDS if k in z.files or k != "bytes_in"}
    except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile) as e:
        from stacklm.data.storage.statefile import load_error_detail

        raise ValueError(f"{where}: not a stacklm dedup signature file ({load_error_detail(e)}); delete it and re-run the signature step") from None
