"""Provenance overhead: side-file bytes vs token bytes, and prebuild / pipeline speed with vs
without provenance, side by side in one run.

    python3 bench/provenance.py [--seq-len 2048] [--vocab 4096] [--text-bytes 8000000] [--tokens 1500000] [--reps 2]

Real text (``stacklm.corpus``: code, docstrings, prose, CJK, math) written as 3 jsonl files and
1 parquet file (two local sources), a BPE of ``--vocab`` ids trained here, the default filters,
exact + near dedup, best-fit packing at ``--seq-len``. Measured:

* storage: the manifest's ``provenance.bytes`` (all ``.prov.npz`` side files) over the token
  bytes of the same shards (``n_seq x seq_len x 2`` for uint16), with pieces per row and mean
  bytes per piece, so the ratio can be read for other document lengths;
* prebuild throughput (``stacklm.prebuild.prebuild``, one worker, train split), provenance on
  and off, alternated ``--reps`` times (ABAB..., so drift in a shared machine hits both);
* the pipeline alone (``build_pipeline(...).windows``: read, filter, dedup, tokenize, mix,
  shuffle, pack; no writing), provenance on and off, alternated the same way;
* the ledger's per-window count (``PackNode._count_emitted``, always on) on and off.

Times are CPU seconds of this process (``time.process_time``, tokenizer threads included), not
wall time: on a machine shared with other jobs, wall time swings by tens of percent between
identical runs, which would drown a difference of a few percent.

The shard loader (``PackedMemmapDataset``) never opens a side file, so reading prebuilt
shards costs the same with or without provenance by construction.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from stacklm.corpus import iter_default_corpus
from stacklm.data.storage import manifest as mf
from stacklm.data.pipeline import PipelineConfig, build_pipeline
from stacklm.data.packing.nodes import PackNode


def write_corpus(tmp: Path, text_bytes: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = list(iter_default_corpus(text_bytes))
    texts = [texts[i] for i in np.random.default_rng(0).permutation(len(texts))]
    (tmp / "web").mkdir()
    for k in range(3):
        with open(tmp / "web" / f"part{k}.jsonl", "w") as f:
            for t in texts[k::4]:
                f.write(json.dumps({"text": t}) + "\n")
    (tmp / "books").mkdir()
    pq.write_table(pa.table({"text": texts[3::4]}), tmp / "books" / "part.parquet")
    return sum(len(t.encode()) for t in texts)


def config(tmp: Path, args) -> PipelineConfig:
    return PipelineConfig.from_dict({
        "seq_len": args.seq_len, "batch_size": 8, "strategy": "best_fit", "shuffle_buffer": 1000, "pack_buffer_docs": 256,
        "holdout_fraction": 0.001, "num_threads": 1, "dedup": {"exact": True, "near": True},
        "mix": {"name": "bench", "total_tokens": args.tokens, "entries": [
            {"name": "web", "kind": "local", "path": str(tmp / "web" / "*.jsonl"), "weight": 0.75, "domain": "code"},
            {"name": "books", "kind": "local", "path": str(tmp / "books" / "*.parquet"), "weight": 0.25, "domain": "code"},
        ]},
    })


def run_prebuild(cfg, tok, out: Path, provenance: bool, tokens_per_shard: int) -> tuple[float, dict]:
    from stacklm.prebuild import prebuild

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prebuild(cfg, tok, out, splits=("train",), tokens_per_shard=tokens_per_shard, progress=False, provenance=provenance)
    return time.process_time() - t0, mf.read_manifest(out / "train")


def run_pipeline(cfg, tok, provenance: bool, ledger_count: bool) -> tuple[float, int]:
    original = PackNode._count_emitted
    if not ledger_count:
        PackNode._count_emitted = lambda self, window, origin: None
    try:
        pipe = build_pipeline(cfg, tok, "train", provenance=provenance)
        pipe.windows.reset()
        t0 = time.process_time()
        n = sum(1 for _ in pipe.windows)
        return time.process_time() - t0, n
    finally:
        PackNode._count_emitted = original


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--text-bytes", type=int, default=8_000_000)
    p.add_argument("--tokens", type=int, default=1_500_000, help="train budget of each prebuild / pipeline run")
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    import logging

    logging.disable(logging.WARNING)  # the corpus' invalid/filtered rows are counted, not news here
    from stacklm.tokenizer.training import train_from_iterable

    tok = train_from_iterable(iter_default_corpus(1_000_000), args.vocab).tokenizer
    tmp = Path(tempfile.mkdtemp(prefix="stacklm-prov-bench-"))
    n_bytes = write_corpus(tmp, args.text_bytes)
    cfg = config(tmp, args)
    tokens_per_shard = args.seq_len * 256
    print(f"corpus: {n_bytes / 1e6:.1f} MB of real text, 3 jsonl + 1 parquet; vocab {args.vocab}, seq_len {args.seq_len}, "
          f"best_fit, exact+near dedup; train budget {args.tokens:,} tokens; {args.reps} alternating reps")

    times: dict[bool, list[float]] = {True: [], False: []}
    manifest = None
    for _ in range(args.reps):
        for prov in (True, False):
            secs, m = run_prebuild(cfg, tok, tmp / f"out_{prov}", prov, tokens_per_shard)
            times[prov].append(secs)
            if prov:
                manifest = m
    token_bytes = int(manifest["n_seq"]) * args.seq_len * 2
    prov_bytes = int(manifest["provenance"]["bytes"])
    from stacklm.data.storage.provenance import decode_rows, prov_path

    pieces = sum(len(decode_rows(prov_path(tmp / "out_True" / "train", s["name"]).read_bytes())[1]) for s in manifest["shards"])
    rows = int(manifest["n_seq"])
    docs = sum(r["docs"] for r in manifest["realized"].values())
    doc_tokens = sum(r["tokens"] for r in manifest["realized"].values())
    print(f"\nstorage: {prov_bytes:,} provenance bytes / {token_bytes:,} token bytes = {100 * prov_bytes / token_bytes:.3f}% "
          f"({len(manifest['shards'])} shards, {rows:,} rows, {pieces:,} pieces = {pieces / rows:.2f} per row, "
          f"{prov_bytes / max(pieces, 1):.2f} bytes per piece; {docs:,} docs of {doc_tokens / max(docs, 1):,.0f} tokens on average)")

    tokens = rows * args.seq_len
    print(f"\nprebuild ({tokens:,} tokens written per run), CPU seconds per run and tokens per CPU second (median):")
    for prov in (True, False):
        med = statistics.median(times[prov])
        print(f"  provenance {'on ' if prov else 'off'}: {', '.join(f'{t:.2f}' for t in times[prov])} s -> {tokens / med:,.0f} tok/s")
    print(f"  on/off time ratio: {statistics.median(times[True]) / statistics.median(times[False]):.3f}")

    variants = [("provenance on, ledger count on", True, True), ("provenance off, ledger count on", False, True),
                ("provenance off, ledger count off", False, False)]
    ptimes: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    n_windows = 0
    for _ in range(args.reps):
        for name, prov, count in variants:
            secs, n_windows = run_pipeline(cfg, tok, prov, count)
            ptimes[name].append(secs)
    print(f"\npipeline alone ({n_windows:,} windows = {n_windows * args.seq_len:,} tokens per run), CPU seconds, windows per CPU second (median):")
    base = statistics.median(ptimes[variants[-1][0]])
    for name, _, _ in variants:
        med = statistics.median(ptimes[name])
        print(f"  {name:34s}: {', '.join(f'{t:.2f}' for t in ptimes[name])} s -> {n_windows / med:,.1f} windows/s "
              f"({med / base:.3f}x the time of the last)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
