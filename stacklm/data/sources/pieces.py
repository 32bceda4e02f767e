"""Pieces: the disjoint spans of a file that readers can take without reading the rest of it.

Why: with fewer files than (rank, worker) readers, every reader used to scan every file and
keep every ``count``-th row (``sharding`` strided mode), so a pass read each input ``count``
times. A piece is a span one reader can open and read on its own:

* a plain JSON-lines file: a byte range starting at a line start (about ``size / 64`` bytes,
  between ``PIECE_MIN`` and ``PIECE_MAX``), with the line number and the row number (blank
  lines not counted) at its start, so a document keeps the ``doc_id`` and provenance record
  it has when the file is read whole. Those two numbers are why a piece index exists: they
  can only be known by counting the lines before the piece, once (``line_pieces``);
* a parquet file: one row group (its first row comes from the footer; nothing is read);
* a ``.gz`` / ``.zst`` file and a ``.txt`` file (one document): the whole file. gzip has no
  random access (a reader would decompress everything before its range); zstd frames could
  be pieces, but a frame's first line number again needs a decompression pass, and JSON-lines
  corpora are usually many files (``F >= readers``, no pieces needed), so it is not built.

The pieces depend only on the file's bytes (not on the reader count), so the same document
gets the same piece whatever the task count. An index is built by one scan that only counts
lines (no JSON parsing); it is kept per process and, when ``STACKLM_PIECE_CACHE`` names a
folder (the prebuild sets its own state folder), in a small JSON file there, so the jobs of a
build read each input once per pass and the index once per build (``index_bytes_read``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

PIECE_MIN = 1 << 10
PIECE_MAX = 4 << 20
PIECES_PER_FILE = 64
CACHE_ENV = "STACKLM_PIECE_CACHE"
INDEX_VERSION = 1
_COMPRESSED = (".gz", ".zst", ".zstd")


@dataclass(frozen=True)
class Piece:
    """A span of part ``part``. ``lo``/``hi``: byte offsets (JSON lines; ``hi`` -1 = to the
    end) or row-group indices (parquet); ``line``: the 0-based line (parquet: row) at its
    start; ``row``: the 0-based non-blank row at its start (``doc_id``'s row); ``nbytes``:
    its size on disk (the read volume when it is read whole)."""

    part: int
    lo: int
    hi: int
    line: int
    row: int
    nbytes: int


_MEMO: dict[tuple, list[tuple]] = {}
_INDEX_BYTES = [0]


def index_bytes_read() -> int:
    """Bytes this process has scanned to build piece indexes (not served from a cache)."""
    return _INDEX_BYTES[0]


def piece_target(size: int) -> int:
    return max(PIECE_MIN, min(PIECE_MAX, -(-size // PIECES_PER_FILE)))


def line_pieces(path: str, size: int) -> list[tuple[int, int, int, int]]:
    """``[(start, end, line, row)]`` of a plain JSON-lines file: cuts at the first line start at
    or after every ``piece_target`` bytes. Counted the way ``JsonlReader`` and ``PartNode``
    count: a line is whatever ``for raw in file`` yields; a blank line (``raw.strip()`` empty)
    has a line number but no row number."""
    step = piece_target(size)
    cuts = [(0, 0, 0)]
    offset = line = row = 0
    nxt = step
    with open(path, "rb") as f:
        for raw in f:
            if offset >= nxt and offset < size:
                cuts.append((offset, line, row))
                nxt = offset + step
            offset += len(raw)
            line += 1
            if raw.strip():
                row += 1
    _INDEX_BYTES[0] += offset
    ends = [c[0] for c in cuts[1:]] + [size]
    return [(start, end, ln, rw) for (start, ln, rw), end in zip(cuts, ends)]


def _stamp(path: str) -> tuple[str, int, int]:
    st = os.stat(path)
    return os.path.abspath(path), st.st_size, st.st_mtime_ns


def _cache_file(key: tuple) -> str | None:
    folder = os.environ.get(CACHE_ENV)
    if not folder:
        return None
    import xxhash

    return os.path.join(folder, xxhash.xxh64(json.dumps(key).encode()).hexdigest() + ".json")


def _cached_line_pieces(path: str) -> list[tuple]:
    key = (INDEX_VERSION, *_stamp(path))
    if key in _MEMO:
        return _MEMO[key]
    cache = _cache_file(key)
    spans = None
    if cache and os.path.exists(cache):
        try:  # data only: a list of 4 ints per piece, checked; anything else is rebuilt
            data = json.loads(open(cache, "rb").read())
            if data.get("key") == list(key) and all(len(p) == 4 and all(isinstance(v, int) for v in p) for p in data["pieces"]):
                spans = [tuple(p) for p in data["pieces"]]
        except (OSError, ValueError, AttributeError, TypeError, KeyError):
            spans = None
    if spans is None:
        spans = line_pieces(path, key[2])
        if cache and os.path.isdir(os.path.dirname(cache)):  # a build's folder, made by its prebuild; gone: no cache
            tmp = f"{cache}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump({"key": list(key), "pieces": spans}, f)
            os.replace(tmp, cache)  # atomic: concurrent builders write the same content
    _MEMO[key] = spans
    return spans


def file_pieces(part: int, path: str, fmt: str) -> list[Piece]:
    """The pieces of one file (see the module docstring for what a piece is per format)."""
    size = os.path.getsize(path)
    if fmt == "jsonl" and not path.endswith(_COMPRESSED):
        return [Piece(part, s, e, ln, rw, e - s) for s, e, ln, rw in _cached_line_pieces(path)]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        out, first = [], 0
        for g in range(meta.num_row_groups):
            rg = meta.row_group(g)
            on_disk = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
            out.append(Piece(part, g, g + 1, first, first, int(on_disk)))
            first += rg.num_rows
        if not out:
            return [Piece(part, 0, 0, 0, 0, size)]
        # the header and footer go with the last group, so a file's pieces add up to its size
        last = out[-1]
        out[-1] = Piece(part, last.lo, last.hi, last.line, last.row, last.nbytes + size - sum(p.nbytes for p in out))
        return out
    return [Piece(part, 0, -1, 0, 0, size)]


def _file_permutation(part: int, n: int, seed: int):
    """The seeded order of one file's ``n`` pieces in the spread read order."""
    import numpy as np

    return np.random.default_rng([int(seed) & 0xFFFFFFFF, part]).permutation(n)


def signed_prefix(pieces: list[Piece], seed: int, fraction: float) -> list[Piece]:
    """The first pieces of one file's seeded order (``spread_order``'s, which reads every file's
    pieces in that order) that hold at least ``fraction`` of its bytes, at least one piece; in
    file order. Why: a small prebuild signs only these for its global dedup pass and its packing
    reads only these (``stacklm.prebuild.signing``); they depend on the file's bytes, the seed and
    ``fraction`` only, never on the reader count, so the dedup decision over them does not either."""
    if not pieces or fraction >= 1.0:
        return list(pieces)
    total = max(1, sum(max(1, p.nbytes) for p in pieces))
    taken, got = [], 0
    for i in _file_permutation(pieces[0].part, len(pieces), seed).tolist():
        if taken and got >= fraction * total:
            break
        taken.append(i)
        got += max(1, pieces[i].nbytes)
    return [pieces[i] for i in sorted(taken)]


def spread_order(pieces: list[Piece], seed: int) -> list[Piece]:
    """``pieces`` in a seeded order that spreads any prefix over all of them: each file's
    pieces in a seeded random order, and the files interleaved so that every file gives one
    piece first, then after every piece each file has given about its share of the bytes (the
    file furthest behind its share goes next).
    Why: a token budget smaller than the source stops reading after a prefix of this order; a
    prefix of file order was the head of the first files only (docs/prebuild.md). Deterministic
    in ``seed`` and the pieces, so a resume rebuilds the same order from the state's piece index."""
    import heapq

    by_part: dict[int, list[Piece]] = {}
    for p in pieces:
        by_part.setdefault(p.part, []).append(p)
    queues, size = {}, {}
    for part, ps in by_part.items():
        queues[part] = [ps[i] for i in _file_permutation(part, len(ps), seed)]
        size[part] = max(1, sum(max(1, p.nbytes) for p in ps))
    taken = dict.fromkeys(queues, 0)
    # the file furthest below its share goes next: every file gives its first piece in the
    # first round (a small budget still samples every file), then each keeps to its share
    heap = [(0.0, part) for part in queues]
    heapq.heapify(heap)
    out = []
    while heap:
        _, part = heapq.heappop(heap)
        p = queues[part].pop(0)
        out.append(p)
        taken[part] += max(1, p.nbytes)
        if queues[part]:
            heapq.heappush(heap, (taken[part] / size[part], part))
    return out
