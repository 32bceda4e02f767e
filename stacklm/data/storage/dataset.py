"""Reading prebuilt shards: ``PackedMemmapDataset``.

``PackedMemmapDataset`` is map-style over memmapped ``.tokens.bin`` files (so it works with
``DistributedSampler``, ``ElasticSampler`` or any index sampler): index ``i`` is found with one
``np.searchsorted`` over the shards' cumulative row counts, and the batch contract
(``input_ids``, ``position_ids``, ``seq_ids``, ``targets``) is derived from the tokens, exactly as
``stacklm.data.packing.pack.collate`` derives it for the streaming pipes. It validates the shard set
when opened (manifest, file sizes, dtype, special ids, a sample of token ids, optionally the
tokenizer hash), and checks each shard's content hash against the manifest the first time a
process reads a row of it (``verify_content``); ``verify_shard_set`` also reads every id.

The elastic order over it (``ElasticSampler``, ``ElasticBatchNode``) is a resume rule, so it
lives with the others in ``stacklm.datamodule.resume.sampler``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stacklm.data.contract import (
    IGNORE_INDEX, PLANES, contract_batch, contract_buffer, contract_planes, lean_batch, segment_starts,
)
from stacklm.data.storage.datafiles import check_data_dir
from stacklm.data.storage.manifest import REQUIRED, check_split, read_manifest, split_directory, tokenizer_hash
from stacklm.data.storage.shards import check_content_hash, open_tokens, tokens_path
from stacklm.errors import ArgumentTypeError, DataError


DEFAULT_SAMPLE_ROWS = 256  # rows whose ids are checked on open (``verify`` checks all)
_MIN_ROWS_FOR_BOS_CHECK = 32


# ---------------------------------------------------------------------------------------
# Batch contract from stored windows
# ---------------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _arange(n: int) -> np.ndarray:
    a = np.arange(n, dtype=np.int64)
    a.flags.writeable = False
    return a


def derive_batch(rows: np.ndarray, bos_id: int, eos_id: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Windows ``(B, seq_len)`` -> the batch contract, ``torch.long`` ``(B, seq_len - 1)``.

    Same result as ``pack.collate`` (tested equal on packed real text and on adversarial rows),
    computed differently because this is the shard loader's hot path: segment starts are
    sparse (a few per window), so instead of ``collate``'s dense per-row ``cumsum`` and
    ``maximum.accumulate`` we find the starts once (``flatnonzero``), expand positions and
    segment ids with ``np.repeat``, mask targets at the few start positions only, and look at
    padding only in the rows that have some. About 3x faster than ``collate`` at B=8, T=2048
    (``bench/loader.py``).
    """
    rows = np.ascontiguousarray(rows)
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"expected windows of shape (batch, seq_len >= 2), got {rows.shape}")
    B, L = rows.shape
    T = L - 1
    _, is_pad, pad_rows, where, row, col, starts = segment_starts(rows, bos_id, eos_id, pad_id)
    n = len(starts)
    lengths = np.empty(n, dtype=np.int64)
    np.subtract(starts[1:], starts[:-1], out=lengths[:-1])
    lengths[-1] = B * T - starts[-1]
    out = contract_buffer(B, T)
    input_ids, position_ids, seq_ids, targets = contract_planes(out)
    np.subtract(_arange(B * T), np.repeat(starts, lengths), out=position_ids.reshape(-1))
    first_of_row = np.searchsorted(starts, _arange(B) * T)  # index of each row's first segment
    seq_ids.reshape(-1)[:] = np.repeat(_arange(n) - first_of_row[starts // T], lengths)
    input_ids[:] = rows[:, :T]
    targets[:] = rows[:, 1:]
    targets.reshape(-1)[(where - row - 1)[col > 0]] = IGNORE_INDEX  # the target would start a segment
    for r in pad_rows:
        np.copyto(targets[r], IGNORE_INDEX, where=is_pad[r, 1:])
    return contract_batch(out)


# ---------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------
def resolve_split_dir(path: str | os.PathLike, split: str | None = None) -> Path:
    """``path`` itself when it holds a split's shards, else ``path/split`` (default ``train``),
    a directory inside ``path`` (``datafiles.check_data_dir``: a link out of the build is refused)."""
    path = Path(path)
    if split is not None:
        if check_data_dir(path / split, path) is not None:
            return path / split
        if path.name == split:
            return path
        raise DataError(f"{path} has no '{split}' split directory; prebuild writes {path}/train and {path}/val", path=path)
    if (path.is_dir() and not any(p.name.endswith(".tokens.bin") for p in path.iterdir())
            and check_data_dir(path / "train", path) is not None):
        return path / "train"
    return path


class PackedMemmapDataset(torch.utils.data.Dataset):
    """Map-style dataset over one split of a prebuilt shard set.

    ``ds[i]`` is one row of the batch contract (tensors of shape ``(seq_len - 1,)``), so the
    default collate and any sampler work; ``ds[list_of_indices]`` / ``ds.get_batch(indices)``
    derive a whole batch in one vectorised pass (use it with ``batch_size=None`` and a batch
    sampler, or with ``stacklm.datamodule.resume.sampler.ElasticBatchNode``). Memmaps are opened lazily per process and never
    pickled, so ``DataLoader`` workers (fork or spawn) share the page cache, not copies.

    ``verify_content`` (default on): the first time a process reads a row of a shard, the
    shard's whole ``tokens.bin`` is hashed (xxh64, ``shards.check_content_hash``, the same check
    as ``stacklm verify``) and compared with the manifest before the row is returned, so a
    flipped bit that stays inside the vocabulary, or a damaged hash in the manifest, is a
    ``DataError`` naming the shard, the manifest and ``stacklm verify`` instead of training
    data. Once per shard per process (each ``DataLoader`` worker checks the shards it reads;
    a worker of a later epoch again), then nothing: one ``os.getpid()`` per batch. Cost:
    ``bench/loader.py --verify-only``. ``False`` reads without it (the size, id-range and
    per-batch vocab checks stay).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        split: str | None = None,
        *,
        tokenizer=None,
        sample_rows: int = DEFAULT_SAMPLE_ROWS,
        seed: int = 0,
        verify_content: bool = True,
        cache=None,
        planes: str = "full",
    ) -> None:
        if planes not in PLANES:
            raise ArgumentTypeError(f"PackedMemmapDataset: planes must be one of {PLANES}, got {planes!r}")
        self.planes = planes  # what ``get_batch`` derives: all four planes, or the lean ones (``contract.lean_batch``)
        if not isinstance(verify_content, bool):
            raise TypeError(f"PackedMemmapDataset: verify_content must be True or False, got {verify_content!r}")
        self.verify_content = verify_content
        from stacklm.data.storage import remote

        self.url = str(path) if remote.is_remote(path) else None  # read from its local mirror (``remote.mirror``)
        self.path = resolve_split_dir(remote.local_path(path), split)
        # ``cache`` (a ``prefetch.ShardCache``): the token files are streamed into this directory
        # as readers need them (``shard_window``), so no file is checked or sampled here; the row
        # counts are the manifest's, each download is checked against its xxh64, and every
        # batch's ids against the vocabulary.
        self.cache = cache
        layout = check_split(self.path, files=cache is None)  # the checks every reader of a split makes
        self.manifest = m = layout.manifest
        where = str(self.path / "manifest.json")
        self.seq_len, self.vocab_size, self.dtype = layout.seq_len, layout.vocab_size, layout.dtype
        self.bos_id, self.eos_id, self.pad_id = m["bos_id"], m["eos_id"], m["pad_id"]
        if tokenizer is not None:
            check_tokenizer(m, tokenizer, where)
        self.shard_names = layout.shard_names
        if cache is not None:
            sample_rows = 0
        self.shard_rows = np.asarray(layout.shard_rows, dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(self.shard_rows)])[:-1].astype(np.int64)
        self.num_rows = layout.num_rows
        if self.num_rows == 0:
            raise DataError(f"{where}: the '{m['split']}' split holds no sequences; raise the token budget (or the holdout fraction for val) and rebuild", path=where)
        self._maps: list[np.ndarray] | None = None
        self._verified: tuple[int, np.ndarray, threading.Lock] | None = None  # (pid, shard checked?, lock)
        self._all_verified_in: int | None = None  # pid of the process that has checked every shard
        self.check_sample(sample_rows, seed)

    # -- files ---------------------------------------------------------------------------
    def _open(self) -> list[np.ndarray]:
        if self._maps is None:
            self._maps = [
                open_tokens(self.path, name, self.dtype, int(n), self.seq_len).view(np.ndarray)
                for name, n in zip(self.shard_names, self.shard_rows)
            ]
        return self._maps

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = None  # a pickled memmap would copy the whole shard
        state["_verified"] = state["_all_verified_in"] = None  # each process checks for itself
        return state

    def _verify(self, shards: np.ndarray) -> None:
        """Check the content hash of each of ``shards`` not yet checked in this process.

        Per process, keyed by pid: a forked ``DataLoader`` worker inherits the parent's
        attributes, and its own check is what the docstring promises. The lock makes threads
        of one process (a threaded mapper) hash each shard once and never read an unchecked one."""
        pid = os.getpid()
        state = self._verified
        if state is None or state[0] != pid:
            state = self._verified = (pid, np.zeros(len(self.shard_names), dtype=bool), threading.Lock())
        _, done, lock = state
        todo = np.unique(shards[~done[shards]])
        if todo.size:
            with lock:
                for s in todo.tolist():
                    if not done[s]:
                        check_content_hash(self.path, self.manifest["shards"][s], self.path / "manifest.json")
                        done[s] = True
        if done.all():
            self._all_verified_in = pid

    # -- indexing ------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.num_rows

    @property
    def num_tokens(self) -> int:
        return self.num_rows * self.seq_len

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard number, row within shard) of global row indices: O(log n_shards) each."""
        shard = np.searchsorted(self.shard_starts, indices, side="right") - 1
        return shard, indices - self.shard_starts[shard]

    def rows(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The stored windows of ``indices``, shape ``(len(indices), seq_len)``."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < -self.num_rows or hi >= self.num_rows:
                raise IndexError(f"row index out of range for a split of {self.num_rows} rows: {lo}..{hi}")
            if lo < 0:
                idx = np.where(idx < 0, idx + self.num_rows, idx)
        return self._read(idx, verify=self.verify_content)

    def _stream_maps(self, shards: np.ndarray) -> dict[int, np.ndarray]:
        """Memmaps of ``shards`` for one read, each once it is in the streamed cache. Opened per
        read and dropped after it: a reader never keeps an evicted shard's blocks on disk."""
        maps = {}
        for s in np.unique(shards).tolist():
            self.cache.ensure(s)
            maps[s] = open_tokens(self.path, self.shard_names[s], self.dtype, int(self.shard_rows[s]), self.seq_len).view(np.ndarray)
        return maps

    def _read(self, idx: np.ndarray, *, verify: bool) -> np.ndarray:
        shard, local = self.locate(idx)
        if self.cache is not None:
            maps = self._stream_maps(shard)
        else:
            maps = self._maps if self._maps is not None else self._open()
        if verify and self._all_verified_in != os.getpid():
            self._verify(shard)
        out = np.empty((len(idx), self.seq_len), dtype=self.dtype)
        for j, (s, r) in enumerate(zip(shard.tolist(), local.tolist())):
            out[j] = maps[s][r]
        return out

    def get_batch(self, indices: Sequence[int] | np.ndarray, n_pad: int = 0, planes: str | None = None) -> dict[str, Any]:
        """The batch contract for ``indices`` then ``n_pad`` padding rows (no loss): tensors
        ``(len(indices) + n_pad, seq_len - 1)``, the four planes or the lean ones (``planes``,
        default the dataset's).

        Every batch's ids are checked against the vocabulary (one max over the rows, cheap next
        to deriving the batch): a corrupt row never reaches the model, and the error names the
        shard file and row. Opening checks a sample, ``stacklm verify`` every row."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        rows = self.rows(idx)
        if rows.size and int(rows.max()) >= self.vocab_size:
            self._raise_out_of_vocab(idx, rows)
        if n_pad:  # padding rows derive like any row of pad ids: one segment, every target ignored
            rows = np.concatenate([rows, np.full((n_pad, self.seq_len), self.pad_id, dtype=rows.dtype)])
        if (planes or self.planes) == "lean":
            return lean_batch(rows, self.bos_id, self.eos_id, self.pad_id)
        return derive_batch(rows, self.bos_id, self.eos_id, self.pad_id)

    def _raise_out_of_vocab(self, idx: np.ndarray, rows: np.ndarray) -> None:
        r = int(np.argmax((rows >= self.vocab_size).any(axis=1)))
        global_row = int(idx[r]) + (self.num_rows if idx[r] < 0 else 0)
        shard, local = self.locate(np.array([global_row]))
        path = tokens_path(self.path, self.shard_names[int(shard[0])])
        raise DataError(
            f"{path}: row {int(local[0])} holds token id {int(rows[r].max())} >= vocab_size {self.vocab_size} from the "
            "manifest: the shard is corrupt or was built with a larger vocabulary; run `stacklm verify` on the directory "
            "and rebuild with `stacklm prebuild`",
            path=path,
        )

    def __getitem__(self, index):
        """``ds[i]``: one row; ``ds[a:b]`` or ``ds[[i, j, ...]]``: a batch. Any other index (a
        float, a bool, a 2-D array) is an ``ArgumentTypeError``: ``np.asarray(1.5)`` used to read
        a 2-D batch of row 1."""
        if isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_)):
            # one row for the default collate: always the four planes (the lean ones are a batch's)
            return {k: v[0] for k, v in self.get_batch([int(index)], planes="full").items()}
        if isinstance(index, slice):
            index = range(*index.indices(self.num_rows))
        rows = np.asarray(index)
        if rows.ndim != 1 or not (rows.dtype.kind in "iu" or rows.size == 0):
            got = type(index).__name__ + (f" of dtype {rows.dtype}, shape {rows.shape}" if rows.ndim else f" {index!r}")
            raise ArgumentTypeError(f"PackedMemmapDataset[{index!r}]: an index is an int, a slice or a 1-D sequence of ints, got {got}")
        return self.get_batch(rows.astype(np.int64, copy=False))

    # -- checks --------------------------------------------------------------------------
    def check_sample(self, sample_rows: int = DEFAULT_SAMPLE_ROWS, seed: int = 0) -> None:
        """Cheap check on open: ids of up to ``sample_rows`` rows (always including each
        shard's first and last row when there are few shards) below the vocab size, and the
        manifest's bos id present in a large enough sample."""
        if sample_rows <= 0:
            return
        rng = np.random.default_rng(seed)
        picks = rng.choice(self.num_rows, size=min(sample_rows, self.num_rows), replace=False)
        if len(self.shard_rows) * 2 <= sample_rows:
            picks = np.union1d(picks, np.concatenate([self.shard_starts, self.shard_starts + self.shard_rows - 1]))
        picks = np.sort(picks)
        # not content-checked here: opening stays cheap; the hash is checked where rows are read to train on
        rows = self._read(picks, verify=False)
        over = rows >= self.vocab_size
        if over.any():
            r = int(np.argmax(over.any(axis=1)))
            shard, local = self.locate(picks[r : r + 1])
            raise DataError(
                f"{tokens_path(self.path, self.shard_names[int(shard[0])])}: row {int(local[0])} holds token id "
                f"{int(rows[r].max())} >= vocab_size {self.vocab_size} from the manifest: the shard is corrupt or was built "
                "with a larger vocabulary; run `stacklm verify` on the directory and rebuild with `stacklm prebuild`",
                path=tokens_path(self.path, self.shard_names[int(shard[0])]),
            )
        if len(rows) >= _MIN_ROWS_FOR_BOS_CHECK and not (rows == self.bos_id).any():
            raise DataError(
                f"{self.path / 'manifest.json'}: bos_id {self.bos_id} occurs in none of {len(rows)} sampled rows: the "
                "manifest's special ids do not match the shards (or the shards were written by another tokenizer); rebuild",
                path=self.path / "manifest.json",
            )


def check_tokenizer(manifest: dict, tokenizer, where: str) -> None:
    """Refuse a tokenizer other than the one the shards were built with (the ids would mean other
    tokens). ``tokenizer`` is loaded (``tokenizer_hash`` refuses a path)."""
    given = tokenizer_hash(tokenizer)
    vocab = tokenizer.vocab_size
    if given != manifest["tokenizer_hash"]:
        raise DataError(
            f"{where} was built with tokenizer sha256 {manifest['tokenizer_hash'][:16]}... (vocab {manifest['vocab_size']}) "
            f"but the given tokenizer is {given[:16]}... (vocab {vocab}): its ids would mean other tokens. Use the "
            "tokenizer the shards were built with, or rebuild the shards with `stacklm prebuild --tokenizer ...`",
            path=where,
        )


def verify_shard_set(path: str | os.PathLike, *, tokenizer=None, progress: bool = True) -> dict[str, Any]:
    """Full check of a prebuilt directory (top or split): every shard's size, content hash and
    every token id. Raises ``DataError`` naming the first bad file; returns per-split totals.
    A remote URL is mirrored first (each shard hash-checked on download, ``remote.mirror``),
    then the mirror is checked as a local directory."""
    from stacklm.data.storage import remote

    path = Path(remote.local_path(path))
    top = read_manifest(path, required=REQUIRED)
    splits = {top["split"]: path} if "shards" in top else {name: split_directory(path, name) for name in top.get("splits", {})}
    if not splits:
        raise DataError(f"{path / 'manifest.json'} lists no splits and no shards; rebuild with `stacklm prebuild`", path=path)
    report: dict[str, Any] = {}
    for split, directory in splits.items():
        ds = PackedMemmapDataset(directory, tokenizer=tokenizer, sample_rows=0, verify_content=False)  # hashed below, in order
        shards = ds.manifest["shards"]
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=ds.num_tokens, unit="tok", unit_scale=True, desc=f"verify {split}")
        max_id = -1
        for k, entry in enumerate(shards):
            tpath = tokens_path(directory, entry["name"])
            check_content_hash(directory, entry, directory / "manifest.json", advise_verify=False)
            data = ds._open()[k]
            step = max(1, (1 << 22) // ds.seq_len)
            for lo in range(0, len(data), step):
                chunk_max = int(data[lo : lo + step].max())
                if chunk_max >= ds.vocab_size:
                    row = lo + int(np.argmax((data[lo : lo + step] >= ds.vocab_size).any(axis=1)))
                    raise DataError(
                        f"{tpath}: row {row} holds token id {chunk_max} >= vocab_size {ds.vocab_size}: the shard is corrupt or "
                        "was built with a larger vocabulary; rebuild with `stacklm prebuild`",
                        path=tpath,
                    )
                max_id = max(max_id, chunk_max)
                if bar is not None:
                    bar.update(min(step, len(data) - lo) * ds.seq_len)
        if bar is not None:
            bar.close()
        report[split] = {"shards": len(shards), "rows": ds.num_rows, "tokens": ds.num_tokens, "max_id": max_id, "vocab_size": ds.vocab_size}
    return report

