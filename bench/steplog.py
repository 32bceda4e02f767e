"""Step-log overhead (``stacklm.data.storage.steplog``): bytes against the token bytes it describes,
and the loader with the log on against off, side by side in one run.

    python3 bench/steplog.py [--seq-len 2048] [--batch 8] [--text-bytes 30000000] [--batches 150] [--reps 2]

Real text (``stacklm.corpus``: code, docstrings, prose, CJK, math) written as 4 jsonl files, a
BPE of ``--vocab`` ids trained here, exact + near dedup, best-fit packing at ``--seq-len``:
``StackDataModule(mode="stream")`` with ``--workers`` loader workers, as a trainer reads it.

* storage, stream mode: the log's bytes (frames of each row's document pieces and CRC) over
  the token bytes of the rows it describes (``rows x seq_len x 2``, uint16 as a prebuild
  stores them), with pieces per row;
* storage, shards mode: a ``StepLogWriter`` fed the batches of a ``--shard-rows``-row
  epoch's permutation (global row indices, the only thing shards mode logs);
* loader: batches/s of the stream loader with the log off and on, alternated ``--reps`` times
  (ABAB..., so drift on a shared machine hits both), each over ``--batches`` batches after the
  first; and the main process's time inside the writer per batch, timed directly (the only
  code the log adds to the loader's path: the packer tracks pieces either way);
* worker side: the graph's batches (``PackBatchNode``: read, dedup, tokenize, mix, shuffle,
  pack, collate, per-batch counts) in one process with provenance off and on, CPU seconds,
  alternated: the pieces and CRCs the batches carry, which stream mode now always computes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from stacklm.corpus import iter_default_corpus


def write_corpus(tmp: Path, text_bytes: int) -> int:
    texts = list(iter_default_corpus(text_bytes))
    texts = [texts[i] for i in np.random.default_rng(0).permutation(len(texts))]
    for k in range(4):
        with open(tmp / f"corpus{k}.jsonl", "w") as f:
            for t in texts[k::4]:
                f.write(json.dumps({"text": t}) + "\n")
    return sum(len(t.encode()) for t in texts)


def pipeline_config(tmp: Path) -> dict:
    return {
        "mix": {"name": "bench", "total_tokens": 10**12, "entries": [
            {"name": "corpus", "kind": "local", "path": str(tmp / "corpus*.jsonl"), "weight": 1.0, "domain": "code"}]},
        "strategy": "best_fit", "shuffle_buffer": 1000, "pack_buffer_docs": 256, "holdout_fraction": 0.0,
        "dedup": {"exact": True, "near": True}, "num_threads": 1,
    }


class TimedWriter:
    """Wraps a ``StepLogWriter``: seconds spent in it (adds and the flushes they trigger)."""

    def __init__(self, writer) -> None:
        self.writer, self.seconds = writer, 0.0

    def __getattr__(self, name):
        attr = getattr(self.writer, name)
        if not callable(attr):
            return attr

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return attr(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def run_loader(args, tok_dir: Path, pipeline: dict, log_dir: Path | None) -> dict:
    from stacklm.datamodule import StackDataModule

    dm = StackDataModule(mode="stream", tokenizer=str(tok_dir), pipeline=pipeline, seq_len=args.seq_len, batch_size=args.batch,
                         num_workers=args.workers, val_batches=0, step_log=str(log_dir) if log_dir else False)
    dm.setup("fit")
    loader = dm.train_dataloader()
    timed = None
    if log_dir is not None:
        timed = loader.step_log = TimedWriter(loader.step_log)
    it = iter(loader)
    next(it)  # workers started, buffers filled
    t0 = time.perf_counter()
    for _ in range(args.batches):
        next(it)
    secs = time.perf_counter() - t0
    out = {"batches_per_s": args.batches / secs}
    if timed is not None:
        out["writer_us_per_batch"] = timed.seconds / (args.batches + 1) * 1e6  # steady state: frames written as they fill
        timed.writer.close()
        frames = list(log_dir.rglob("*.frames"))
        out["bytes"] = sum(p.stat().st_size for p in frames)
        out["rows"] = (args.batches + 1) * args.batch
        from stacklm.data.storage.steplog import frame_records, read_frames

        pieces = [len(p) for f in frames for fr in read_frames(f) for rec in frame_records(fr) for p in rec["pieces"]]
        out["pieces_per_row"] = sum(pieces) / max(1, len(pieces))
    del it
    return out


def graph_cpu_seconds(args, tok, pipeline: dict, provenance: bool) -> float:
    from stacklm.data.pipeline import PipelineConfig

    cfg = PipelineConfig.from_dict({**pipeline, "seq_len": args.seq_len, "batch_size": args.batch})
    pipe = cfg.build(tok, "train", provenance=provenance)
    batches = pipe.batches
    batches.reset()
    t0 = time.process_time()
    for _ in range(args.graph_batches):
        next(batches)
    return time.process_time() - t0


def shards_bytes_per_row(rows: int, batch: int) -> float:
    from stacklm.data.storage.steplog import StepLogWriter

    perm = np.random.default_rng(0).permutation(rows)
    with tempfile.TemporaryDirectory() as d:
        w = StepLogWriter(Path(d) / "g", 0)
        for b in range(0, rows, batch):
            w.add_rows(0, b // batch, perm[b : b + batch], 0)
        w.close()
        return w.bytes / rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--text-bytes", type=int, default=30_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batches", type=int, default=150)
    ap.add_argument("--graph-batches", type=int, default=60)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--shard-rows", type=int, default=1_000_000)
    args = ap.parse_args()

    from stacklm.tokenizer.training import train_from_iterable

    tmp = Path(tempfile.mkdtemp(prefix="stacklm-steplog-bench-"))
    n_bytes = write_corpus(tmp, args.text_bytes)
    tok = train_from_iterable(iter_default_corpus(2_000_000), args.vocab).tokenizer
    tok_dir = tmp / "tok"
    tok.save(tok_dir / "tokenizer.stacklm.json")
    pipeline = pipeline_config(tmp)
    print(f"{n_bytes / 1e6:.1f} MB of real text as 4 jsonl files, vocab {args.vocab}, exact + near dedup, best fit, "
          f"B={args.batch}, seq_len={args.seq_len}, {args.workers} loader workers")

    run_loader(args, tok_dir, pipeline, None)  # warm-up: the worker forkserver starts, the files reach the page cache
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for rep in range(args.reps):
        runs["off"].append(run_loader(args, tok_dir, pipeline, None))
        runs["on"].append(run_loader(args, tok_dir, pipeline, tmp / f"log{rep}"))
    on = runs["on"][-1]
    token_bytes = on["rows"] * args.seq_len * 2
    print("\nstorage")
    print(f"  stream: {on['bytes']:,} B for {on['rows']} rows ({on['pieces_per_row']:.2f} pieces/row) = "
          f"{on['bytes'] / on['rows']:.1f} B/row = {on['bytes'] / token_bytes:.3%} of the token bytes ({token_bytes:,} B)")
    per_row = shards_bytes_per_row(args.shard_rows, args.batch)
    print(f"  shards: {per_row:.2f} B/row over a {args.shard_rows:,}-row epoch = {per_row / (args.seq_len * 2):.3%} of the "
          f"token bytes")
    print("\nstream loader, batches/s (alternated off/on)")
    for key in ("off", "on"):
        rates = [r["batches_per_s"] for r in runs[key]]
        print(f"  log {key:3s}: " + " ".join(f"{r:.1f}" for r in rates) + f"  (median {statistics.median(rates):.1f})")
    ratio = statistics.median(r["batches_per_s"] for r in runs["on"]) / statistics.median(r["batches_per_s"] for r in runs["off"])
    writer = [r["writer_us_per_batch"] for r in runs["on"]]
    interval = 1e6 / statistics.median(r["batches_per_s"] for r in runs["on"])
    print(f"  on/off: {ratio:.3f}; main process in the writer: " + " / ".join(f"{w:.0f}" for w in writer) +
          f" us per batch ({statistics.median(writer) / interval:.2%} of the {interval:,.0f} us between batches)")

    print("\nworker side: the graph's batches in one process, CPU s (provenance off/on alternated)")
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.reps):
        for prov in (False, True):
            times[prov].append(graph_cpu_seconds(args, tok, pipeline, prov))
    for prov in (False, True):
        print(f"  provenance {'on ' if prov else 'off'}: " + " ".join(f"{t:.2f}" for t in times[prov]) +
              f" s for {args.graph_batches} batches")
    print(f"  on/off: {statistics.median(times[True]) / statistics.median(times[False]):.3f}")


if __name__ == "__main__":
    main()
