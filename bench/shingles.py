"""Near-dedup signing throughput: stacklm's char 7-gram and word 5-gram shingles vs datatrove's
own ``MinhashDedupSignature`` stage, on the same documents, in one run.

    python3 bench/shingles.py [--mb 8] [--corpus default|prose] [--repeats 3]

Documents: the first ``--mb`` MB of ``stacklm.corpus.iter_default_corpus`` (the Python standard
library: code files interleaved with docstrings / pydoc topics, CJK and math text) or of
``iter_prose`` (docstrings and pydoc topics only). Every side does the whole signing job from
raw text: normalise, shingle, MinHash, band keys (stacklm: ``MinHasher.keys`` in batches of
``--batch``, 120 one-permutation min-hashes, 12 bands); datatrove: ``MinhashDedupSignature.run``
with its default ``MinhashConfig`` (word 5-grams, 14 buckets x 8 hashes, xxhash64), which
also writes its signature files (to a temporary folder) and sorts them. datatrove picks spaCy
as the English word tokenizer; spaCy is not installed here, so it is given a whitespace
tokenizer (``str.split``): the cheapest possible, so its numbers are an upper bound for it.
Times are CPU seconds (``time.process_time``, best of ``--repeats``): every side is
single-threaded, and CPU time is not inflated by other processes on a shared machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from stacklm.corpus import iter_default_corpus, iter_prose
from stacklm.data.dedup.minhash import MinHasher


def load_docs(mb: float, corpus: str) -> list[str]:
    source = iter_prose if corpus == "prose" else iter_default_corpus
    return list(source(int(mb * 1e6)))


def cpu_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def stacklm_signing(kind: str, docs: list[str], batch: int):
    hasher = MinHasher(shingle=kind)
    hasher.keys(docs[:4])  # lazy imports and tables outside the timing

    def run() -> None:
        for i in range(0, len(docs), batch):
            hasher.keys(docs[i : i + batch])

    return run


def whitespace_tokenizer():
    """A datatrove ``WordTokenizer`` that splits at whitespace (``str.split``): spaCy, datatrove's
    English tokenizer, is not installed here. On text ``simplify_text`` has already stripped of
    punctuation it differs from spaCy only where spaCy splits a word on its own (``cannot``)."""
    from datatrove.utils.word_tokenizers import WordTokenizer

    class Whitespace(WordTokenizer):
        def word_tokenize(self, text: str) -> list[str]:
            return text.split()

        def sent_tokenize(self, text: str) -> list[str]:
            return [text]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return [(0, len(text))]

    return Whitespace()


def datatrove_signing(docs: list[str]):
    from datatrove.data import Document
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from loguru import logger

    logger.disable("datatrove")  # its per-run "Sorting buckets..." lines would interleave with the table
    documents = [Document(text=t, id=str(i)) for i, t in enumerate(docs)]

    def run() -> None:
        with tempfile.TemporaryDirectory() as out:
            step = MinhashDedupSignature(output_folder=out, config=MinhashConfig(), language=whitespace_tokenizer())
            for _ in step.run(iter(documents)) or ():  # a plain function in some versions, a generator in others
                pass

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=8.0, help="MB of text to sign")
    ap.add_argument("--corpus", choices=("default", "prose"), default="default")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    docs = load_docs(args.mb, args.corpus)
    mb = sum(len(d.encode("utf-8", "surrogatepass")) for d in docs) / 1e6
    rows = [
        ("stacklm char 7-grams (default)", stacklm_signing("char", docs, args.batch)),
        ("stacklm word 5-grams (dedup.shingle: word)", stacklm_signing("word", docs, args.batch)),
        ("datatrove MinhashDedupSignature (word 5-grams)", datatrove_signing(docs)),
    ]
    secs = {name: cpu_seconds(fn, args.repeats) for name, fn in rows}
    word = secs[rows[1][0]]
    print(f"{len(docs):,} documents, {mb:.1f} MB ({args.corpus} corpus), best of {args.repeats}, CPU seconds\n")
    print("| signing | CPU s | docs per CPU-s | MB per CPU-s | CPU time / stacklm word |")
    print("|---|---:|---:|---:|---:|")
    for name, s in secs.items():
        print(f"| {name} | {s:.2f} | {len(docs) / s:,.0f} | {mb / s:.1f} | {s / word:.2f} |")


if __name__ == "__main__":
    main()
