"""Part readers: iterate the raw rows of one file or hub shard and report an exact position.

Why jsonl and txt are read here rather than by the ``datasets`` json/text builders: those
builders either raise on one invalid UTF-8 byte or replace it silently, so the audit could
not count what was lost; decoding lines ourselves lets ``clean_text`` see the raw bytes.
Local parquet files are read with pyarrow directly (``ParquetReader``: one column, batch by
batch, position = row number); hub datasets go through ``datasets.load_dataset(..., streaming=True)``.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from typing import Any

from stacklm.data.audit import MALFORMED_JSON, MISSING_TEXT, NOT_AN_OBJECT
from stacklm.errors import InvalidRecordError, column_error


def open_binary(path: str) -> io.BufferedIOBase:
    """A binary stream of the decompressed bytes (plain, .gz, .zst/.zstd)."""
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith((".zst", ".zstd")):
        return io.BufferedReader(_ZstdRaw(path), buffer_size=1 << 20)
    return open(path, "rb")


class _ZstdRaw(io.RawIOBase):
    """Multi-frame zstd decompression that raises on a truncated or corrupt file.

    Why not ``zstandard``'s ``stream_reader``: on a file cut inside a frame it returns EOF
    without an error, so a damaged file would silently yield fewer (or no) documents.
    """

    def __init__(self, path: str) -> None:
        import zstandard

        self._zstd = zstandard
        self._file = open(path, "rb")
        self._dctx = zstandard.ZstdDecompressor()
        self._dobj = self._dctx.decompressobj()
        self._in_frame = False
        self._buf, self._pos = memoryview(b""), 0

    def readable(self) -> bool:
        return True

    def readinto(self, out) -> int:
        while self._pos >= len(self._buf):
            chunk = self._file.read(1 << 20)
            if not chunk:
                if self._in_frame:
                    raise self._zstd.ZstdError("truncated zstd file: the last frame ends early")
                return 0
            self._buf, self._pos = memoryview(self._decompress(chunk)), 0
        n = min(len(out), len(self._buf) - self._pos)
        out[:n] = self._buf[self._pos : self._pos + n]
        self._pos += n
        return n

    def _decompress(self, chunk: bytes) -> bytes:
        pieces = []
        while chunk:
            if self._dobj.eof:  # previous frame complete: the rest starts a new frame
                self._dobj = self._dctx.decompressobj()
            pieces.append(self._dobj.decompress(chunk))
            self._in_frame = not self._dobj.eof
            chunk = self._dobj.unused_data if self._dobj.eof else b""
        return b"".join(pieces)

    def close(self) -> None:
        self._file.close()
        super().close()


def _skip_bytes(stream: io.BufferedIOBase, n: int) -> None:
    """Advance a forward-only (zstd) stream by ``n`` decompressed bytes."""
    while n > 0:
        chunk = stream.read(min(n, 1 << 20))
        if not chunk:
            return
        n -= len(chunk)


def json_error_detail(e: json.JSONDecodeError) -> str:
    """``"<what> at column <n>"``; some of ``json``'s messages end in "at" already ("Invalid
    control character at"), and said "at at column" with it."""
    return f"{e.msg.removesuffix(' at')} at column {e.colno}"


def loads_json_line(raw: bytes, *, invalid_utf8: str) -> tuple[Any, bool]:
    """``(json.loads(raw), had_invalid_utf8)``. A line that is not valid UTF-8 is decoded with
    the ``invalid_utf8`` error handler instead of failing (``surrogateescape`` keeps the bad
    bytes recoverable, ``replace`` turns them into U+FFFD); JSON errors propagate for the caller
    to name the file and line its own way."""
    try:
        return json.loads(raw), False
    except UnicodeDecodeError:
        return json.loads(raw.decode("utf-8", errors=invalid_utf8)), True


def missing_column(path: str, text_column: str, rows: int) -> list[str] | None:
    """The fields of ``path``'s JSON lines when its first ``rows`` records (every one, in a
    shorter file) are all objects without ``text_column``: a wrong ``text_column``, said once
    before any row is read, as a parquet file's schema says it (``ParquetReader``), instead of
    ``rows`` rows each logged as ``missing_text`` before the file is refused anyway. ``None``
    when a record has the column or a line is not a JSON object (the rows' own rules count
    and name those)."""
    keys: set[str] = set()
    seen = 0
    with open_binary(path) as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                obj, _ = loads_json_line(raw, invalid_utf8="replace")
            except (json.JSONDecodeError, RecursionError):
                return None
            if not isinstance(obj, dict) or text_column in obj:
                return None
            keys.update(map(str, obj))
            seen += 1
            if seen >= rows:
                break
    return sorted(keys) if seen else None


class JsonlReader:
    """JSON lines; yields raw line bytes (``None`` for blank lines) so unowned rows in strided
    mode are never parsed. Position = decompressed byte offset and line number."""

    def __init__(self, path: str, text_column: str, source: str, position: dict | None, piece=None) -> None:
        self.path, self.text_column, self.source = path, text_column, source
        self.keys: list[str] = []
        # A piece (``pieces.Piece``) of a plain file: lines starting in [lo, hi) only, numbered
        # from the piece's first line, so a line keeps the number it has in a whole-file read.
        start, self.end = (piece.lo, piece.hi) if piece is not None else (0, -1)
        self.offset = int(position["offset"]) if position else start
        self.line = int(position["line"]) if position else (piece.line if piece is not None else 0)
        self.opened_at = self.offset
        self._stream = open_binary(path)
        if path.endswith((".zst", ".zstd")):
            _skip_bytes(self._stream, self.offset)
        elif self.offset:
            self._stream.seek(self.offset)  # O(1) for plain files; gzip decompresses forward in C

    def __iter__(self) -> Iterator[bytes | None]:
        end = self.end
        for raw in self._stream:
            if 0 <= end <= self.offset:  # the next piece's first line: not ours
                return
            self.row_start = self.offset  # where this line starts: a buffered document's position
            self.offset += len(raw)
            self.line += 1
            yield raw if raw.strip() else None

    row_start = 0  # decompressed byte offset of the line yielded last

    def rows_at(self, offsets) -> Iterator[bytes]:
        """The raw lines starting at byte ``offsets`` (ascending; repeats allowed), for re-reading
        buffered documents (``stacklm.data.doc_refs``): a seek per line in a plain file, one
        forward pass through a compressed one (where a seek is a decompression up to it)."""
        compressed = self.path.endswith((".gz", ".zst", ".zstd"))
        at, last = self.offset, None
        for off in offsets:
            off = int(off)
            if last is not None and off == last[0]:
                yield last[1]
                continue
            if not compressed:
                self._stream.seek(off)
            elif off >= at:
                _skip_bytes(self._stream, off - at)
            else:
                raise ValueError(f"{self.path}: offsets must ascend to re-read a compressed file ({off} after {at})")
            raw = self._stream.readline()
            at = self.offset = off + len(raw)
            last = (off, raw)
            yield raw

    def consumed(self) -> int | None:
        """Bytes of the file read since it was opened (plain files; None when compressed: the
        decompressed offset is not the bytes read)."""
        return None if self.path.endswith((".gz", ".zst", ".zstd")) else self.offset - self.opened_at

    def position(self) -> dict:
        return {"offset": self.offset, "line": self.line}

    @property
    def record(self) -> int:
        """0-based line number of the row yielded last (provenance: blank lines count)."""
        return self.line - 1

    def where(self) -> str:
        return f"{self.path}, line {self.line}"

    def text_of(self, raw: bytes) -> Any:
        """The text column's value; an ``InvalidRecordError`` (with its reason) for a line that
        is not JSON, not an object, or has no text column."""
        try:
            # Invalid UTF-8: parse with the bad bytes escaped; the text field goes back to its
            # original bytes below so the audit counts them exactly.
            obj, lenient = loads_json_line(raw, invalid_utf8="surrogateescape")
        except (json.JSONDecodeError, RecursionError) as e:
            detail = json_error_detail(e) if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise self._invalid(MALFORMED_JSON, f"not valid JSON ({detail}); is this a JSON-lines file?") from None
        if not isinstance(obj, dict):
            raise self._invalid(NOT_AN_OBJECT, f"expected a JSON object per line, got {type(obj).__name__}")
        if self.text_column not in obj:
            self.keys = list(obj)  # for the missing-column error if no row of the file has it
            raise self._invalid(MISSING_TEXT, f"no field {self.text_column!r} (fields: {sorted(map(str, obj))})")
        value = obj[self.text_column]
        if lenient and isinstance(value, str):
            try:
                value = value.encode("utf-8", errors="surrogateescape")
            except UnicodeEncodeError:
                pass  # also holds JSON-escaped surrogates: counted as surrogates instead
        return value

    def _invalid(self, reason: str, problem: str) -> InvalidRecordError:
        return InvalidRecordError(
            f"source {self.source!r}: {self.where()}: {problem}", reason=reason, source=self.source, file=self.path
        )

    def close(self) -> None:
        self._stream.close()


class TextFileReader:
    """A .txt file (optionally compressed) is one document: books and articles are whole."""

    def __init__(self, path: str, text_column: str, source: str, position: dict | None, piece=None) -> None:
        self.path = path
        self.done = bool(position and position.get("done"))

    def __iter__(self) -> Iterator[bytes]:
        if self.done:
            return
        with open_binary(self.path) as f:
            data = f.read()
        self.done = True
        yield data

    def position(self) -> dict:
        return {"done": int(self.done)}

    record = 0  # the file is the one record
    row_start = 0

    def rows_at(self, offsets) -> Iterator[bytes]:
        """The file's one record, once per offset (each is 0): re-reading a buffered document."""
        data = None
        for _ in offsets:
            if data is None:
                with open_binary(self.path) as f:
                    data = f.read()
            yield data

    def where(self) -> str:
        return self.path

    def text_of(self, raw: bytes) -> bytes:
        return raw

    def close(self) -> None:
        pass


class ParquetReader:
    """One local parquet file's ``text_column``, read with pyarrow in record batches.

    Why not ``datasets``' parquet builder for a local file: importing ``datasets`` costs
    seconds per loader worker and brings its own worker-sharding rules; pyarrow reads the one
    column directly. Position = rows read; a resume skips whole row groups by their metadata
    row counts, then slices into the group where it stopped.
    """

    BATCH_ROWS = 1024

    def __init__(self, path: str, text_column: str, source: str, position: dict | None, piece=None) -> None:
        import pyarrow.parquet as pq

        self.path, self.text_column, self.source = path, text_column, source
        # A piece (``pieces.Piece``): row groups [lo, hi) only, rows numbered as in the whole file.
        self._groups = (piece.lo, piece.hi) if piece is not None else None
        self.row = int(position["row"]) if position else (piece.line if piece is not None else 0)
        self._file = pq.ParquetFile(path)
        columns = self._file.schema_arrow.names
        if text_column not in columns:
            raise column_error(source, text_column, columns, path)

    def __iter__(self) -> Iterator[Any]:
        skip = self.row
        meta = self._file.metadata
        first = 0  # the row group where reading resumes: skip the whole ones before it
        while first < meta.num_row_groups and skip >= meta.row_group(first).num_rows:
            skip -= meta.row_group(first).num_rows
            first += 1
        last = meta.num_row_groups
        if self._groups is not None:
            last = self._groups[1]
        groups = list(range(first, last))
        if not groups:
            return
        for batch in self._file.iter_batches(batch_size=self.BATCH_ROWS, row_groups=groups, columns=[self.text_column]):
            values = batch.column(0).to_pylist()
            if skip:
                values, skip = values[skip:], max(0, skip - len(values))
            for value in values:
                self.row += 1
                # A 1-tuple, because a bare None means "blank line" to ``PartNode``; a null or
                # non-text value is counted by reason in ``TextPartSource``.
                yield (value,)

    def position(self) -> dict:
        return {"row": self.row}

    @property
    def record(self) -> int:
        """0-based row number of the row yielded last (provenance)."""
        return self.row - 1

    row_start = record  # a row's position is its row number

    def rows_at(self, rows) -> Iterator[tuple[Any]]:
        """The rows numbered ``rows`` (ascending) as 1-tuples, reading only the row groups that
        hold them: re-reading buffered documents (``stacklm.data.doc_refs``)."""
        import numpy as np

        rows = np.asarray(rows, dtype=np.int64)
        meta = self._file.metadata
        starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        groups = np.searchsorted(starts, rows, side="right") - 1
        for g in np.unique(groups).tolist():
            if not 0 <= g < meta.num_row_groups:
                raise ValueError(f"{self.path} has {starts[-1]} rows; no row {int(rows[groups == g][0])}")
            column = self._file.read_row_group(g, columns=[self.text_column]).column(0)
            for value in column.take(rows[groups == g] - starts[g]).to_pylist():
                yield (value,)

    def where(self) -> str:
        return f"{self.path}, row {self.row}"

    def text_of(self, raw: tuple[Any]) -> Any:
        return raw[0]

    def close(self) -> None:
        self._file.close()


class DatasetsReader:
    """One ``datasets`` IterableDataset (a hub shard or a parquet file); its own
    ``state_dict()`` is the exact position."""

    def __init__(self, dataset, text_column: str, source: str, label: str, position: dict | None) -> None:
        self.dataset, self.text_column, self.source, self.label = dataset, text_column, source, label
        self.path = label
        self.row = 0
        if position:
            self.dataset.load_state_dict(position)

    def __iter__(self) -> Iterator[dict]:
        for row in dataset_rows(self.dataset):
            self.row += 1
            yield row

    def position(self) -> dict:
        return self.dataset.state_dict()

    @property
    def record(self) -> int:
        """0-based index in this part's stream of the row yielded last (provenance)."""
        return self.row - 1

    def where(self) -> str:
        return f"{self.label}, row {self.row}"

    def text_of(self, row: dict) -> Any:
        try:
            return row[self.text_column]
        except KeyError:
            raise column_error(self.source, self.text_column, list(row), self.label) from None

    def close(self) -> None:
        pass


def dataset_rows(dataset) -> Iterator[dict]:
    """The rows of a ``datasets`` IterableDataset, all of them, also inside a loader worker.

    Why not ``iter(dataset)``: inside a torch ``DataLoader`` worker, ``IterableDataset.__iter__``
    looks at ``torch.utils.data.get_worker_info()`` and keeps only shards ``worker::num_workers``
    (none at all for a worker past ``n_shards``). stacklm already gives each (rank, worker) its own
    parts (``sharding.assign_parts``), so that second split would lose rows. ``iter(batch_size=1)``
    reads the same stream, from the same ``load_state_dict`` position, without the worker split.
    """
    for batch in dataset.iter(batch_size=1):
        yield {key: values[0] for key, values in batch.items()}


def import_datasets():
    """The ``datasets`` module, imported on first use (importing it takes seconds) with its
    progress bars off; missing, an error naming the ``[hf]`` extra."""
    from stacklm.optional import require

    datasets = require("datasets", "hf", "reading parquet files and hub datasets")

    datasets.disable_progress_bars()  # one bar per file would bury the useful output
    return datasets
