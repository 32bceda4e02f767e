"""``stacklm inspect OUT --why SOURCE/FILE/ROW``: why the global dedup removed a document.

The decision's evidence (``stacklm.data.dedup.evidence``) names, per removed document, the kept
document it duplicates, the reason and the similarity the decision estimated from the two
MinHash signatures. Here the two texts are read back from the sources (the same source nodes
the pipeline reads, opened on all parts) and their exact Jaccard similarity is computed over
the shingles the config's near dedup takes (``dedup.min_hasher().shingle_set``), so the
estimate can be checked against the truth, document by document.

The evidence is one file beside a stream config's ``dedup.index`` (``X.npz`` ->
``X.evidence.npz``) or a finished prebuild's ``OUT/dedup-evidence/<job>.evidence.npz``; shards
are read one at a time, so a lookup holds one shard, never the corpus' evidence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stacklm.errors import UserError

EXCERPT_CHARS = 160


def parse_doc_id(doc_id: str, sources: Sequence[str]) -> tuple[str, str, int]:
    """``(source, file label, row)`` of a ``doc_id`` (``source/file/row``, as the ledger, the
    dedup index and its evidence name documents); a malformed one or a source the mix does not
    have is refused naming ``--why``."""
    source, _, rest = str(doc_id).partition("/")
    label, _, row = rest.rpartition("/")
    if not source or not label or not row.isdigit():
        raise UserError(f"--why {doc_id!r}: a document is named SOURCE/FILE/ROW (e.g. web/a.jsonl/17: the file as the "
                        "source lists it, the row counted from 0 over its records, blank lines not counted)")
    if source not in sources:
        raise UserError(f"--why {doc_id!r}: source {source!r} is not in the config's mix ({', '.join(sources)}); "
                        "name a document as SOURCE/FILE/ROW with one of them")
    return source, label, int(row)


def find_removal(evidence_files: Sequence[str | Path], doc_id: str, split: str | None = None) -> tuple[dict[str, Any] | None, int, list[str]]:
    """``(row, removals, splits)``: the evidence row of ``doc_id`` (``DedupEvidence.why`` plus
    its ``split``), or ``None`` when the decision did not remove it; ``removals`` and ``splits``:
    what was searched. Each file is loaded (data only) and dropped before the next."""
    from stacklm.data.dedup.evidence import DedupEvidence

    removals, seen, every = 0, set(), set()
    for path in evidence_files:
        ev = DedupEvidence.load(path)
        every |= set(ev.splits)
        for s in sorted(ev.splits):
            if split is not None and s != split:
                continue
            seen.add(s)
            removals += int(ev.splits[s]["removed"].size)
            row = ev.why(s, doc_id)
            if row is not None:
                return {**row, "split": s}, removals, sorted(seen)
    if split is not None and split not in every:
        raise UserError(f"--split {split}: the dedup decision has no split {split!r} (it has {', '.join(sorted(every)) or 'none'}); "
                        "leave --split out to search every split")
    return None, removals, sorted(seen)


def read_documents(config, doc_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The documents ``doc_ids`` name (``{"text", "record", ...}`` as their source yields them),
    each part read from its start up to the last one wanted; ids not found are left out (the
    source changed since the decision)."""
    from stacklm.data.sources import ShardSpec, open_source
    from stacklm.data.sources.entry import part_documents
    from stacklm.data.storage.provenance import source_files

    entries = {e.name: e for e in config.mix.entries}
    wanted: dict[tuple[str, str], set[str]] = {}
    for d in doc_ids:
        source, label, _ = parse_doc_id(d, list(entries))
        wanted.setdefault((source, label), set()).add(d)
    found: dict[str, dict[str, Any]] = {}
    for (source, label), ids in wanted.items():
        node = open_source(entries[source], shard=ShardSpec())
        node.reset()
        labels = source_files(node)
        if label not in labels:
            continue
        for doc in part_documents(node, labels.index(label)):
            if doc["doc_id"] in ids:
                found[doc["doc_id"]] = doc
                if ids <= found.keys():
                    break
    return found


def missing_document(config, doc_id: str) -> str | None:
    """Why ``doc_id`` names no document of the config's sources (its file is not one the
    source lists, or the file has no such row), or ``None`` when it does."""
    from stacklm.config import did_you_mean
    from stacklm.data.sources import ShardSpec, open_source
    from stacklm.data.sources.entry import part_documents
    from stacklm.data.storage.provenance import source_files

    entries = {e.name: e for e in config.mix.entries}
    source, label, row = parse_doc_id(doc_id, list(entries))
    node = open_source(entries[source], shard=ShardSpec())
    node.reset()
    labels = source_files(node)
    if label not in labels:
        return f"source {source!r} has no file {label!r}{did_you_mean(label, labels)} (files are named as the source lists them)"
    if any(doc["doc_id"] == doc_id for doc in part_documents(node, labels.index(label))):
        return None
    return f"file {label!r} of source {source!r} has no row {row} (rows count its records from 0, blank lines not counted)"


def explain_removal(evidence_files: Sequence[str | Path], config, doc_id: str, split: str | None = None) -> dict[str, Any]:
    """Why ``doc_id`` was removed: ``{"doc_id", "removed": False, "removals", "splits"}`` when
    the evidence does not list it; else also ``split``, ``reason`` (exact, near, cross_split),
    ``kept`` and ``kept_split``, ``similarity`` (the decision's estimate), ``threshold``,
    ``shingles`` and, when both texts can still be read from the sources, ``exact_jaccard``
    and an excerpt of each from just before their first difference (``text_removed``,
    ``text_kept`` from character ``excerpt_from``, with their ``record``: the line or row
    ``stacklm inspect --row`` names); otherwise ``texts_unreadable`` says why."""
    from stacklm.data.dedup.minhash import jaccard
    from stacklm.errors import StackLMError

    parse_doc_id(doc_id, [e.name for e in config.mix.entries])
    row, removals, splits = find_removal(evidence_files, doc_id, split)
    out: dict[str, Any] = {"doc_id": doc_id, "removed": row is not None, "removals": removals, "splits": splits}
    if row is None:
        # "not removed" only for a document that exists: a mistyped file or row is not a kept document
        try:
            problem = missing_document(config, doc_id)
        except (StackLMError, OSError) as e:
            out["unchecked"] = f"could not read the source to check the document exists: {str(e).splitlines()[0]}"
            problem = None
        if problem:
            raise UserError(f"--why {doc_id}: no such document: {problem}")
        if split is not None:
            elsewhere, _, _ = find_removal(evidence_files, doc_id, None)
            if elsewhere is not None:
                out["removed_in"] = elsewhere["split"]
        return out
    hasher = config.dedup.min_hasher()
    out.update(row)
    out["threshold"] = getattr(config.dedup, "near_threshold", None)
    out["shingles"] = f"{hasher.shingle} {hasher.shingle_size}-grams"
    try:
        docs = read_documents(config, [doc_id, row["kept"]])
    except (StackLMError, OSError) as e:  # a source gone or moved since the build: the estimate still stands
        out["texts_unreadable"] = str(e).splitlines()[0]
        return out
    missing = [d for d in (doc_id, row["kept"]) if d not in docs]
    if missing:
        out["texts_unreadable"] = f"{', '.join(missing)} not found in the sources (changed since the decision?)"
        return out
    removed, kept = docs[doc_id], docs[row["kept"]]
    out["exact_jaccard"] = jaccard(hasher.shingle_set(removed["text"]), hasher.shingle_set(kept["text"]))
    # the excerpts start a little before the first character where the texts differ: a near copy
    # usually shares its opening, and the difference is what the reader wants to see
    a, b = removed["text"], kept["text"]
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    out["excerpt_from"] = start = max(0, first - EXCERPT_CHARS // 4)
    for key, doc in (("removed", removed), ("kept", kept)):
        out[f"text_{key}"] = doc["text"][start : start + EXCERPT_CHARS]
        out[f"record_{key}"] = int(doc.get("record", -1))
    return out


def format_removal(why: Mapping[str, Any]) -> str:
    """``explain_removal``'s answer in a few lines."""
    d = why["doc_id"]
    if not why["removed"]:
        line = (f"{d}: not removed by the dedup decision (none of its {why['removals']:,} removals in "
                f"{', '.join(why['splits']) or 'no split'} is this document)")
        if "removed_in" in why:
            line += f"; it is removed in {why['removed_in']}: leave --split out to see why"
        if "unchecked" in why:
            line += f"; {why['unchecked']}"
        return line
    other = f" [{why['kept_split']}]" if why["kept_split"] != why["split"] else ""
    lines = [f"{d} [{why['split']}]: removed ({why['reason']}) as a copy of {why['kept']}{other}, which is kept"]
    est = f"estimated {why['similarity']:.3f} (fraction of equal MinHash values)"
    exact = f", exact Jaccard {why['exact_jaccard']:.3f}" if "exact_jaccard" in why else ""
    threshold = f"; threshold {why['threshold']}" if why.get("threshold") is not None else ""
    lines.append(f"  similarity over {why['shingles']}: {est}{exact}{threshold}")
    if "texts_unreadable" in why:
        lines.append(f"  texts not read, no exact Jaccard: {why['texts_unreadable']}")
    else:
        if why["excerpt_from"]:
            lines.append(f"  both texts from character {why['excerpt_from']:,} (just before the first difference):")
        for key, name in (("removed", d), ("kept", why["kept"])):
            lines.append(f"  {key:<7} {name} (record {why[f'record_{key}']}): {why[f'text_{key}']!r}")
    return "\n".join(lines)
