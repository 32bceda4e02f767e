"""Document sources: Hugging Face streams, local files, and an offline synthetic corpus.

Every source is a ``torchdata.nodes.BaseNode`` yielding documents
``{"text", "source", "domain", "doc_id"}`` after the byte-loss audit (``audit.clean_text``),
with its counts in ``node.stats`` (a ``StageStats``).

Reading is organised in *parts* (files, or the shards of a hub dataset). A (rank, worker)
pair reads whole parts when there are at least as many parts as readers, else every part
with a row stride (``assign_parts``); either way the readers together see every row exactly
once. The state is small and exact: which part, how many rows into it, the reader's own
position (a byte offset, or the ``datasets`` stream's ``state_dict()``), and the counters.

Why jsonl and txt are read here rather than by the ``datasets`` json/text builders: those
builders either raise on one invalid UTF-8 byte or replace it silently, so the audit could
not count what was lost; decoding lines ourselves lets ``clean_text`` see the raw bytes.
Parquet and hub datasets go through ``datasets.load_dataset(..., streaming=True)``.
"""

from __future__ import annotations

import difflib
import glob as globlib
import gzip
import io
import json
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from stacklm.data.audit import clean_text, record_audit
from stacklm.data.registry import DataMixEntry
from stacklm.data.stats import StageStats

# A stream whose first rows are all empty almost always reads the wrong column or files.
FIRST_ROWS_CHECK = 100
DEFAULT_SYNTHETIC_DOCS = 100_000
FALLBACK_OFFLINE = "fallback_offline"
BLANK_LINES = "blank_lines_skipped"

# ---------------------------------------------------------------------------------------
# Errors: every one names the source, and the file or hub path where it applies.


class SourceError(RuntimeError):
    """A source cannot be read; the message names the source and the file/part."""

    def __init__(self, message: str, *, source: str, file: str | None = None) -> None:
        super().__init__(message)
        self.source = source
        self.file = file


class TextColumnError(SourceError, ValueError):
    """The configured text column is not among the dataset's columns."""


class EmptySourceError(SourceError):
    """The source has no rows, or its first rows are all empty."""


class SourceNotFoundError(SourceError, FileNotFoundError):
    """A glob matched no files."""


def _column_error(source: str, column: str, available: Sequence[str], where: str) -> TextColumnError:
    available = sorted(map(str, available))
    close = difflib.get_close_matches(column, available, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return TextColumnError(
        f"source {source!r}: text column {column!r} not found in {where}; available columns: {available}.{hint} "
        f"Set text_column to one of them.",
        source=source,
        file=where,
    )


# ---------------------------------------------------------------------------------------
# Sharding by (rank, worker).


@dataclass(frozen=True)
class ShardSpec:
    """Which slice of every source this reader takes: reader ``index`` of ``count``."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.num_workers < 1:
            raise ValueError(f"ShardSpec: world_size and num_workers must be >= 1, got {self}")
        if not (0 <= self.rank < self.world_size and 0 <= self.worker < self.num_workers):
            raise ValueError(f"ShardSpec: need 0 <= rank < world_size and 0 <= worker < num_workers, got {self}")

    @property
    def index(self) -> int:
        return self.rank * self.num_workers + self.worker

    @property
    def count(self) -> int:
        return self.world_size * self.num_workers

    @classmethod
    def current(cls) -> ShardSpec:
        """This process's shard: rank from torch.distributed (or RANK/WORLD_SIZE), worker from
        the DataLoader worker info (a single reader when neither is set)."""
        import torch

        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return cls(rank, world, worker, num_workers)


def assign_parts(num_parts: int, shard: ShardSpec) -> tuple[list[int], bool]:
    """``(parts this reader opens, strided)``.

    With at least as many parts as readers, reader ``i`` owns parts ``i, i+count, ...`` whole
    (no wasted reads). Otherwise every reader opens every part and keeps global rows
    ``r % count == i`` (``strided``): always correct, at the cost of each reader scanning the
    rows it skips. Either way every row belongs to exactly one reader.
    """
    if num_parts >= shard.count:
        return list(range(shard.index, num_parts, shard.count)), False
    return list(range(num_parts)), shard.count > 1


def owns_row(global_row: int, shard: ShardSpec) -> bool:
    """In strided mode: does this reader keep the stream's ``global_row``?"""
    return global_row % shard.count == shard.index


# ---------------------------------------------------------------------------------------
# Part readers: iterate raw rows of one file / hub shard and report an exact position.


def _open_binary(path: str) -> io.BufferedIOBase:
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


class _JsonlReader:
    """JSON lines; yields raw line bytes (``None`` for blank lines) so unowned rows in strided
    mode are never parsed. Position = decompressed byte offset and line number."""

    def __init__(self, path: str, text_column: str, source: str, position: dict | None) -> None:
        self.path, self.text_column, self.source = path, text_column, source
        self.offset = int(position["offset"]) if position else 0
        self.line = int(position["line"]) if position else 0
        self._stream = _open_binary(path)
        if path.endswith((".zst", ".zstd")):
            _skip_bytes(self._stream, self.offset)
        elif self.offset:
            self._stream.seek(self.offset)  # O(1) for plain files; gzip decompresses forward in C

    def __iter__(self) -> Iterator[bytes | None]:
        for raw in self._stream:
            self.offset += len(raw)
            self.line += 1
            yield raw if raw.strip() else None

    def position(self) -> dict:
        return {"offset": self.offset, "line": self.line}

    def where(self) -> str:
        return f"{self.path}, line {self.line}"

    def text_of(self, raw: bytes) -> Any:
        lenient = False
        try:
            try:
                obj = json.loads(raw)
            except UnicodeDecodeError:
                # Invalid UTF-8: parse with the bad bytes escaped; the text field goes back to
                # its original bytes below so the audit counts them exactly.
                obj, lenient = json.loads(raw.decode("utf-8", errors="surrogateescape")), True
        except (json.JSONDecodeError, RecursionError) as e:
            detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            raise SourceError(
                f"source {self.source!r}: {self.where()}: not valid JSON ({detail}); is this a JSON-lines file?",
                source=self.source,
                file=self.path,
            ) from e
        if not isinstance(obj, dict):
            raise SourceError(
                f"source {self.source!r}: {self.where()}: expected a JSON object per line, got {type(obj).__name__}",
                source=self.source,
                file=self.path,
            )
        if self.text_column not in obj:
            raise _column_error(self.source, self.text_column, list(obj), self.where())
        value = obj[self.text_column]
        if lenient and isinstance(value, str):
            try:
                value = value.encode("utf-8", errors="surrogateescape")
            except UnicodeEncodeError:
                pass  # also holds JSON-escaped surrogates: counted as surrogates instead
        return value

    def close(self) -> None:
        self._stream.close()


class _TextFileReader:
    """A .txt file (optionally compressed) is one document: books and articles are whole."""

    def __init__(self, path: str, text_column: str, source: str, position: dict | None) -> None:
        self.path = path
        self.done = bool(position and position.get("done"))

    def __iter__(self) -> Iterator[bytes]:
        if self.done:
            return
        with _open_binary(self.path) as f:
            data = f.read()
        self.done = True
        yield data

    def position(self) -> dict:
        return {"done": int(self.done)}

    def where(self) -> str:
        return self.path

    def text_of(self, raw: bytes) -> bytes:
        return raw

    def close(self) -> None:
        pass


class _DatasetsReader:
    """One ``datasets`` IterableDataset (a hub shard or a parquet file); its own
    ``state_dict()`` is the exact position."""

    def __init__(self, dataset, text_column: str, source: str, label: str, position: dict | None) -> None:
        self.dataset, self.text_column, self.source, self.label = dataset, text_column, source, label
        self.path = label
        self.row = 0
        if position:
            self.dataset.load_state_dict(position)

    def __iter__(self) -> Iterator[dict]:
        for row in self.dataset:
            self.row += 1
            yield row

    def position(self) -> dict:
        return self.dataset.state_dict()

    def where(self) -> str:
        return f"{self.label}, row {self.row}"

    def text_of(self, row: dict) -> Any:
        try:
            return row[self.text_column]
        except KeyError:
            raise _column_error(self.source, self.text_column, list(row), self.label) from None

    def close(self) -> None:
        pass


def _datasets():
    import datasets

    datasets.disable_progress_bars()  # one bar per file would bury the useful output
    return datasets


# ---------------------------------------------------------------------------------------
# The part-based nodes: the reading machinery (shared with ``sft.ConversationSource``), and
# the text source shared by local files and hub streams.


def glob_files(patterns: Sequence[str]) -> list[str]:
    """The files (not folders) matching any of ``patterns`` (``~`` and ``**`` expanded), sorted."""
    return sorted({p for pat in patterns for p in globlib.glob(os.path.expanduser(pat), recursive=True) if os.path.isfile(p)})


def hub_load_kwargs(split: str, **optional: Any) -> dict[str, Any]:
    """``load_dataset`` keyword arguments for a stream: ``split``, ``streaming`` and every
    optional one (``name``, ``data_dir``, ``data_files``, ``revision``) that is set."""
    return {"split": split, "streaming": True, **{k: v for k, v in optional.items() if v is not None}}


class _PartNode(BaseNode[dict]):
    """Rows of parts (files, or a dataset's shards) split across (rank, worker) readers.

    One place for what every part-reading node needs: listing and assigning parts, opening
    each at its exact position, skipping rows another reader owns, errors that name the part,
    and the small exact state (part, row, global row, owned rows, emitted, reader position,
    counts). A subclass lists and opens parts and turns one owned row into a document
    (``_document``, ``None`` to skip it); ``_check_exhausted`` says why an empty stream is wrong.
    """

    KIND = "source"  # how messages name this node: "source 'x': ..."

    def __init__(self, name: str, domain: str, *, shard: ShardSpec | None, stage: str = "source") -> None:
        super().__init__()
        self.name, self.domain = name, domain
        self.shard = shard or ShardSpec()
        self.stats = StageStats(stage)
        self._parts: list[str] | None = None
        self._reader = None
        self._dataset = None  # the opened hub stream, for nodes reading one

    # hooks -------------------------------------------------------------------------
    def _list_parts(self) -> list[str]:
        raise NotImplementedError

    def _open_part(self, part: int, position: dict | None):
        raise NotImplementedError

    def _describe(self) -> str:
        raise NotImplementedError

    def _document(self, raw: Any, row: int) -> dict | None:
        raise NotImplementedError

    def _check_exhausted(self) -> None:
        raise NotImplementedError

    def _part_path(self, part: int) -> str:
        return self._parts[part]

    def _where(self) -> str:
        return self._reader.where() if self._reader is not None else self._describe()

    def _hub_shard(self, part: int):
        """Part ``part`` of the opened hub stream (one contiguous slice of its shards)."""
        n = len(self._parts)
        return self._dataset.shard(num_shards=n, index=part, contiguous=True) if n > 1 else self._dataset

    # node ----------------------------------------------------------------------------
    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if self._parts is None:
            self._parts = self._list_parts()
            self._assigned, self._strided = assign_parts(len(self._parts), self.shard)
        self._close()
        st = initial_state or {}
        self._k = int(st.get("part", 0))
        self._row = int(st.get("row", 0))
        self._global_row = int(st.get("global_row", 0))
        self._owned_rows = int(st.get("owned_rows", 0))
        self._emitted = int(st.get("emitted", 0))
        self._pos = st.get("pos")
        self.stats.load_dict(st.get("stats", {}))

    def get_state(self) -> dict:
        return {
            "part": self._k,
            "row": self._row,
            "global_row": self._global_row,
            "owned_rows": self._owned_rows,
            "emitted": self._emitted,
            "pos": self._reader.position() if self._reader is not None else self._pos,
            "stats": self.stats.to_dict(),
        }

    def _close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        self._reader = None

    def next(self) -> dict:
        while True:
            if self._reader is None:
                if self._k >= len(self._assigned):
                    self._check_exhausted()
                    raise StopIteration
                part = self._assigned[self._k]
                try:
                    self._reader = self._open_part(part, self._pos)
                except SourceError:
                    raise
                except Exception as e:
                    raise SourceError(
                        f"{self.KIND} {self.name!r}: cannot open {self._part_path(part)}: {type(e).__name__}: {e}",
                        source=self.name,
                        file=self._part_path(part),
                    ) from e
                self._reader.row = self._row  # for messages: rows already read from this part
                self._rows = iter(self._reader)
            try:
                raw = next(self._rows)
            except StopIteration:
                self._close()
                self._k, self._row, self._pos = self._k + 1, 0, None
                continue
            except SourceError:
                raise
            except Exception as e:  # corrupt gzip/zstd/parquet, I/O errors: name the file
                raise SourceError(
                    f"{self.KIND} {self.name!r}: failed reading {self._where()}: {type(e).__name__}: {e}",
                    source=self.name,
                    file=getattr(self._reader, "path", None),
                ) from e
            if raw is None:
                self.stats.add(self.name, BLANK_LINES)
                continue
            row, global_row = self._row, self._global_row
            self._row += 1
            self._global_row += 1
            if self._strided and not owns_row(global_row, self.shard):
                continue
            self._owned_rows += 1
            doc = self._document(raw, row)
            if doc is None:
                continue
            self._emitted += 1
            return doc


class _PartSource(_PartNode):
    """Text documents from the ``text_column`` of each row, after the byte-loss audit."""

    def __init__(self, name: str, domain: str, *, text_column: str, shard: ShardSpec | None, first_rows_check: int) -> None:
        super().__init__(name, domain, shard=shard)
        self.text_column = text_column
        self.first_rows_check = first_rows_check

    def _document(self, raw: Any, row: int) -> dict | None:
        value = self._reader.text_of(raw)
        text, audit = clean_text(self._as_text(value))
        if not record_audit(self.stats, self.name, audit):
            if self._emitted == 0 and self._owned_rows >= self.first_rows_check:
                raise EmptySourceError(
                    f"source {self.name!r}: the first {self._owned_rows} rows of {self._describe()} have no text in "
                    f"column {self.text_column!r} (last: {self._reader.where()}); check text_column and the files",
                    source=self.name,
                    file=self._reader.where(),
                )
            return None
        return {
            "text": text,
            "source": self.name,
            "domain": self.domain,
            "doc_id": f"{self.name}/{self._parts[self._assigned[self._k]]}/{row}",
        }

    def _as_text(self, value: Any) -> str | bytes:
        if value is None:
            return ""
        if isinstance(value, (str, bytes)):
            return value
        raise SourceError(
            f"source {self.name!r}: {self._reader.where()}: column {self.text_column!r} holds "
            f"{type(value).__name__}, not text; point text_column at a string column",
            source=self.name,
            file=self._reader.where(),
        )

    def _check_exhausted(self) -> None:
        if self._emitted:
            return
        if self._owned_rows:
            raise EmptySourceError(
                f"source {self.name!r}: all {self._owned_rows} rows of {self._describe()} have empty text in "
                f"column {self.text_column!r}",
                source=self.name,
                file=self._describe(),
            )
        if self._global_row == 0:  # strided readers of a tiny source may legitimately own nothing
            raise EmptySourceError(
                f"source {self.name!r}: {self._describe()} contains no rows"
                + (f" (parts of shard {self.shard.index}/{self.shard.count})" if self.shard.count > 1 else ""),
                source=self.name,
                file=self._describe(),
            )


# ---------------------------------------------------------------------------------------
# Local files.

_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "txt", ".text": "txt", ".md": "txt"}
_COMPRESSIONS = (".gz", ".zst", ".zstd")


def file_format(path: str) -> str:
    """``jsonl`` / ``parquet`` / ``txt`` from the file name (compression suffix ignored)."""
    base = path
    for ext in _COMPRESSIONS:
        if base.endswith(ext):
            base = base[: -len(ext)]
            break
    fmt = _FORMATS.get(os.path.splitext(base)[1].lower())
    if fmt is None or (fmt == "parquet" and base != path):
        raise ValueError(
            f"unsupported file type {path!r}; supported: .jsonl/.ndjson/.json (JSON lines), .txt, each optionally "
            f".gz/.zst, and .parquet"
        )
    return fmt


class LocalFileSource(_PartSource):
    """Files matching glob pattern(s); one part per file, in sorted path order."""

    def __init__(
        self,
        name: str,
        files: str | Sequence[str],
        domain: str,
        *,
        text_column: str = "text",
        shard: ShardSpec | None = None,
        first_rows_check: int = FIRST_ROWS_CHECK,
    ) -> None:
        super().__init__(name, domain, text_column=text_column, shard=shard, first_rows_check=first_rows_check)
        self.patterns = [files] if isinstance(files, str) else list(files)

    def _describe(self) -> str:
        return f"files {self.patterns}"

    def _list_parts(self) -> list[str]:
        paths = glob_files(self.patterns)
        if not paths:
            raise SourceNotFoundError(
                f"source {self.name!r}: glob {self.patterns if len(self.patterns) > 1 else self.patterns[0]!r} matched no "
                f"files (cwd {os.getcwd()}); check the path",
                source=self.name,
                file=str(self.patterns),
            )
        formats = {}
        for p in paths:
            try:
                formats[p] = file_format(p)
            except ValueError as e:
                raise SourceError(f"source {self.name!r}: {e}", source=self.name, file=p) from None
        self._paths, self._formats = paths, formats
        # Labels relative to the files' common folder: stable doc_ids across machines.
        root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
        return [os.path.relpath(os.path.abspath(p), root) for p in paths]

    def _part_path(self, part: int) -> str:
        return self._paths[part]

    def _open_part(self, part: int, position: dict | None):
        path = self._paths[part]
        fmt = self._formats[path]
        if fmt == "jsonl":
            return _JsonlReader(path, self.text_column, self.name, position)
        if fmt == "txt":
            return _TextFileReader(path, self.text_column, self.name, position)
        import pyarrow.parquet as pq

        columns = pq.read_schema(path).names
        if self.text_column not in columns:
            raise _column_error(self.name, self.text_column, columns, path)
        ds = _datasets().load_dataset("parquet", data_files=[path], split="train", streaming=True, columns=[self.text_column])
        return _DatasetsReader(ds, self.text_column, self.name, path, position)


# ---------------------------------------------------------------------------------------
# Hugging Face streams.


class HFStreamSource(_PartSource):
    """``datasets.load_dataset(path, name, split=..., streaming=True, ...)``; one part per
    dataset shard. Only *opening* may fall back to the synthetic corpus
    (``fallback_offline=True``); errors after that propagate.
    """

    def __init__(
        self,
        name: str,
        path: str,
        domain: str,
        *,
        config_name: str | None = None,
        split: str = "train",
        data_dir: str | None = None,
        data_files: str | Sequence[str] | None = None,
        revision: str | None = None,
        text_column: str = "text",
        shard: ShardSpec | None = None,
        fallback_offline: bool = False,
        fallback_seed: int = 0,
        fallback_docs: int | None = None,
        first_rows_check: int = FIRST_ROWS_CHECK,
    ) -> None:
        super().__init__(name, domain, text_column=text_column, shard=shard, first_rows_check=first_rows_check)
        self.path, self.config_name, self.split = path, config_name, split
        self.data_dir, self.revision = data_dir, revision
        self.data_files = [data_files] if isinstance(data_files, str) else (list(data_files) if data_files else None)
        self.fallback_offline, self.fallback_seed, self.fallback_docs = fallback_offline, fallback_seed, fallback_docs
        self._fallback: SyntheticSource | None = None

    @classmethod
    def from_entry(cls, entry: DataMixEntry, *, shard: ShardSpec | None = None, fallback_offline: bool = False) -> HFStreamSource:
        return cls(
            entry.name, entry.path, entry.domain, config_name=entry.config_name, split=entry.split,
            data_dir=entry.data_dir, data_files=entry.data_files, revision=entry.revision,
            text_column=entry.text_column, shard=shard, fallback_offline=fallback_offline,
            fallback_seed=entry.seed, fallback_docs=entry.num_docs,
        )

    def _describe(self) -> str:
        bits = [self.path] + [f"{k}={v}" for k, v in (("name", self.config_name), ("data_dir", self.data_dir),
                                                       ("revision", self.revision)) if v]
        if self.data_files:
            bits.append(f"data_files={self.data_files}")
        return f"datasets stream {' '.join(bits)} split={self.split}"

    def _load(self):
        kwargs = hub_load_kwargs(self.split, name=self.config_name, data_dir=self.data_dir, data_files=self.data_files,
                                 revision=self.revision)
        return _datasets().load_dataset(self.path, **kwargs)

    def _list_parts(self) -> list[str]:  # opening is done by reset(), which may fall back
        raise AssertionError("HFStreamSource opens its stream in reset()")

    def _use_dataset(self, ds) -> None:
        """Validate the opened stream (errors here never fall back) and split it into parts."""
        columns = list(ds.features) if ds.features is not None else None
        if columns is None:  # features unknown until read: look at the first row
            first = next(iter(ds), None)
            if first is None:
                raise EmptySourceError(f"source {self.name!r}: {self._describe()} contains no rows", source=self.name, file=self.path)
            columns = list(first)
        if self.text_column not in columns:
            raise _column_error(self.name, self.text_column, columns, self._describe())
        if len(columns) > 1:
            ds = ds.select_columns([self.text_column])  # convert only the column we use
        self._dataset = ds
        self._parts = [f"shard{j:05d}" for j in range(ds.n_shards)]
        self._assigned, self._strided = assign_parts(len(self._parts), self.shard)

    def _open_part(self, part: int, position: dict | None):
        return _DatasetsReader(self._hub_shard(part), self.text_column, self.name, f"{self._describe()} {self._parts[part]}", position)

    def reset(self, initial_state: dict | None = None) -> None:
        st = initial_state or {}
        if self._parts is None and self._fallback is None:
            if st.get("fallback"):  # a resumed fallback stream stays the same stream
                self._start_fallback(None)
            else:
                try:
                    ds = self._load()
                except Exception as e:  # only *opening*, and only for want of a network, may fall back
                    if not (self.fallback_offline and _is_unreachable(e)):
                        raise SourceError(
                            f"source {self.name!r}: cannot open {self._describe()}: {type(e).__name__}: {e}. Check the "
                            f"hub id, config and files"
                            + ("" if self.fallback_offline else ", or pass fallback_offline=True to use the offline synthetic corpus"),
                            source=self.name,
                            file=self.path,
                        ) from e
                    self._start_fallback(f"{type(e).__name__}: {e}")
                else:
                    self._use_dataset(ds)
        if self._fallback is not None:
            if initial_state is not None and not st.get("fallback"):
                raise SourceError(
                    f"source {self.name!r}: the checkpoint is from the real stream of {self._describe()}, but it could "
                    f"not be opened now; resume where the hub is reachable",
                    source=self.name,
                    file=self.path,
                )
            BaseNode.reset(self, initial_state)
            self._fallback.reset(st.get("synthetic"))
            if initial_state is None:
                self.stats.add(self.name, FALLBACK_OFFLINE)
            return
        if st.get("fallback"):
            raise SourceError(
                f"source {self.name!r}: the checkpoint is from the offline fallback, but this node opened the real "
                f"stream; build it the same way as the checkpointed run",
                source=self.name,
                file=self.path,
            )
        super().reset(initial_state)

    def _start_fallback(self, reason: str | None) -> None:
        self._fallback = SyntheticSource(
            self.name, self.domain, seed=self.fallback_seed, num_docs=self.fallback_docs, shard=self.shard,
            stats=self.stats, label="synthetic-fallback",
        )
        if reason is not None:
            warnings.warn(
                f"source {self.name!r}: could not open {self._describe()} ({reason}); falling back to the offline "
                f"synthetic {self.domain} corpus (fallback_offline=True). The run is NOT reading the real data.",
                RuntimeWarning,
                stacklevel=3,
            )

    @property
    def is_fallback(self) -> bool:
        return self._fallback is not None

    def next(self) -> dict:
        if self._fallback is not None:
            return self._fallback.next()
        return super().next()

    def get_state(self) -> dict:
        if self._fallback is not None:
            return {"fallback": 1, "synthetic": self._fallback.get_state()}
        return super().get_state()


# Exception class names (anywhere in the cause chain) that mean "the hub is unreachable", as
# raised by datasets, huggingface_hub, requests, httpx and urllib3. Anything else (a wrong
# hub id, a corrupt file) is a real error and must not be papered over by the fallback.
_UNREACHABLE = {
    "ConnectionError", "ConnectError", "ConnectTimeout", "ReadTimeout", "Timeout", "TimeoutError",
    "OfflineModeIsEnabled", "LocalEntryNotFoundError", "NameResolutionError", "MaxRetryError", "NewConnectionError",
}


def _is_unreachable(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(cls.__name__ in _UNREACHABLE for cls in type(exc).__mro__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


# ---------------------------------------------------------------------------------------
# The offline synthetic corpus.

_POOL_BYTES = {"prose": 700_000, "code": 2_000_000, "math": None}  # ~1 s to load each
EXACT_DUP_EVERY = 97
NEAR_DUP_EVERY = 53
_DUP_LOOKBACK = 5_000  # duplicates copy a recent document, as crawls do


@lru_cache(maxsize=None)
def _pool(domain: str) -> tuple[str, ...]:
    """Real text segments (paragraphs / code blocks / formula groups) from ``stacklm.corpus``."""
    from stacklm import corpus

    if domain == "code":
        segments = []
        for doc in corpus.iter_code(_POOL_BYTES["code"]):
            lines = doc.splitlines()
            segments += ["\n".join(lines[i : i + 40]) for i in range(0, len(lines), 40)]
    else:
        src = corpus.iter_prose(_POOL_BYTES["prose"]) if domain == "prose" else corpus.iter_math(None)
        segments = [p.strip() for doc in src for p in doc.split("\n\n")]
    segments = [s for s in segments if len(s) >= 80]
    if not segments:  # pragma: no cover - a stripped Python without its stdlib sources
        raise RuntimeError(f"synthetic corpus: no real {domain} text found in the standard library")
    return tuple(segments)


def synthetic_duplicate_of(index: int, seed: int = 0) -> tuple[str, int] | None:
    """``("exact" | "near", j)`` when document ``index`` copies earlier original ``j``, else None.

    Every 97th document (index 96, 193, ...) is an exact copy, every 53rd otherwise a light
    edit; ``j`` is always an original (never itself a copy). Ground truth for dedup tests.
    """
    pos = index + 1
    kind = "exact" if pos % EXACT_DUP_EVERY == 0 else "near" if pos % NEAR_DUP_EVERY == 0 else None
    if kind is None:
        return None
    rng = np.random.default_rng([seed, index, 1])
    j = int(rng.integers(max(0, index - _DUP_LOOKBACK), index))
    while synthetic_duplicate_of_slot(j):
        j -= 1
    return kind, j


def synthetic_duplicate_of_slot(index: int) -> bool:
    pos = index + 1
    return pos % EXACT_DUP_EVERY == 0 or pos % NEAR_DUP_EVERY == 0


def near_edit(text: str, rng: np.random.Generator, rate: float = 0.03) -> str:
    """A light edit: ~``rate`` of the words substituted, deleted or doubled (at least one)."""
    words = text.split(" ")
    n_edits = max(1, int(len(words) * rate))
    positions = sorted(set(rng.integers(0, len(words), n_edits).tolist()), reverse=True)
    for pos, op, other in zip(positions, rng.integers(0, 3, len(positions)), rng.integers(0, len(words), len(positions))):
        if op == 0:
            words[pos] = words[other % len(words)]  # earlier deletions may have shortened the list
        elif op == 1 and len(words) > 1:
            del words[pos]
        else:
            words.insert(pos, words[pos])
    return " ".join(words)


def _original_text(index: int, domain: str, seed: int) -> str:
    pool = _pool(domain)
    rng = np.random.default_rng([seed, index, 0])
    lo, hi = {"prose": (3, 9), "code": (1, 4), "math": (2, 6)}[domain]
    picks = rng.integers(0, len(pool), int(rng.integers(lo, hi)))
    return "\n\n".join(pool[i] for i in picks.tolist())


def synthetic_text(index: int, domain: str = "prose", seed: int = 0) -> str:
    """Document ``index`` of the synthetic corpus: several real segments drawn at random (so
    documents share little text unless they are injected duplicates)."""
    dup = synthetic_duplicate_of(index, seed)
    if dup is None:
        return _original_text(index, domain, seed)
    kind, j = dup
    base = _original_text(j, domain, seed)
    return base if kind == "exact" else near_edit(base, np.random.default_rng([seed, index, 2]))


class SyntheticSource(BaseNode[dict]):
    """Deterministic offline corpus with injected exact (every 97th) and near (every 53rd)
    duplicates. Random access by index, so the state is one int and sharding strides it."""

    def __init__(
        self,
        name: str = "synthetic",
        domain: str = "prose",
        *,
        seed: int = 0,
        num_docs: int | None = None,
        shard: ShardSpec | None = None,
        stats: StageStats | None = None,
        label: str = "synthetic",
    ) -> None:
        super().__init__()
        if domain not in _POOL_BYTES:
            raise ValueError(f"synthetic source {name!r}: domain must be one of {sorted(_POOL_BYTES)}, got {domain!r}")
        self.name, self.domain, self.seed, self.label = name, domain, seed, label
        self.num_docs = DEFAULT_SYNTHETIC_DOCS if num_docs is None else num_docs
        self.shard = shard or ShardSpec()
        self.stats = stats if stats is not None else StageStats("source")

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        st = initial_state or {}
        self._next = int(st.get("next", self.shard.index))
        self.stats.load_dict(st.get("stats", {}))

    def get_state(self) -> dict:
        return {"next": self._next, "stats": self.stats.to_dict()}

    def next(self) -> dict:
        while self._next < self.num_docs:
            i = self._next
            self._next += self.shard.count
            text, audit = clean_text(synthetic_text(i, self.domain, self.seed))
            if record_audit(self.stats, self.name, audit):
                return {"text": text, "source": self.name, "domain": self.domain, "doc_id": f"{self.name}/{self.label}/{i}"}
        raise StopIteration


# ---------------------------------------------------------------------------------------


def open_source(entry: DataMixEntry, *, shard: ShardSpec | None = None, fallback_offline: bool = False) -> BaseNode:
    """The source node for one registry entry."""
    if entry.kind == "hf":
        return HFStreamSource.from_entry(entry, shard=shard, fallback_offline=fallback_offline)
    if entry.kind == "local":
        return LocalFileSource(entry.name, list(entry.data_files or [entry.path]), entry.domain, text_column=entry.text_column, shard=shard)
    return SyntheticSource(entry.name, entry.domain, seed=entry.seed, num_docs=entry.num_docs, shard=shard)
