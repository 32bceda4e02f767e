"""Training input for the tokenizer: a byte-budgeted, streamed, audited text sample.

``stream_sample(paths_or_globs, max_bytes)`` reads files (plain, .gz or .zst) block by block (never a whole file,
so a 100 MB single line costs a few MB of memory), decodes them as UTF-8 and yields text
chunks of at most ``chunk_bytes`` UTF-8 bytes. ``sample_texts(texts, max_bytes)`` applies the
same rules to in-memory strings (e.g. ``stacklm.corpus.iter_default_corpus()``).

Rules (both functions):

* **Budget.** (``stream_sample``; ``text_input.open_text_mix`` shares the budget between its
  inputs by weight or by the text each holds, ``text_sizes``, and applies this rule per input.) The yielded text is the first ``max_bytes`` UTF-8 bytes of the cleaned input
  stream, exactly. The one exception: when the budget falls inside a multi-byte character,
  that character is left out rather than split, so the sample is 1-3 bytes short. The last
  chunk is cut at the budget even mid-word (once per sample, recorded in the audit as
  ``budget_cut_mid_word``): an exact, reproducible budget matters more than one word.
* **Chunk boundaries.** A chunk never spans two files/documents and never splits a UTF-8
  sequence. Inside a file a chunk ends where a whitespace run begins (``"foo" | " bar"``), so
  the GPT-4-style pre-tokenizer sees the same pieces it would see in the whole text (it
  attaches a leading space to the following word). If the window holds no such boundary,
  the end of a leading whitespace run is used; if there is no whitespace at all (one "word"
  longer than ``chunk_bytes``, e.g. a minified 100 MB line), the chunk is cut at the last
  character boundary that fits and the cut is counted as ``forced_cuts``.
* **Byte-loss audit.** Nothing is dropped silently. Per input file the audit counts invalid
  UTF-8 sequences (each replaced by one U+FFFD, as Python's ``errors="replace"`` groups
  them), NUL bytes (removed: they are never text and some tools treat them as terminators),
  and UTF-8-encoded lone surrogates (``ED A0..BF xx``, CESU-8/WTF-8 leftovers; one U+FFFD
  each). For in-memory strings, lone surrogate code points (e.g. from ``surrogateescape``) are
  replaced the same way. Counts cover every byte *read*; reads stop at most a few KiB past
  the budget (``bytes_read`` reports exactly how much).

An empty result is not an error here (the caller decides what an empty corpus means), but
``SampleAudit.raise_if_empty()`` gives the caller one clear message naming the inputs.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator

import regex

from stacklm.data.audit import clean_text

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: big enough to amortise per-chunk work, small in RAM
_MIN_READ_BYTES = 4096

COUNTERS = (
    "bytes_read",
    "bytes_yielded",
    "chunks",
    "invalid_utf8_replaced",
    "nul_bytes_removed",
    "lone_surrogates_replaced",
    "forced_cuts",
)
_LOSS_COUNTERS = ("invalid_utf8_replaced", "nul_bytes_removed", "lone_surrogates_replaced")
# records (JSON lines, parquet, datasets rows) skipped by the source node, by reason
RECORD_COUNTERS = ("records_empty", "records_binary", "records_invalid", "blank_lines")

_REPLACEMENT = "\ufffd"
_REPLACEMENT_UTF8 = _REPLACEMENT.encode("utf-8")
# A surrogate code point encoded as UTF-8 (ED A0..BF 80..BF). Strict UTF-8 rejects it, and
# Python's decoder would report it as three separate errors; we count it as one loss.
_ENCODED_SURROGATE = regex.compile(rb"\xed[\xa0-\xbf][\x80-\xbf]")
# Last position where a whitespace run starts after a non-space (the preferred cut).
_RUN_START_REVERSE = regex.compile(r"(?<=\S)\s", flags=regex.REVERSE)
_LEADING_SPACE = regex.compile(r"\s+")


class SampleAudit:
    """What the sampler read, yielded and replaced, per input file.

    ``per_file[path]`` maps each name in ``COUNTERS`` to an int. The trainer stores
    ``to_dict()`` in the artifact's metadata and prints ``summary()``.
    """

    def __init__(self, inputs: list[str], max_bytes: int | None, chunk_bytes: int) -> None:
        self.inputs = list(inputs)
        self.max_bytes = max_bytes
        self.chunk_bytes = chunk_bytes
        self.per_file: dict[str, dict[str, int]] = {}
        self.duplicate_paths: list[str] = []
        self.budget_reached = False
        self.budget_cut_mid_word = False
        self.file_sizes: dict[str, int] = {}  # on-disk size per input file
        # per input (file, or a stream by its label): its source and the text it holds by estimate
        # (``text_sizes.text_estimate``; ``None`` for a stream), what its share was decided on
        self.estimates: dict[str, dict] = {}
        # per source of a mix (``text_input.open_text_mix``): its weight and how the shares were set
        self.sources: dict[str, dict] = {}
        self.weight_by: str | None = None
        self.complete: dict[str, bool] = {}  # per input read: True when read to its end, not stopped at its share

    def _counts(self, name: str) -> dict[str, int]:
        if name not in self.per_file:
            self.per_file[name] = dict.fromkeys(COUNTERS, 0)
        return self.per_file[name]

    @property
    def bytes_yielded(self) -> int:
        return sum(c["bytes_yielded"] for c in self.per_file.values())

    def total(self, counter: str) -> int:
        if counter not in COUNTERS and not any(counter in c for c in self.per_file.values()):
            raise KeyError(f"unknown audit counter {counter!r}; choose one of {COUNTERS}")
        return sum(c.get(counter, 0) for c in self.per_file.values())

    def raise_if_empty(self) -> None:
        """Raise ``ValueError`` naming the inputs when nothing usable was yielded."""
        if self.bytes_yielded == 0:
            lost = {k: self.total(k) for k in _LOSS_COUNTERS if self.total(k)}
            detail = f"; removed/replaced: {lost}" if lost else ""
            raise ValueError(
                f"empty corpus: {len(self.per_file)} input(s) {self.inputs!r} yielded no text "
                f"(bytes read: {self.total('bytes_read')}{detail}). Pass non-empty UTF-8 text files."
            )

    def to_dict(self) -> dict:
        """JSON-ready form for the artifact's metadata."""
        return {
            "inputs": list(self.inputs),
            "max_bytes": self.max_bytes,
            "chunk_bytes": self.chunk_bytes,
            "bytes_yielded": self.bytes_yielded,
            "budget_reached": self.budget_reached,
            "budget_cut_mid_word": self.budget_cut_mid_word,
            "duplicate_paths": list(self.duplicate_paths),
            "file_sizes": dict(self.file_sizes),
            "estimates": {name: dict(e) for name, e in self.estimates.items()},
            "sources": {name: dict(v) for name, v in self.sources.items()},
            "weight_by": self.weight_by,
            "complete": dict(self.complete),
            "totals": {k: self.total(k) for k in COUNTERS},
            "per_file": {name: dict(c) for name, c in self.per_file.items()},
        }

    def _state(self) -> str:
        """What ended the sample, in words that match what was read."""
        if self.budget_reached:
            return "budget reached"
        if self.max_bytes is None:
            return "every input read to its end"
        stopped = [n for n, done in self.complete.items() if not done]
        if not stopped:
            return "input exhausted: every input read to its end"
        short = self.max_bytes - self.bytes_yielded
        left = sum(max(0, (self.estimates.get(n, {}).get("text") or 0) - self.per_file[n]["bytes_yielded"]) for n in stopped)
        return (f"budget not filled: {short:,} B short, while {len(stopped):,} input(s) stopped at their share "
                f"hold ~{left:,} B more by estimate")

    def summary(self, max_inputs: int = 10, max_files: int = 20) -> list[str]:
        """Printable lines: the header (text yielded, inputs and sources read, bytes read, what
        ended it), one line per source of a mix, the ``max_inputs`` inputs that gave the most
        plus one line for the rest (every input stays in ``to_dict()``), the byte loss and the
        files that lost bytes (up to ``max_files``)."""
        budget = "no budget" if self.max_bytes is None else f"budget {self.max_bytes:,} B"
        # every input of a mix, also one not read (a plain stream lists only the files that lost bytes)
        names = list(dict.fromkeys([*self.file_sizes, *self.estimates]))
        total = self.bytes_yielded
        gave = {n: c.get("bytes_yielded", 0) for n, c in self.per_file.items()} | {n: self.per_file.get(n, {}).get("bytes_yielded", 0) for n in names}
        n_sources = len(self.sources)
        lines = [
            f"sample: {total:,} B of text from {sum(1 for g in gave.values() if g):,} of {len(gave):,} input(s)"
            + (f" in {n_sources} sources" if n_sources > 1 else "")
            + f" ({self.total('bytes_read'):,} B read; {budget}, {self._state()})"
        ]

        def pct(n: int) -> str:
            return f"{n / total if total else 0:.1%}"

        if n_sources > 1:
            by = "weight" if self.weight_by == "mix" else "share of the text"
            for src, info in sorted(self.sources.items(), key=lambda kv: -sum(gave[n] for n in kv[1]["inputs"])):
                got = sum(gave[n] for n in info["inputs"])
                est = info.get("text")
                lines.append(f"  source {src!r}: {got:,} B ({pct(got)} of the sample; {by} {info['share']:.1%}) from "
                             f"{len(info['inputs']):,} input(s)" + (f", ~{est:,} B of text" if est is not None else ""))
        ranked = sorted(names, key=lambda n: -gave[n])
        for name in ranked[:max_inputs]:
            c, est = self.per_file.get(name, {}), self.estimates.get(name, {})
            quota = c.get("quota", -1)
            size = self.file_sizes.get(name)
            held = (f"of ~{est['text']:,} B of text ({size:,} B on disk" + (f", {est['how']}" if est.get("how") not in (None, "size") else "")
                    + ")") if est.get("text") is not None and size is not None else (f"of {size:,} B on disk" if size is not None else "")
            lines.append(
                f"  {name}: {gave[name]:,} B ({pct(gave[name])} of the sample) {held}".rstrip()
                + (f", share {quota:,} B" if quota >= 0 else "")
                + ("" if name in self.per_file else ", not read (budget spent)")
            )
        rest = ranked[max_inputs:]
        if rest:
            lines.append(f"  ... and {len(rest):,} more input(s): {sum(gave[n] for n in rest):,} B ({pct(sum(gave[n] for n in rest))} "
                         "of the sample); every input is in the artifact's metadata.sample_audit.per_file")
        loss = ", ".join(f"{k}={self.total(k):,}" for k in _LOSS_COUNTERS)
        lines.append(f"  byte loss: {loss}; forced_cuts={self.total('forced_cuts'):,}")
        if self.duplicate_paths:
            lines.append(f"  skipped {len(self.duplicate_paths)} path(s) matched twice: {self.duplicate_paths[:5]}")
        records = [c for c in self.per_file.values() if "records_empty" in c]
        if records:  # JSON lines / parquet / datasets inputs (stacklm.data.sources.text_input)
            skipped = {k: sum(c.get(k, 0) for c in records) for k in RECORD_COUNTERS}
            lines.append(
                f"  records: {sum(c['documents'] for c in records):,} documents read; skipped: "
                + ", ".join(f"{k}={v:,}" for k, v in skipped.items())
            )
        lossy = [(n, c) for n, c in self.per_file.items() if any(c[k] for k in _LOSS_COUNTERS)]
        for name, c in lossy[:max_files]:
            detail = ", ".join(f"{k}={c[k]:,}" for k in _LOSS_COUNTERS if c[k])
            lines.append(f"  {name}: {detail}")
        if len(lossy) > max_files:
            lines.append(f"  ... and {len(lossy) - max_files} more file(s) with byte loss")
        return lines

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"SampleAudit({self.to_dict()['totals']})"


class TextSample:
    """A single-pass iterator of text chunks with its ``audit`` (filled while iterating)."""

    def __init__(self, chunks: Iterator[str], audit: SampleAudit) -> None:
        self._chunks = chunks
        self.audit = audit

    def __iter__(self) -> "TextSample":
        return self

    def __next__(self) -> str:
        return next(self._chunks)

    def close(self) -> None:
        """Stop early and close the open file now (otherwise it closes at garbage collection)."""
        self._chunks.close()


# ----------------------------------------------------------------------------- decoding


def clean_bytes(raw: bytes, counts: dict[str, int]) -> str:
    """Decode a piece of UTF-8 (cut at a safe boundary) and count what was replaced/removed.

    Not ``stacklm.data.audit.clean_text``: a file sample counts a UTF-8-encoded surrogate
    (``ED A0..BF xx``) as one lost character where Python's decoder, and so the document
    audit, sees three invalid bytes; and a sample never drops text, it only counts."""
    genuine = raw.count(_REPLACEMENT_UTF8)  # U+FFFD already in the input is not a loss
    raw, n_surrogates = _ENCODED_SURROGATE.subn(_REPLACEMENT_UTF8, raw)
    text = raw.decode("utf-8", errors="replace")
    n_invalid = text.count(_REPLACEMENT) - genuine - n_surrogates if "\ufffd" in text else 0
    n_nul = text.count("\x00")
    if n_nul:
        text = text.replace("\x00", "")
    counts["invalid_utf8_replaced"] += n_invalid
    counts["lone_surrogates_replaced"] += n_surrogates
    counts["nul_bytes_removed"] += n_nul
    return text


def _safe_split(raw: bytes) -> tuple[bytes, bytes]:
    """Split ``raw`` so the head holds no partial UTF-8 sequence: the tail starts at the last
    non-continuation byte among the final 4 bytes. Decoding head, then tail + next block,
    gives exactly what decoding the whole file at once would (errors grouped the same way)."""
    for i in range(len(raw) - 1, max(len(raw) - 5, -1), -1):
        if not 0x80 <= raw[i] <= 0xBF:
            return raw[:i], raw[i:]
    return raw, b""  # >= 4 trailing continuation bytes: strays, each its own error anyway


def _utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8"))


# ----------------------------------------------------------------------------- chunking


class _Budget:
    def __init__(self, max_bytes: int | None) -> None:
        self.left = max_bytes  # None: unlimited

    @property
    def done(self) -> bool:
        return self.left is not None and self.left <= 0


def _chunk_pieces(
    pieces: Iterable[str], budget: _Budget, chunk_bytes: int, counts: dict[str, int], audit: SampleAudit
) -> Iterator[str]:
    """Cut the cleaned text of one file/document (given as consecutive pieces) into chunks.

    ``pending[pos:]`` is the text not yet yielded; an offset instead of slicing keeps the
    cost linear when many small chunks come out of one large block.
    """
    pending, pos, avail = "", 0, 0  # avail: UTF-8 bytes of pending[pos:]
    it = iter(pieces)
    eof = False
    while not budget.done:
        if not eof:
            piece = next(it, None)
            if piece is None:
                eof = True
            elif piece:
                pending = pending[pos:] + piece
                pos = 0
                avail += _utf8_len(piece)
        while avail and not budget.done:
            limit = chunk_bytes if budget.left is None else min(chunk_bytes, budget.left)
            final = budget.left is not None and budget.left <= chunk_bytes
            if avail <= limit:
                if not eof and not (final and avail == limit):
                    break  # need more text (or the next char) to decide the cut
                chunk = pending[pos:]
                nbytes = avail
            elif final:
                # The budget ends inside this text: cut exactly there (or just before a
                # character that does not fit) and stop the whole sample.
                chunk = _prefix_within(pending, pos, limit)
                nbytes = _utf8_len(chunk)
                nxt = pending[pos + len(chunk)]
                audit.budget_cut_mid_word = audit.budget_cut_mid_word or (
                    bool(chunk) and not chunk[-1].isspace() and not nxt.isspace()
                )
                budget.left = 0
            else:
                chunk, nbytes = _cut(pending, pos, limit, counts)
            pos += len(chunk)
            avail -= nbytes
            if budget.left is not None:
                budget.left = max(0, budget.left - nbytes)
                if budget.done:
                    audit.budget_reached = True
            if chunk:
                counts["bytes_yielded"] += nbytes
                counts["chunks"] += 1
                yield chunk
        if eof:
            return


def _prefix_within(pending: str, pos: int, limit: int) -> str:
    """Longest prefix of ``pending[pos:]`` whose UTF-8 form fits in ``limit`` bytes."""
    window = pending[pos : pos + limit]  # k chars are >= k bytes, so this covers the limit
    if window.isascii():
        return window
    data = window.encode("utf-8")
    if len(data) <= limit:
        return window
    return data[:limit].decode("utf-8", errors="ignore")  # drops only a partial last char


def _cut(pending: str, pos: int, limit: int, counts: dict[str, int]) -> tuple[str, int]:
    """The next chunk of ``pending[pos:]``, which holds more than ``limit`` bytes: end it where
    a whitespace run starts (see the module docstring for the fallbacks)."""
    window = _prefix_within(pending, pos, limit)
    n = len(window)
    probe = pending[pos : pos + n + 1]  # the window plus one char of lookahead
    m = _RUN_START_REVERSE.search(probe)
    if m is not None:
        cut = m.start()
    else:
        lead = _LEADING_SPACE.match(probe)
        cut = lead.end() if lead is not None and lead.end() <= n else 0
        if cut == 0:  # one "word" longer than the chunk: cut at a character boundary
            cut = n
            counts["forced_cuts"] += 1
    chunk = window[:cut]
    return chunk, _utf8_len(chunk)


# ----------------------------------------------------------------------------- inputs


def resolve_inputs(paths_or_globs: str | os.PathLike | Iterable[str | os.PathLike]) -> tuple[list[str], list[str]]:
    """Expand globs (sorted, ``**`` recursive) and check plain paths; returns (files, duplicates).

    Raises ``FileNotFoundError`` naming the first glob that matches no file or missing path.
    """
    if isinstance(paths_or_globs, (str, os.PathLike)):
        paths_or_globs = [paths_or_globs]
    specs = [os.fspath(p) for p in paths_or_globs]
    if not specs:
        raise ValueError("no input paths given; pass files or globs such as 'data/**/*.txt'")
    files: list[str] = []
    seen: set[str] = set()
    duplicates: list[str] = []
    for spec in specs:
        if glob.has_magic(spec):
            matched = [p for p in sorted(glob.glob(spec, recursive=True)) if os.path.isfile(p)]
            if not matched:
                raise FileNotFoundError(f"input glob {spec!r} matches no file")
        else:
            if os.path.isdir(spec):
                raise IsADirectoryError(f"input {spec!r} is a directory; pass a glob such as '{spec}/**/*.txt'")
            if not os.path.isfile(spec):
                raise FileNotFoundError(f"input file {spec!r} does not exist")
            matched = [spec]
        for path in matched:
            key = os.path.realpath(path)
            if key in seen:
                duplicates.append(path)
                continue
            seen.add(key)
            files.append(path)
    return files, duplicates


def _check_sizes(max_bytes: int | None, chunk_bytes: int) -> None:
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive int or None (no budget), got {max_bytes!r}")
    if not isinstance(chunk_bytes, int) or chunk_bytes < 4:
        raise ValueError(f"chunk_bytes must be an int >= 4 (one UTF-8 character), got {chunk_bytes!r}")


def _file_pieces(path: str, budget: _Budget, read_bytes: int, counts: dict[str, int]) -> Iterator[str]:
    """Cleaned text of one file, block by block. Near the end of the budget reads shrink so
    the audit does not count bytes far beyond what the sample uses."""
    # .gz / .zst decompressed on the fly
    from stacklm.data.sources.readers import open_binary

    carry = b""
    with open_binary(path) as f:
        while True:
            want = read_bytes
            if budget.left is not None:
                want = max(_MIN_READ_BYTES, min(read_bytes, budget.left + 8))
            block = f.read(want)
            counts["bytes_read"] += len(block)
            if not block:
                if carry:
                    yield clean_bytes(carry, counts)
                return
            head, carry = _safe_split(carry + block)
            if head:
                yield clean_bytes(head, counts)


def stream_sample(
    paths_or_globs: str | os.PathLike | Iterable[str | os.PathLike],
    max_bytes: int | None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    read_bytes: int | None = None,
) -> TextSample:
    """Yield text chunks (each <= ``chunk_bytes`` UTF-8 bytes) from files, up to ``max_bytes``.

    Inputs are resolved eagerly, so a missing file or an empty glob raises here, naming it.
    ``read_bytes`` is the block size (default: ``chunk_bytes``, at least 64 KiB); memory stays
    around ``chunk_bytes + read_bytes`` whatever the file or line length. The returned
    iterator's ``.audit`` (a ``SampleAudit``) is complete once iteration ends.
    """
    _check_sizes(max_bytes, chunk_bytes)
    files, duplicates = resolve_inputs(paths_or_globs)
    block = read_bytes if read_bytes is not None else max(chunk_bytes, 64 * 1024)
    if block < 1:
        raise ValueError(f"read_bytes must be >= 1, got {read_bytes!r}")
    specs = [os.fspath(paths_or_globs)] if isinstance(paths_or_globs, (str, os.PathLike)) else [
        os.fspath(p) for p in paths_or_globs
    ]
    audit = SampleAudit(specs, max_bytes, chunk_bytes)
    audit.duplicate_paths = duplicates

    def gen() -> Iterator[str]:
        budget = _Budget(max_bytes)
        for path in files:
            if budget.done:
                break
            counts = audit._counts(path)
            pieces = _file_pieces(path, budget, block, counts)
            try:
                yield from _chunk_pieces(pieces, budget, chunk_bytes, counts, audit)
            finally:
                pieces.close()  # close the file now, not at garbage collection

    return TextSample(gen(), audit)


def sample_texts(
    texts: Iterable[str],
    max_bytes: int | None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    *,
    source: str = "<texts>",
) -> TextSample:
    """``stream_sample``'s rules for in-memory strings; all texts are audited as ``source``.

    Each text is a document: chunks never span two of them. Non-``str`` items raise
    ``TypeError`` naming their position (bytes must be decoded by the caller or written to a
    file for ``stream_sample``, which audits the decoding).
    """
    _check_sizes(max_bytes, chunk_bytes)
    audit = SampleAudit([source], max_bytes, chunk_bytes)

    def gen() -> Iterator[str]:
        budget = _Budget(max_bytes)
        counts = audit._counts(source)
        counts["documents"] = 0
        for i, text in enumerate(texts):
            if budget.done:
                break
            if not isinstance(text, str):
                raise TypeError(f"{source}: item {i} is {type(text).__name__}, expected str")
            counts["documents"] += 1
            counts["bytes_read"] += len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
            text, repairs = clean_text(text)  # the document audit's repair: NULs out, lone surrogates -> U+FFFD
            counts["lone_surrogates_replaced"] += repairs.lone_surrogates
            counts["nul_bytes_removed"] += repairs.nul_bytes
            yield from _chunk_pieces((text,), budget, chunk_bytes, counts, audit)

    return TextSample(gen(), audit)


__all__ = [
    "COUNTERS",
    "DEFAULT_CHUNK_BYTES",
    "SampleAudit",
    "TextSample",
    "clean_bytes",
    "resolve_inputs",
    "sample_texts",
    "stream_sample",
]

