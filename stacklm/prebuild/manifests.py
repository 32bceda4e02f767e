"""The output directory's records: claiming it for a build (``prepare``: refuse a directory
built differently), and the split and top manifests written once every job is done
(``finalize``: the top manifest is the "finished" mark)."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from stacklm.data import ledger
from stacklm.data.storage import provenance
from stacklm.data.storage import manifest as mf
from stacklm.data.audit import INVALID_RECORDS
from stacklm.data.mix.schedule import merge_phase_reports
from stacklm.data.storage.shards import atomic_write_shard_file, dtype_name
from stacklm.errors import LedgerError, PrebuildError
from stacklm.prebuild.plan import BUILD_FILE, REVISIONS_FILE, STATE_DIR, PrebuildPlan, state_dir_of


def _read_build_file(path: Path) -> dict[str, Any]:
    """An unfinished build's ``.prebuild/build.json`` (its identity). Anything else under that
    name (a pickle, a cut or garbled file: a ``UnicodeDecodeError`` traceback before) is one
    line naming the file; data only, never unpickled."""
    from stacklm.data.storage.statefile import is_pickle_head

    data = path.read_bytes()
    try:
        found = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        what = "pickled data, which stacklm never loads" if is_pickle_head(data) else f"not JSON ({e})"
        raise PrebuildError(f"{path} is {what}: the unfinished build's identity is damaged; delete {path.parent.parent} and "
                            "build again", path=path) from None
    if not isinstance(found, dict):
        raise PrebuildError(f"{path}: expected a JSON object, got {type(found).__name__}; delete {path.parent.parent} and build again",
                            path=path)
    return found


def _check_out_dir(plan: PrebuildPlan, identity: dict[str, Any]) -> bool:
    """Refuse a directory built (or being built) differently; True when already complete."""
    out = plan.out
    top = mf.manifest_path(out)
    build_file = state_dir_of(out) / BUILD_FILE
    if top.exists():
        found, where = mf.read_manifest(out).get("build", {}), top
    elif build_file.exists():
        found, where = _read_build_file(build_file), build_file
    elif out.exists() and any(p.name != STATE_DIR for p in out.iterdir()):  # a bare .prebuild/: killed while claiming
        raise PrebuildError(
            f"{out} is not empty and holds no stacklm prebuild ({top.name} or {STATE_DIR}/{BUILD_FILE}); "
            "choose a new or empty --out directory",
            path=out,
        )
    else:
        return False
    problems = []
    if found.get("tokenizer_hash") != identity["tokenizer_hash"]:
        problems.append(
            f"tokenizer: built with sha256 {str(found.get('tokenizer_hash'))[:16]}... (vocab {found.get('vocab_size')}), "
            f"this run's tokenizer is {identity['tokenizer_hash'][:16]}... (vocab {identity['vocab_size']})"
        )
    diffs = mf.config_differences(found.get("config", {}), identity["config"])
    if diffs:
        problems.append("config: " + "; ".join(diffs[:8]) + (f"; ... {len(diffs) - 8} more" if len(diffs) > 8 else ""))
    for key in ("workers", "tokens_per_shard", "splits"):
        if found.get(key) != identity[key]:
            problems.append(f"{key}: built with {found.get(key)!r}, this run has {identity[key]!r}")
    if found.get("provenance", True) != identity["provenance"]:  # builds before provenance had it on
        problems.append(f"provenance: built with {found.get('provenance', True)!r}, this run has {identity['provenance']!r}")
    if problems:
        raise PrebuildError(
            f"{where} belongs to a different build, refusing to mix them:\n  - " + "\n  - ".join(problems)
            + (
                f"\nRe-run with the original settings to resume, or choose another --out (or delete {out})."
                if top.exists()
                else f"\nThat build stopped unfinished after writing shards. To resume it, re-run with its original settings; "
                f"to start over with these settings (e.g. a fixed config), delete {out} (`rm -r {out}`) and re-run."
            ),
            path=where,
        )
    return top.exists()


def _common_fields(plan: PrebuildPlan, identity: dict[str, Any]) -> dict[str, Any]:
    cfg, tok = plan.config, plan.tokenizer
    return {
        "format": mf.FORMAT,
        "version": mf.VERSION,
        "seq_len": cfg.seq_len,
        "dtype": dtype_name(plan.dtype),
        "vocab_size": tok.vocab_size,
        "bos_id": tok.bos_id,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "tokenizer_hash": identity["tokenizer_hash"],
        "filter_config_hash": cfg.filters.config_hash(),
        "config_hash": identity["config_hash"],
        "seed": cfg.seed,
        "packing_strategy": cfg.strategy,
        "build": identity,
    }


# Source-stage reasons that each count one row read (the others count bytes or repairs).
_DOCS_READ = ("kept", "dropped_empty", "dropped_binary", *INVALID_RECORDS)


def split_manifest(plan: PrebuildPlan, identity: dict[str, Any], split: str, summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge the jobs of one split (prebuild workers or datatrove tasks) into its manifest."""
    shards: list[dict] = []
    for s in summaries:
        w, n = int(s["worker"]), int(s["workers"])
        shards += [{**info, "index": j * n + w} for j, info in enumerate(s["shards"])]
    shards.sort(key=lambda d: d["index"])
    for d in shards:
        del d["index"]
    stats = mf.sum_counts(s["stats"] for s in summaries)
    realized = mf.merge_realized((s["realized"] for s in summaries), plan.config.mix.target_weights())
    n_seq = sum(int(d["n_seq"]) for d in shards)
    holdout = stats.get("holdout", {})
    extra: dict[str, Any] = {}
    if all("ledger" in s for s in summaries):  # the token ledger, summed over the jobs (stacklm.data.ledger)
        merged = ledger.merge(s["ledger"] for s in summaries)
        ledger.enforce(merged, f"prebuild {plan.out} split {split!r}")
        extra["ledger"] = ledger.with_status(merged)
    decontam = [s.get("decontam") for s in summaries if s.get("decontam")]
    if decontam:  # per evaluation set: documents and tokens removed, a few examples (stacklm.data.quality.decontam)
        from stacklm.data.quality.decontam import merge_reports

        extra["decontamination"] = merge_reports(decontam, plan.config.decontaminate.examples)
    if summaries and all(s.get("provenance") for s in summaries):
        first = summaries[0]["provenance"]
        extra["provenance"] = provenance.manifest_entry([e.name for e in plan.config.mix.entries], first["files"]) | {
            "bytes": sum(int(s["provenance"]["bytes"]) for s in summaries)}
    return {
        **_common_fields(plan, identity),
        "split": split,
        "n_seq": n_seq,
        "n_tokens": n_seq * plan.config.seq_len,
        "budget": sum(int(s["budget"]) for s in summaries),
        "shards": shards,
        "sources": mf.source_list(plan.config.mix.to_dict(), realized, stats, _resolved_revisions(plan.out)),
        "realized": realized,
        "mix_phases": merge_phase_reports([s.get("mix_phases") or [] for s in summaries]),
        "drops": mf.drop_summary(stats, realized),
        "stats": stats,
        "holdout": {
            "fraction": plan.config.holdout_fraction,
            "docs_kept_for_this_split": sum(int(v.get("kept", 0)) for v in holdout.values()),
            "docs_skipped_for_the_other_split": sum(int(v.get("holdout_other_split", 0)) for v in holdout.values()),
        },
        "packing": mf.merge_packing(s["packing"] for s in summaries),
        "offline_fallback": sorted(src for src, per in stats.get("source", {}).items() if per.get("fallback_offline")),
        "warnings": build_warnings(split, summaries, stats),
        **extra,
        "tasks": [
            {
                "worker": int(s["worker"]),
                "budget": int(s["budget"]),
                "shards": len(s["shards"]),
                "n_seq": sum(int(d["n_seq"]) for d in s["shards"]),
                "docs_read": {src: sum(int(per.get(r, 0)) for r in _DOCS_READ) for src, per in s["stats"].get("source", {}).items()},
            }
            for s in summaries
        ],
    }


def _dry_message(split: str, job: int, src: str, r: Mapping[str, Any]) -> str:
    tokens, planned = int(r["tokens"]), int(r.get("planned_budget", 0))
    share = f"share {float(r['realized_weight']):.4f} vs target {float(r['target_weight']):.4f}"
    if tokens < planned:
        return f"source {src!r} ran dry in {split} job {job}: {tokens:,} of {planned:,} planned tokens, {share}"
    # more than planned: it took over the budget of sources that ran out before it, then ran out too
    return (f"source {src!r} ran out of documents in {split} job {job} after {tokens:,} tokens (more than its {planned:,} "
            f"planned: it filled in for sources that ran dry first), so the job's budget was not met; {share}")


def build_warnings(split: str, summaries: Sequence[Mapping[str, Any]], stats: Mapping[str, Any]) -> list[dict[str, Any]]:
    """What a reader of the manifest must not miss: sources that ran dry in a job (its budget
    went to the others; its share is below target) and sources built from the offline fallback
    (synthetic text, not the real data)."""
    out: list[dict[str, Any]] = []
    for s in summaries:
        for src, r in s["realized"].items():
            if r.get("status") == "ran_dry":
                out.append({
                    "kind": "ran_dry", "split": split, "source": src, "job": int(s["worker"]),
                    "tokens": int(r["tokens"]), "planned_tokens": int(r.get("planned_budget", 0)),
                    "delivered_share": float(r["realized_weight"]), "target_share": float(r["target_weight"]),
                    "message": _dry_message(split, s["worker"], src, r),
                })
    for src, per in sorted(stats.get("source", {}).items()):
        if per.get("fallback_offline"):
            out.append({"kind": "offline_fallback", "split": split, "source": src,
                        "message": f"source {src!r} was built from the synthetic offline fallback, not the real data"})
    return out


def top_manifest(plan: PrebuildPlan, identity: dict[str, Any], splits: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    val = splits.get("val")
    return {
        **_common_fields(plan, identity),
        "splits": {
            name: {
                "path": name,
                "n_seq": m["n_seq"],
                "n_tokens": m["n_tokens"],
                "shards": len(m["shards"]),
                "packing": m["packing"],
            }
            for name, m in splits.items()
        },
        "sources": splits[plan.splits[0]]["sources"],
        **({"ledger": {name: m["ledger"] for name, m in splits.items()}} if all("ledger" in m for m in splits.values()) else {}),
        **({"decontamination": {name: m["decontamination"] for name, m in splits.items() if "decontamination" in m}}
           if any("decontamination" in m for m in splits.values()) else {}),
        "mix_phases": splits[plan.splits[0]].get("mix_phases", []),
        "drops": {name: m["drops"] for name, m in splits.items()},
        "offline_fallback": sorted({src for m in splits.values() for src in m["offline_fallback"]}),
        "warnings": [w for m in splits.values() for w in m["warnings"]],
        "holdout": {
            "fraction": plan.config.holdout_fraction,
            "val_sequences": val["n_seq"] if val else 0,
            "val_tokens": val["n_tokens"] if val else 0,
            "val_docs": sum(r["docs"] for r in val["realized"].values()) if val else 0,
            "val_doc_tokens": sum(r["tokens"] for r in val["realized"].values()) if val else 0,
        },
    }


def _job(split: str, worker: int) -> str:
    return f"split {split!r} job {worker}"


def check_tasks(summaries: Sequence[Mapping[str, Any]], name_task: Callable[[str, int], str] = _job, *,
                strict: bool | None = None) -> None:
    """Refuse the jobs' counts before any manifest is written, naming the job (``name_task(split,
    worker)``: a datatrove task's rank and log):

    - a job whose own token ledger does not add up (``read = dropped + holdout + buffered +
      kept``, ``kept = delivered + remainder``): the sum over jobs can add up while two jobs
      are off in opposite directions, so each job is checked, then each split's sum;
    - a job that kept documents of its split (read, not held out, not dropped) and wrote no
      sequence: a task that silently produced nothing (a writer that never ran, shards lost)
      must not pass as a small share. A job whose every document was dropped, each counted
      under its reason, is not silent: with a global dedup decision a task's slice can be all
      copies of documents another task keeps (4 tasks over a small corpus do this).

    ``LedgerError`` / ``PrebuildError``; ``strict=False`` (or ``STACKLM_LEDGER_STRICT=0``)
    makes the ledger failures a loud warning instead, recorded in the manifest.
    """
    strict = os.environ.get(ledger.STRICT_ENV, "") != "0" if strict is None else strict
    problems, empty = [], []
    for s in sorted(summaries, key=lambda s: (s["split"], int(s["worker"]))):
        who = name_task(s["split"], int(s["worker"]))
        if "ledger" not in s:  # counts of a job resumed from before stacklm kept a ledger
            continue
        problems += [f"{who}: {p}" for p in ledger.check(s["ledger"])]
        own = {src: int(u["docs"]["read"]) - int(u["docs"]["holdout"]) for src, u in s["ledger"].items()}
        n_seq = sum(int(d["n_seq"]) for d in s["shards"])
        merged = ledger.merge([s["ledger"]])
        if sum(own.values()) > 0 and n_seq == 0 and any(int(u["docs"]["kept"]) for u in merged.values()):
            terms = "; ".join(
                f"{src}: {n:,} read for this split, dropped {sum(merged[src]['docs']['dropped'].values()):,}, "
                f"kept {merged[src]['docs']['kept']:,}, delivered {merged[src]['docs']['delivered']:,}"
                for src, n in own.items() if n
            )
            empty.append(f"{who} read {sum(own.values()):,} documents of its split and wrote no sequence ({terms})")
    for split in sorted({s["split"] for s in summaries}):
        jobs = [s for s in summaries if s["split"] == split]
        if jobs and all("ledger" in s for s in jobs):
            problems += [f"split {split!r}, summed over its {len(jobs)} jobs: {p}" for p in ledger.check(ledger.merge(s["ledger"] for s in jobs))]
    if empty:
        raise PrebuildError(
            "a job produced nothing where input existed: " + "; ".join(empty)
            + ". Read its log, fix the cause (a source that cannot be read, a filter that drops everything), delete its "
            "counts (.prebuild/<split>-w<k>.done.json; datatrove: its completions/ file) and re-run"
        )
    if problems:
        message = ("the token ledger does not add up (a stage lost or repeated data without counting it): " + "; ".join(problems)
                   + f". The shards are kept; set {ledger.STRICT_ENV}=0 to write the manifests anyway, with the failed identities recorded")
        if strict:
            raise LedgerError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def refuse_empty_split(plan: PrebuildPlan, split: str, manifest: Mapping[str, Any]) -> None:
    """A split with no token is no training data: the build would "succeed" with nothing to
    train on (``decontaminate`` with ``n: 1`` removed every document and exited 0). Refused in
    one line saying where the documents went (the drop counts, summed over the sources). The
    one empty split a config asks for is kept: val with ``holdout_fraction: 0``."""
    if int(manifest["n_seq"]) > 0 or (split == "val" and not plan.config.holdout_fraction):
        return  # holdout_fraction 0: an empty val split is what the config asks for
    totals: dict[str, int] = {}
    for per in manifest["drops"].values():
        for reason, n in per.items():
            if reason in ("bytes_replaced", "nul_removed", "tokens_cut_by_budget") or reason in INVALID_RECORDS:
                continue  # bytes, not documents; invalid records counted once as invalid_records
            totals[reason] = totals.get(reason, 0) + int(n)
    read = sum(int(per.get(r, 0)) for per in manifest["stats"].get("source", {}).values() for r in _DOCS_READ)
    gone = ", ".join(f"{n:,} {reason}" for reason, n in sorted(totals.items(), key=lambda kv: -kv[1]) if n) or "none dropped"
    raise PrebuildError(
        f"split {split!r} has no tokens: of {read:,} documents read, {gone}; nothing is left to train on. Change the "
        f"configuration (filters, decontaminate, holdout_fraction, the sources), then delete {plan.out} and build again",
        path=plan.out,
    )


def finalize(plan: PrebuildPlan, identity: dict[str, Any], summaries: Sequence[Mapping[str, Any]],
             name_task: Callable[[str, int], str] = _job) -> dict[str, Any]:
    """Check the jobs' counts (``check_tasks``), write the split manifests, then the top manifest
    (the "finished" mark), then drop the resume state."""
    for split in plan.splits:
        jobs = [s for s in summaries if s["split"] == split]
        if len(jobs) != plan.workers:
            raise PrebuildError(f"split {split!r}: {len(jobs)} of {plan.workers} jobs finished; re-run to complete the rest")
    check_tasks(summaries, name_task)
    per_split = {}
    for split in plan.splits:
        jobs = sorted((s for s in summaries if s["split"] == split), key=lambda s: s["worker"])
        per_split[split] = split_manifest(plan, identity, split, jobs)
    for split, manifest in per_split.items():  # before any manifest: a set a loader would open is never empty
        refuse_empty_split(plan, split, manifest)
    for split in plan.splits:
        mf.write_manifest(plan.out / split, per_split[split])
    top = top_manifest(plan, identity, per_split)
    index_path = state_dir_of(plan.out) / "dedup_index.npz"  # dedup_pass.INDEX_FILE
    shard_dir = state_dir_of(plan.out) / "dedup-index"  # dedup_pass.INDEX_SHARDS: the staged decision's
    index = None
    if index_path.exists():  # the global dedup pass that decided the exact_dup/near_dup drops
        from stacklm.prebuild.dedup_pass import load_build_index

        index = load_build_index(index_path)
    elif shard_dir.is_dir():  # the same index, one shard per job: the same hash and counts, range by range
        from stacklm.data.dedup.shards import index_shard_paths, merged_identity

        index = merged_identity(index_shard_paths(shard_dir))
    if index is not None:
        top["global_dedup"] = {"index_sha256": index.content_hash, "docs": index.meta.get("docs"), "removed": index.counts()}
        similarity = keep_dedup_evidence(shard_dir, plan.out)
        if similarity is not None:
            top["global_dedup"]["removal_similarity"] = similarity
    volume = read_volume(summaries, index.meta.get("bytes_read") if index is not None else None)
    if volume is not None:
        top["read_volume"] = volume
    mf.write_manifest(plan.out, top)
    shutil.rmtree(state_dir_of(plan.out), ignore_errors=True)
    return top


def keep_dedup_evidence(shard_dir: Path, out: Path) -> dict[str, dict[str, dict[str, int]]] | None:
    """Move the decision's evidence (``X.evidence.npz`` beside each index shard ``X.npz``) to
    ``OUT/dedup-evidence/`` before the state folder goes, so ``stacklm inspect OUT --why ID`` can
    still say why a document was removed; return per split and source its removal-similarity
    histogram (the top manifest's ``global_dedup.removal_similarity``: the summary and
    ``stacklm ledger`` read it there). ``None`` when the index has no evidence (a build begun
    before the decision wrote it): nothing is moved, and they say how to get it. Moved, not
    merged: a file per job, so no process holds the evidence of the whole corpus. Idempotent:
    a finalize run again after a crash finds the files already moved."""
    from stacklm.data.dedup.evidence import BUILD_EVIDENCE_DIR, build_evidence_files, evidence_path, split_histograms
    from stacklm.data.dedup.shards import index_shard_paths

    shards = index_shard_paths(shard_dir) if shard_dir.is_dir() else []
    kept = out / BUILD_EVIDENCE_DIR
    if not shards or not all(evidence_path(p).exists() or (kept / evidence_path(p).name).exists() for p in shards):
        return None
    kept.mkdir(exist_ok=True)
    for p in shards:
        if evidence_path(p).exists():
            os.replace(evidence_path(p), kept / evidence_path(p).name)
    return split_histograms(build_evidence_files(out))


def read_volume(summaries: Sequence[Mapping[str, Any]], dedup_bytes: Mapping[str, Mapping[str, int]] | None) -> dict[str, Any] | None:
    """The build's read volume per pass: input bytes read by all tasks of the pass against the
    inputs' size (1.0 = each input read once; less when a budget stops the packing early).
    Passes: the dedup signatures (when the global dedup runs; every document, per split) and
    the packing (per split); plus the bytes of the piece index (``sources.pieces``), read once
    per build when a source has fewer files than tasks."""
    if not summaries or not all("read" in s for s in summaries):
        return None
    inputs: dict[str, int] = {}
    index: dict[str, int] = {}
    for s in summaries:
        for src, n in s["read"]["input_bytes"].items():
            inputs[src] = max(inputs.get(src, 0), int(n))
        for src, n in s["read"].get("index_bytes", {}).items():
            index[src] = max(index.get(src, 0), int(n))
    passes = []
    if dedup_bytes:
        for split in sorted(dedup_bytes):
            passes.append({"pass": "dedup_signatures", "split": split, "bytes": {k: int(v) for k, v in dedup_bytes[split].items()}})
    for split in sorted({s["split"] for s in summaries}):
        read: dict[str, int] = {}
        for s in summaries:
            if s["split"] == split:
                for src, n in s["read"]["bytes"].items():
                    read[src] = read.get(src, 0) + int(n)
        passes.append({"pass": "packing", "split": split, "bytes": read})
    total = sum(inputs.values())
    for p in passes:
        p["total"] = sum(p["bytes"].values())
        p["ratio"] = round(p["total"] / total, 4) if total else 0.0
    return {"input_bytes": inputs, "input_total": total, "index_bytes": sum(index.values()), "passes": passes}


def prepare(plan: PrebuildPlan) -> tuple[dict[str, Any], bool]:
    """Check/claim ``plan.out``: returns ``(identity, already_complete)``."""
    identity = plan.identity()
    complete = _check_out_dir(plan, identity)
    if complete:
        shutil.rmtree(state_dir_of(plan.out), ignore_errors=True)  # killed after the manifest
        return identity, True
    state_dir = state_dir_of(plan.out)
    state_dir.mkdir(parents=True, exist_ok=True)
    if not (state_dir / BUILD_FILE).exists():  # claims the directory for this build
        atomic_write_shard_file(state_dir / BUILD_FILE, json.dumps(identity, sort_keys=True, indent=1).encode())
    if not (state_dir / REVISIONS_FILE).exists():  # resolved once, so a resume records the same
        revisions = mf.resolve_revisions(plan.config.mix.to_dict())
        atomic_write_shard_file(state_dir / REVISIONS_FILE, json.dumps(revisions, sort_keys=True).encode())
    return identity, False


def _resolved_revisions(out: Path) -> dict[str, str | None]:
    path = state_dir_of(out) / REVISIONS_FILE
    return json.loads(path.read_text()) if path.exists() else {}
