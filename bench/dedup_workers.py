"""Dedup counts of `stacklm prebuild --workers N` on a real corpus with planted cross-file copies.

    python3 bench/dedup_workers.py [--docs 1500] [--files 8] [--workers 1 2 4] [--out /tmp/dw]

Corpus: the first ``--docs`` documents of ``stacklm.corpus.iter_default_corpus`` (Python
standard library text), dealt round-robin into ``--files`` jsonl files; then ``--plant``
documents of file 0.. get an exact copy (case/whitespace changed) appended to another file and
as many get a near copy (``inject_edits`` at Jaccard ~0.9) in a third file, so copies always
sit in other files (other readers whenever N > 1). Each N builds the same config; printed:
exact/near duplicates removed (from the manifest), kept documents and realized document
tokens per split. Also prints the in-flight cross-stream rate: how many of the duplicates the
global pass removes a per-reader in-flight dedup with N readers would miss.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stacklm.corpus import iter_default_corpus
from tests.helpers.synthetic_edits import inject_edits


def write_corpus(root: Path, n_docs: int, n_files: int, n_plant: int, seed: int = 0) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    docs = [d for d, _ in zip((d for d in iter_default_corpus() if len(d) > 200), range(n_docs))]
    files: list[list[str]] = [[] for _ in range(n_files)]
    for i, d in enumerate(docs):
        files[i % n_files].append(d)
    picks = rng.choice(len(docs), size=2 * n_plant, replace=False)
    for k, i in enumerate(picks):
        home = i % n_files
        other = (home + 1 + k % (n_files - 1)) % n_files
        if k < n_plant:  # exact after normalisation: case and whitespace changed
            files[other].append("  " + docs[i].upper().replace(" ", "   ") + "\n")
        else:
            files[other].append(inject_edits(docs[i], max(1, len(docs[i]) // 400), rng))
    root.mkdir(parents=True, exist_ok=True)
    for f, rows in enumerate(files):
        with open(root / f"part-{f:02d}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": r}) + "\n" for r in rows)
    return {"docs": len(docs), "planted_exact": n_plant, "planted_near": n_plant}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=1500)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--plant", type=int, default=100)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", default="/tmp/dedup_workers")
    ap.add_argument("--stream-readers", type=int, nargs="*", default=[1, 2, 4, 8], help="stream mode: readers to measure")
    args = ap.parse_args()

    from stacklm.corpus import iter_default_corpus as corpus
    from stacklm.data.storage import manifest as mf
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.prebuild import prebuild
    from stacklm.tokenizer.training import train_from_iterable

    out = Path(args.out)
    planted = write_corpus(out / "corpus", args.docs, args.files, args.plant)
    tok = train_from_iterable(corpus(400_000), 1024).tokenizer
    cfg = PipelineConfig.from_dict({
        "seq_len": 256, "batch_size": 4, "seed": 0, "shuffle_buffer": 64, "pack_buffer_docs": 32, "holdout_fraction": 0.05,
        "num_threads": 1, "mix": {"name": "stdlib", "total_tokens": 10**10, "entries": [
            {"name": "stdlib", "kind": "local", "path": str(out / "corpus" / "*.jsonl"), "weight": 1.0, "domain": "code"}]},
    })
    print(json.dumps(planted))
    rows = []
    for n in args.workers:
        t0 = time.perf_counter()
        dest = out / f"w{n}"
        import shutil

        shutil.rmtree(dest, ignore_errors=True)
        top = prebuild(cfg, tok, dest, workers=n, tokens_per_shard=256 * 64, progress=False)
        secs = time.perf_counter() - t0
        for split in ("train", "val"):
            m = mf.read_manifest(dest / split)
            d = m["stats"].get("dedup", {}).get("stdlib", {})
            rows.append((n, split, d.get("exact_dup", 0), d.get("near_dup", 0), d.get("kept", 0),
                         sum(r["tokens"] for r in m["realized"].values()), round(secs, 1)))
        del top
    if args.stream_readers:
        stream_cross_rate(cfg, tuple(args.stream_readers))
    print(f"{'workers':>7} {'split':>5} {'exact_dup':>9} {'near_dup':>8} {'kept':>6} {'doc_tokens':>10} {'secs':>6}")
    for r in rows:
        print(f"{r[0]:>7} {r[1]:>5} {r[2]:>9} {r[3]:>8} {r[4]:>6} {r[5]:>10} {r[6]:>6}")


def stream_cross_rate(cfg, readers_list=(1, 2, 4, 8), split="train") -> list[tuple]:
    """Stream mode's in-flight dedup with R readers (rank x worker slices): the documents it
    delivers that the global pass removes (duplicates whose earlier copy another reader read)."""
    from stacklm.data.dedup import DedupNode, ExactDeduper, NearDeduper
    from stacklm.data.dedup.global_index import id_keys
    from stacklm.data.pipeline import document_chain
    from stacklm.data.sources import ShardSpec
    from stacklm.prebuild.dedup_pass import build_dedup_index

    index = build_dedup_index(cfg, (split,), 1)
    rows = []
    for r in readers_list:
        delivered, passed, removed = 0, 0, 0
        for k in range(r):
            for entry in cfg.mix.entries:
                node = DedupNode(document_chain(cfg, entry, split, ShardSpec(0, 1, k, r))["filter"], ExactDeduper(), NearDeduper())
                node.reset(None)
                ids = [d["doc_id"] for d in node]
                delivered += len(ids)
                passed += int((index.lookup(split, id_keys(ids)) > 0).sum())
                removed += node.stats.total("exact_dup") + node.stats.total("near_dup")
        rows.append((r, removed, delivered, passed, passed / max(1, delivered)))
    total = sum(index.counts()[split].values())
    print(f"global pass removes {total} of {index.meta['docs'][split]} {split} documents")
    print(f"{'readers':>7} {'in-flight removed':>17} {'delivered':>9} {'dups passed':>11} {'rate':>7}")
    for row in rows:
        print(f"{row[0]:>7} {row[1]:>17} {row[2]:>9} {row[3]:>11} {row[4]:>7.2%}")
    return rows


if __name__ == "__main__":
    main()
