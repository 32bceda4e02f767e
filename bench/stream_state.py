"""What a stream-mode checkpoint holds per reader, and how it grows with the documents read.

    python3 bench/stream_state.py [--docs 1000000] [--at 10000 100000 1000000] [--shuffle-buffer 10000]

A real stream graph (local jsonl sources -> holdout -> filter -> dedup -> tokenize -> mix ->
shuffle -> best-fit pack -> batch, ``stacklm.data.pipeline.build_pipeline``) runs over a synthetic
corpus with planted exact and near duplicates, twice, side by side:

* **in-flight** dedup (``dedup: {exact: true, near: true}``: what the Stack-100M config ran before)
* **global index** (``dedup: {index: ..., exact: false, near: false}``), the index built by
  ``stacklm dedup-index`` over the same corpus before the run (its time and size are printed).

At each ``--at`` count of documents read, the graph's ``state_dict()`` is serialised exactly as a
Lightning checkpoint stores it (``to_checkpoint_safe`` then ``torch.save``) and split by part:
dedup indexes, the shuffle buffer, the packer's buffer, the rest. One reader here is one
(rank, loader worker) pair; a rank checkpoints ``num_workers`` of them.

Documents are short (~60 words) so a million of them runs in minutes on two cores; the dedup
part of the state is per document, the buffers per buffered token, so the shuffle-buffer figure
for real ~1k-token documents is the printed one scaled by the token ratio (printed too).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_rng = random.Random(1)
# word-like tokens with the stop words prose has, so the quality filter keeps the documents
WORDS = ["".join(_rng.choices("abcdefghijklmnopqrstuvwxyz", k=_rng.randint(2, 9))) for _ in range(20000)]
WORDS += ["the", "and", "of", "to", "that", "with", "is", "in"] * 500


def write_corpus(d: Path, n_docs: int, files: int = 4, dup_rate: float = 0.1, seed: int = 0) -> Path:
    """``n_docs`` documents in ``files`` jsonl files; ``dup_rate`` of them copies of an earlier one
    (half exact, half with one word changed: a near duplicate)."""
    rng = random.Random(seed)
    handles = [open(d / f"part{k}.jsonl", "w") for k in range(files)]
    recent: list[str] = []
    for i in range(n_docs):
        if recent and rng.random() < dup_rate:
            text = rng.choice(recent)
            if rng.random() < 0.5:
                words = text.split()
                words[rng.randrange(len(words))] = rng.choice(WORDS)
                text = " ".join(words)
        else:
            text = " ".join(rng.choices(WORDS, k=rng.randint(40, 80))) + "."
            recent.append(text)
            if len(recent) > 1000:
                recent.pop(rng.randrange(len(recent)))
        handles[i % files].write(json.dumps({"text": text}) + "\n")
    for h in handles:
        h.close()
    return d


def state_parts(state) -> dict[str, int]:
    """Bytes of the torch-saved checkpoint form of ``state``, split into the parts named above."""
    import torch

    from stacklm.datamodule.loader import to_checkpoint_safe

    def size(obj) -> int:
        buf = io.BytesIO()
        torch.save(to_checkpoint_safe(obj), buf)
        return buf.tell()

    parts = {"dedup": 0, "shuffle_buffer": 0, "pack_buffer": 0}

    def walk(obj, path: str) -> None:  # cut the named subtrees out, wherever they sit in the graph
        if isinstance(obj, dict):
            for k in list(obj):
                v = obj[k]
                if k in ("exact", "near") and isinstance(v, dict):
                    parts["dedup"] += size(v)
                    obj[k] = None
                elif k == "shuffle" and isinstance(v, dict):
                    parts["shuffle_buffer"] += size(v)
                    obj[k] = None
                elif k == "packer" and isinstance(v, dict):
                    parts["pack_buffer"] += size(v)
                    obj[k] = None
                else:
                    walk(v, f"{path}.{k}")
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")

    import copy

    rest = copy.deepcopy(state)
    total = size(state)
    walk(rest, "")
    parts["rest"] = size(rest)
    parts["total"] = total
    return parts


def run_graph(cfg_dict: dict, tok, at: list[int]) -> list[dict]:
    from stacklm.data.pipeline import PipelineConfig, build_pipeline

    cfg = PipelineConfig.from_dict(cfg_dict)
    p = build_pipeline(cfg, tok)
    src = next(iter(p.sources.values())) if hasattr(p, "sources") else None
    out, marks, t0 = [], list(at), time.perf_counter()
    for _ in p.batches:
        read = _records_read(p)
        if marks and read >= marks[0]:
            parts = state_parts(p.batches.state_dict())
            out.append({"docs_read": read, "seconds": time.perf_counter() - t0, **parts})
            print(f"  {read:>9,} docs read  {time.perf_counter() - t0:6.1f}s  " + "  ".join(
                f"{k}={v / 2**20:.2f}MiB" for k, v in parts.items()), flush=True)
            while marks and read >= marks[0]:
                marks.pop(0)
        if not marks:
            break
    del src
    return out


def _records_read(p) -> int:
    return sum(per.get("records_read", 0) for per in p.stats().get("source", {}).values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=1_000_000)
    ap.add_argument("--at", type=int, nargs="*", default=None, help="document counts to measure at (default: docs/100, docs/10, docs)")
    ap.add_argument("--shuffle-buffer", type=int, default=10000, help="as configs/stack-100m.yaml")
    ap.add_argument("--pack-buffer-docs", type=int, default=1000, help="as configs/stack-100m.yaml")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    at = args.at or [args.docs // 100, args.docs // 10, int(args.docs * 0.98)]

    from stacklm.corpus import iter_default_corpus
    from stacklm.tokenizer.training import train_from_iterable

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = train_from_iterable(iter_default_corpus(2_000_000), 4096).tokenizer
    results: dict = {"docs": args.docs, "shuffle_buffer": args.shuffle_buffer, "pack_buffer_docs": args.pack_buffer_docs}
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        t = time.perf_counter()
        write_corpus(d, args.docs)
        print(f"corpus: {args.docs:,} documents in {time.perf_counter() - t:.1f}s")
        base = {
            "mix": {"name": "bench", "total_tokens": 10**12,
                    "entries": [{"name": "web", "kind": "local", "weight": 1.0, "domain": "prose",
                                 "data_files": sorted(str(p) for p in d.glob("part*.jsonl"))}]},
            "seq_len": args.seq_len, "batch_size": 8, "holdout_fraction": 0.001, "num_threads": 2,
            "shuffle_buffer": args.shuffle_buffer, "pack_buffer_docs": args.pack_buffer_docs,
        }
        cfg_path = d / "cfg.yaml"
        import yaml

        cfg_path.write_text(yaml.safe_dump({"data": {"pipeline": {**base, "dedup": {"exact": True, "near": True}}}}))
        t = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "stacklm.cli", "dedup-index", "--config", str(cfg_path), "--out",
                              str(d / "dedup.npz")], capture_output=True, text=True, cwd=ROOT)
        if res.returncode:
            sys.exit(f"dedup-index failed: {res.stderr[-2000:]}")
        results["index"] = {"seconds": time.perf_counter() - t, "bytes": (d / "dedup.npz").stat().st_size}
        print(f"dedup-index: {results['index']['seconds']:.1f}s, {results['index']['bytes'] / 2**20:.2f} MiB on disk")
        for name, dedup in (("global index", {"index": str(d / "dedup.npz"), "exact": False, "near": False}),
                            ("in-flight", {"exact": True, "near": True})):
            print(f"== {name}")
            results[name] = run_graph({**base, "dedup": dedup}, tok, at)
    tokens_per_doc = 60 * 1.0  # ~1 token per synthetic word at this vocab; real documents ~1k tokens
    results["note"] = (f"shuffle buffer scales with buffered tokens: x{1000 / tokens_per_doc:.0f} for ~1k-token documents")
    print(results["note"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
