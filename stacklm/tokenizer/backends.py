"""Training backends behind one signature: ``(docs, num_merges, pattern, progress) -> BpeTrainOutput``.

``fast`` is `rustbpe` (nanochat's trainer: parallel chunk counting plus the same heap
algorithm in Rust, same tie-break rule), the default. ``python`` is our from-scratch trainer
(``train.py``). Both must give identical merges; ``tests/tokenizer/test_train.py`` checks it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from stacklm.tokenizer.train import BpeTrainOutput, count_chunks, train_bpe

BACKENDS = ("fast", "python")


def _metered(docs: Iterable[str], progress: Callable[[int], None] | None) -> Iterator[str]:
    for doc in docs:
        if progress is not None:
            progress(len(doc.encode("utf-8", "surrogatepass")))
        yield doc


def train_fast(
    docs: Iterable[str],
    num_merges: int,
    pattern: str,
    progress_bytes: Callable[[int], None] | None = None,
    progress_merges: Callable[[int], None] | None = None,
) -> BpeTrainOutput:
    import rustbpe

    tok = rustbpe.Tokenizer()
    tok.train_from_iterator(_metered(docs, progress_bytes), 256 + num_merges, pattern=pattern)
    ranks = sorted(tok.get_mergeable_ranks(), key=lambda kv: kv[1])
    token_bytes = [bytes(b) for b, rank in ranks if rank >= 256]
    if progress_merges is not None:
        progress_merges(len(token_bytes))
    return BpeTrainOutput(token_bytes=token_bytes, merges=None, unique_chunks=-1, total_chunks=-1)


def train_python(
    docs: Iterable[str],
    num_merges: int,
    pattern: str,
    progress_bytes: Callable[[int], None] | None = None,
    progress_merges: Callable[[int], None] | None = None,
) -> BpeTrainOutput:
    counts = count_chunks(docs, pattern, progress_bytes)
    return train_bpe(counts, num_merges, progress_merges)


def get_backend(name: str):
    try:
        return {"fast": train_fast, "python": train_python}[name]
    except KeyError:
        raise ValueError(f"unknown tokenizer training backend {name!r}; choose one of {BACKENDS}") from None
