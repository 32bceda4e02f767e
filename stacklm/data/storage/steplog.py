"""The step log: which rows each global step of a training run trained on, written as it trains.

Why a log and not a replay: a loss spike is asked about after the fact ("which documents were
in step 41,200?"), often after a crash and a resume on another shape. Re-deriving the batches
would mean re-running the pipes from a snapshot; the log answers from a few bytes per row:

* shards mode: the global row index of each row of the batch (``stacklm inspect`` then reads
  the row's tokens and pieces from the prebuild's shards and provenance side files);
* stream mode: each row's document pieces (source, file, record, token range in the row,
  offset in the document: ``stacklm.data.storage.provenance.PIECE_FIELDS``, carried on the batch by
  the packer) and a CRC-32 of the row's window, so ``stacklm inspect --step`` can rebuild the
  tokens from the source files and check them;
* sft and preference modes: the same pieces, one per conversation packed in the row (sft) or the
  row's pair (preference: the chosen side's range), and the CRC of the row's loss-tagged ids
  (preference: the pair's), so ``stacklm inspect --step`` names the conversations a step trained
  on and renders them again to check.

Layout: ``<root>/<generation>/`` per fit attempt (a generation: a fresh start or a resume),
named by its start time, so they sort in the order they ran. In it, ``meta.json`` (rank 0:
the mode, the shape, the data and tokenizer it read) and one ``rank-NNNNN.frames`` per rank,
each rank writing what its own loader delivered. A frame is ``MAGIC``, a little-endian
uint64 length and a compressed npz of up to ``FRAME_BATCHES`` batches (columns, so the
sequential record numbers and zero offsets compress to about a byte each); it is written when
full, every ``FRAME_SECONDS`` seconds, at every checkpoint and when the fit ends, so a crash
loses at most the batches since the last of those (a killed run's torn last frame is skipped).

Which generation answers step ``S``: the newest one that logged it. A resume from a
checkpoint at step 100 of a run that crashed at step 150 re-trains steps 100..150; its
records of those steps supersede the crashed run's (``find_step``).

The rows are those the loader handed to the step, in the main process, with the trainer's
``global_step`` at that moment (Lightning does not fetch ahead of a loader with a length), so
with gradient accumulation a step holds several batches per rank (``batch``: the rank's batch
index in its epoch).

A file format beside the prebuild's provenance side files (its columns are theirs), so here in
data/storage/: the datamodule's loaders write it and ``stacklm inspect`` (below the datamodule)
reads it.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import struct
import time
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.atomic import atomic_write_text
from stacklm.data.storage.datafiles import read_data_bytes
from stacklm.data.storage.provenance import columns_to_pieces, row_columns
from stacklm.errors import DataError

FORMAT = "stacklm-steplog/1"
DIR_NAME = "steplog"
META = "meta.json"
MAGIC = b"SLF1"
FRAME_BATCHES = 64
FRAME_SECONDS = 30.0
_HEADER = struct.Struct("<4sQ")
_BATCH_COLUMNS = ("step", "epoch", "batch", "n_rows", "n_pad", "skipped")


def new_generation() -> str:
    """A generation name, the same on every rank (rank 0's, broadcast under DDP; a collective:
    call it on every rank). UTC start time, so generations sort in the order they ran."""
    name = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ") + f"-{os.getpid()}"
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover
        return name
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    return name


UNKNOWN = 2**32 - 1  # a piece's file, record or offset that a state saved without provenance did not keep


def _stored(pieces: Sequence[Sequence[int]] | None) -> list[tuple[int, ...]]:
    """A row's pieces as stored: unknown (``None``, or -1 fields of a state restored from a
    checkpoint written without provenance) kept as ``UNKNOWN``, never as a wrong number."""
    if pieces is None:
        return []
    return [tuple(UNKNOWN if v < 0 and k in (1, 2, 5) else v for k, v in enumerate(p)) for p in pieces]


def _uint(values: Sequence[int] | np.ndarray, dtype=np.uint32) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).astype(dtype)


class StepLogWriter:
    """One rank's writer: ``add`` per batch handed to the step, frames as described above.

    ``step_of``: the trainer's global step now (``None``: this writer counts its batches).
    Bytes written are counted (``bytes``), so the overhead is measurable against the token
    bytes delivered (``bench/steplog.py``)."""

    def __init__(self, directory: str | Path, rank: int, *, meta: Mapping[str, Any] | None = None,
                 step_of: Callable[[], int] | None = None, frame_batches: int = FRAME_BATCHES,
                 frame_seconds: float = FRAME_SECONDS) -> None:
        self.directory = Path(directory)
        self.meta = dict(meta) if meta is not None else None  # written with the first frame: a run that never trains leaves nothing
        self.path = self.directory / f"rank-{int(rank):05d}.frames"
        self.step_of = step_of
        self.frame_batches, self.frame_seconds = int(frame_batches), float(frame_seconds)
        self.bytes = 0
        self.batches = 0
        self._kind = "pieces"  # what the batches carry: "rows" (shards mode) or "pieces" (stream mode)
        self._file = None
        self._reset_frame()
        atexit.register(self.close)  # a run that dies by an exception still writes its last frame

    def _reset_frame(self) -> None:
        self._batch_cols: dict[str, list[int]] = {k: [] for k in _BATCH_COLUMNS}
        self._rows: list[int] = []  # shards mode: global row indices
        self._pieces: list[list[tuple[int, ...]]] = []  # stream mode: each row's pieces
        self._crc: list[int] = []
        self._since = time.monotonic()

    def _step(self) -> int:
        return int(self.step_of()) if self.step_of is not None else self.batches

    def _add(self, epoch: int, batch: int, n_rows: int, n_pad: int, step: int | None = None, skipped: bool = False) -> None:
        for key, value in zip(_BATCH_COLUMNS, (self._step() if step is None else step, epoch, batch, n_rows, n_pad, skipped)):
            self._batch_cols[key].append(int(value))
        self.batches += 1
        if len(self._batch_cols["step"]) >= self.frame_batches or time.monotonic() - self._since >= self.frame_seconds:
            self.flush()

    def add_rows(self, epoch: int, batch: int, rows: np.ndarray, n_pad: int) -> None:
        """Shards mode: a batch of global rows ``rows`` (then ``n_pad`` padding rows)."""
        self._kind = "rows"
        self._rows.extend(np.asarray(rows, dtype=np.int64).tolist())
        self._add(epoch, batch, len(rows), n_pad)

    def add_skipped(self, step: int, epoch: int, rows: np.ndarray) -> None:
        """Shards mode: the rows global step ``step`` would have trained, passed over by
        ``skip_steps`` (all ranks' rows in one record, ``batch`` -1, not counted as trained)."""
        self._kind = "rows"
        self._rows.extend(np.asarray(rows, dtype=np.int64).tolist())
        self._add(epoch, -1, len(rows), 0, step=step, skipped=True)
        self.batches -= 1  # not a batch handed to a step

    def add_pieces(self, epoch: int, batch: int, pieces: Sequence[Sequence[tuple[int, ...]] | None], crc: Sequence[int],
                   n_pad: int) -> None:
        """Stream mode: each real row's pieces (``None``: not known) and window CRC (then
        ``n_pad`` padding rows)."""
        self._kind = "pieces"
        self._pieces.extend(pieces)
        self._crc.extend(crc)
        self._add(epoch, batch, len(pieces), n_pad)

    def flush(self) -> None:
        """Write the batches added since the last frame as one frame (no-op when none)."""
        if not self._batch_cols["step"]:
            return
        cols = {k: np.asarray(v, dtype=np.int64) for k, v in self._batch_cols.items()}
        if self._kind == "rows":
            cols["rows"] = np.asarray(self._rows, dtype=np.int64)
        else:
            known = [p is not None for p in self._pieces]
            try:
                cols.update(row_columns([p if p is not None else [] for p in self._pieces]))
            except ValueError:  # unknown fields (-1): a state restored from a checkpoint without provenance
                cols.update(row_columns([_stored(p) for p in self._pieces]))
            cols["crc"] = _uint(self._crc)
            if not all(known):
                cols["known"] = np.asarray(known, dtype=np.uint8)
        buf = io.BytesIO()
        np.savez_compressed(buf, **cols)
        data = buf.getvalue()
        if self._file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            if self.meta is not None:
                atomic_write_text(self.directory / META, json.dumps({"format": FORMAT, **self.meta}, indent=1, sort_keys=True))
            self._file = open(self.path, "ab")  # noqa: SIM115 - held open for the run; closed in close()
        self._file.write(_HEADER.pack(MAGIC, len(data)) + data)
        self._file.flush()
        self.bytes += _HEADER.size + len(data)
        self._reset_frame()

    def close(self) -> None:
        atexit.unregister(self.close)
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------
def read_frames(path: str | Path) -> Iterator[dict[str, np.ndarray]]:
    """The frames of one rank's file, in order; stops at a torn last frame (a killed run)."""
    data = read_data_bytes(path)  # a FIFO or a link out of the run folder: refused, never opened
    pos = 0
    while pos + _HEADER.size <= len(data):
        magic, length = _HEADER.unpack_from(data, pos)
        if magic != MAGIC:
            raise DataError(f"{path}: not a step-log frame at byte {pos} (expected {MAGIC!r}, found {magic!r}): the file "
                               "is damaged or is not a step log; move it away to read the rest of the log")
        if pos + _HEADER.size + length > len(data):
            return  # the torn last frame of a killed run
        frame = data[pos + _HEADER.size : pos + _HEADER.size + length]
        try:
            with np.load(io.BytesIO(frame), allow_pickle=False) as z:
                yield {k: z[k] for k in z.files}
        except (ValueError, OSError, KeyError, zipfile.BadZipFile) as e:
            from stacklm.data.storage.statefile import load_error_detail

            raise DataError(f"{path}: the frame at byte {pos} is damaged ({load_error_detail(e, frame)}); move the file away "
                               "to read the rest of the log") from None
        pos += _HEADER.size + length


def frame_records(frame: Mapping[str, np.ndarray]) -> Iterator[dict[str, Any]]:
    """A frame's batches: ``step``, ``epoch``, ``batch``, ``n_pad`` and either ``rows`` (shards)
    or ``pieces`` (per row, ``PIECE_FIELDS`` tuples) and ``crc`` (stream)."""
    n_rows = frame["n_rows"].astype(np.int64)
    first = np.concatenate([[0], np.cumsum(n_rows)])
    ptr = pieces = None
    if "row_pieces" in frame:
        ptr, pieces = columns_to_pieces(frame)
    for i in range(len(n_rows)):
        rec = {k: int(frame[k][i]) for k in ("step", "epoch", "batch", "n_pad")}
        rec["skipped"] = bool(frame["skipped"][i]) if "skipped" in frame else False  # skip_steps (older logs: none)
        lo, hi = int(first[i]), int(first[i + 1])
        if "rows" in frame:
            rec["rows"] = frame["rows"][lo:hi].tolist()
        else:
            known = frame["known"][lo:hi].tolist() if "known" in frame else [1] * (hi - lo)
            rec["pieces"] = [[[None if v == UNKNOWN and k in (1, 2, 5) else v for k, v in enumerate(p)]
                              for p in pieces[ptr[r] : ptr[r + 1]].tolist()] if known[r - lo] else None
                             for r in range(lo, hi)]
            rec["crc"] = frame["crc"][lo:hi].tolist()
        yield rec


def resolve_root(path: str | Path) -> Path:
    """The step-log root from what a user passes: the root itself, or a run directory holding
    ``steplog/`` (one generation's folder is taken by ``find_step`` as that run alone)."""
    p = Path(path)
    for candidate in (p / DIR_NAME, p):
        if candidate.is_dir() and any((g / META).is_file() for g in candidate.iterdir() if g.is_dir()):
            return candidate
    raise DataError(
        f"{p}: no step log here (looked for {p / DIR_NAME}/<run>/{META}); a shards- or stream-mode fit writes one under "
        f"<trainer default_root_dir>/{DIR_NAME} unless StackDataModule(step_log=False); pass that directory"
    )


def generations(root: str | Path) -> list[Path]:
    """The generations under ``root``, oldest first."""
    return sorted(g for g in Path(root).iterdir() if g.is_dir() and (g / META).is_file())


def read_meta(generation: Path) -> dict[str, Any]:
    try:
        meta = json.loads(read_data_bytes(generation / META))
    except (ValueError, OSError) as e:
        raise DataError(f"{generation / META}: unreadable ({type(e).__name__}: {e}); it is not a step-log run folder "
                           "(move it away)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise DataError(f"{generation / META}: format {found!r}, this stacklm reads {FORMAT!r}")
    return meta


def find_step(root: str | Path, step: int) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    """``(generation, its meta, the records of global step `step` of every rank, by rank then
    batch)``. The run that owns step ``S`` is the newest generation that started at or before
    ``S`` (a resume from step ``k`` supersedes every older run's steps from ``k`` on: those were
    trained, but the run's history continued from the checkpoint instead). When the owner did
    not log ``S`` (it stopped or was killed first), that is an error naming what it logged."""
    if (Path(root) / META).is_file():  # one run's folder: that run's records, superseded or not
        gen = Path(root)
        meta = read_meta(gen)
        lo, hi, records = _scan(gen, step)
        if not records:
            raise DataError(f"{gen}: this run did not log global step {step} (it logged steps "
                               f"{'none' if lo is None else f'{lo}..{hi}'})")
        return gen, meta, records
    root = resolve_root(root)
    spans: list[tuple[Path, dict[str, Any], int, int | None, list[dict[str, Any]]]] = []
    for gen in generations(root):
        lo, hi, records = _scan(gen, step)
        meta = read_meta(gen)
        start = meta.get("start_step", lo)
        if start is not None:
            spans.append((gen, meta, int(start), hi, records))
    owners = [span for span in spans if span[2] <= step]
    if not owners:
        raise DataError(f"{root}: no run logged global step {step} (runs: {_describe(spans)})")
    gen, meta, start, hi, records = owners[-1]
    if not records:
        older = [g for g, _, s, h, _ in spans if g != gen and h is not None and s <= step <= h]
        raise DataError(
            f"{root}: global step {step} belongs to run {gen.name} (the newest to start at or before it, at step {start}), "
            f"which logged steps {start}..{hi if hi is not None else '(none)'} and stopped before it"
            + (f"; {', '.join(str(g) for g in older)} trained it before being superseded by that resume (pass that folder to "
               "read what it trained)" if older else "")
            + f". A run killed mid-way loses the batches since its last frame (at most {FRAME_BATCHES} per rank or "
            f"{FRAME_SECONDS:.0f} s)."
        )
    return gen, meta, records


def _scan(gen: Path, step: int) -> tuple[int | None, int | None, list[dict[str, Any]]]:
    """One pass over a run's frames: the lowest and highest step it logged, and the records of
    ``step`` of every rank, by rank then batch."""
    lo = hi = None
    records: list[dict[str, Any]] = []
    for path in sorted(gen.glob("rank-*.frames")):
        rank = int(path.stem.split("-")[1])
        for frame in read_frames(path):
            steps = frame["step"]
            if len(steps):
                lo = int(steps.min()) if lo is None else min(lo, int(steps.min()))
                hi = int(steps.max()) if hi is None else max(hi, int(steps.max()))
            if step in steps:
                records.extend({"rank": rank, **r} for r in frame_records(frame) if r["step"] == step)
    return lo, hi, sorted(records, key=lambda r: (r["rank"], r["epoch"], r["batch"]))


def _describe(spans) -> str:
    return ", ".join(f"{g.name} steps {s}..{h}" for g, _, s, h, _ in spans) or "none"
