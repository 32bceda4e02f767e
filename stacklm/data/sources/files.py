"""Local files (jsonl / txt, optionally .gz / .zst, and parquet) as a document source."""

from __future__ import annotations

import glob as globlib
import os
from collections.abc import Sequence

from stacklm.data.sources.parts import FIRST_ROWS_CHECK, TextPartSource
from stacklm.data.sources.pieces import file_pieces, signed_prefix, spread_order
from stacklm.data.sources.readers import JsonlReader, ParquetReader, TextFileReader, missing_column
from stacklm.data.sources.sharding import ShardSpec
from stacklm.errors import SourceError, SourceNotFoundError, column_error

_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".txt": "txt", ".text": "txt", ".md": "txt"}
_COMPRESSIONS = (".gz", ".zst", ".zstd")


def glob_files(patterns: Sequence[str]) -> list[str]:
    """The files (not folders) matching any of ``patterns`` (``~`` and ``**`` expanded), sorted."""
    return sorted({p for pat in patterns for p in globlib.glob(os.path.expanduser(pat), recursive=True) if os.path.isfile(p)})


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


class LocalFileSource(TextPartSource):
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
        on_invalid: str = "skip",
        order_seed: int | None = None,
    ) -> None:
        super().__init__(
            name, domain, text_column=text_column, shard=shard, first_rows_check=first_rows_check, on_invalid=on_invalid
        )
        self.patterns = [files] if isinstance(files, str) else list(files)
        # None: files in sorted order, each from its start; a seed: pieces in a seeded order
        # spread over every file (``pieces.spread_order``), so a budget takes a sample, not heads
        self.order_seed = order_seed
        # None: every piece; a fraction: only each file's signed prefix (``limit_to_signed``)
        self.signed_fraction: float | None = None
        self._heads_checked: set[int] = set()  # JSON-lines files whose head showed the text column (``_open_part``)

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

    def _part_size(self, part: int) -> int:
        return os.path.getsize(self._paths[part])

    @property
    def index_bytes(self) -> int:
        """Bytes of the plain JSON-lines files a piece index was built over (one counting scan
        of each, ``sources.pieces``; once per build when cached); 0 when files are read whole."""
        if self._parts is None:
            self.reset(None)
        if self._pieces is None:
            return 0
        return sum(os.path.getsize(p) for p in self._paths if self._formats[p] == "jsonl" and not p.endswith(_COMPRESSIONS))

    def limit_to_signed(self, fraction: float) -> None:
        """Read only each file's first pieces in the seeded order holding ``fraction`` of its
        bytes (``pieces.signed_prefix``): what a small prebuild's dedup pass signed
        (``stacklm.prebuild.signing``), so no unsigned document is ever read; the source ends
        there. Only with the spread order (``order_seed``); call before the first ``reset``."""
        if self.order_seed is None:
            raise ValueError(f"source {self.name!r}: a signed prefix needs the spread read order")
        self.signed_fraction = float(fraction)
        self._parts = None  # pieces are listed again, limited, at the next reset

    def _list_pieces(self) -> list[list] | None:
        pieces = self._all_pieces()
        if pieces is None or self.signed_fraction is None:
            return pieces
        return [signed_prefix(ps, self.order_seed, self.signed_fraction) for ps in pieces]

    def _all_pieces(self) -> list[list] | None:
        # Whole files while there are at least as many files as readers (each file read by
        # one reader, no index needed); else pieces (``sources.pieces``), so readers split
        # files instead of each scanning all of them.
        if len(self._paths) >= self.shard.count:
            if self.order_seed is None:
                return None
            # whole files per reader, in pieces only for the spread order: index only its own
            own = set(range(self.shard.index, len(self._paths), self.shard.count))
            return [self._file_pieces(i) if i in own else [] for i in range(len(self._paths))]
        return [self._file_pieces(i) for i in range(len(self._paths))]

    def _file_pieces(self, i: int) -> list:
        """``file_pieces`` of file ``i``; a file its format cannot read (a text file named
        ``.parquet``: pyarrow's ``ArrowInvalid``) is a ``SourceError`` naming the source and the
        file, as when the reader opens it, not a traceback from the piece index."""
        path = self._paths[i]
        try:
            return file_pieces(i, path, self._formats[path])
        except (OSError, ValueError, UnicodeDecodeError) as e:  # pyarrow's ArrowInvalid is a ValueError
            raise SourceError(f"source {self.name!r}: cannot read {path} as {self._formats[path]}: {type(e).__name__}: {e}",
                              source=self.name, file=path) from None

    def index_all(self) -> None:
        """Build (or find in the cache) the piece index of every file this source reads in
        pieces, for all readers at once (the prebuild runs this once before its jobs)."""
        if self._parts is None:
            self.reset(None)
        if self._pieces is not None:
            for i in range(len(self._paths)):
                self._file_pieces(i)

    def _order_pieces(self, pieces: list) -> list:
        return pieces if self.order_seed is None else spread_order(pieces, self.order_seed)

    def _open_part(self, part: int, position: dict | None, piece=None):
        path = self._paths[part]
        fmt = self._formats[path]
        if fmt == "jsonl":
            if part not in self._heads_checked:  # once per file and reader, as a parquet file's schema
                keys = missing_column(path, self.text_column, self.first_rows_check)
                if keys is not None:
                    raise column_error(self.name, self.text_column, keys, path)
                self._heads_checked.add(part)
            return JsonlReader(path, self.text_column, self.name, position, piece)
        if fmt == "txt":
            return TextFileReader(path, self.text_column, self.name, position)
        return ParquetReader(path, self.text_column, self.name, position, piece)
