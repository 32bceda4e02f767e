"""Where each token of a packed window came from: ``WindowOrigin`` (per token its source, the
documents starting in the window, and with provenance each document piece), its compact state
form, and the per-source counts derived from it (what a batch delivers, document tokens).

Kept beside ``pack.py`` (which fills it) so the packers stay one job: placing tokens.
"""

from __future__ import annotations

import zlib
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from stacklm.data.storage.provenance import PIECE_FIELDS

__all__ = ["PIECE_FIELDS", "WindowOrigin", "content_by_source", "delivery_counts", "load_origins", "origins_state", "window_crc"]


class WindowOrigin(NamedTuple):
    """Side data of one packed window (when the packer tracks sources): ``origin[i]`` is the
    index of the source of token ``i`` (-1 for padding), and ``starts`` lists ``(source, length)``
    of each document whose ``<bos>`` is in this window (length in tokens, ``<bos>``/``<eos>``
    included). What lets a batch say exactly what it delivers (``delivery_counts``).

    ``pieces`` (packers built with ``provenance=True``): one row per document piece in the
    window, ``PIECE_FIELDS``: source index, file (part index in the source), record (0-based row
    in that file), ``[row_start, row_end)`` in the window and the piece's offset in the wrapped
    document ``<bos> ids <eos>`` (``stacklm.data.storage.provenance``)."""

    origin: np.ndarray
    starts: list[tuple[int, int]]
    pieces: list[tuple[int, int, int, int, int, int]] | None = None


def origins_state(origins: Sequence[WindowOrigin], seq_len: int) -> dict[str, np.ndarray]:
    """Windows' origins as three arrays (four with provenance; for a node's state)."""
    planes = np.stack([o.origin for o in origins]) if origins else np.zeros((0, seq_len), dtype=np.int16)
    starts = [(k, s, n) for k, o in enumerate(origins) for s, n in o.starts]
    out = {"origin": planes, "starts": np.array(starts, dtype=np.int64).reshape(-1, 3)}
    if any(o.pieces is not None for o in origins):
        pieces = [(k, *p) for k, o in enumerate(origins) for p in o.pieces or ()]
        out["pieces"] = np.array(pieces, dtype=np.int64).reshape(-1, 1 + len(PIECE_FIELDS))
    return out


def load_origins(state: dict[str, np.ndarray]) -> deque[WindowOrigin]:
    planes = np.asarray(state["origin"], dtype=np.int16)
    per: list[list[tuple[int, int]]] = [[] for _ in range(len(planes))]
    for k, s, n in np.asarray(state["starts"]).reshape(-1, 3).tolist():
        per[k].append((int(s), int(n)))
    pieces: list[list | None] = [None] * len(planes)
    if "pieces" in state:
        pieces = [[] for _ in range(len(planes))]
        for k, *p in np.asarray(state["pieces"]).reshape(-1, 1 + len(PIECE_FIELDS)).tolist():
            pieces[k].append(tuple(p))
    return deque(WindowOrigin(planes[k].copy(), per[k], pieces[k]) for k in range(len(planes)))


def content_by_source(window: np.ndarray, origin: np.ndarray, n_sources: int, bos_id: int, eos_id: int) -> np.ndarray:
    """Per source, the document tokens of ``window`` (not ``<bos>``/``<eos>``/padding): the
    token ledger counts document tokens, the unit of the tokenizer and the mix budget."""
    keep = (window != bos_id) & (window != eos_id) & (origin >= 0)
    return np.bincount(origin[keep].astype(np.int64), minlength=n_sources)


def delivery_counts(origins: Sequence[WindowOrigin], n_sources: int, windows: Sequence[np.ndarray] | None = None) -> dict[str, list]:
    """What a batch of windows delivers to the step, per source: ``tokens`` (the non-pad
    positions of ``input_ids``, i.e. each window but its last token), ``docs`` (documents whose
    ``<bos>`` is in the batch) and ``doc_lengths`` (``[source, length]`` of each).

    With the ``windows`` (a packer with provenance), also what a training run's step log records
    of each row (``stacklm.data.storage.steplog``): ``pieces`` (per row its ``PIECE_FIELDS``
    tuples; ``None`` for a window restored from a state saved without provenance) and ``crc``
    (per row the CRC-32 of the window's int32 bytes, which lets ``stacklm inspect --step``
    check the tokens it rebuilds from the sources).

    Plain lists, not tensors: a loader worker moves every tensor of a batch into a shared-memory
    block of its own (about 0.35 ms each, measured), while lists travel pickled with the batch."""
    planes = np.stack([o.origin for o in origins])[:, :-1].astype(np.int64).ravel()
    tokens = np.bincount(planes + 1, minlength=n_sources + 1)[1:]
    starts = np.array([st for o in origins for st in o.starts], dtype=np.int64).reshape(-1, 2)
    docs = np.bincount(starts[:, 0], minlength=n_sources) if len(starts) else np.zeros(n_sources, dtype=np.int64)
    out = {"tokens": tokens.tolist(), "docs": docs.tolist(), "doc_lengths": starts.tolist()}
    if windows is not None:
        out["pieces"] = [None if o.pieces is None else list(o.pieces) for o in origins]
        out["crc"] = [window_crc(w) for w in windows]
    return out


def window_crc(window: np.ndarray) -> int:
    """CRC-32 of a packed window as int32 bytes: what the step log keeps of its tokens (4 bytes
    a row instead of ``2 x seq_len``), enough to tell a faithful rebuild from a changed source."""
    return zlib.crc32(np.ascontiguousarray(window, dtype=np.int32).tobytes())
