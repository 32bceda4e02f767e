"""Read volume per pass of a prebuild whose sources have fewer files than tasks.

    python3 bench/read_volume.py [--docs 3000] [--workers 1 2 4]

Writes a small real-text corpus (``stacklm.corpus``: stdlib code, docstrings, ...) as one
JSON-lines file plus a second, smaller one, trains a 512-id tokenizer, and runs ``prebuild``
with global dedup and a budget the corpus does not fill, at each ``--workers``. Prints, per
build, the manifest's ``read_volume`` (bytes read by all tasks of each pass / input bytes),
and what the whole-file assignment of before reads in the same passes (every task scanning
every file: measured on the sources alone, the same reads without the tokenizing), and checks
the delivered documents are the same for every worker count.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=3000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()

    from stacklm.corpus import iter_default_corpus
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.data.sources import LocalFileSource, ShardSpec
    from stacklm.data.storage import manifest as mf
    from stacklm.prebuild import prebuild
    from stacklm.prebuild.summary import summary_table
    from stacklm.tokenizer.training import train_from_iterable

    root = Path(tempfile.mkdtemp(prefix="read_volume_"))
    docs = [d for d in iter_default_corpus(4_000_000) if d.strip()][: args.docs]
    (root / "data").mkdir()
    cut = len(docs) * 4 // 5
    for name, part in (("big.jsonl", docs[:cut]), ("small.jsonl", docs[cut:])):
        with open(root / "data" / name, "w") as f:
            for d in part:
                f.write(json.dumps({"text": d}) + "\n")
    tok = train_from_iterable(iter_default_corpus(400_000), 512).tokenizer
    section = {
        "seq_len": 128, "batch_size": 4, "seed": 0, "shuffle_buffer": 64, "pack_buffer_docs": 32, "holdout_fraction": 0.05,
        "tokenize_batch_docs": 32, "num_threads": 1, "dedup": {"exact": True, "near": True},
        "mix": {"name": "rv", "total_tokens": 10**9, "entries": [
            {"name": "corpus", "kind": "local", "path": str(root / "data" / "*.jsonl"), "weight": 1.0, "domain": "code", "filters": "none"}]},
    }
    cfg = PipelineConfig.from_dict(section)
    size = sum(p.stat().st_size for p in (root / "data").glob("*.jsonl"))
    print(f"corpus: {len(docs)} documents in 2 files, {size:,} bytes")
    delivered = {}
    for w in args.workers:
        t0 = time.perf_counter()
        out = root / f"w{w}"
        prebuild(cfg, tok, out, workers=w, tokens_per_shard=128 * 64, progress=False)
        secs = time.perf_counter() - t0
        top = mf.read_manifest(out)
        vol = top["read_volume"]
        # before: each task of a pass scans every file whole (strided rows) when files < tasks
        before = 0
        for r in range(w):
            src = LocalFileSource("corpus", [str(root / "data" / "*.jsonl")], "code", shard=ShardSpec(0, 1, r, w))
            src._list_pieces = lambda: None
            src.reset(None)
            for _ in src:
                pass
            before += src.bytes_in
        print(f"\n--workers {w} ({secs:.1f}s); before (whole files per task): every full pass reads {before / size:.2f}x")
        print("\n".join(line for line in summary_table(top, str(out)).splitlines() if "read volume" in line or "x" == line.strip()[-1:]))
        delivered[w] = top["holdout"]["val_docs"], {s: r["docs"] for s, r in mf.read_manifest(out / "train")["realized"].items()}
    print("\ndelivered (val docs, train docs per source) per workers:", delivered)


if __name__ == "__main__":
    main()
