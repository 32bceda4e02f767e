"""The part-reading node every source shares, and the text source of local files and hub streams.

Reading is organised in *parts* (files, or the shards of a hub dataset), assigned to (rank,
worker) readers by ``sharding.assign_parts``. The state is small and exact: which part, how
many rows into it, the reader's own position (a byte offset, or the ``datasets`` stream's
``state_dict()``), and the counters.
"""

from __future__ import annotations

from typing import Any

from torchdata.nodes import BaseNode

from stacklm.data.audit import clean_text, record_audit
from stacklm.data.sources.errors import EmptySourceError, SourceError
from stacklm.data.sources.sharding import ShardSpec, assign_parts, owns_row
from stacklm.data.stats import StageStats

# A stream whose first rows are all empty almost always reads the wrong column or files.
FIRST_ROWS_CHECK = 100
BLANK_LINES = "blank_lines_skipped"


class PartNode(BaseNode[dict]):
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


class TextPartSource(PartNode):
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
