"""``train_from_iterable``: train a ``StackTokenizer`` of exactly ``vocab_size`` ids from a stream
of documents, the one entry point to both training backends (``backends.py``: ``fast`` is
`rustbpe`, ``python`` the from-scratch trainer of ``train.py``), and its ``TrainResult``.

Documents are cleaned as encoding sees them (lone surrogates replaced, very long whitespace runs
cut by ``segments.split_long_runs``); a corpus that runs out of repeated pairs is padded with
``<|unused_N|>`` fillers below the specials, with a warning.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import regex

from stacklm.tokenizer.artifact import SPECIAL_NAME
from stacklm.tokenizer.backends import BACKENDS, get_backend
from stacklm.tokenizer.bpe import StackTokenizer
from stacklm.tokenizer.rules import replace_lone_surrogates
from stacklm.tokenizer.segments import split_long_runs
from stacklm.tokenizer.specials import (
    DEFAULT_VOCAB_SIZE,
    GPT4_PATTERN,
    N_BYTES,
    SPECIAL_TOKENS,
    special_token_ids,
)


@dataclass
class TrainResult:
    tokenizer: StackTokenizer
    n_merges: int
    shortfall: int  # merges the corpus could not supply (filled with <|unused_N|>)
    backend: str
    seconds: float
    bytes_seen: int
    docs_seen: int
    surrogates_replaced: int
    extra: dict[str, Any] = field(default_factory=dict)


class _Counter:
    def __init__(self, bar=None) -> None:
        self.bytes = 0
        self.docs = 0
        self.bar = bar

    def __call__(self, n: int) -> None:
        self.bytes += n
        self.docs += 1
        if self.bar is not None:
            self.bar.update(n)


def train_from_iterable(
    docs: Iterable[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    *,
    backend: str = "fast",
    pattern: str = GPT4_PATTERN,
    progress: bool = False,
    total_bytes: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> TrainResult:
    """Train a tokenizer of exactly ``vocab_size`` ids from a stream of documents.

    Learns up to ``vocab_size - 256 - len(special_tokens)`` merges; if the corpus runs out of
    repeated pairs first, the shortfall is filled with ``<|unused_N|>`` ids *below* the
    specials (so the specials never move) and a loud warning says so.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown tokenizer training backend {backend!r}; choose one of {BACKENDS}")
    special_tokens = tuple(special_tokens)
    for s in special_tokens:
        if not SPECIAL_NAME.fullmatch(s):
            raise ValueError(f"special token {s!r} must look like <|name|>")
    special_token_ids(vocab_size, special_tokens)  # validates room
    max_merges = vocab_size - N_BYTES - len(special_tokens)
    regex.compile(pattern)

    surrogates = 0
    docs_seen = [0]

    def clean(stream: Iterable[str]):
        nonlocal surrogates
        for doc in stream:
            if not isinstance(doc, str):
                raise TypeError(f"training documents must be str, got {type(doc).__name__}")
            fixed = replace_lone_surrogates(doc)
            if fixed is not doc:
                surrogates += fixed.count("\ufffd") - doc.count("\ufffd")
                doc = fixed
            if doc:
                docs_seen[0] += 1
                yield from split_long_runs(doc)  # as encoding does; the Rust regex fails on ~1M runs

    # One bar at a time: reading ends before merging starts, so the merging bar opens on the
    # first merge, after the reading bar closed (two bars open at once tangled in a log or pipe).
    bars: list = []

    def merged(n: int) -> None:
        if len(bars) == 1:
            bars[0].close()
            bars.append(tqdm(total=max_merges, unit="merge", desc=f"tokenizer[{backend}] merging"))
        bars[-1].update(n)

    if progress:
        from tqdm.auto import tqdm

        bars.append(tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"tokenizer[{backend}] reading"))
    meter = _Counter(bars[0] if bars else None)
    t0 = time.perf_counter()
    try:
        out = get_backend(backend)(clean(docs), max_merges, pattern, meter, merged if bars else None)
    finally:
        for bar in bars:
            bar.close()
    seconds = time.perf_counter() - t0
    if meter.bytes == 0:
        raise ValueError("empty training corpus: the input yielded no text; check the input paths/globs and byte budget")
    shortfall = max_merges - len(out.token_bytes)
    if shortfall:
        msg = (
            f"tokenizer corpus ran short: learned {len(out.token_bytes)} of {max_merges} merges; "
            f"padded the vocab with {shortfall} <|unused_N|> fillers (ids {N_BYTES + len(out.token_bytes)}.."
            f"{N_BYTES + max_merges - 1}). Train on more (or more varied) text for a full vocab."
        )
        warnings.warn(msg, stacklevel=2)  # one line on the command line (stacklm.once.one_line_warnings)
    meta = {
        "backend": backend,
        "bytes_seen": meter.bytes,
        "docs_seen": docs_seen[0],
        "surrogates_replaced": surrogates,
        "shortfall": shortfall,
        "train_seconds": round(seconds, 3),
        **(metadata or {}),
    }
    tok = StackTokenizer(
        out.token_bytes,
        pattern=pattern,
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        merge_pairs=out.merges,
        metadata=meta,
    )
    return TrainResult(tok, len(out.token_bytes), shortfall, backend, seconds, meter.bytes, docs_seen[0], surrogates)
