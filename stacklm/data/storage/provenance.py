"""Provenance of every prebuilt row: which document pieces (source, file, record, token range,
offset in the document) it holds.

Why a side file per shard and not columns in the token file: the token files stay the plain
``n_seq x seq_len`` arrays every reader memmaps, and provenance costs nothing to a loader that
does not ask for it. A shard ``shard_XXXXX`` gets ``shard_XXXXX.prov.npz`` (compressed npz),
written before the shard's own files (so a complete shard always has it):

* ``row_pieces`` (n_rows,): the number of pieces in each row;
* per piece, in row order: ``source`` (index into the manifest's ``provenance.sources``),
  ``file_index`` (index into that source's ``provenance.files``), ``record`` (0-based row of that file:
  line for jsonl, row for parquet, index in a hub stream part), ``length`` and ``doc_offset``.

Pieces fill a row from token 0 without gaps (both packers place them back to back; padding
only follows them), so ``row_start`` is the running sum of the lengths and is not stored. A
piece covers its tokens of the *wrapped* document ``<bos> ids <eos>``: ``doc_offset`` 0 is the
``<bos>``. Most pieces start at offset 0 and records run in order within a file, so the arrays
compress to a few bytes a piece (``bench/provenance.py`` measures it against the token bytes).
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data.storage.datafiles import check_data_file, read_data_bytes
from stacklm.data.storage.shards import atomic_write_shard_file
from stacklm.errors import DataError

PROV_SUFFIX = ".prov.npz"
FORMAT = "stacklm-provenance/1"
# One document piece of a packed window (``stacklm.data.packing.origins.WindowOrigin.pieces``). Defined
# here, not in pack.py, so the CLI and the prebuild's manifests read provenance without torch.
PIECE_FIELDS = ("source", "file", "record", "row_start", "row_end", "doc_offset")


def prov_path(directory: str | Path, name: str) -> Path:
    return Path(directory) / f"{name}{PROV_SUFFIX}"


def _smallest_uint(values: np.ndarray) -> np.ndarray:
    top = int(values.max()) if values.size else 0
    for dtype in (np.uint16, np.uint32, np.uint64):
        if top <= np.iinfo(dtype).max:
            return values.astype(dtype)
    raise ValueError(f"value {top} does not fit uint64")  # pragma: no cover


def row_columns(rows: Sequence[Sequence[tuple[int, ...]]]) -> dict[str, np.ndarray]:
    """Rows of pieces (``rows[i]``: row ``i``'s ``PIECE_FIELDS`` tuples) as the compact columns
    both side files store (a shard's here, a training run's step log in
    ``stacklm.data.storage.steplog``): ``row_pieces`` and per piece ``source``, ``file_index``,
    ``record``, ``length``, ``doc_offset``, each in the smallest unsigned type."""
    flat = np.array([p for row in rows for p in row], dtype=np.int64).reshape(-1, len(PIECE_FIELDS))
    counts = np.array([len(row) for row in rows], dtype=np.int64)
    src, fid, rec, start, end, off = flat.T
    # The invariant that lets row_start go unstored: pieces are back to back from token 0.
    lengths = end - start
    cs = np.cumsum(lengths)
    first = np.cumsum(counts) - counts  # each row's first piece (no row, e.g. a frame of padding batches: none)
    base = np.concatenate([[0], cs])[np.repeat(first, counts)]
    if len(flat) and (not np.array_equal(cs - lengths - base, start) or (lengths <= 0).any() or (src < 0).any()):
        raise ValueError("provenance pieces are not back to back from token 0 of each row; this is a packer bug")
    if (fid < 0).any() or (rec < 0).any():
        raise ValueError("a document without file/record reached the packer; every source must set them for provenance")
    return {"row_pieces": _smallest_uint(counts), "source": _smallest_uint(src), "file_index": _smallest_uint(fid),
            "record": _smallest_uint(rec), "length": _smallest_uint(lengths), "doc_offset": _smallest_uint(off)}


def encode_rows(rows: Sequence[Sequence[tuple[int, ...]]]) -> bytes:
    """The side file of one shard: ``rows[i]`` is row ``i``'s pieces (``PIECE_FIELDS`` tuples)."""
    buf = io.BytesIO()
    np.savez_compressed(buf, **row_columns(rows))
    return buf.getvalue()


def decode_rows(data: bytes | Path, where: str | Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(row_ptr, pieces)``: row ``i``'s pieces are ``pieces[row_ptr[i]:row_ptr[i+1]]``, each a
    ``PIECE_FIELDS`` row (``row_start``/``row_end`` restored). Read with ``allow_pickle=False``:
    a side file sits in a shard directory anyone may have written, so a pickle (or an object
    array) in its place is a ``DataError`` naming it, never run."""
    where = where if where is not None else (data if isinstance(data, Path) else "provenance side file")
    try:
        with np.load(io.BytesIO(data) if isinstance(data, bytes) else data, allow_pickle=False) as z:
            return columns_to_pieces(z)
    except (ValueError, KeyError, OSError, EOFError, zipfile.BadZipFile, AttributeError) as e:
        from stacklm.data.storage.statefile import load_error_detail

        raise DataError(f"{where}: not a stacklm provenance side file ({load_error_detail(e, data)}); rebuild the prebuild, "
                         "or restore the file from the build", path=where) from None


def columns_to_pieces(columns: Mapping[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``row_columns`` back to ``(row_ptr, pieces)`` (see ``decode_rows``)."""
    counts = np.asarray(columns["row_pieces"]).astype(np.int64)
    lengths = np.asarray(columns["length"]).astype(np.int64)
    cols = [np.asarray(columns[k]).astype(np.int64) for k in ("source", "file_index", "record")]
    off = np.asarray(columns["doc_offset"]).astype(np.int64)
    ptr = np.concatenate([[0], np.cumsum(counts)])
    ends = np.cumsum(lengths)
    row_base = np.repeat(np.concatenate([[0], ends])[ptr[:-1]], counts)
    end = ends - row_base
    pieces = np.stack([*cols, end - lengths, end, off], axis=1) if len(lengths) else np.zeros((0, len(PIECE_FIELDS)), np.int64)
    return ptr, pieces


def source_files(node) -> list[str]:
    """The labels of a source node's parts (files, hub stream parts), in part-index order: what
    a piece's ``file`` indexes (a synthetic source has one, its label)."""
    parts = getattr(node, "part_labels", None) or getattr(node, "_parts", None)
    if parts is None:
        return [str(getattr(node, "label", node.name))]
    return [str(p) for p in parts]


def manifest_entry(sources: Sequence[str], files: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """The split manifest's ``provenance``: source names and each source's file labels (relative
    to the files' common folder, as in ``doc_id``: no machine paths, so equal builds stay equal
    bytes; the source's own coordinates are in the manifest's ``sources``)."""
    return {"format": FORMAT, "suffix": PROV_SUFFIX, "sources": list(sources), "files": {k: list(v) for k, v in files.items()},
            "fields": list(PIECE_FIELDS), "doc_offset_of": "<bos> ids <eos>"}


# ---------------------------------------------------------------------------------------
# Reading: one row of a prebuilt split with its pieces.
# ---------------------------------------------------------------------------------------
def _split_dir(directory: str | Path, split: str) -> Path:
    d = Path(directory)
    top = d / "manifest.json"
    if check_data_file(top) is None:
        raise DataError(f"{top} is missing: {d} is not a finished prebuild (run `stacklm prebuild` first)", path=top)
    from stacklm.data.storage import manifest as mf

    m = mf.read_manifest(d)  # names checked: a split path from the manifest never leaves d
    if "splits" in m:
        if split not in m["splits"]:
            raise DataError(f"{d} has no split {split!r} (splits: {sorted(m['splits'])}); pass --split", path=top)
        return mf.split_directory(d, m["splits"][split]["path"])  # a link out of d: refused
    return d


def _split_provenance(split_dir: str | Path, sources: Sequence[str]):
    """``(manifest, column, shards)`` of a split for the two whole-split readers below, or
    ``None`` without provenance: ``column[i]`` is the position in ``sources`` of the side files'
    source ``i``; ``shards`` yields ``(n_seq, ptr, pieces)`` per shard in manifest order, each
    side file checked against its shard's row count."""
    from stacklm.data.storage import manifest as mf

    split_dir = Path(split_dir)
    m = mf.read_manifest(split_dir)
    prov = m.get("provenance")
    if not prov:
        return None
    column = np.array([list(sources).index(name) if name in sources else -1 for name in prov["sources"]], dtype=np.int64)
    if (column < 0).any():
        raise DataError(f"{split_dir}: provenance names sources {prov['sources']} that the manifest's mix {list(sources)} "
                        "does not", path=split_dir)

    def shards():
        for shard in m["shards"]:
            n = int(shard["n_seq"])
            path = prov_path(split_dir, shard["name"])
            ptr, pieces = decode_rows(read_data_bytes(path), path)
            if len(ptr) - 1 != n:
                raise DataError(f"{prov_path(split_dir, shard['name'])} holds {len(ptr) - 1} rows but the shard has {n}",
                                path=split_dir)
            yield n, ptr, pieces

    return m, column, shards()


def row_source_counts(split_dir: str | Path, sources: Sequence[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """Per global row of a split (shards in manifest order) and per source of ``sources``:
    ``tokens`` (``input_ids`` positions, i.e. the window but its last token, uint16) and
    ``docs`` (documents whose ``<bos>`` is in the row, uint16); ``None`` when the split was built
    without provenance. What lets shards mode count exactly what each delivered row holds.
    Memory: ``4 x n_sources`` bytes a row (about 200 MB for 10M rows of 5 sources)."""
    found = _split_provenance(split_dir, sources)
    if found is None:
        return None
    m, column, shards = found
    last = int(m["seq_len"]) - 1  # input_ids = window[:-1]
    n_rows = int(m["n_seq"])
    tokens = np.zeros((n_rows, len(sources)), dtype=np.uint16)
    docs = np.zeros((n_rows, len(sources)), dtype=np.uint16)
    first = 0
    for n, ptr, pieces in shards:
        rows = first + np.repeat(np.arange(n), np.diff(ptr))
        src = column[pieces[:, 0]]
        inside = np.clip(np.minimum(pieces[:, 4], last) - pieces[:, 3], 0, None)
        np.add.at(tokens, (rows, src), inside.astype(np.uint16))
        np.add.at(docs, (rows, src), (pieces[:, 5] == 0).astype(np.uint16))
        first += n
    return tokens, docs


class RowSources:
    """Per global row of a split, the source of every window position, from the provenance
    side files: what per-source loss (``stacklm.source_loss``) attributes each target token by.
    Held as the pieces' ``(source, row_start, row_end)`` of the whole split (``ptr`` indexes
    them per row), about 10 bytes a piece; ``None`` from ``load`` when the split was built
    without provenance. ``sources`` fixes the column order (the manifest's mix order)."""

    def __init__(self, ptr: np.ndarray, source: np.ndarray, start: np.ndarray, end: np.ndarray, seq_len: int) -> None:
        self.ptr, self.source, self.start, self.end, self.seq_len = ptr, source, start, end, int(seq_len)

    @classmethod
    def load(cls, split_dir: str | Path, sources: Sequence[str]) -> RowSources | None:
        found = _split_provenance(split_dir, sources)
        if found is None:
            return None
        m, column, shards = found
        ptrs, srcs, starts, ends, first = [np.zeros(1, np.int64)], [], [], [], 0
        for _, ptr, pieces in shards:
            ptrs.append(ptr[1:] + first)
            first += int(ptr[-1])
            srcs.append(column[pieces[:, 0]].astype(np.int16))
            starts.append(pieces[:, 3].astype(np.int32))
            ends.append(pieces[:, 4].astype(np.int32))
        cat = (lambda parts, dtype: np.concatenate(parts) if parts else np.zeros(0, dtype))
        return cls(np.concatenate(ptrs), cat(srcs, np.int16), cat(starts, np.int32), cat(ends, np.int32), int(m["seq_len"]))

    def positions(self, rows: Sequence[int], n_pad: int = 0) -> np.ndarray:
        """``(len(rows) + n_pad, seq_len)`` int16: the source index of each window position of
        each row, -1 where no document is (padding)."""
        out = np.full((len(rows) + int(n_pad), self.seq_len), -1, dtype=np.int16)
        for i, row in enumerate(np.asarray(rows, dtype=np.int64).tolist()):
            for k in range(int(self.ptr[row]), int(self.ptr[row + 1])):
                out[i, self.start[k] : self.end[k]] = self.source[k]
        return out


def pieces_positions(rows: Sequence[Sequence[Sequence[int]] | None], seq_len: int, n_pad: int = 0) -> np.ndarray:
    """Stream mode's counterpart of ``RowSources.positions``: each row's ``PIECE_FIELDS``
    tuples (as the packer puts them on a batch) to per-position source indices; a row whose
    pieces are unknown (``None``: restored from a state saved without provenance) is all -1."""
    out = np.full((len(rows) + int(n_pad), int(seq_len)), -1, dtype=np.int16)
    for i, row in enumerate(rows):
        for src, _file, _rec, a, b, _off in row or ():
            out[i, a:b] = src
    return out


def row_provenance(directory: str | Path, row: int, split: str = "train") -> dict[str, Any]:
    """``{"row", "input_ids", "segments": [{"source", "file", "record", "row_start", "row_end",
    "doc_offset"}, ...]}`` for global row ``row`` of ``split`` (shards in manifest order);
    ``input_ids`` is the whole stored window. Many rows: one ``RowProvenance``."""
    return RowProvenance(directory, split)(row)


class RowProvenance:
    """Rows of one prebuilt split with their pieces: the manifests read once, each shard's side
    file decoded once (a training step's rows, ``stacklm inspect --step``, hit the same shards)."""

    def __init__(self, directory: str | Path, split: str = "train") -> None:
        from stacklm.data.storage import manifest as mf

        self.directory, self.split = directory, split
        self.split_dir = _split_dir(directory, split)
        layout = mf.check_split(self.split_dir)  # the loader's checks: a damaged manifest or a shard file that is not one
        self.manifest = m = layout.manifest
        self.prov = m.get("provenance")
        if not self.prov:
            raise DataError(f"{self.split_dir}/manifest.json has no 'provenance': this prebuild was written without it "
                             "(or before stacklm recorded it); rebuild it to ask where rows came from", path=self.split_dir)
        self.n_rows, self.seq_len, self.dtype = layout.num_rows, layout.seq_len, layout.dtype
        self.first_rows = np.cumsum([0] + [int(shard["n_seq"]) for shard in m["shards"]])  # each shard's first global row
        self._shards: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _shard(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Shard ``k``'s ``(row_ptr, pieces, tokens)``, decoded on first use."""
        from stacklm.data.storage.shards import open_tokens

        if k not in self._shards:
            shard = self.manifest["shards"][k]
            n = int(shard["n_seq"])
            path = prov_path(self.split_dir, shard["name"])
            if check_data_file(path) is None:
                raise DataError(f"{path} is missing (the manifest records provenance); rebuild the prebuild", path=path)
            ptr, pieces = decode_rows(read_data_bytes(path), path)
            if len(ptr) - 1 != n:
                raise DataError(f"{path} holds {len(ptr) - 1} rows but the shard has {n}: the file belongs to another build",
                                 path=path)
            tokens = open_tokens(self.split_dir, shard["name"], self.dtype, n, self.seq_len)
            self._shards[k] = (ptr, pieces, tokens)
        return self._shards[k]

    def __call__(self, row: int) -> dict[str, Any]:
        if not 0 <= row < self.n_rows:
            raise DataError(f"row {row} is out of range: split {self.split!r} of {self.directory} has {self.n_rows:,} rows "
                             f"(0..{self.n_rows - 1})", path=self.split_dir)
        k = int(np.searchsorted(self.first_rows, row, side="right")) - 1
        local = row - int(self.first_rows[k])
        ptr, pieces, tokens = self._shard(k)
        prov = self.prov
        segments = []
        for src, fid, rec, start, end, off in pieces[ptr[local] : ptr[local + 1]].tolist():
            name = prov["sources"][src]
            segments.append({"source": name, "file": prov["files"][name][fid], "record": rec, "row_start": start, "row_end": end,
                             "doc_offset": off})
        return {"row": int(row), "input_ids": [int(x) for x in tokens[local]], "segments": segments,
                "shard": self.manifest["shards"][k]["name"], "split": self.split}
