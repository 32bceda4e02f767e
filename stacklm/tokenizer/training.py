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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import regex

from stacklm.progress_lines import ProgressLines, count, duration, eta, percent, rate, wants_lines
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
    """Bytes and documents read; ``on_read(n)`` is told each document's bytes."""

    def __init__(self, on_read: Callable[[int], None] | None = None) -> None:
        self.bytes = 0
        self.docs = 0
        self.on_read = on_read

    def __call__(self, n: int) -> None:
        self.bytes += n
        self.docs += 1
        if self.on_read is not None:
            self.on_read(n)


def _progress(enabled: bool, backend: str, total_bytes: int | None, max_merges: int):
    """``(meter, merged, read_done, close)``: the reading meter, the merge callback (None: no
    progress), what is called when the input is exhausted and what ends the progress. On a
    terminal two tqdm bars, one at a time: reading ends before merging starts, so the merging bar
    opens on the first merge, after the reading bar closed (two bars open at once tangled in a log
    or pipe). Elsewhere plain lines (``stacklm.progress_lines``, ``_LineProgress``)."""
    if not enabled:
        return _Counter(), None, None, lambda: None
    if wants_lines():
        lp = _LineProgress(f"train-tokenizer[{backend}]", total_bytes, max_merges, backend)
        return _Counter(lp.read), lp.merged, lp.read_done, lp.close
    from tqdm.auto import tqdm

    bars: list = [tqdm(total=total_bytes, unit="B", unit_scale=True, desc=f"tokenizer[{backend}] reading")]

    def merged(n: int) -> None:
        if len(bars) == 1:
            bars[0].close()
            bars.append(tqdm(total=max_merges, unit="merge", desc=f"tokenizer[{backend}] merging"))
        bars[-1].update(n)

    def close() -> None:
        for bar in bars:
            bar.close()

    return _Counter(bars[0].update), merged, None, close


class _LineProgress:
    """Tokenizer training as plain lines: while reading, MB read of the byte budget, MB/s and
    ETA; when the input is exhausted one line with what was read; then merges done of the total,
    merges/s and ETA (``python`` backend; ``fast``, rustbpe, says nothing until it is done)."""

    def __init__(self, label: str, total_bytes: int | None, max_merges: int, backend: str) -> None:
        self.lines = ProgressLines(label)
        self.total_bytes, self.max_merges, self.backend = total_bytes, max_merges, backend
        self.bytes = self.merges = 0
        self.merging_since: float | None = None

    def _read_fields(self) -> list[tuple[str, str]]:
        secs = max(self.lines.elapsed(), 1e-9)
        total = self.total_bytes
        shown = f"{count(self.bytes)}/{count(total)} ({percent(self.bytes, total)})" if total else count(self.bytes)
        return [("bytes", shown), ("MB/s", f"{self.bytes / secs / 1e6:.2f}"), ("elapsed", duration(secs))]

    def read(self, n: int) -> None:
        self.bytes += n
        if self.lines.due():
            fields = self._read_fields()
            if self.total_bytes:
                fields.append(("ETA", eta(self.total_bytes - self.bytes, self.bytes / max(self.lines.elapsed(), 1e-9))))
            self.lines.write([("", "reading"), *fields])

    def read_done(self) -> None:
        if self.merging_since is None:
            quiet = " (rustbpe says nothing until it is done)" if self.backend == "fast" else ""
            self.lines.write([("", "input read"), *self._read_fields(), ("now merging", f"{count(self.max_merges)} merges{quiet}")])
            self.merging_since = self.lines.clock()

    def merged(self, n: int) -> None:
        self.read_done()
        self.merges += n
        if self.lines.due() or self.merges >= self.max_merges:
            self._merge_line()

    def _merge_line(self) -> None:
        secs = max(self.lines.clock() - (self.merging_since or self.lines.started), 1e-9)
        per_s = self.merges / secs
        done = self.merges >= self.max_merges
        self.lines.write([("", "merged" if done else "merging"),
                          ("merges", f"{count(self.merges)}/{count(self.max_merges)} ({percent(self.merges, self.max_merges)})"),
                          ("merges/s", rate(per_s)), ("elapsed", duration(self.lines.elapsed())),
                          *([] if done else [("ETA", eta(self.max_merges - self.merges, per_s))])])

    def close(self) -> None:
        if 0 < self.merges < self.max_merges:  # the corpus ran out of pairs: say where merging stopped
            self._merge_line()


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

    def clean(stream: Iterable[str], read_done: Callable[[], None] | None):
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
        if read_done is not None:
            read_done()

    meter, merged, read_done, close = _progress(progress, backend, total_bytes, max_merges)
    t0 = time.perf_counter()
    try:
        out = get_backend(backend)(clean(docs, read_done), max_merges, pattern, meter, merged)
    finally:
        close()
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
