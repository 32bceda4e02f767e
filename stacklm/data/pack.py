"""Document-aware packing of tokenized documents into ``seq_len`` windows, and their batches.

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
from torchdata.nodes import BaseNode, Batcher, Mapper

from stacklm.data.contract import IGNORE_INDEX, contract_batch, contract_buffer, contract_planes
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

    def __init__(self, seq_len: int, bos_id: int, eos_id: int, pad_id: int) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2 (a window of seq_len tokens gives seq_len-1 targets), got {seq_len}")
        if len({bos_id, eos_id, pad_id}) != 3:
            raise ValueError(f"bos_id, eos_id and pad_id must differ, got {bos_id}, {eos_id}, {pad_id}")
        self.seq_len, self.bos_id, self.eos_id, self.pad_id = int(seq_len), int(bos_id), int(eos_id), int(pad_id)
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.windows = 0
        self.docs = 0
        self.docs_cut = 0
        self.doc_tokens = 0  # tokens of the pieces, <bos>/<eos> included
        self.pad_tokens = 0
        self.stats = StageStats("pack")

    def _wrap(self, doc: dict) -> np.ndarray:
        ids = np.asarray(doc["ids"])
        specials = (ids == self.bos_id) | (ids == self.eos_id) | (ids == self.pad_id)
        if specials.any():
            raise ValueError(
                f"doc {doc.get('doc_id')!r} of source {doc.get('source')!r} already contains the bos/eos/pad id "
                f"{int(ids[np.argmax(specials)])}; the packer adds those itself — encode untrusted text without special ids"
            )
        piece = np.empty(len(ids) + 2, dtype=np.int32)
        piece[0] = self.bos_id
        piece[1:-1] = ids
        piece[-1] = self.eos_id
        self.docs += 1
        self.doc_tokens += len(piece)
        self.stats.add(doc.get("source", "?"), "kept")
        return piece

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
        return {
            "counters": np.array([self.windows, self.docs, self.docs_cut, self.doc_tokens, self.pad_tokens], dtype=np.int64),
            "stats": self.stats.to_dict(),
        }

    def _load_counters(self, state: dict[str, Any]) -> None:
        self.windows, self.docs, self.docs_cut, self.doc_tokens, self.pad_tokens = (int(x) for x in state["counters"])
        self.stats.load_dict(state["stats"])

    def __call__(self, docs: Iterable[dict]) -> Iterator[np.ndarray]:
        for doc in docs:
            yield from self.push(doc)
        yield from self.finish()


class GreedyPacker(_Packer):
    """Concatenate ``<bos> doc <eos>`` pieces; cut every ``seq_len``; pad only the last window."""

    strategy = "greedy"

    def __init__(self, seq_len: int, bos_id: int, eos_id: int, pad_id: int) -> None:
        super().__init__(seq_len, bos_id, eos_id, pad_id)
        self.reset()

    def reset(self) -> None:
        self._reset_counters()
        self._window = np.full(self.seq_len, self.pad_id, dtype=np.int32)
        self._fill = 0

    def push(self, doc: dict) -> list[np.ndarray]:
        piece = self._wrap(doc)
        if self._fill + len(piece) > self.seq_len:
            self._count_cut(doc)
        out = []
        pos, n, L = 0, len(piece), self.seq_len
        while pos < n:
            take = min(L - self._fill, n - pos)
            self._window[self._fill : self._fill + take] = piece[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == L:
                out.append(self._window)
                self.windows += 1
                self._window = np.full(L, self.pad_id, dtype=np.int32)
                self._fill = 0
        return out

    def finish(self) -> list[np.ndarray]:
        if self._fill == 0:
            return []
        window = self._window  # already pad-filled past _fill
        self.pad_tokens += self.seq_len - self._fill
        self.windows += 1
        self._window = np.full(self.seq_len, self.pad_id, dtype=np.int32)
        self._fill = 0
        return [window]

    def state(self) -> dict[str, Any]:
        return {"partial": self._window[: self._fill].copy(), **self._counter_state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.reset()
        partial = np.asarray(state["partial"], dtype=np.int32)
        self._window[: len(partial)] = partial
        self._fill = len(partial)
        self._load_counters(state)


class BestFitPacker(_Packer):
    """Best-fit-decreasing packing over a bounded buffer of ``buffer_docs`` pieces.

    Why not nanochat's best-fit (which crops a document to fill the last gap): the contract
    here is that a document that fits in a window is never cut; with a large enough buffer of
    real text the gaps get filled by short documents instead (padding well under 1% at 2048).
    The buffer is a sorted list of ``(length, arrival)`` keys, so each placement is a bisect.
    """

    strategy = "best_fit"

    def __init__(self, seq_len: int, bos_id: int, eos_id: int, pad_id: int, buffer_docs: int = DEFAULT_BUFFER_DOCS) -> None:
        super().__init__(seq_len, bos_id, eos_id, pad_id)
        if buffer_docs < 1:
            raise ValueError(f"buffer_docs must be >= 1, got {buffer_docs}")
        self.buffer_docs = int(buffer_docs)
        self.reset()

    def reset(self) -> None:
        self._reset_counters()
        self._keys: list[tuple[int, int]] = []  # sorted (length, arrival)
        self._pieces: dict[int, np.ndarray] = {}
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self._keys)

    def _add_piece(self, piece: np.ndarray) -> None:
        key = (len(piece), self._arrivals)
        self._arrivals += 1
        self._pieces[key[1]] = piece
        insort(self._keys, key)

    def push(self, doc: dict) -> list[np.ndarray]:
        piece = self._wrap(doc)
        out = []
        L = self.seq_len
        if len(piece) > L:
            self._count_cut(doc)
            n_full = len(piece) // L
            out.extend(piece[k * L : (k + 1) * L].copy() for k in range(n_full))
            self.windows += n_full
            piece = piece[n_full * L :].copy()
        if len(piece):
            self._add_piece(piece)
        while len(self._keys) >= self.buffer_docs:
            out.append(self._build_window())
        return out

    def _build_window(self) -> np.ndarray:
        L, keys = self.seq_len, self._keys
        window = np.full(L, self.pad_id, dtype=np.int32)
        fill = 0
        while keys:
            idx = bisect_right(keys, (L - fill, 1 << 62)) - 1
            if idx < 0:
                break
            length = keys[idx][0]
            idx = bisect_left(keys, (length, -1))  # oldest piece of that length
            _, arrival = keys.pop(idx)
            window[fill : fill + length] = self._pieces.pop(arrival)
            fill += length
            if fill == L:
                break
        self.pad_tokens += L - fill
        self.windows += 1
        return window

    def finish(self) -> list[np.ndarray]:
        out = []
        while self._keys:
            out.append(self._build_window())
        return out

    def state(self) -> dict[str, Any]:
        arrivals = np.array([a for _, a in self._keys], dtype=np.int64)
        pieces = [self._pieces[a] for a in arrivals.tolist()]
        lengths = np.array([len(p) for p in pieces], dtype=np.int64)
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        return {
            "tokens": tokens,
            "lengths": lengths,
            "arrivals": arrivals,
            "next_arrival": self._arrivals,
            **self._counter_state(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.reset()
        tokens = np.asarray(state["tokens"], dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum(state["lengths"])]).astype(np.int64)
        for i, arrival in enumerate(np.asarray(state["arrivals"]).tolist()):
            self._pieces[arrival] = tokens[offsets[i] : offsets[i + 1]].copy()
            self._keys.append((int(offsets[i + 1] - offsets[i]), arrival))
        self._keys.sort()
        self._arrivals = int(state["next_arrival"])
        self._load_counters(state)


def make_packer(
    strategy: str, seq_len: int, bos_id: int, eos_id: int, pad_id: int, buffer_docs: int = DEFAULT_BUFFER_DOCS
) -> GreedyPacker | BestFitPacker:
    if strategy == "greedy":
        return GreedyPacker(seq_len, bos_id, eos_id, pad_id)
    if strategy == "best_fit":
        return BestFitPacker(seq_len, bos_id, eos_id, pad_id, buffer_docs)
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
    """Picklable ``collate`` bound to the special ids (for ``Mapper``/``ParallelMapper``)."""

    def __init__(self, bos_id: int, eos_id: int, pad_id: int) -> None:
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id

    def __call__(self, windows: Sequence[np.ndarray]) -> dict[str, torch.Tensor]:
        return collate(windows, self.bos_id, self.eos_id, self.pad_id)


# ---------------------------------------------------------------------------------------
# Nodes
# ---------------------------------------------------------------------------------------
class PackNode(BaseNode[np.ndarray]):
    """Yields packed windows (int32 arrays of ``seq_len``) one at a time.

    State: the source's state, the packer's buffer (one concatenated token array + lengths +
    arrival numbers, or the partial greedy window), the windows completed but not yet yielded
    (one 2-D array) and the counters, so a restored node continues bit for bit.
    """

    SOURCE_KEY = "source"

    def __init__(
        self,
        source: BaseNode[dict],
        seq_len: int,
        strategy: str,
        bos_id: int,
        eos_id: int,
        pad_id: int,
        buffer_docs: int = DEFAULT_BUFFER_DOCS,
    ) -> None:
        super().__init__()
        self.source = source
        self.packer = make_packer(strategy, seq_len, bos_id, eos_id, pad_id, buffer_docs)
        self._ready: deque[np.ndarray] = deque()
        self._source_done = False

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._ready = deque()
        if initial_state is None:
            self.source.reset()
            self.packer.reset()
            self._source_done = False
            return
        self.source.reset(initial_state[self.SOURCE_KEY])
        self.packer.load_state(initial_state["packer"])
        self._ready.extend(np.asarray(initial_state["ready"], dtype=np.int32).copy())
        self._source_done = bool(initial_state["source_done"])

    def next(self) -> np.ndarray:
        while not self._ready:
            if self._source_done:
                raise StopIteration
            try:
                doc = next(self.source)
            except StopIteration:
                self._source_done = True
                self._ready.extend(self.packer.finish())
                continue
            self._ready.extend(self.packer.push(doc))
        return self._ready.popleft()

    def get_state(self) -> dict[str, Any]:
        ready = np.stack(self._ready) if self._ready else np.zeros((0, self.packer.seq_len), dtype=np.int32)
        return {
            self.SOURCE_KEY: self.source.state_dict(),
            "packer": self.packer.state(),
            "ready": ready,
            "source_done": self._source_done,
        }

    def summary(self) -> dict[str, Any]:
        return self.packer.summary()


def batch_node(pack_node: PackNode, batch_size: int, drop_last: bool = True) -> BaseNode[dict[str, torch.Tensor]]:
    """``Batcher`` + ``collate``: a node of batch-contract dicts (state handled by the torchdata nodes)."""
    p = pack_node.packer
    return Mapper(Batcher(pack_node, batch_size, drop_last=drop_last), Collate(p.bos_id, p.eos_id, p.pad_id))
