"""Where a small token budget takes its documents from, and how much it tokenizes to keep them.

    python3 bench/budget_spread.py [--budget 60000] [--workers 1]

Writes four JSON-lines files of very different sizes (about 1 : 4 : 16 : 64, real text from
``stacklm.corpus`` cut into documents of at most 1,500 characters) as one source, trains a 512-id tokenizer, and prebuilds with a budget
well under the corpus. Prints, per file, its share of the source's bytes and of the delivered
documents' tokens (from the provenance side files), and the ledger's tokenized / kept tokens
(``read`` / ``kept``) and read / kept documents.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_corpus(folder: Path, total_docs: int = 3400) -> list[Path]:
    from stacklm.corpus import iter_default_corpus

    # documents of at most 1,500 characters, so shares count many documents, not a few modules
    docs = [d[i : i + 1500] for d in iter_default_corpus(8_000_000) for i in range(0, len(d), 1500) if d[i : i + 1500].strip()]
    docs = docs[:total_docs]
    sizes = [1, 4, 16, 64]
    counts = [total_docs * s // sum(sizes) for s in sizes]
    paths, start = [], 0
    folder.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(counts):
        p = folder / f"f{i}_{sizes[i]:02d}.jsonl"
        with open(p, "w") as f:
            for d in docs[start : start + n]:
                f.write(json.dumps({"text": d}) + "\n")
        start += n
        paths.append(p)
    return paths


def delivered_tokens_by_file(out: Path, split: str = "train") -> Counter:
    from stacklm.data.storage import manifest as mf
    from stacklm.data.storage.provenance import decode_rows, prov_path

    m = mf.read_manifest(out / split)
    prov, tokens = m["provenance"], Counter()
    for shard in m["shards"]:
        _, rows = decode_rows(prov_path(out / split, shard["name"]).read_bytes())
        for src, fid, _rec, start, end in rows[:, :5].tolist():
            tokens[prov["files"][prov["sources"][src]][fid]] += end - start
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=60_000)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--docs", type=int, default=3400)
    args = ap.parse_args()

    from stacklm.data.pipeline import PipelineConfig
    from stacklm.data.storage import manifest as mf
    from stacklm.prebuild import prebuild
    from stacklm.tokenizer.training import train_from_iterable
    from stacklm.corpus import iter_default_corpus

    root = Path(tempfile.mkdtemp(prefix="budget_spread_"))
    paths = write_corpus(root / "data", args.docs)
    tok = train_from_iterable(iter_default_corpus(400_000), 512).tokenizer
    cfg = PipelineConfig.from_dict({
        "seq_len": 128, "batch_size": 4, "seed": 0, "shuffle_buffer": 64, "pack_buffer_docs": 32, "holdout_fraction": 0.01,
        "num_threads": 1, "dedup": {"exact": False, "near": False},
        "mix": {"name": "bs", "total_tokens": args.budget, "entries": [
            {"name": "all", "kind": "local", "path": str(root / "data" / "*.jsonl"), "weight": 1.0, "domain": "code", "filters": "none"}]},
    })
    t0 = time.perf_counter()
    out = root / "out"
    prebuild(cfg, tok, out, workers=args.workers, tokens_per_shard=128 * 64, progress=False)
    secs = time.perf_counter() - t0
    top = mf.read_manifest(out)
    led = top["ledger"]["train"]
    led = led.get("sources", led)["all"]
    size = sum(p.stat().st_size for p in paths)
    got = delivered_tokens_by_file(out)
    print(f"{len(paths)} files, {size:,} bytes; budget {args.budget:,} tokens; workers {args.workers}; {secs:.1f}s")
    print(f"  {'file':<12} {'bytes share':>11} {'delivered share':>15}")
    for p in paths:
        print(f"  {p.name:<12} {p.stat().st_size / size:>11.3f} {got[p.name] / max(1, sum(got.values())):>15.3f}")
    t, d = led["tokens"], led["docs"]
    print(f"  ledger train: docs read {d['read']:,} kept {d['kept']:,} (read/kept {d['read'] / max(1, d['kept']):.2f}); "
          f"tokens tokenized {t['read']:,} kept {t['kept']:,} (tokenized/kept {t['read'] / max(1, t['kept']):.2f})")
    vol = top.get("read_volume")
    if vol:
        print("  read volume: " + ", ".join(f"{p['pass']} {p['split']} {p['ratio']:.2f}x" for p in vol["passes"]))


if __name__ == "__main__":
    main()
