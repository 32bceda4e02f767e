"""The prebuild's global dedup pass: signatures per (split, reader) slice, then one decision over
all splits (no duplicate set keeps members in two splits), made by the staged decision's
functions (``stacklm.data.dedup.staged``: buckets, then the cluster, in this process) so its
memory is bounded by one bucket chunk or a share of the verified pairs, not by the corpus; saved as one
removed-id shard per packing job in ``OUT/.prebuild/dedup-index/`` before any packing job starts.

The packing jobs then run with in-flight dedup off and drop the ids the index lists, so the
documents removed (and, unless the token budget binds, the documents kept) are the same for
every ``--workers N`` and every number of datatrove tasks (docs/prebuild.md says exactly what
is invariant; ``stacklm.data.dedup.global_index`` explains the design). Also the
engine of ``stacklm dedup-index`` (stream mode's offline index) with ``--executor pool``;
``--executor local|slurm|ray`` runs the same stages as datatrove tasks
(``stacklm.scale.datatrove_executors.dedup_index_executors``: the same file).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.errors import ConfigError, PrebuildError

INDEX_FILE = "dedup_index.npz"
INDEX_SHARDS = "dedup-index"  # the staged decision's removed ids, one DedupIndex per job (``staged``)


Starmap = Callable[[Callable[..., Any], Sequence[tuple]], Iterable[Any]]  # (fn, arg tuples) -> fn(*args) for each, in order


def uses_global_dedup(config) -> bool:
    return bool(config.dedup.exact or config.dedup.near)


def packing_config(config):
    """The config the packing jobs run: in-flight dedup off (the global index replaces it)."""
    if not uses_global_dedup(config):
        return config
    return dataclasses.replace(config, dedup=dataclasses.replace(config.dedup, exact=False, near=False, index=None))


def signature_slice(config_dict: dict[str, Any], split: str, reader: int, readers: int,
                    signed: dict[str, float] | None = None) -> dict[str, Any]:
    """Step 1 for reader ``reader`` of ``readers``: every source's documents after holdout and
    filter, as signature records (``collect_signatures``). A plain function of plain
    arguments, so it runs in a spawned process or a datatrove task alike. ``signed``: the
    sources of which only a prefix is signed, with its fraction (``stacklm.prebuild.signing``)."""
    from stacklm.data.dedup.global_index import collect_signatures
    from stacklm.data.pipeline import PipelineConfig, document_chain, last_document_node
    from stacklm.data.sources import ShardSpec

    config = PipelineConfig.from_dict(config_dict)
    hasher = config.dedup.min_hasher() if config.dedup.near else None
    source_index = {e.name: i for i, e in enumerate(config.mix.entries)}

    bytes_in = np.zeros(len(config.mix.entries), dtype=np.int64)  # input bytes read, per source

    def docs():
        for i, entry in enumerate(config.mix.entries):
            chain = document_chain(config, entry, split, ShardSpec(0, 1, reader, readers))
            if signed and entry.name in signed:
                chain["source"].limit_to_signed(signed[entry.name])
            node = last_document_node(chain)
            node.reset(None)
            yield from node
            bytes_in[i] = getattr(chain["source"], "bytes_in", 0)

    return {**collect_signatures(docs(), source_index, hasher, exact=config.dedup.exact), "bytes_in": bytes_in}


def write_slice(config_dict: dict[str, Any], split: str, reader: int, readers: int, sig_dir: str,
                signed: dict[str, float] | None = None) -> dict[str, Any]:
    """Step 1 for one slice, written to disk as the staged decision's signature columns
    (``staged.write_signature_dir``) by the process that read it: what comes back to the
    parent is only the slice's read volume, so the parent never holds every signature (the
    one-process decision did: ~1.5 GB per million documents)."""
    from stacklm.data.dedup.staged import write_signature_dir

    sig = signature_slice(config_dict, split, reader, readers, signed)
    meta = write_signature_dir(sig, split, sig_dir)
    return {"split": split, "docs": int(meta["n"]), "bytes_in": [int(x) for x in sig["bytes_in"]]}


def build_index_shards(
    config, splits: Sequence[str], readers: int, work_dir: str | Path, out_dir: str | Path,
    starmap: Starmap | None = None, signed: dict[str, Any] | None = None,
) -> list[Path]:
    """Steps 1 and 2 as the staged decision (``stacklm.data.dedup.staged``), through
    ``starmap``: signatures per (split, reader) slice into ``work_dir/sig/<job>/``, then every
    bucket task (``decision.staged_decision``), then the decision here, so the largest process
    holds one bucket chunk or one partition of the verified pairs, never every document; then one removed-id
    shard per slice in ``out_dir/<job>.npz``, its evidence beside it (``<job>.evidence.npz``),
    all written beside and renamed, so a half-written set is never taken for a finished one. ``starmap(fn, arg_tuples)`` yields ``fn(*args)`` for
    each tuple, in order -- ``stacklm prebuild``'s pool runs both the slices and the bucket
    tasks in parallel; default: one after the other, here.
    The decision is ``decide_splits``'s (canonical kept copy, val wins across splits), so the
    removed ids are the same as the one-process decision's for any ``readers``.
    ``signed``: a small build's ``signing.signing_plan``: each split signs only the listed
    sources' signed prefixes; recorded in every shard's meta, where the packing jobs read it.
    Returns the shard paths, in (split, reader) order."""
    import shutil

    from stacklm.data.dedup import staged
    from stacklm.data.dedup.decision import staged_decision
    from stacklm.data.dedup.shards import write_index_shards
    from stacklm.data.dedup.global_index import binding_meta
    from stacklm.prebuild.plan import job_name

    work_dir, out_dir = Path(work_dir), Path(out_dir)
    cfg = config.to_dict()
    names = [job_name(s, r) for s in splits for r in range(readers)]
    dirs = [work_dir / "sig" / n for n in names]
    fractions = (signed or {}).get("fractions", {})
    jobs = [(cfg, s, r, readers, str(d), fractions.get(s)) for (s, r), d in zip([(s, r) for s in splits for r in range(readers)], dirs)]
    starmap = starmap or staged.in_process
    # what the index is bound to (``global_index.check_bound``), taken before anything is read
    binding = binding_meta(config)
    results = list(starmap(write_slice, jobs))
    # the signature pass's read volume (input bytes read, per split and source): not in the
    # index's content hash, reported in the top manifest's ``read_volume``
    bytes_read = {s: {e.name: 0 for e in config.mix.entries} for s in splits}
    for res in results:
        for e, n in zip(config.mix.entries, res["bytes_in"]):
            bytes_read[res["split"]][e.name] += int(n)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with staged_decision(dirs, starmap=starmap, threshold=config.dedup.near_threshold, work_dir=work_dir) as decision:
        write_index_shards(dirs, decision, tmp, {"dedup": config.dedup.index_meta(), "bytes_read": bytes_read, **binding,
                                                 **({"signed": signed} if signed else {})})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    shutil.rmtree(work_dir / "sig", ignore_errors=True)
    return [out_dir / f"{n}.npz" for n in names]


def build_dedup_index(
    config, splits: Sequence[str], readers: int, starmap: Starmap | None = None, work_dir: str | Path | None = None,
    out: str | Path | None = None,
):
    """The whole index in one ``DedupIndex`` (``stacklm dedup-index``, tests): the staged
    decision's shards (``build_index_shards``, in ``work_dir``, default a temporary folder)
    merged (``shards.load_shards``: the same arrays, hash and counts as one file); saved at
    ``out`` with its evidence beside it when given (``shards.save_merged``)."""
    import shutil
    import tempfile

    from stacklm.data.dedup.shards import load_shards, save_merged

    config.check_stages_run()  # the readers run the user stages: refused before any work
    work = Path(tempfile.mkdtemp(prefix=".dedup-index-", dir=work_dir))
    try:
        paths = build_index_shards(config, splits, readers, work, work / "index", starmap)
        return save_merged(paths, out) if out is not None else load_shards(paths)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def load_build_index(path: Path):
    """A build's own ``.prebuild/dedup_index.npz`` (data only, ``allow_pickle=False``); a file that
    is not one is refused, naming it and saying to delete it (the next run rebuilds it)."""
    from stacklm.data.dedup.global_index import DedupIndex

    try:
        return DedupIndex.load(path, fix="delete it and re-run the same command (the dedup pass runs again)")
    except ConfigError as e:  # not the user's `dedup.index` setting: the build's own state
        raise PrebuildError(str(e).removeprefix("dedup.index: "), path=path) from None


def check_resumed_corpus(plan, shards: Path) -> None:
    """A resumed build's index was decided on the corpus the build began with: refuse to go on
    (in one line naming the source and file) when the corpus or the inputs that decide which
    documents its ids name have changed since (``global_index.check_bound``); its shards would
    mix two corpora and its removed ids would name other documents. Shards of a build begun
    before the binding existed carry no fingerprint and are not checked. Called on the resume of
    ``stacklm prebuild`` (``load_or_build``) and of ``prebuild-datatrove`` (its driver)."""
    from stacklm.data.dedup.global_index import check_bound

    from stacklm.data.dedup.shards import index_shard_paths

    first = next(iter(index_shard_paths(shards)), None)
    if first is None:
        return
    index = load_build_index(first)
    if "corpus" not in index.meta:
        return
    try:
        check_bound(index, plan.config, first, what=f"prebuild {plan.out}: this unfinished build",
                    fix=f"restore the corpus it began with, or start over (delete {plan.out})")
    except ConfigError as e:
        raise PrebuildError(str(e), path=plan.out) from None


def load_or_build(plan, starmap: Starmap | None = None) -> None:
    """The build's index, before any packing job: one removed-id shard per job in
    ``.prebuild/dedup-index/`` (``build_index_shards``; each packing job loads only its own,
    ``jobs.job_dedup_index``). Kept on a resume (it is renamed into place only when complete);
    a build begun before the staged decision, with its one-file ``dedup_index.npz``, keeps that."""
    from stacklm.prebuild.plan import state_dir_of

    state = state_dir_of(plan.out)
    if (state / INDEX_SHARDS).is_dir():
        check_resumed_corpus(plan, state / INDEX_SHARDS)
        return
    if (state / INDEX_FILE).exists():
        return
    from stacklm.prebuild import signing

    signed = signing.signing_plan(plan.config, plan.tokenizer, plan.splits, plan.sign_margin)
    line = signing.describe(signed, plan.config.mix.total_tokens)
    if line:  # said whatever the progress setting: it decides what the dedup pass can see
        print(line, file=sys.stderr)
    build_index_shards(plan.config, plan.splits, plan.workers, state / "dedup-work", state / INDEX_SHARDS, starmap, signed)
