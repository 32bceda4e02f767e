"""stacklm's near-dedup decision beside datatrove's own MinHash stages, on ``bench/dedup_accuracy.py``'s
planted corpus (``python3 bench/dedup_accuracy.py --datatrove``; needs the ``scale`` extra).

Three decisions on the same documents (the corpus of ``make_corpus``, same ``--seed``):

* **datatrove**: its real stages ``MinhashDedupSignature`` -> ``MinhashDedupBuckets`` ->
  ``MinhashDedupCluster`` -> ``MinhashDedupFilter`` with the default ``MinhashConfig`` (word
  5-grams, 14 buckets x 8 hashes, 64-bit xxhash), each stage one ``LocalPipelineExecutor`` in a
  temporary folder (workers=1; one task, except the buckets stage: datatrove asks for a multiple
  of 14 tasks there, so one per bucket). Documents are ``datatrove.data.Document`` with id = row;
  the filter's exclusion writer (Parquet; datatrove's JSONL writer needs ``orjson``, not installed) says which rows it removed, and the documents it passes
  on are written too and checked to be the rest. datatrove's English word tokenizer is spaCy,
  which is not installed here: words are split at whitespace (``bench/shingles.py``'s
  ``whitespace_tokenizer``), which on ``simplify_text``'s output differs from spaCy only where
  spaCy splits a word itself (``cannot``). datatrove's cluster is union-find over unverified
  candidates (one shared bucket joins two documents; components are removed down to one).
* **stacklm word**: ``run_decision`` with ``MinHasher(shingle="word")`` (word 5-grams, 12 bands x
  10 rows, verified at ``dedup.near_threshold``).
* **stacklm char**: the default decision (character 7-grams), as the rest of the bench reports it.

Each is measured (``measure``) against both ground truths: exact Jaccard over word 5-gram sets
(``MinHasher(shingle="word").shingle_set``: ``normalize_text`` then datatrove's ``simplify_text``
and a whitespace word split -- what datatrove's signatures estimate here, up to NFKC/casefold)
and over character 7-gram sets. A datatrove removal counts as an exact copy when its normalised
text equals a kept document's (the rule stacklm's exact pass applies). CPU seconds are
``time.process_time`` of the decision from raw text (signing included): for stacklm without its
``decide_splits`` cross-check; for datatrove its signature, buckets and cluster executors, their
file writes included, with its filter stage (which here also writes every document to Parquet
for the read-back) given apart.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.dedup_accuracy import PRECISION_AT, RECALL_AT, UNSUPPORTED_BELOW, Corpus, GroundTruth, measure, run_decision
from bench.shingles import whitespace_tokenizer
from stacklm.data.dedup.minhash import MinHasher
from stacklm.data.quality.normalize import normalize_text

DECISIONS = ("datatrove", "stacklm word", "stacklm char")
TRUTHS = ("word", "char")  # the shingles of the ground truth each measure uses


def _written_ids(folder: Path) -> list[int]:
    """The ``id`` of every document a datatrove ``ParquetWriter`` wrote under ``folder`` (none when
    it wrote no file)."""
    import pyarrow.parquet as pq

    return [int(i) for path in sorted(folder.rglob("*.parquet")) for i in pq.read_table(path, columns=["id"]).column("id").to_pylist()]


def run_datatrove(texts: list[str]) -> tuple[np.ndarray, dict[str, float], dict[str, Any]]:
    """datatrove's four MinHash stages on ``texts`` (module docstring): (removed mask, CPU seconds
    per stage, its MinhashConfig in words)."""
    from datatrove.data import Document
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.writers import ParquetWriter
    from loguru import logger

    logger.disable("datatrove")  # a log line per task and stage would bury the table
    config = MinhashConfig()
    docs = [Document(text=t, id=str(i)) for i, t in enumerate(texts)]
    with tempfile.TemporaryDirectory(prefix="dedup-datatrove-") as tmp:
        d = Path(tmp)
        stages = [  # (name, pipeline, tasks)
            ("signature", [docs, MinhashDedupSignature(output_folder=str(d / "sigs"), config=config, language=whitespace_tokenizer())], 1),
            ("buckets", [MinhashDedupBuckets(input_folder=str(d / "sigs"), output_folder=str(d / "buckets"), config=config)], config.num_buckets),
            ("cluster", [MinhashDedupCluster(input_folder=str(d / "buckets"), output_folder=str(d / "remove"), config=config)], 1),
            ("filter", [docs, MinhashDedupFilter(input_folder=str(d / "remove"), exclusion_writer=ParquetWriter(str(d / "removed"))),
              ParquetWriter(str(d / "kept"))], 1),
        ]
        cpu: dict[str, float] = {}
        for name, pipeline, tasks in stages:
            start = time.process_time()
            LocalPipelineExecutor(pipeline, tasks=tasks, workers=1, logging_dir=str(d / "logs" / name)).run()
            cpu[name] = time.process_time() - start
        removed_ids, kept_ids = _written_ids(d / "removed"), _written_ids(d / "kept")
    if sorted(removed_ids + kept_ids) != list(range(len(texts))):
        raise SystemExit(f"dedup_datatrove: datatrove's filter removed {len(removed_ids):,} and passed on {len(kept_ids):,} "
                         f"of {len(texts):,} documents, not each exactly once (a datatrove version this bench does not know)")
    removed = np.zeros(len(texts), dtype=bool)
    removed[removed_ids] = True
    return removed, cpu, {"n_grams": config.n_grams, "num_buckets": config.num_buckets, "hashes_per_bucket": config.hashes_per_bucket}


def _codes(texts: list[str], removed: np.ndarray) -> np.ndarray:
    """``measure``'s codes for a removed mask: 1 when the normalised text equals a kept document's, else 2."""
    norm = [normalize_text(t) for t in texts]
    kept = {norm[i] for i in np.flatnonzero(~removed).tolist()}
    return np.array([0 if not r else 1 if n in kept else 2 for n, r in zip(norm, removed.tolist())], dtype=np.int8)


def compare(corpus: Corpus, char_truth: GroundTruth, char_code: np.ndarray, char_cpu: float) -> dict[str, Any]:
    """The three decisions, each measured against both ground truths, and the overlap of their
    removed sets with datatrove's; prints the table and returns every number."""
    texts = corpus.texts
    word_hasher = MinHasher(shingle="word")
    word_cpu: dict[str, float] = {}
    word_code = run_decision(texts, word_hasher, word_cpu)
    dt_removed, dt_cpu, dt_config = run_datatrove(texts)
    codes = {"datatrove": _codes(texts, dt_removed), "stacklm word": word_code, "stacklm char": char_code}
    truths = {"word": GroundTruth(texts, word_hasher), "char": char_truth}
    decision_cpu = sum(v for k, v in dt_cpu.items() if k != "filter")
    out: dict[str, Any] = {"datatrove_config": dt_config, "datatrove_cpu_by_stage": dt_cpu,
                           "cpu_seconds": {"datatrove": decision_cpu, "stacklm word": word_cpu["decision"], "stacklm char": char_cpu}}
    out["measures"] = {name: {t: measure(corpus, truths[t], code) for t in TRUTHS} for name, code in codes.items()}
    a = dt_removed
    out["overlap_with_datatrove"] = {name: overlap(a, codes[name] > 0, truths["word"]) for name in DECISIONS[1:]}
    print()
    print(table(out, len(texts)))
    return out


def overlap(datatrove: np.ndarray, mine: np.ndarray, truth: GroundTruth) -> dict[str, int]:
    """The removed sets of datatrove and a decision side by side, and why they differ (on ``truth``):
    a document only this decision removed whose best kept partner datatrove removed is the same
    pair with the other copy kept; one only datatrove removed that has no document datatrove kept
    at J >= 0.7 is a removal no similar kept copy supports (a chain or an unverified candidate)."""
    only_this, only_datatrove = np.flatnonzero(mine & ~datatrove), np.flatnonzero(datatrove & ~mine)
    _, partner = truth.best_partner(only_this, ~mine)
    kept_j, _ = truth.best_partner(only_datatrove, ~datatrove)
    return {"both": int((datatrove & mine).sum()), "only_datatrove": int(only_datatrove.size), "only_this": int(only_this.size),
            "only_this_partner_removed_by_datatrove": int(datatrove[partner[partner >= 0]].sum()),
            f"only_datatrove_no_kept_partner_J<{UNSUPPORTED_BELOW[0]}": int((kept_j < UNSUPPORTED_BELOW[0]).sum())}


def _pair(m: dict[str, dict[str, Any]], get) -> str:
    """A measure under the word truth / under the char truth."""
    return " / ".join(get(m[t]) for t in TRUTHS)


def _value(r: dict[str, Any]) -> str:
    return f"{r['value']:.3f}" if r["den"] else "n/a"


def table(out: dict[str, Any], docs: int) -> str:
    """The comparison as one markdown table: a row per measure, a column per decision; a cell
    that depends on the ground truth gives it on word 5-grams / on char 7-grams."""
    ms, ov = out["measures"], out["overlap_with_datatrove"]
    c = out["datatrove_config"]
    heads = [f"datatrove MinHash stages ({c['n_grams']}-grams, {c['num_buckets']}x{c['hashes_per_bucket']})",
             "stacklm word 5-grams (12x10, verified)", "stacklm char 7-grams (default)"]
    rows = [
        ("removed (exact copy of a kept document + near)", lambda n: f"{ms[n]['char']['removed']:,} ({ms[n]['char']['removed_exact']:,} + {ms[n]['char']['removed_near']:,})"),
        *[(f"precision at J >= {t} (word / char J)", lambda n, t=t: _pair(ms[n], lambda m: _value(m["precision"][str(t)]["all"]))) for t in PRECISION_AT],
        *[(f"recall at J >= {t} (word / char J)", lambda n, t=t: _pair(ms[n], lambda m: _value(m["recall"][str(t)]))) for t in RECALL_AT],
        ("exact copies removed (recall)", lambda n: _value(ms[n]["char"]["exact_recall"])),
        ("lowest J of a removal's best kept partner (word / char)", lambda n: _pair(ms[n], lambda m: f"{m['lowest_removal_j']:.3f}" if m["lowest_removal_j"] is not None else "n/a")),
        *[(f"chain members removed with no kept partner at J >= {t} (word / char J)",
           lambda n, t=t: _pair(ms[n], lambda m: str(m["chains"]["removed_without_kept_partner"][f"J<{t}"]))) for t in UNSUPPORTED_BELOW[:1]],
        ("chain members removed (of planted)", lambda n: f"{ms[n]['char']['chains']['removed']} of {ms[n]['char']['chains']['members']}"),
        ("removed by datatrove too (A∩B)", lambda n: f"{ov[n]['both']:,}" if n in ov else "-"),
        (f"removed only by datatrove (of them: no document datatrove kept at word J >= {UNSUPPORTED_BELOW[0]})",
         lambda n: f"{ov[n]['only_datatrove']:,} ({ov[n][f'only_datatrove_no_kept_partner_J<{UNSUPPORTED_BELOW[0]}']:,})" if n in ov else "-"),
        ("removed only by this decision (of them: its best kept partner, word J, removed by datatrove)",
         lambda n: f"{ov[n]['only_this']:,} ({ov[n]['only_this_partner_removed_by_datatrove']:,})" if n in ov else "-"),
        ("CPU s of the decision (signing included; datatrove: + its filter stage)",
         lambda n: f"{out['cpu_seconds'][n]:.1f}" + (f" (+ {out['datatrove_cpu_by_stage']['filter']:.1f})" if n == "datatrove" else "")),
    ]
    lines = [f"| {docs:,} planted documents | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    lines += [f"| {label} | " + " | ".join(cell(n) for n in DECISIONS) + " |" for label, cell in rows]
    return "\n".join(lines)
