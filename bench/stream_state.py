"""What a stream-mode checkpoint holds per reader and per rank, how it grows with the documents
read, what writing it and resuming from it cost: buffers saved by position (issue 34,
``stacklm.data.doc_refs``) beside the content they saved before, at the same point of one run.

    python3 bench/stream_state.py --quick                       # a few minutes
    python3 bench/stream_state.py --kinds short long --short-at 10000 100000 --long-at 10000 20000 \\
        --settings 10000/1000 2000/1000 --json state.json

A real stream graph (local jsonl sources -> holdout -> filter -> dedup -> tokenize -> mix ->
shuffle -> best-fit pack -> batch, ``stacklm.data.pipeline.build_pipeline``) runs over each
corpus kind, once per dedup mode and buffer setting:

* corpora: **short** synthetic documents (~60 tokens: 40-80 frequent words of the standard
  library's prose, with 10% planted exact and near copies) and **long** real documents (~3,000 tokens: the Python sources on this machine,
  the standard library then site-packages, concatenated in path order and cut at line ends);
* dedup: **in-flight** (``dedup: {exact: true, near: true}``) and the **global index**
  (``dedup: {index: ..., exact: false, near: false}``, built by ``stacklm dedup-index`` over the
  same corpus first; its time and size are printed);
* buffers (``--settings SHUFFLE/PACK``): stack-100m's ``shuffle_buffer`` 10000 /
  ``pack_buffer_docs`` 1000 (also this bench's defaults) and the pipeline's default 2000 / 1000.

At each count of documents read (the sources' ``records_read``), the graph's ``state_dict()`` is
taken (timed), serialised exactly as a Lightning checkpoint stores the loader state
(``to_checkpoint_safe`` then ``torch.save``, then written to a file in the temporary directory;
timed together), loaded back (``torch.load`` with ``weights_only=True`` then
``from_checkpoint_safe``; timed), restored into a fresh graph (``reset(state)``, timed: by
position this re-reads and re-tokenizes the buffered documents; the restored graphs' next
batches must agree across the forms), and split by part: dedup indexes,
the shuffle buffer, the packer's buffer, the documents pending inside the per-source stages
(the tokenizer's encoded batch, the dedup stage's queue), the rest. Each part is its own
``torch.save``, so the parts add up to the total plus about 1.5 kB per extra part (its own
container and the keys it repeats; printed as ``split overhead``).

One reader is one (rank, loader worker) pair; the bench runs one. The per-rank figure is
``total x --workers`` (4, stack-100m's ``num_workers``): every worker of a rank reads its own
share with the same buffers, so each holds a state of this size. It is computed, not measured
through ``StackDataModule``'s loader.
"""

from __future__ import annotations

import argparse
import copy
import io
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS: list[str] = []  # the short documents' vocabulary: ``short_words``


def short_words(n: int = 400) -> list[str]:
    """The ``n`` most frequent lower-case words of the bench tokenizer's own training text (the
    standard library's prose), each mostly one token: 40-80 of them make a ~60-token document
    that the prose filter keeps (at least 40 words, stop words present)."""
    import collections
    import re

    from stacklm.corpus import iter_default_corpus

    counts = collections.Counter(w for text in iter_default_corpus(2_000_000) for w in re.findall(r"\b[a-z]{2,12}\b", text))
    return [w for w, _ in counts.most_common(n)]

# where the long real documents come from: text already on this machine, no network
PYTHON_TREES = (Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}",
                Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages")
STACK_100M = (10000, 1000)  # configs/stack-100m.yaml: shuffle_buffer, pack_buffer_docs
PARTS = ("dedup", "shuffle_buffer", "pack_buffer", "pending", "rest")


def write_corpus(d: Path, n_docs: int, files: int = 4, dup_rate: float = 0.1, seed: int = 0) -> list[str]:
    """``n_docs`` short documents in ``files`` jsonl files; ``dup_rate`` of them copies of an earlier
    one (half exact, half with one word changed: a near duplicate). Returns the files."""
    if not WORDS:
        WORDS.extend(short_words())
    rng = random.Random(seed)
    paths = [d / f"part{k}.jsonl" for k in range(files)]
    handles = [open(p, "w") for p in paths]
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
    return [str(p) for p in paths]


def _python_sources():
    """Every utf-8 ``.py`` file under ``PYTHON_TREES``, in sorted path order (a fixed corpus)."""
    for tree in PYTHON_TREES:
        for dirpath, dirnames, filenames in os.walk(tree):
            dirnames.sort()
            if "site-packages" in dirnames and tree == PYTHON_TREES[0]:
                dirnames.remove("site-packages")  # read once, as the second tree
            for name in sorted(filenames):
                if name.endswith(".py"):
                    try:
                        yield (Path(dirpath) / name).read_text(encoding="utf-8")
                    except (UnicodeDecodeError, OSError):
                        continue


def write_long_corpus(d: Path, n_docs: int, tok, tokens: int = 3000, files: int = 4) -> list[str]:
    """``n_docs`` real documents of about ``tokens`` tokens: Python sources concatenated and cut at
    a line end once a document reaches the character count that ``tokens`` takes in ``tok``
    (measured on the first 1 MB, then
    on every 50th document). Exits with one line if the machine holds too little text."""
    paths = [d / f"long{k}.jsonl" for k in range(files)]
    handles = [open(p, "w") for p in paths]
    chars, written, doc, size, sample = None, 0, [], 0, []
    for text in _python_sources():
        if chars is None:
            sample.append(text)
            if sum(map(len, sample)) < 1_000_000:
                continue
            joined = "".join(sample)
            chars = tokens * len(joined) / len(tok.encode(joined))
            lines = joined.splitlines(keepends=True)
        else:
            lines = text.splitlines(keepends=True)
        for line in lines:
            doc.append(line)
            size += len(line)
            if size >= chars:
                text = "".join(doc)
                handles[written % files].write(json.dumps({"text": text}) + "\n")
                written, doc, size = written + 1, [], 0
                if written % 50 == 0:  # keep the characters per token current as the files change kind
                    chars = 0.8 * chars + 0.2 * tokens * len(text) / max(1, len(tok.encode(text)))
                if written == n_docs:
                    for h in handles:
                        h.close()
                    return [str(p) for p in paths]
    sys.exit(f"bench/stream_state.py: only {written:,} long documents in {', '.join(map(str, PYTHON_TREES))}; "
             f"ask for fewer with --long-at")


def _save_size(obj) -> int:
    import torch

    from stacklm.datamodule.loader import to_checkpoint_safe

    buf = io.BytesIO()
    torch.save(to_checkpoint_safe(obj), buf)
    return buf.tell()


def state_parts(state) -> dict[str, int]:
    """Bytes of the torch-saved checkpoint form of each part of ``state`` (``PARTS``), each saved
    alone; ``state`` is not changed."""
    cut_out: dict[str, list] = {"dedup": [], "shuffle_buffer": [], "pack_buffer": [], "pending": []}
    # "pending": documents a per-source stage holds between its input and its output (the tokenizer's
    # encoded batch, the dedup stage's queue): content too, outside the two named buffers
    cut = {"exact": "dedup", "near": "dedup", "shuffle": "shuffle_buffer", "packer": "pack_buffer", "pending": "pending"}

    def walk(obj) -> None:  # cut the named subtrees out, wherever they sit in the graph
        if isinstance(obj, dict):
            for k in list(obj):
                if k in cut and isinstance(obj[k], (dict, list)):
                    cut_out[cut[k]].append(obj[k])
                    obj[k] = None
                else:
                    walk(obj[k])
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    rest = _copy_containers(state)
    walk(rest)
    # one torch.save per part (all its subtrees in one list), so the split costs one container per part
    return {**{k: _save_size(v) if v else 0 for k, v in cut_out.items()}, "rest": _save_size(rest)}


def _copy_containers(obj):
    """``obj`` with its dicts and lists copied and its leaves (arrays, strings) shared: the cut
    replaces subtrees in the copy without copying megabytes of token ids."""
    if isinstance(obj, dict):
        return {k: _copy_containers(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_containers(v) for v in obj]
    return obj


def split_overhead(row: dict) -> int:
    """Bytes the split adds over the one file: each part saved alone carries its own container
    (about 1.3 kB a part) and repeats the pickle of keys the file writes once."""
    return sum(row[k] for k in PARTS) - row["total"]


def measure_state(state, path: Path, workers: int) -> dict:
    """Write ``state`` to ``path`` as a checkpoint does, read it back, and split it: bytes per part,
    the bytes ``torch.save`` writes (``total``), ``per_rank`` (``total x workers``) and the seconds of each step."""
    import torch

    from stacklm.datamodule.loader import from_checkpoint_safe, to_checkpoint_safe

    t = time.perf_counter()
    buf = io.BytesIO()  # the bytes first, then the file: the archive name inside torch's zip is the
    torch.save(to_checkpoint_safe(state), buf)  # file's stem, so a file's length varies with its name
    path.write_bytes(buf.getbuffer())
    save_s = time.perf_counter() - t
    total = buf.tell()
    del buf
    t = time.perf_counter()
    from_checkpoint_safe(torch.load(path, weights_only=True))
    load_s = time.perf_counter() - t
    return {**state_parts(state), "total": total, "per_rank": total * workers, "save_s": save_s, "load_s": load_s}


FORMS = ("positions", "content")  # buffers saved by position (issue 34: stacklm.data.doc_refs) or by content (before)


def use_refs(p, refs) -> None:
    """Point every buffering node of pipeline ``p`` at ``refs`` (None: save buffers by content, as
    before issue 34). Only the saving changes: what the nodes hold is the same either way."""
    for chain in p.chains.values():
        for node in chain.values():
            if hasattr(node, "refs"):
                node.refs = refs
    p.shuffle.refs = refs
    p.windows.packer.refs = refs


def run_graph(cfg_dict: dict, tok, at: list[int], work: Path, workers: int, label: str = "", on_state=None,
              forms: tuple[str, ...] = FORMS) -> list[dict]:
    """Run the graph of ``cfg_dict`` until the sources have read each count in ``at``; per count and
    state form (``forms``) one ``measure_state`` row, with ``restore_s``: a fresh graph's
    ``reset(state)`` (by position: re-reading and re-tokenizing the buffered documents), whose next
    batch is checked equal across the forms (``on_state``, if given, also gets each state)."""
    import numpy as np

    from stacklm.data.pipeline import PipelineConfig, build_pipeline

    cfg = PipelineConfig.from_dict(cfg_dict)
    p = build_pipeline(cfg, tok)
    refs = p.shuffle.refs
    out, marks, t0 = [], sorted(at), time.perf_counter()
    for _ in p.batches:
        read = _records_read(p)
        if marks and read >= marks[0]:
            t = time.perf_counter()
            nexts = []
            for form in forms:
                use_refs(p, refs if form == "positions" else None)
                ts = time.perf_counter()
                state = p.batches.state_dict()
                row = {"form": form, "docs_read": read, "run_s": t - t0, "state_dict_s": time.perf_counter() - ts,
                       "content_bytes": refs.bytes_by_content if form == "positions" else None,
                       **measure_state(state, work / "state.pt", workers)}
                fresh = build_pipeline(cfg, tok)
                ts = time.perf_counter()
                fresh.batches.reset(state)
                row["restore_s"] = time.perf_counter() - ts
                nexts.append(next(iter(fresh.batches))["input_ids"].numpy())
                del fresh
                out.append(row)
                if on_state is not None:
                    on_state(state)
                print(f"  {label:<34} {form:<9} {read:>9,} read {row['run_s']:6.0f}s  " + "  ".join(
                    f"{k}={row[k] / 2**20:.3f}" for k in (*PARTS, "total", "per_rank"))
                    + f" MiB  split overhead {split_overhead(row):,} B  state_dict {row['state_dict_s']:.2f}s save {row['save_s']:.2f}s "
                    f"load {row['load_s']:.2f}s restore {row['restore_s']:.2f}s", flush=True)
            use_refs(p, refs)
            if any(not np.array_equal(nexts[0], n) for n in nexts[1:]):
                sys.exit(f"bench/stream_state.py: {label}: the graphs restored from the {forms} states disagree on the next batch")
            while marks and read >= marks[0]:
                marks.pop(0)
            t0 += time.perf_counter() - t  # the measuring is not the graph's time
        if not marks:
            break
    if marks:
        print(f"  {label}: the corpus ended at {_records_read(p):,} documents read, before {marks}", flush=True)
    return out


def _records_read(p) -> int:
    return sum(per.get("records_read", 0) for per in p.stats().get("source", {}).values())


def pipeline_config(files: list[str], domain: str, shuffle_buffer: int, pack_buffer_docs: int, dedup: dict,
                    seq_len: int = 2048) -> dict:
    return {
        "mix": {"name": "bench", "total_tokens": 10**12,
                "entries": [{"name": "web", "kind": "local", "weight": 1.0, "domain": domain, "data_files": files}]},
        "seq_len": seq_len, "batch_size": 8, "holdout_fraction": 0.001, "num_threads": 2,
        "shuffle_buffer": shuffle_buffer, "pack_buffer_docs": pack_buffer_docs, "dedup": dedup,
    }


def build_index(base: dict, d: Path) -> dict:
    """``stacklm dedup-index`` over the corpus of ``base``, as a user runs it; its seconds and bytes."""
    import yaml

    cfg_path = d / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({"data": {"pipeline": {**base, "dedup": {"exact": True, "near": True}}}}))
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "stacklm.cli", "dedup-index", "--config", str(cfg_path), "--out",
                          str(d / "dedup.npz")], capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        sys.exit(f"dedup-index failed: {res.stderr[-2000:]}")
    return {"seconds": time.perf_counter() - t, "bytes": (d / "dedup.npz").stat().st_size}


def print_table(results: dict) -> None:
    print("\n| corpus | dedup | shuffle/pack | docs read | saved by | per reader | per rank | dedup | shuffle buffer | pack buffer "
          "| pending | rest | state_dict s | save s | load s | restore s |\n"
          "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def size(b: int) -> str:
        return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.0f} KiB"

    for run in results["runs"]:
        for r in run["rows"]:
            print(f"| {run['kind']} | {run['dedup']} | {run['shuffle_buffer']}/{run['pack_buffer_docs']} | {r['docs_read']:,} "
                  f"| {r['form']} | {size(r['total'])} | {size(r['per_rank'])} | " + " | ".join(size(r[k]) for k in PARTS)
                  + f" | {r['state_dict_s']:.2f} | {r['save_s']:.2f} | {r['load_s']:.2f} | {r['restore_s']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", nargs="+", choices=("short", "long"), default=["short", "long"])
    ap.add_argument("--short-at", type=int, nargs="+", default=[10_000, 100_000, 1_000_000],
                    help="short documents read at which to measure (the corpus is the largest, plus 2%%)")
    ap.add_argument("--long-at", type=int, nargs="+", default=[10_000, 100_000])
    ap.add_argument("--settings", nargs="+", default=[f"{STACK_100M[0]}/{STACK_100M[1]}", "2000/1000"],
                    help="SHUFFLE_BUFFER/PACK_BUFFER_DOCS pairs (default: stack-100m's, then the pipeline's default)")
    ap.add_argument("--dedup", nargs="+", choices=("index", "in-flight"), default=["index", "in-flight"])
    ap.add_argument("--workers", type=int, default=4, help="loader workers per rank (stack-100m: 4); per rank = per reader x this")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="short documents at 10k and 30k, long at 3k, stack-100m's buffers "
                    "(a mark below the shuffle buffer is measured at the first batch, once the buffer is full or the corpus read)")
    ap.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS),
                    help="buffers saved by position (issue 34) and/or by content (before), side by side at the same point")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.quick:
        args.short_at, args.long_at, args.settings = [10_000, 30_000], [3_000], [f"{STACK_100M[0]}/{STACK_100M[1]}"]
    settings = [tuple(int(x) for x in s.split("/")) for s in args.settings]

    from stacklm.corpus import iter_default_corpus
    from stacklm.tokenizer.training import train_from_iterable

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = train_from_iterable(iter_default_corpus(2_000_000), 4096).tokenizer
    results: dict = {"workers": args.workers, "seq_len": args.seq_len, "index": {}, "runs": [], "command": sys.argv[1:]}
    for kind in args.kinds:
        at = args.short_at if kind == "short" else args.long_at
        n_docs = int(max(at) * 1.02) + 1  # a little past the last mark: holdout and dedup leave some unread at the end
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            t = time.perf_counter()
            files = write_corpus(d, n_docs) if kind == "short" else write_long_corpus(d, n_docs, tok)
            with open(files[0]) as f:  # the tokens of the first 200 documents: what "~N tokens" means here
                tokens = [len(tok.encode(json.loads(line)["text"])) for line in itertools.islice(f, 200)]
            print(f"== {kind}: {n_docs:,} documents, ~{sum(tokens) / len(tokens):,.0f} tokens each, "
                  f"{sum(Path(f).stat().st_size for f in files) / 2**20:,.0f} MiB, written in {time.perf_counter() - t:.0f}s",
                  flush=True)
            domain = "prose" if kind == "short" else "code"
            if "index" in args.dedup:
                results["index"][kind] = build_index(pipeline_config(files, domain, *settings[0], {}, args.seq_len), d)
                print(f"   dedup-index: {results['index'][kind]['seconds']:.0f}s, "
                      f"{results['index'][kind]['bytes'] / 2**20:.2f} MiB on disk", flush=True)
            for shuffle_buffer, pack_buffer_docs in settings:
                for mode in args.dedup:
                    dedup = ({"index": str(d / "dedup.npz"), "exact": False, "near": False} if mode == "index"
                             else {"exact": True, "near": True})
                    cfg = pipeline_config(files, domain, shuffle_buffer, pack_buffer_docs, dedup, args.seq_len)
                    rows = run_graph(cfg, tok, at, d, args.workers, f"{kind} {mode} {shuffle_buffer}/{pack_buffer_docs}",
                                     forms=tuple(args.forms))
                    results["runs"].append({"kind": kind, "dedup": mode, "shuffle_buffer": shuffle_buffer,
                                            "pack_buffer_docs": pack_buffer_docs, "tokens_per_doc": sum(tokens) / len(tokens),
                                            "rows": rows})
    print_table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
