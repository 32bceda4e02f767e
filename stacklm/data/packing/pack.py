"""Document-aware packing of tokenized documents into ``seq_len`` windows, and their collation to
the batch contract (the packing nodes are in ``stacklm.data.packing.nodes``).

Every document becomes the piece ``<bos> ids <eos>``. Two strategies:

* ``greedy`` — concatenate pieces and cut the stream every ``seq_len`` tokens. Documents that
  straddle a window edge are cut; only the very last window is padded; no token is dropped.
* ``best_fit`` — keep a bounded buffer of pieces and fill each window best-fit-decreasing
  (repeatedly place the largest buffered piece that still fits; the oldest among equal
  lengths). A piece that fits in a window is never cut; a window is padded only when no
  buffered piece fits its gap. Documents longer than a window are chunked: their leading
  full windows are emitted as they arrive, the tail goes into the buffer like any piece.

The batch contract (docs/architecture.md) is derived from the window tokens alone, the same way the shard
reader derives it on read, so what the packer writes needs no side data:

* a segment starts at the window start, at every ``<bos>``, right after every ``<eos>``, and
  where padding starts; so a chunk that does not begin with ``<bos>`` (the continuation of a
  cut document) is its own segment, wherever it sits;
* ``position_ids`` count from 0 at each segment start. A continuation fragment therefore also
  restarts at 0 rather than at its true offset in the document: its true offset may exceed
  ``seq_len`` and it can never attend to its earlier part (another window) anyway, and a value
  derivable from the tokens is what lets shards store tokens only. Padding is a segment too;
* ``targets[i] = window[i + 1]``, or ``-100`` where ``window[i + 1]`` is padding or starts a
  new segment. So the last token of a document predicting its ``<eos>`` is trained on, while
  ``<eos>`` → next ``<bos>`` (and a cut into a fragment) is not.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from stacklm.data.contract import PLANES, IGNORE_INDEX, contract_batch, contract_buffer, contract_planes, lean_batch
from stacklm.data.packing.origins import (  # WindowOrigin: also imported from here
    PIECE_FIELDS,
    WindowOrigin,
    content_by_source,
    load_origins,
    origins_state,
)
from stacklm.data.stats import StageStats

STRATEGIES = ("greedy", "best_fit")
DEFAULT_BUFFER_DOCS = 1000


# ---------------------------------------------------------------------------------------
# Packers (plain logic)
# ---------------------------------------------------------------------------------------
class _Packer:
    """Shared config, document wrapping and counters of both strategies.

    ``push(doc)`` returns the windows it completed (each an int32 array of ``seq_len``),
    ``finish()`` flushes the rest at the end of the stream.
    """

    strategy = ""

    def __init__(
        self, seq_len: int, bos_id: int, eos_id: int, pad_id: int, sources: Sequence[str] | None = None, provenance: bool = False,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (a window of seq_len tokens gives seq_len-1 targets), got {seq_len}")
        if len({bos_id, eos_id, pad_id}) != 3:
            raise ValueError(f"bos_id, eos_id and pad_id must differ, got {bos_id}, {eos_id}, {pad_id}")
        self.seq_len, self.bos_id, self.eos_id, self.pad_id = int(seq_len), int(bos_id), int(eos_id), int(pad_id)
        # Source tracking (``sources`` given): every emitted window gets its ``WindowOrigin`` in
        # ``self.origins``, in emission order, for the consumer to pop next to the window.
        self.track_sources = sources is not None
        if provenance and not self.track_sources:
            raise ValueError("provenance=True needs sources=[...] (each piece names its source)")
        self.provenance = bool(provenance)
        self._initial_sources = list(sources or [])
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.windows = 0
        self.docs = 0
        self.docs_cut = 0
        self.doc_tokens = 0  # tokens of the pieces, <bos>/<eos> included
        self.pad_tokens = 0
        self.stats = StageStats("pack")
        self.sources = list(self._initial_sources)
        self._source_index = {name: i for i, name in enumerate(self.sources)}
        self.origins: deque[WindowOrigin] = deque()

    def _source_of(self, doc: dict) -> int:
        """Index of ``doc``'s source in ``self.sources`` (a source not named up front is appended)."""
        name = doc.get("source", "?")
        index = self._source_index.get(name)
        if index is None:
            index = self._source_index[name] = len(self.sources)
            self.sources.append(name)
        return index

    def _new_origin(self, fill: int = -1) -> np.ndarray:
        return np.full(self.seq_len, fill, dtype=np.int16)

    def _wrap(self, doc: dict) -> np.ndarray:
        ids = np.asarray(doc["ids"])
        specials = (ids == self.bos_id) | (ids == self.eos_id) | (ids == self.pad_id)
        if specials.any():
            raise ValueError(
                f"doc {doc.get('doc_id')!r} of source {doc.get('source')!r} already contains the bos/eos/pad id "
                f"{int(ids[np.argmax(specials)])}; the packer adds those itself — encode untrusted text without special ids"
            )
        piece = self._wrapped(ids)
        self.docs += 1
        self.doc_tokens += len(piece)
        self.stats.add(doc.get("source", "?"), "kept")
        self.stats.add(doc.get("source", "?"), "tokens", len(ids))  # document tokens (the ledger's unit)
        return piece

    def _wrapped(self, ids: np.ndarray) -> np.ndarray:
        """``<bos> ids <eos>`` as int32, without counting (a re-read document, ``doc_refs``)."""
        piece = np.empty(len(ids) + 2, dtype=np.int32)
        piece[0], piece[1:-1], piece[-1] = self.bos_id, ids, self.eos_id
        return piece

    @staticmethod
    def _doc_where(doc: dict) -> tuple[int, int]:
        """``(file, record)`` of a document for provenance; ``(-1, -1)`` when its source does not say."""
        return int(doc.get("file", -1)), int(doc.get("record", -1))

    def buffered(self) -> dict[int, list[int]]:
        """Per source index, ``[docs, document tokens]`` pushed but not in an emitted window yet
        (a document counts where its ``<bos>`` is)."""
        raise NotImplementedError

    def _count_cut(self, doc: dict) -> None:
        self.docs_cut += 1
        self.stats.add(doc.get("source", "?"), "cut_across_windows")

    def summary(self) -> dict[str, Any]:
        total = self.windows * self.seq_len
        return {
            "strategy": self.strategy,
            "seq_len": self.seq_len,
            "windows": self.windows,
            "docs": self.docs,
            "docs_cut": self.docs_cut,
            "doc_tokens": self.doc_tokens,
            "pad_tokens": self.pad_tokens,
            "pad_fraction": self.pad_tokens / total if total else 0.0,
        }

    def _counter_state(self) -> dict[str, Any]:
        out = {
            "counters": np.array([self.windows, self.docs, self.docs_cut, self.doc_tokens, self.pad_tokens], dtype=np.int64),
            "stats": self.stats.to_dict(),
        }
        if self.track_sources:
            out["sources"] = list(self.sources)
            out["origins"] = origins_state(self.origins, self.seq_len)
        return out

    def _load_counters(self, state: dict[str, Any]) -> None:
        self.windows, self.docs, self.docs_cut, self.doc_tokens, self.pad_tokens = (int(x) for x in state["counters"])
        self.stats.load_dict(state["stats"])
        if self.track_sources:
            self.sources = list(state.get("sources", self.sources))
            self._source_index = {name: i for i, name in enumerate(self.sources)}
            self.origins = load_origins(state["origins"]) if "origins" in state else deque()

    def __call__(self, docs: Iterable[dict]) -> Iterator[np.ndarray]:
        for doc in docs:
            yield from self.push(doc)
        yield from self.finish()


class GreedyPacker(_Packer):
    """Concatenate ``<bos> doc <eos>`` pieces; cut every ``seq_len``; pad only the last window."""

    strategy = "greedy"

    def __init__(
        self, seq_len: int, bos_id: int, eos_id: int, pad_id: int, sources: Sequence[str] | None = None, provenance: bool = False,
    ) -> None:
        super().__init__(seq_len, bos_id, eos_id, pad_id, sources, provenance)
        self.reset()

    def reset(self) -> None:
        self._reset_counters()
        self._window = np.full(self.seq_len, self.pad_id, dtype=np.int32)
        self._fill = 0
        self._origin = self._new_origin()
        self._starts: list[tuple[int, int]] = []
        self._pieces: list[tuple[int, ...]] | None = [] if self.provenance else None

    def _emit(self) -> np.ndarray:
        window = self._window
        if self.track_sources:
            self.origins.append(WindowOrigin(self._origin, self._starts, self._pieces))
            self._origin, self._starts = self._new_origin(), []
            self._pieces = [] if self.provenance else None
        self._window = np.full(self.seq_len, self.pad_id, dtype=np.int32)
        self._fill = 0
        self.windows += 1
        return window

    def push(self, doc: dict) -> list[np.ndarray]:
        piece = self._wrap(doc)
        src = self._source_of(doc) if self.track_sources else -1
        where = self._doc_where(doc) if self.provenance else None
        if self._fill + len(piece) > self.seq_len:
            self._count_cut(doc)
        out = []
        pos, n, L = 0, len(piece), self.seq_len
        while pos < n:
            take = min(L - self._fill, n - pos)
            self._window[self._fill : self._fill + take] = piece[pos : pos + take]
            if self.track_sources:
                self._origin[self._fill : self._fill + take] = src
                if pos == 0:
                    self._starts.append((src, n))
                if where is not None:
                    self._pieces.append((src, *where, self._fill, self._fill + take, pos))
            self._fill += take
            pos += take
            if self._fill == L:
                out.append(self._emit())
        return out

    def finish(self) -> list[np.ndarray]:
        if self._fill == 0:
            return []
        self.pad_tokens += self.seq_len - self._fill
        return [self._emit()]  # already pad-filled past _fill

    def buffered(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for src, _ in self._starts:
            out.setdefault(src, [0, 0])[0] += 1
        if self._fill:
            for src, n in enumerate(content_by_source(self._window[: self._fill], self._origin[: self._fill], len(self.sources),
                                                      self.bos_id, self.eos_id).tolist()):
                if n:
                    out.setdefault(src, [0, 0])[1] += n
        return out

    def state(self) -> dict[str, Any]:
        out = {"partial": self._window[: self._fill].copy(), **self._counter_state()}
        if self.track_sources:
            out["partial_origin"] = self._origin[: self._fill].copy()
            out["partial_starts"] = np.array(self._starts, dtype=np.int64).reshape(-1, 2)
        if self.provenance:
            out["partial_pieces"] = np.array(self._pieces, dtype=np.int64).reshape(-1, len(PIECE_FIELDS))
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        self.reset()
        partial = np.asarray(state["partial"], dtype=np.int32)
        self._window[: len(partial)] = partial
        self._fill = len(partial)
        self._load_counters(state)
        if self.track_sources and "partial_origin" in state:
            self._origin[: self._fill] = np.asarray(state["partial_origin"], dtype=np.int16)
            self._starts = [(int(a), int(b)) for a, b in np.asarray(state["partial_starts"]).reshape(-1, 2)]
        if self.provenance and "partial_pieces" in state:
            self._pieces = [tuple(p) for p in np.asarray(state["partial_pieces"]).reshape(-1, len(PIECE_FIELDS)).tolist()]
        elif self.provenance and self._fill:  # saved without provenance: what fills the window so far is not known
            self._pieces = [(max(0, int(self._origin[0])), -1, -1, 0, self._fill, -1)]


class BestFitPacker(_Packer):
    """Best-fit-decreasing packing over a bounded buffer of ``buffer_docs`` pieces.

    Why not nanochat's best-fit (which crops a document to fill the last gap): the contract
    here is that a document that fits in a window is never cut; with a large enough buffer of
    real text the gaps get filled by short documents instead (padding well under 1% at 2048).
    The buffer is a sorted list of ``(length, arrival)`` keys, so each placement is a bisect.

    Bounded wait: best-fit-decreasing alone keeps short documents as gap fillers for as long
    as a longer piece fits, so with a large buffer they wait for most of a run (the stdlib
    corpus at 2048 with 256 pieces: p99 2,673 windows of 4,526 for documents shorter than the
    median, against 231 with the bound: ``bench/packing.py``) — a silent skew of the realized
    mix over time, i.e. of a short-document source's share per phase. So a piece that has waited ``max_wait``
    arrivals (default: ``buffer_docs``, one turnover of the buffer) is placed first in the next
    window, oldest first, before best-fit fills the rest. Deterministic in the arrival
    numbers the state already holds, so resume stays exact.
    """

    strategy = "best_fit"

    def __init__(
        self, seq_len: int, bos_id: int, eos_id: int, pad_id: int, buffer_docs: int = DEFAULT_BUFFER_DOCS,
        sources: Sequence[str] | None = None, provenance: bool = False, max_wait: int | None = None,
    ) -> None:
        super().__init__(seq_len, bos_id, eos_id, pad_id, sources, provenance)
        if buffer_docs < 1:
            raise ValueError(f"buffer_docs must be >= 1, got {buffer_docs}")
        self.buffer_docs = int(buffer_docs)
        self.max_wait = int(max_wait) if max_wait is not None else self.buffer_docs
        self.reset()

    def reset(self) -> None:
        self._reset_counters()
        self._keys: list[tuple[int, int]] = []  # sorted (length, arrival)
        self._pieces: dict[int, np.ndarray] = {}
        # arrival -> (source, document length; 0 for a continuation), + (file, record, offset in the
        # wrapped document) with provenance
        self._meta: dict[int, tuple[int, ...]] = {}
        self._arrivals = 0
        self._order: deque[int] = deque()  # arrivals in order (placed ones skipped lazily): the oldest first
        # With ``refs`` (a ``doc_refs.DocRefs``, set by ``PackNode``): arrival -> (the document's fields
        # without its ids, the piece's offset in the wrapped document), so the state holds positions
        self._docs: dict[int, tuple[dict, int]] = {}

    def __len__(self) -> int:
        return len(self._keys)

    refs = None  # a ``doc_refs.DocRefs``: the buffer is checkpointed by position (``PackNode`` sets it)

    def _add_piece(self, piece: np.ndarray, source: int = -1, doc_len: int = 0, where: tuple[int, ...] = (),
                   doc: dict | None = None, offset: int = 0) -> None:
        key = (len(piece), self._arrivals)
        self._arrivals += 1
        self._pieces[key[1]] = piece
        if self.refs is not None:
            self._docs[key[1]] = ({k: v for k, v in doc.items() if k != "ids"}, offset)
        self._order.append(key[1])
        if self.track_sources:
            self._meta[key[1]] = (source, doc_len, *where)
        insort(self._keys, key)

    def push(self, doc: dict) -> list[np.ndarray]:
        piece = self._wrap(doc)
        src = self._source_of(doc) if self.track_sources else -1
        doc_len = len(piece)
        out = []
        L = self.seq_len
        offset = 0  # of the buffered piece in the wrapped document
        if len(piece) > L:
            self._count_cut(doc)
            n_full = len(piece) // L
            out.extend(piece[k * L : (k + 1) * L].copy() for k in range(n_full))
            if self.track_sources:
                f, r = self._doc_where(doc) if self.provenance else (0, 0)
                self.origins.extend(
                    WindowOrigin(self._new_origin(src), [(src, doc_len)] if k == 0 else [],
                                 [(src, f, r, 0, L, k * L)] if self.provenance else None)
                    for k in range(n_full)
                )
            self.windows += n_full
            piece = piece[n_full * L :].copy()
            offset = n_full * L
            doc_len = 0  # the tail continues a document already counted where it started
        if len(piece):
            self._add_piece(piece, src, doc_len, (*self._doc_where(doc), offset) if self.provenance else (), doc, offset)
        while len(self._keys) >= self.buffer_docs:
            out.append(self._build_window())
        return out

    def _build_window(self) -> np.ndarray:
        L, keys = self.seq_len, self._keys
        window = np.full(L, self.pad_id, dtype=np.int32)
        origin = self._new_origin() if self.track_sources else None
        starts: list[tuple[int, int]] = []
        pieces: list[tuple[int, ...]] | None = [] if self.provenance else None
        fill = 0

        def place(arrival: int, length: int, at: int) -> int:
            """Put piece ``arrival`` at ``at``; the fill after it."""
            window[at : at + length] = self._pieces.pop(arrival)
            self._docs.pop(arrival, None)
            if origin is not None:
                src, doc_len, *where = self._meta.pop(arrival)
                origin[at : at + length] = src
                if doc_len:
                    starts.append((src, doc_len))
                if pieces is not None:
                    pieces.append((src, where[0], where[1], at, at + length, where[2]))
            return at + length

        order = self._order
        while order:  # pieces that waited max_wait arrivals go first, oldest first (bounded wait)
            arrival = order[0]
            if arrival not in self._pieces:
                order.popleft()  # placed already
                continue
            length = len(self._pieces[arrival])
            if arrival > self._arrivals - 1 - self.max_wait or fill + length > L:
                break
            order.popleft()
            keys.pop(bisect_left(keys, (length, arrival)))
            fill = place(arrival, length, fill)
        while keys and fill < L:
            idx = bisect_right(keys, (L - fill, 1 << 62)) - 1
            if idx < 0:
                break
            length = keys[idx][0]
            idx = bisect_left(keys, (length, -1))  # oldest piece of that length
            _, arrival = keys.pop(idx)
            fill = place(arrival, length, fill)
        self.pad_tokens += L - fill
        self.windows += 1
        if origin is not None:
            self.origins.append(WindowOrigin(origin, starts, pieces))
        return window

    def finish(self) -> list[np.ndarray]:
        out = []
        while self._keys:
            out.append(self._build_window())
        return out

    def buffered(self) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for arrival, piece in self._pieces.items():
            src, doc_len = self._meta[arrival][:2]
            slot = out.setdefault(src, [0, 0])
            slot[0] += 1 if doc_len else 0
            # A buffered piece is a whole ``<bos> ids <eos>`` (doc_len set) or the tail after a
            # long document's full windows (``<eos>`` only); ids hold no specials (``_wrap``), so
            # its content is its length less those, without a pass over the tokens: the
            # workers' summaries call this for all ~1000 buffered pieces every few batches.
            slot[1] += len(piece) - (2 if doc_len else 1)
        return out

    def state(self) -> dict[str, Any]:
        arrivals = np.array([a for _, a in self._keys], dtype=np.int64)
        pieces = [self._pieces[a] for a in arrivals.tolist()]
        out: dict[str, Any] = {"arrivals": arrivals, "next_arrival": self._arrivals, **self._counter_state()}
        if self.refs is not None:  # by position: each piece is its document's wrapped ids from an offset
            docs = [self._docs[a] for a in arrivals.tolist()]
            offsets = [off for _, off in docs]
            out["pieces"] = self.refs.save([d for d, _ in docs], payloads=pieces, extra=offsets,
                                           lengths=[off + len(p) - 2 for off, p in zip(offsets, pieces)])  # wrapped: <bos> ids <eos>
        else:
            out["lengths"] = np.array([len(p) for p in pieces], dtype=np.int64)
            out["tokens"] = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        if self.track_sources:
            width = 5 if self.provenance else 2
            out["piece_meta"] = np.array([self._meta[a] for a in arrivals.tolist()], dtype=np.int64).reshape(-1, width)
        return out

    def load_state(self, state: dict[str, Any]) -> None:
        self.reset()
        arrivals = np.asarray(state["arrivals"]).tolist()
        if "pieces" in state:  # saved by position (``doc_refs``)
            if self.refs is None:
                raise ValueError("a packer state saved by position needs the graph's DocRefs to load")
            docs, pieces, offsets = self.refs.load(state["pieces"], payload=lambda doc, off: self._wrapped(doc["ids"])[off:])
            for arrival, doc, piece, off in zip(arrivals, docs, pieces, offsets):
                self._pieces[arrival] = np.asarray(piece, dtype=np.int32)
                self._docs[arrival] = ({k: v for k, v in doc.items() if k != "ids"}, off)
        else:
            tokens = np.asarray(state["tokens"], dtype=np.int32)
            bounds = np.concatenate([[0], np.cumsum(state["lengths"])]).astype(np.int64)
            for i, arrival in enumerate(arrivals):
                self._pieces[arrival] = tokens[bounds[i] : bounds[i + 1]].copy()
        for arrival in arrivals:
            self._keys.append((len(self._pieces[arrival]), arrival))
        self._keys.sort()
        self._order = deque(sorted(self._pieces))
        self._arrivals = int(state["next_arrival"])
        self._load_counters(state)
        if self.track_sources and "piece_meta" in state:
            arrivals = np.asarray(state["arrivals"])
            meta = np.asarray(state["piece_meta"], dtype=np.int64).reshape(len(arrivals), -1) if len(arrivals) else np.zeros((0, 5))
            if self.provenance and meta.shape[1] < 5:  # saved without provenance: file, record, offset not known (-1)
                meta = np.concatenate([meta, np.full((len(meta), 5 - meta.shape[1]), -1, dtype=np.int64)], axis=1)
            for arrival, row in zip(np.asarray(state["arrivals"]).tolist(), meta.tolist()):
                self._meta[arrival] = tuple(int(x) for x in row[: 5 if self.provenance else 2])


def make_packer(
    strategy: str, seq_len: int, bos_id: int, eos_id: int, pad_id: int, buffer_docs: int = DEFAULT_BUFFER_DOCS,
    sources: Sequence[str] | None = None, provenance: bool = False,
) -> GreedyPacker | BestFitPacker:
    if strategy == "greedy":
        return GreedyPacker(seq_len, bos_id, eos_id, pad_id, sources, provenance)
    if strategy == "best_fit":
        return BestFitPacker(seq_len, bos_id, eos_id, pad_id, buffer_docs, sources, provenance)
    raise ValueError(f"unknown packing strategy {strategy!r}; choose one of {STRATEGIES}")


def pack_greedy(docs: Iterable[dict], seq_len: int, bos_id: int, eos_id: int, pad_id: int) -> Iterator[np.ndarray]:
    """Windows of ``seq_len`` tokens from the greedy strategy."""
    return GreedyPacker(seq_len, bos_id, eos_id, pad_id)(docs)


def pack_best_fit(
    docs: Iterable[dict], seq_len: int, bos_id: int, eos_id: int, pad_id: int, buffer_docs: int = DEFAULT_BUFFER_DOCS
) -> Iterator[np.ndarray]:
    """Windows of ``seq_len`` tokens from the best-fit strategy."""
    return BestFitPacker(seq_len, bos_id, eos_id, pad_id, buffer_docs)(docs)


# ---------------------------------------------------------------------------------------
# Batch contract
# ---------------------------------------------------------------------------------------
def segment_layout(windows: np.ndarray, bos_id: int, eos_id: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-token segment index and offset inside the segment for a (B, L) array of windows.

    Vectorised over the whole batch (no per-document Python). See the module docstring for
    where segments start.
    """
    w = np.asarray(windows)
    if w.ndim != 2:
        raise ValueError(f"expected a (batch, seq_len) array of windows, got shape {w.shape}")
    B, L = w.shape
    is_pad = w == pad_id
    start = w == bos_id
    start[:, 1:] |= w[:, :-1] == eos_id
    start[:, 1:] |= is_pad[:, 1:] != is_pad[:, :-1]
    start[:, 0] = True
    seg = np.cumsum(start, axis=1, dtype=np.int64) - 1
    idx = np.broadcast_to(np.arange(L, dtype=np.int64), (B, L))
    seg_first = np.maximum.accumulate(np.where(start, idx, 0), axis=1)
    return seg, idx - seg_first


def collate(windows: Sequence[np.ndarray] | np.ndarray, bos_id: int, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Windows (each ``seq_len`` tokens) → the batch contract, ``torch.long`` of shape (B, seq_len-1)."""
    w = np.asarray(windows) if isinstance(windows, np.ndarray) else np.stack(windows)
    w = w.astype(np.int64, copy=False)
    if w.ndim != 2 or w.shape[1] < 2:
        raise ValueError(f"expected windows of shape (batch, seq_len >= 2), got {w.shape}")
    seg, pos = segment_layout(w, bos_id, eos_id, pad_id)
    out = contract_buffer(w.shape[0], w.shape[1] - 1)
    planes = contract_planes(out)
    planes.input_ids[:] = w[:, :-1]
    planes.targets[:] = w[:, 1:]
    planes.targets[(seg[:, 1:] != seg[:, :-1]) | (w[:, 1:] == pad_id)] = IGNORE_INDEX
    planes.position_ids[:] = pos[:, :-1]
    planes.seq_ids[:] = seg[:, :-1]
    return contract_batch(out)


def window_to_example(window: np.ndarray, bos_id: int, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    """One window → the batch contract for one row, each tensor of shape (seq_len-1,)."""
    return {k: v[0] for k, v in collate(np.asarray(window)[None], bos_id, eos_id, pad_id).items()}


class Collate:
    """Picklable ``collate`` bound to the special ids (for ``Mapper``/``ParallelMapper``);
    ``planes="lean"`` ships the lean planes instead (``stacklm.data.contract.lean_batch``)."""

    def __init__(self, bos_id: int, eos_id: int, pad_id: int, planes: str = "full") -> None:
        if planes not in PLANES:
            raise ValueError(f"Collate: planes must be one of {PLANES}, got {planes!r}")
        self.bos_id, self.eos_id, self.pad_id, self.planes = bos_id, eos_id, pad_id, planes

    def __call__(self, windows: Sequence[np.ndarray]) -> dict[str, Any]:
        if self.planes == "lean":
            return lean_batch(np.stack(windows), self.bos_id, self.eos_id, self.pad_id)
        return collate(windows, self.bos_id, self.eos_id, self.pad_id)
