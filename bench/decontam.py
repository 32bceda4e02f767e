"""Decontamination cost per MB beside the tokenizer's encode cost per MB, and its accuracy
against a brute-force reference, in one run.

    python3 bench/decontam.py [--mb 8] [--eval-mb 1] [--n 13] [--planted 200]

Training text: the first ``--mb`` MB of ``stacklm.corpus.iter_default_corpus`` (the Python
standard library: CJK and math text, code, docstrings). Evaluation set: records of ~600
characters cut from the ``--eval-mb`` MB of the corpus that follow (real text, not in the
training slice), plus ``--planted`` training documents that get a 13-word span of an evaluation
record pasted in under another surface (upper case, punctuation, line breaks).

Timed (CPU seconds, ``time.process_time``, best of ``--repeats``, single thread, interleaved
rounds): the stage's per-document work (``words_of`` + ``NgramIndex.lookup``, what
``DecontamNode`` does per document) and the tokenizer's ``encode`` per document (a 4096-id
tokenizer trained on 2 MB of the same text; ``TokenizeNode`` calls the same encoder), on the
same documents. Also the index build time and size.

Accuracy: every document's hits (position, set) against a brute-force reference (Python
tuples of the NFKC/\\w/casefold words, set membership): misses and false hits are counted.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
import time
import unicodedata
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from stacklm.corpus import iter_default_corpus
from stacklm.data.quality.ngrams import build_index, words_of


def _ref_words(text: str) -> list[str]:
    return [w.casefold() for w in re.findall(r"\w+", unicodedata.normalize("NFKC", text))]


def _cpu(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=8.0)
    ap.add_argument("--eval-mb", type=float, default=1.0)
    ap.add_argument("--n", type=int, default=13)
    ap.add_argument("--planted", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = args.n

    corpus = list(iter_default_corpus(int((args.mb + args.eval_mb) * 1_000_000)))
    train, evaltext, size = [], [], 0
    for d in corpus:
        (train if size < args.mb * 1_000_000 else evaltext).append(d)
        size += len(d.encode())
    records = [chunk for d in evaltext for chunk in (d[i : i + 600] for i in range(0, len(d), 600)) if len(chunk.split()) >= n]
    rng = random.Random(0)
    planted = set(rng.sample(range(len(train)), min(args.planted, len(train))))
    for i in planted:
        w = _ref_words(rng.choice(records))
        if len(w) < n:
            continue
        at = rng.randrange(len(w) - n + 1)
        span = " ".join((x.upper() if k % 3 == 0 else x) + (",\n" if k % 4 == 1 else " ") for k, x in enumerate(w[at : at + n]))
        cut = rng.randrange(len(train[i]) + 1)
        train[i] = train[i][:cut] + " " + span + " " + train[i][cut:]
    mb = sum(len(d.encode()) for d in train) / 1e6

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.process_time()
        index = build_index(Path(tmp) / "idx", n, [("eval", records)], "bench")
        build_s = time.process_time() - t0
        index_bytes = sum(f.stat().st_size for f in Path(index.folder).iterdir())

        from stacklm.tokenizer.training import train_from_iterable

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tok = train_from_iterable(iter(corpus[: max(1, len(corpus) // 5)]), 4096).tokenizer

        def stage():
            for d in train:
                w = words_of(d)
                if len(w) >= n:
                    index.lookup(w)

        def encode():
            for d in train:
                tok.encode(d)

        best = {"decontam": float("inf"), "encode": float("inf")}
        for _ in range(args.repeats):
            best["decontam"] = min(best["decontam"], _cpu(stage))
            best["encode"] = min(best["encode"], _cpu(encode))

        grams = set()
        for r in records:
            w = _ref_words(r)
            grams |= {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}
        miss = false = hits_docs = 0
        for d in train:
            w = _ref_words(d)
            want = {i for i in range(len(w) - n + 1) if tuple(w[i : i + n]) in grams}
            got = {i for i, _ in index.lookup(words_of(d))}
            miss += len(want - got)
            false += len(got - want)
            hits_docs += bool(want)
        planted_found = sum(1 for i in planted if index.lookup(words_of(train[i])))

    print(f"scale: {len(train):,} training documents, {mb:.2f} MB; evaluation set {len(records):,} records, "
          f"{len(index):,} distinct {n}-grams; {len(planted)} planted copies; CPU s, single thread, best of {args.repeats}; "
          f"{os.cpu_count()} CPUs (shared)")
    print(f"index build: {build_s:.2f} s CPU, {index_bytes / 1e6:.2f} MB on disk")
    print(f"{'stage':<28} {'ms/MB':>8} {'MB/s':>8}")
    for name, label in (("decontam", "decontam (words + lookup)"), ("encode", "tokenizer encode")):
        print(f"{label:<28} {1000 * best[name] / mb:>8.1f} {mb / best[name]:>8.2f}")
    print(f"decontam / encode: {best['decontam'] / best['encode']:.2f}x")
    print(f"accuracy vs brute force: {hits_docs} documents overlap; missed n-grams {miss}, false hits {false}; "
          f"planted found {planted_found}/{len(planted)}")


if __name__ == "__main__":
    main()
