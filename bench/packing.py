"""Packing waste, greedy vs best-fit, on real documents.

    python3 bench/packing.py [--seq-len 2048] [--max-bytes N] [--buffers 8,32,100,1000] [--corpus default|code|prose]

Documents: ``stacklm.corpus.iter_default_corpus`` (the Python standard library: code files,
docstrings, pydoc topics, CJK and math text), tokenized by a quick ``rustbpe`` tokenizer
trained on a ~5 MB slice at vocab 8192 with the GPT-4 pattern; ``<bos>/<eos>/<pad>`` take the
three ids above the vocabulary. Documents are fed in a seeded shuffled order (the pipeline
shuffles before packing). ``short wait``: windows a document shorter than the median waits in
the packer (from its push to the window its first piece lands in), p50/p99/max; ``long p50``
the same for the others (best-fit keeps short documents as gap fillers; its ``max_wait`` bounds
that wait, so a short-document source is not delivered late). ``run(...)`` returns the numbers as a dict for ``bench/pipeline.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from stacklm.corpus import iter_default_corpus, iter_domain
from stacklm.data.packing.pack import make_packer
from stacklm.tokenizer.specials import GPT4_PATTERN


def corpus_texts(corpus: str = "default", max_bytes: int | None = None) -> list[str]:
    """``default`` = the mixed corpus; ``code`` / ``prose`` / ``math`` / ``cjk`` = one domain."""
    return list(iter_default_corpus(max_bytes) if corpus == "default" else iter_domain(corpus, max_bytes))


def tokenize_corpus(
    max_bytes: int | None = None, train_bytes: int = 5_000_000, vocab_size: int = 8192, chunk: int = 256, corpus: str = "default"
) -> list[np.ndarray]:
    """Real documents as int32 id arrays (no specials), through a quick rustbpe tokenizer."""
    import rustbpe

    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(iter_default_corpus(train_bytes), vocab_size, pattern=GPT4_PATTERN)
    texts = corpus_texts(corpus, max_bytes)
    out: list[np.ndarray] = []
    for i in tqdm(range(0, len(texts), chunk), desc="tokenize", unit="batch", leave=False):
        out.extend(np.asarray(ids, dtype=np.int32) for ids in tok.batch_encode(texts[i : i + chunk]))
    return out


def pack_stats(docs: list[dict], strategy: str, seq_len: int, specials: tuple[int, int, int], buffer_docs: int = 1000,
               unbounded_wait: bool = False) -> dict[str, Any]:
    # How long a document waits in the packer, in windows from its push to its first piece's
    # window, for documents shorter than the median ("short") and the others: best-fit keeps
    # short documents as gap fillers, and without a bound on the wait a short-document source
    # is delivered late (a skew of the realized mix over time; ``BestFitPacker.max_wait``).
    median = np.median([len(d["ids"]) for d in docs])
    labelled = [{**d, "file": 0, "record": k} for k, d in enumerate(docs)]
    packer = make_packer(strategy, seq_len, *specials, buffer_docs=buffer_docs, sources=["stdlib"], provenance=True)
    if unbounded_wait:  # the packer without its bound on the wait, for comparison
        packer.max_wait = 1 << 62
    pushed = np.zeros(len(docs), dtype=np.int64)
    placed = np.full(len(docs), -1, dtype=np.int64)
    n_windows = 0
    t0 = time.perf_counter()
    for k, doc in enumerate(labelled):
        pushed[k] = n_windows
        for _ in packer.push(doc):
            for piece in packer.origins.popleft().pieces:
                if placed[piece[2]] < 0:
                    placed[piece[2]] = n_windows
            n_windows += 1
    for _ in packer.finish():
        for piece in packer.origins.popleft().pieces:
            if placed[piece[2]] < 0:
                placed[piece[2]] = n_windows
        n_windows += 1
    seconds = time.perf_counter() - t0
    s = packer.summary()
    assert n_windows == s["windows"] and (placed >= 0).all()
    wait = placed - pushed
    short = np.array([len(d["ids"]) < median for d in docs])
    long_docs = sum(1 for d in docs if len(d["ids"]) + 2 > seq_len)
    s.update(
        fitting_docs_cut=s["docs_cut"] - long_docs,
        buffer_docs=buffer_docs if strategy == "best_fit" else None, unbounded_wait=unbounded_wait,
        docs_cut_fraction=s["docs_cut"] / max(s["docs"], 1),
        seconds=seconds,
        tokens_per_s=s["doc_tokens"] / seconds if seconds else float("inf"),
        wait_short_p50=float(np.median(wait[short])), wait_short_p99=float(np.percentile(wait[short], 99)),
        wait_short_max=int(wait[short].max()), wait_long_p50=float(np.median(wait[~short])),
    )
    return s


def run(
    seq_len: int = 2048,
    max_bytes: int | None = None,
    buffers: tuple[int, ...] = (8, 32, 100, 1000),
    vocab_size: int = 8192,
    seed: int = 0,
    token_docs: list[np.ndarray] | None = None,
    corpus: str = "default",
) -> dict[str, Any]:
    """Pack the same real documents greedily and best-fit (one row per buffer size).

    ``token_docs`` skips tokenization (pass ids made elsewhere, e.g. by bench/pipeline.py).
    """
    t0 = time.perf_counter()
    ids = token_docs if token_docs is not None else tokenize_corpus(max_bytes, vocab_size=vocab_size, corpus=corpus)
    tokenize_s = time.perf_counter() - t0
    order = np.random.default_rng(seed).permutation(len(ids))
    docs = [{"ids": ids[i], "source": "stdlib", "domain": "mixed", "doc_id": str(int(i))} for i in order]
    specials = (vocab_size, vocab_size + 1, vocab_size + 2)
    lengths = np.array([len(d["ids"]) + 2 for d in docs])
    rows = [pack_stats(docs, "greedy", seq_len, specials)]
    rows += [pack_stats(docs, "best_fit", seq_len, specials, b) for b in buffers]
    rows += [pack_stats(docs, "best_fit", seq_len, specials, max(buffers), unbounded_wait=True)]
    return {
        "corpus": corpus,
        "seq_len": seq_len,
        "docs": len(docs),
        "tokens": int(lengths.sum()),
        "docs_longer_than_window": int((lengths > seq_len).sum()),
        "median_doc_tokens": float(np.median(lengths)),
        "tokenize_seconds": tokenize_s,
        "rows": rows,
    }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"corpus {result['corpus']!r}, seq_len {result['seq_len']}: {result['docs']} docs, {result['tokens']:,} tokens (with bos/eos), "
        f"median doc {result['median_doc_tokens']:.0f} tokens, {result['docs_longer_than_window']} docs longer than a window"
    )
    greedy = result["rows"][0]
    head = (
        f"{'strategy':<10}{'buffer':>8}{'windows':>10}{'pad %':>9}{'docs cut':>10}{'cut %':>8}"
        f"{'cut vs greedy':>15}{'fitting cut':>13}{'short wait p50/p99/max':>24}{'long p50':>10}{'Mtok/s':>9}"
    )
    print(head)
    print("-" * len(head))
    # best_fit*: the same packer without its bound on the wait (BestFitPacker.max_wait), for comparison
    for r in result["rows"]:
        ratio = r["docs_cut"] / greedy["docs_cut"] if greedy["docs_cut"] else float("nan")
        print(
            f"{r['strategy'] + ('*' if r['unbounded_wait'] else ''):<10}{(r['buffer_docs'] or '-'):>8}{r['windows']:>10}{100 * r['pad_fraction']:>9.3f}"
            f"{r['docs_cut']:>10}{100 * r['docs_cut_fraction']:>8.2f}{ratio:>14.2f}x{r['fitting_docs_cut']:>13}"
            f"{r['wait_short_p50']:>10.0f}/{r['wait_short_p99']:.0f}/{r['wait_short_max']:<6}{r['wait_long_p50']:>8.0f}"
            f"{r['tokens_per_s'] / 1e6:>9.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--max-bytes", type=int, default=None, help="corpus bytes to use (default: all, ~34 MB)")
    ap.add_argument("--buffers", default="8,32,100,1000", help="best-fit buffer sizes (documents)")
    ap.add_argument("--corpus", default="default", choices=["default", "code", "prose", "math", "cjk"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    res = run(args.seq_len, args.max_bytes, tuple(int(x) for x in args.buffers.split(",")), seed=args.seed, corpus=args.corpus)
    print_table(res)


if __name__ == "__main__":
    main()
