"""The part-reading node every source shares, and the text source of local files and hub streams.

Reading is organised in *parts* (files, or the shards of a hub dataset), assigned to (rank,
worker) readers by ``sharding.assign_parts``. The state is small and exact: which part, how
many rows into it, the reader's own position (a byte offset, or the ``datasets`` stream's
``state_dict()``), and the counters.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from torchdata.nodes import BaseNode

from stacklm.data.audit import (
    BINARY_INVALID_FRACTION,
    DROPPED_BINARY,
    INVALID_UTF8,
    MISSING_TEXT,
    NON_STRING_TEXT,
    NULL_TEXT,
    ON_INVALID,
    clean_text,
    record_audit,
)
from stacklm.data.sources.sharding import ShardSpec, assign_parts, assign_pieces, owns_row
from stacklm.data.stats import StageStats
from stacklm.errors import ConfigError, InvalidRecordError, ResumeRefused, SourceError, column_error
from stacklm.once import first_time

logger = logging.getLogger(__name__)

# A stream whose first rows are all empty almost always reads the wrong column or files.
DEFAULT_TEXT_COLUMN = "text"  # a pre-training source's text column when none is given
FIRST_ROWS_CHECK = 100
BLANK_LINES = "blank_lines_skipped"
RECORDS_READ = "records_read"  # rows this reader owns and looked at (not blank lines, not other readers' rows)
LOGGED_INVALID = 5  # invalid rows logged (with file and line) per reader; the rest are counted


class PartNode(BaseNode[dict]):
    """Rows of parts (files, or a dataset's shards) split across (rank, worker) readers.

    One place for what every part-reading node needs: listing and assigning parts, opening
    each at its exact position, skipping rows another reader owns, errors that name the part,
    and the small exact state (part, row, global row, owned rows, emitted, reader position,
    counts). A subclass lists and opens parts and turns one owned row into a document
    (``_document``, ``None`` to skip it); ``_check_exhausted`` says why an empty stream is wrong.
    """

    KIND = "source"  # how messages name this node: "source 'x': ..."
    # Log bad rows (counted either way). Off for a reader whose rows another reader of the run
    # logs: the val split's (``HoldoutNode``); and a row is logged once per process (``once``).
    log_rows = True
    COUNTS_RECORDS = False  # count owned rows as RECORDS_READ (the token ledger's "read"; text sources)
    _pieces = None  # the assigned pieces (``sources.pieces``), parallel to ``_assigned``; None: whole parts

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

    def _open_part(self, part: int, position: dict | None, piece=None):
        raise NotImplementedError

    def _list_pieces(self) -> list[list] | None:
        """Every part's pieces (``sources.pieces``), or None to read whole parts (hub shards;
        files when whole-file reading already reads each input once)."""
        return None

    def _order_pieces(self, pieces: list) -> list:
        """The order this reader reads its pieces in (as assigned: file order, by default)."""
        return pieces

    def _part_size(self, part: int) -> int:
        """Bytes of part ``part`` on disk (0 when unknown: hub streams)."""
        return 0

    def _describe(self) -> str:
        raise NotImplementedError

    def _document(self, raw: Any, row: int) -> dict | None:
        raise NotImplementedError

    def _check_exhausted(self) -> None:
        raise NotImplementedError

    def _part_path(self, part: int) -> str:
        return self._parts[part]

    def _skip_unowned(self, raw: Any) -> None:
        """A row another (strided) reader owns; nothing to do by default."""

    def _end_part(self) -> None:
        """The current part has no rows left (before it is closed)."""

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
            pieces = self._list_pieces()
            if pieces is None:
                self._pieces = None
                self._assigned, self._strided = assign_parts(len(self._parts), self.shard)
            else:
                self._pieces, self._strided = assign_pieces(pieces, self.shard)
                self._pieces = self._order_pieces(self._pieces)
                self._assigned = [p.part for p in self._pieces]
                # per part: its pieces this reader reads (the last one's position) and whether
                # that is all of them (``TextPartSource``'s all-invalid rule is per file)
                mine: dict[int, int] = {}
                count: dict[int, int] = {}
                for k, piece in enumerate(self._pieces):
                    mine[piece.part] = k
                    count[piece.part] = count.get(piece.part, 0) + 1
                self._last_piece_of = mine
                self._whole_parts = {part for part, n in count.items() if n == len(pieces[part])}
        self._close()
        st = initial_state or {}
        if st.get("parts_hash") is not None and st["parts_hash"] != self._parts_hash():
            # positions (the part index, buffered documents' files) index the listed parts: another list
            # would read other files at them, or skip some, silently
            raise ResumeRefused(
                f"refusing to resume: source {self.name!r}: {self._describe()} now lists {len(self._parts)} part(s), not the "
                f"{int(st.get('parts', -1))} the checkpoint read (a file was added, removed or renamed since); its positions "
                "index that list. Restore the files as they were, or start the run afresh")
        self._k = int(st.get("part", 0))
        self._row = int(st.get("row", self._first_row(0)))
        # input bytes this reader has read (``bytes_in``): the read volume per pass
        self._bytes_in = int(st.get("bytes_in", 0))
        self._global_row = int(st.get("global_row", 0))
        self._owned_rows = int(st.get("owned_rows", 0))
        self._emitted = int(st.get("emitted", 0))
        self._pos = st.get("pos")
        self.stats.load_dict(st.get("stats", {}))

    def _parts_hash(self) -> str:
        """A digest of the part list (names in order): what the state's positions index."""
        import hashlib

        return hashlib.sha256("\n".join(map(str, self._parts)).encode()).hexdigest()[:16]

    def get_state(self) -> dict:
        return {
            **({"parts_hash": self._parts_hash(), "parts": len(self._parts)} if self._parts is not None else {}),
            "part": self._k,
            "row": self._row,
            "global_row": self._global_row,
            "owned_rows": self._owned_rows,
            "emitted": self._emitted,
            "pos": self._reader.position() if self._reader is not None else self._pos,
            "stats": self.stats.to_dict(),
            "bytes_in": self.bytes_in,
        }

    @property
    def bytes_in(self) -> int:
        """Input bytes this reader has read so far: exact for plain JSON-lines files (the bytes
        of the lines read, skipped rows included); a compressed file, a parquet row group or a
        hub-free part counts whole when it is opened."""
        done = self._reader.consumed() if self._reader is not None and hasattr(self._reader, "consumed") else None
        return self._bytes_in + (done or 0)

    @property
    def input_bytes(self) -> int:
        """Bytes of all this source's parts on disk (what one full read of it reads)."""
        if self._parts is None:
            self.reset(None)
        return sum(self._part_size(i) for i in range(len(self._parts)))

    @property
    def index_bytes(self) -> int:
        """Bytes a piece index of this source covers (``sources.pieces``); 0 when parts are read whole."""
        return 0

    def _first_row(self, k: int) -> int:
        """The row number (``doc_id``'s) at the start of the ``k``-th assigned piece."""
        return self._pieces[k].row if self._pieces is not None and k < len(self._pieces) else 0

    def _close(self) -> None:
        if self._reader is not None:
            done = self._reader.consumed() if hasattr(self._reader, "consumed") else None
            self._bytes_in += done or 0
            self._reader.close()
        self._reader = None

    def next(self) -> dict:
        while True:
            if self._reader is None:
                if self._k >= len(self._assigned):
                    self._check_exhausted()
                    raise StopIteration
                part = self._assigned[self._k]
                piece = self._pieces[self._k] if self._pieces is not None else None
                try:
                    self._reader = self._open_part(part, self._pos, piece)
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
                exact = getattr(self._reader, "consumed", lambda: None)() is not None
                if self._pos is None and not exact:
                    # not byte-exact (compressed, parquet, txt): the piece counts whole at a fresh open
                    self._bytes_in += piece.nbytes if piece is not None else self._part_size(part)
            try:
                raw = next(self._rows)
            except StopIteration:
                self._end_part()
                self._close()
                self._k, self._pos = self._k + 1, None
                self._row = self._first_row(self._k)
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
                self._skip_unowned(raw)
                continue
            self._owned_rows += 1
            if self.COUNTS_RECORDS:
                self.stats.add(self.name, RECORDS_READ)  # the ledger's "read" (stacklm.data.ledger)
            doc = self._document(raw, row)
            if doc is None:
                continue
            self._emitted += 1
            return doc


class TextPartSource(PartNode):
    """Text documents from the ``text_column`` of each row, after the byte-loss audit.

    A row that holds no document (``audit.INVALID_RECORDS``: a malformed JSON line, not an
    object, no / null / non-string text) is skipped and counted under its reason with
    ``on_invalid="skip"``, the first ``LOGGED_INVALID`` logged with file and line; with
    ``"raise"`` the first one stops the read. A part (file, hub shard) none of whose rows is a
    record is still an error, raised as soon as its first ``first_rows_check`` rows are all
    invalid or at its end: that is a wrong format or a wrong ``text_column``, not bad rows.

    The rule is per *file*, not per piece (a file read in pieces, ``sources.pieces``): a piece
    with no valid row only ends the read when it is the file's head (its first
    ``first_rows_check`` rows), or when every piece of the file has been read, by this reader,
    without one valid row; a file with some valid rows is read and its bad rows counted (a file
    whose last piece held no valid row was refused whole although 14 % of it was valid). A
    file split between readers is judged by its own pieces only by ``_check_exhausted``.
    """

    COUNTS_RECORDS = True

    def __init__(
        self, name: str, domain: str, *, text_column: str, shard: ShardSpec | None, first_rows_check: int,
        on_invalid: str = "skip",
    ) -> None:
        if on_invalid not in ON_INVALID:
            raise ConfigError(f"source {name!r}: field 'on_invalid' must be one of {ON_INVALID}, got {on_invalid!r}")
        super().__init__(name, domain, shard=shard)
        self.text_column = text_column
        self.first_rows_check = first_rows_check
        self.on_invalid = on_invalid
        # UTF-8 bytes of the records read by this process (progress: MB/s); not in the state.
        self.text_bytes = 0

    @property
    def bytes_read(self) -> int:
        return self.text_bytes

    # state: the current part's valid/invalid rows (for the whole-part check) and its first
    # invalid row's message, plus how many invalid rows were logged.
    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        inv = (initial_state or {}).get("invalid", {})
        self._part_valid = int(inv.get("part_valid", 0))
        self._part_invalid: dict[str, int] = {k: int(v) for k, v in inv.get("part_invalid", {}).items()}
        self._part_first = inv.get("part_first")
        self._part_keys = list(inv.get("part_keys", []))
        self._logged = int(inv.get("logged", 0))
        # per file read in pieces: the files that have shown a valid row, and the invalid counts
        # (and first message) of the pieces of files that have not yet
        self._valid_files = set(int(f) for f in inv.get("valid_files", []))
        self._file_invalid: dict[int, dict[str, Any]] = {int(k): v for k, v in inv.get("file_invalid", {}).items()}

    def get_state(self) -> dict:
        return {
            **super().get_state(),
            "invalid": {
                "part_valid": self._part_valid, "part_invalid": dict(self._part_invalid), "part_first": self._part_first,
                "part_keys": list(self._part_keys), "logged": self._logged,
                **({"valid_files": sorted(self._valid_files), "file_invalid": {str(k): v for k, v in self._file_invalid.items()}}
                   if self._pieces is not None else {}),
            },
        }

    def _text(self, raw: Any) -> str | bytes:
        value = self._reader.text_of(raw)
        if value is None:
            raise InvalidRecordError(
                f"source {self.name!r}: {self._reader.where()}: column {self.text_column!r} is null",
                reason=NULL_TEXT, source=self.name, file=getattr(self._reader, "path", None),
            )
        if isinstance(value, (str, bytes)):
            return value
        raise InvalidRecordError(
            f"source {self.name!r}: {self._reader.where()}: column {self.text_column!r} holds "
            f"{type(value).__name__}, not text; point text_column at a string column",
            reason=NON_STRING_TEXT, source=self.name, file=getattr(self._reader, "path", None),
        )

    def _skip_unowned(self, raw: Any) -> None:
        # Strided readers share parts: a part is "all invalid" only if the rows other readers
        # own are too, so look at them until the part has shown one valid record.
        if self._part_valid == 0:
            try:
                self._text(raw)
            except InvalidRecordError:
                return
            self._part_valid += 1

    def _end_part(self) -> None:
        if self._pieces is None:
            if self._part_invalid and not self._part_valid:
                self._raise_all_invalid(self._part_invalid, self._part_first, self._part_keys)
        else:
            self._end_piece()
        self._part_valid, self._part_invalid, self._part_first, self._part_keys = 0, {}, None, []

    def _end_piece(self) -> None:
        """The per-file rule (class docstring) at the end of a piece."""
        part = self._assigned[self._k]
        if self._part_valid:
            self._valid_files.add(part)
            self._file_invalid.pop(part, None)
        elif self._part_invalid and part not in self._valid_files:
            seen = self._file_invalid.setdefault(part, {"invalid": {}, "first": self._part_first, "keys": self._part_keys})
            for reason, n in self._part_invalid.items():
                seen["invalid"][reason] = seen["invalid"].get(reason, 0) + n
        if self._last_piece_of.get(part) == self._k and part in self._file_invalid:
            seen = self._file_invalid.pop(part)
            if part in self._whole_parts:
                self._raise_all_invalid(seen["invalid"], seen["first"], seen["keys"])

    def _at_file_head(self) -> bool:
        """The current piece starts its file (or parts are read whole): where the early check looks."""
        return self._pieces is None or (self._pieces[self._k].line == 0 and self._assigned[self._k] not in self._valid_files)

    def _raise_all_invalid(self, invalid: dict[str, int], first: str | None, keys: list) -> None:
        where = self._part_path(self._assigned[self._k])
        if set(invalid) == {MISSING_TEXT}:
            raise column_error(self.name, self.text_column, keys, where)
        n = sum(invalid.values())
        raise SourceError(
            f"source {self.name!r}: none of the {n} rows read from {where} is a valid record "
            f"({', '.join(f'{k}={v}' for k, v in sorted(invalid.items()))}); first: {first}. "
            f"Check the file's format and text_column (or drop the file from the source)",
            source=self.name,
            file=where,
        )

    def _invalid(self, err: InvalidRecordError) -> None:
        if self.on_invalid == "raise":
            raise err
        self.stats.add(self.name, err.reason)
        self._part_invalid[err.reason] = self._part_invalid.get(err.reason, 0) + 1
        if self._part_first is None:
            self._part_first = str(err)
            self._part_keys = list(getattr(self._reader, "keys", []))
        if not self._part_valid and sum(self._part_invalid.values()) >= self.first_rows_check and self._at_file_head():
            self._raise_all_invalid(self._part_invalid, self._part_first, self._part_keys)
        # every split (and the global dedup pass) reads the same record: one line per process
        if self.log_rows and self._logged < LOGGED_INVALID and first_time("invalid_record", str(err)):
            self._logged += 1
            logger.warning(
                "%s -- skipped, counted as %s (on_invalid: raise would stop here)%s", err, err.reason,
                "; further invalid rows of this reader are counted, not logged" if self._logged == LOGGED_INVALID else "",
            )

    def _document(self, raw: Any, row: int) -> dict | None:
        try:
            value = self._text(raw)
        except InvalidRecordError as err:
            self._invalid(err)
            return None
        self._part_valid += 1
        text, audit = clean_text(value)
        self.text_bytes += len(value) if isinstance(value, bytes) else (len(text) if text.isascii() else len(text.encode()))
        if not record_audit(self.stats, self.name, audit):
            if self._emitted == 0 and self._owned_rows >= self.first_rows_check:
                raise SourceError(
                    f"source {self.name!r}: the first {self._owned_rows} rows of {self._describe()} have no text in "
                    f"column {self.text_column!r} (last: {self._reader.where()}); check text_column and the files",
                    source=self.name,
                    file=self._reader.where(),
                )
            return None
        return self._make_doc(text, self._assigned[self._k], row, self._reader)

    def _make_doc(self, text: str, part: int, row: int, reader) -> dict:
        doc = {
            "text": text,
            "source": self.name,
            "domain": self.domain,
            "doc_id": f"{self.name}/{self._parts[part]}/{row}",
            # provenance (stacklm.data.storage.provenance): index of the part in the source's sorted part
            # list, and the row's 0-based index in it (line for jsonl, row for parquet, stream index)
            "file": part,
            "record": int(reader.record),
        }
        seek = getattr(reader, "row_start", None)
        if seek is not None:  # where a reader of the part finds the row again (stacklm.data.doc_refs)
            doc["seek"] = int(seek)
        return doc

    def reread(self, files, seeks, records, rows) -> list[dict]:
        """The documents at these positions (part, ``seek`` and ``record`` as ``next`` gave them,
        ``row`` from their ``doc_id``), as ``next`` gave them: for a checkpoint that saved its
        buffered documents by position (``stacklm.data.doc_refs``). A part is opened once and
        read at the positions in ascending order. A row that is no longer a document (the file
        changed) raises ``ResumeRefused`` naming it."""
        if self._parts is None:
            self.reset(None)
        files, seeks = np.asarray(files, dtype=np.int64), np.asarray(seeks, dtype=np.int64)
        out: list[dict | None] = [None] * len(files)
        order = np.lexsort((seeks, files))
        bounds = np.flatnonzero(np.diff(files[order])) + 1
        for idx in np.split(order, bounds) if len(order) else []:
            part = int(files[idx[0]])
            if not 0 <= part < len(self._parts):
                raise ResumeRefused(
                    f"refusing to resume: source {self.name!r}: the checkpoint buffered documents of its part #{part}, but "
                    f"{self._describe()} now lists {len(self._parts)} part(s): a file was removed since. Restore it, or start "
                    "the run afresh")
            reader = self._open_part(part, None, None)
            try:
                for i, raw in zip(idx.tolist(), reader.rows_at(seeks[idx])):
                    try:
                        value = reader.text_of(raw)
                    except InvalidRecordError:
                        value = None
                    text, audit = clean_text(value) if isinstance(value, (str, bytes)) else ("", None)
                    if audit is None or getattr(audit, "drop", None) is not None:
                        raise ResumeRefused(
                            f"refusing to resume: source {self.name!r}: {self._part_path(part)} at byte/row {int(seeks[i])} "
                            f"(record {int(records[i])}) no longer holds the document the checkpoint buffered; the file changed "
                            "since. Restore it, or start the run afresh")
                    out[i] = self._make_doc(text, part, int(rows[i]), _At(int(records[i]), int(seeks[i])))
            finally:
                reader.close()
        return out

    def _check_exhausted(self) -> None:
        if self._emitted:
            return
        if self._owned_rows:
            binary = self.stats.get(self.name, DROPPED_BINARY)
            if binary:  # not empty: undecodable (latin-1, UTF-16, a binary file named .txt)
                why = (f"{binary} of them are not UTF-8 text (more than {BINARY_INVALID_FRACTION:.0%} invalid UTF-8, "
                       f"{self.stats.get(self.name, INVALID_UTF8):,} invalid sequences): convert the files to UTF-8 "
                       "(e.g. iconv -f latin1 -t utf-8) or drop them from the source")
            else:
                why = f"have empty text in column {self.text_column!r}"
            raise SourceError(
                f"source {self.name!r}: all {self._owned_rows} rows of {self._describe()} {why}" if not binary else
                f"source {self.name!r}: no document left of the {self._owned_rows} rows of {self._describe()}: {why}",
                source=self.name,
                file=self._describe(),
            )
        if self._global_row == 0:  # strided readers of a tiny source may legitimately own nothing
            raise SourceError(
                f"source {self.name!r}: {self._describe()} contains no rows"
                + (f" (parts of shard {self.shard.index}/{self.shard.count})" if self.shard.count > 1 else ""),
                source=self.name,
                file=self._describe(),
            )


class _At:
    """A reader's position as ``_make_doc`` reads it, for a re-read row."""

    __slots__ = ("record", "row_start")

    def __init__(self, record: int, row_start: int) -> None:
        self.record, self.row_start = record, row_start
