"""Token shards on disk: the format, the crash-safe writer and the per-shard checks.

One shard is two files (docs/architecture.md, "Shards on disk"):

* ``shard_XXXXX.tokens.bin`` — flat little-endian ``uint16`` (vocab <= 65536) or ``uint32``
  token ids, ``n_seq x seq_len``, row-major: row ``i`` is one packed window;
* ``shard_XXXXX.meta.bin`` — two little-endian int64, ``[n_seq, seq_len]``.

Why raw ``.bin`` files and not ``.npy``: a reader memmaps them with no header parsing, any
language can read them, and the size check (``tokens.bin`` bytes == n_seq x seq_len x itemsize)
catches truncation without reading the data.

A shard becomes visible only once complete: both files are written under temporary names,
fsynced, renamed (tokens first, meta last, so a ``meta.bin`` means "this shard is whole"),
then the directory is fsynced so the renames survive a power cut. A write that fails (disk
full) removes its temporary files and raises ``ShardWriteError``; nothing half-written ever
carries a shard name. Readers additionally only trust shards listed in a ``manifest.json``,
which prebuild writes last.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from stacklm import atomic
from stacklm.atomic import TMP_MARK  # temporary files start with this; never matched as shards
from stacklm.data.storage.datafiles import check_data_file, open_data_file, read_data_bytes
from stacklm.errors import DataError, ShardWriteError
from stacklm.parent_death import exit_if_orphaned, orphaned

SHARD_PREFIX = "shard_"
TOKENS_SUFFIX = ".tokens.bin"
META_SUFFIX = ".meta.bin"
META_DTYPE = np.dtype("<i8")
META_BYTES = 2 * META_DTYPE.itemsize
_SHARD_RE = re.compile(rf"^{SHARD_PREFIX}(\d{{5,}}){re.escape(TOKENS_SUFFIX)}$")
_XXH64_RE = re.compile(r"^[0-9a-f]{16}$")  # what ``xxhash.xxh64_hexdigest`` writes
_HASH_CHUNK = 1 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian ``uint16`` when every id fits (vocab <= 65536), else ``uint32``."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be > 0, got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def dtype_name(dtype: np.dtype) -> str:
    """``"uint16"`` / ``"uint32"``: the spelling used in manifests."""
    return np.dtype(dtype).name


def parse_dtype(name: str, *, where: str) -> np.dtype:
    if name not in ("uint16", "uint32"):
        raise DataError(f"{where}: field 'dtype' must be 'uint16' or 'uint32', got {name!r}; the manifest is corrupt — rebuild with `stacklm prebuild`", path=where)
    return np.dtype(name).newbyteorder("<")


def shard_name(index: int) -> str:
    return f"{SHARD_PREFIX}{index:05d}"


def tokens_path(directory: str | os.PathLike, name: str) -> Path:
    return Path(directory) / f"{name}{TOKENS_SUFFIX}"


def meta_path(directory: str | os.PathLike, name: str) -> Path:
    return Path(directory) / f"{name}{META_SUFFIX}"


def list_shard_files(directory: str | os.PathLike) -> list[str]:
    """Names (``shard_XXXXX``) of the ``.tokens.bin`` files in ``directory``, sorted by index."""
    found = []
    for entry in os.scandir(directory):
        m = _SHARD_RE.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry.name[: -len(TOKENS_SUFFIX)]))
    return [name for _, name in sorted(found)]


def _disk_error(exc: OSError, path: Path, nbytes: int) -> ShardWriteError:
    directory = path.parent
    try:
        free = shutil.disk_usage(directory).free
        room = f"; {free:,} bytes free on that filesystem"
    except OSError:  # pragma: no cover
        room = ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        what = f"the disk is full while writing {path} ({nbytes:,} bytes needed{room})"
    else:
        what = f"could not write {path}: {exc.strerror or exc}"
    return ShardWriteError(
        f"{what}. Nothing partial was left under a shard name. Free space (or pass another --out) and re-run "
        "the same command: it resumes after the last complete shard.",
        path=path,
    )


def atomic_write_shard_file(path: Path, data: bytes | memoryview | np.ndarray, *, fsync_parent: bool = True) -> None:
    """``stacklm.atomic.atomic_write_bytes`` for the files of a shard set (tokens, meta,
    manifest, prebuild state): a failed write (typically a full disk) is a ``ShardWriteError``
    that names the file, the room left and how to resume."""
    atomic.atomic_write_bytes(path, data, fsync_parent=fsync_parent, on_error=_disk_error)


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records per shard."""

    name: str
    n_seq: int
    xxh64: str  # of the tokens.bin bytes: `stacklm verify` recomputes it

    def to_dict(self) -> dict:
        return {"name": self.name, "n_seq": self.n_seq, "xxh64": self.xxh64}


def write_shard(directory: str | os.PathLike, index: int, windows: np.ndarray, dtype: np.dtype) -> ShardInfo:
    """Write ``windows`` (``n_seq x seq_len`` ints) as shard ``index``, atomically.

    Ids must fit ``dtype`` (checked: a silent wrap-around would corrupt the data for good).
    Rewriting an existing index replaces it whole (what a resumed prebuild does).
    """
    directory = Path(directory)
    w = np.asarray(windows)
    if w.ndim != 2 or w.shape[0] < 1 or w.shape[1] < 2:
        raise ValueError(f"a shard holds a (n_seq >= 1, seq_len >= 2) array of windows, got shape {w.shape}")
    dtype = np.dtype(dtype)
    info = np.iinfo(dtype)
    if w.size and (int(w.min()) < 0 or int(w.max()) > info.max):
        raise ValueError(
            f"shard {shard_name(index)}: token ids span [{int(w.min())}, {int(w.max())}] but the shard dtype is "
            f"{dtype.name}; the tokenizer's vocab is larger than the manifest dtype allows"
        )
    tokens = np.ascontiguousarray(w, dtype=dtype.newbyteorder("<"))
    name = shard_name(index)
    meta = np.array([w.shape[0], w.shape[1]], dtype=META_DTYPE)
    atomic_write_shard_file(tokens_path(directory, name), tokens, fsync_parent=False)
    if orphaned():  # a pool worker whose prebuild died (stacklm.parent_death): no tokens file without its meta
        tokens_path(directory, name).unlink(missing_ok=True)
        exit_if_orphaned()
    try:
        atomic_write_shard_file(meta_path(directory, name), meta, fsync_parent=True)
    except BaseException:  # a tokens file without its meta is not a shard: do not leave one
        tokens_path(directory, name).unlink(missing_ok=True)
        raise
    return ShardInfo(name, int(w.shape[0]), xxhash.xxh64_hexdigest(memoryview(tokens).cast("B")))


def remove_temp_files(directory: str | os.PathLike) -> int:
    """Delete leftovers of writes that were killed midway; returns how many."""
    n = 0
    if not os.path.isdir(directory):
        return 0
    for entry in os.scandir(directory):
        if entry.name.startswith(TMP_MARK) and entry.is_file():
            os.unlink(entry.path)
            n += 1
    return n


# ---------------------------------------------------------------------------------------
# Reading and checking one shard.
# ---------------------------------------------------------------------------------------
_REBUILD = "re-run `stacklm prebuild` into a fresh directory (or restore the file from a copy)"


def read_meta(path: str | os.PathLike) -> tuple[int, int]:
    """``(n_seq, seq_len)`` from a ``.meta.bin``; every problem names the file."""
    path = Path(path)
    try:
        raw = read_data_bytes(path)
    except FileNotFoundError:
        tokens = path.with_name(path.name[: -len(META_SUFFIX)] + TOKENS_SUFFIX)
        raise DataError(
            f"{path} is missing (its tokens file {tokens.name} has no meta): the shard was never completed or the "
            f"file was deleted; {_REBUILD}",
            path=path,
        ) from None
    if len(raw) != META_BYTES:
        raise DataError(f"{path} is {len(raw)} bytes, a meta file is {META_BYTES} (int64 n_seq, seq_len); {_REBUILD}", path=path)
    n_seq, seq_len = (int(x) for x in np.frombuffer(raw, dtype=META_DTYPE))
    if n_seq < 0 or seq_len < 2:
        raise DataError(f"{path} says n_seq={n_seq}, seq_len={seq_len}, which is impossible; {_REBUILD}", path=path)
    return n_seq, seq_len


def check_shard_files(directory: str | os.PathLike, name: str, dtype: np.dtype, seq_len: int, n_seq: int | None = None) -> int:
    """Check a shard's meta against the expected layout and its tokens file size; return n_seq."""
    mpath, tpath = meta_path(directory, name), tokens_path(directory, name)
    treal = check_data_file(tpath)  # a FIFO, a device or a link out of the directory: refused, never opened
    if treal is None:
        raise DataError(f"{tpath} is missing (listed in the manifest); {_REBUILD}", path=tpath)
    meta_n, meta_len = read_meta(mpath)
    if meta_len != seq_len:
        raise DataError(f"{mpath} says seq_len={meta_len} but the manifest says {seq_len}: the shard belongs to another build; {_REBUILD}", path=mpath)
    if n_seq is not None and meta_n != n_seq:
        raise DataError(f"{mpath} says n_seq={meta_n} but the manifest lists {n_seq}: the shard was replaced after the build; {_REBUILD}", path=mpath)
    want = meta_n * meta_len * np.dtype(dtype).itemsize
    have = treal.stat().st_size
    if have != want:
        kind = "truncated" if have < want else "longer than its meta says"
        raise DataError(
            f"{tpath} is {have:,} bytes but its meta says {meta_n} x {meta_len} {np.dtype(dtype).name} = {want:,} bytes: "
            f"the file is {kind}; {_REBUILD}",
            path=tpath,
        )
    return meta_n


def open_tokens(directory: str | os.PathLike, name: str, dtype: np.dtype, n_seq: int, seq_len: int) -> np.ndarray:
    """Read-only memmap ``(n_seq, seq_len)`` of a checked shard (an empty array when n_seq == 0)."""
    if n_seq == 0:
        return np.zeros((0, seq_len), dtype=dtype)
    with open_data_file(tokens_path(directory, name)) as f:  # the map holds its own descriptor
        return np.memmap(f, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=(n_seq, seq_len))


def file_xxh64(path: str | os.PathLike) -> str:
    """xxh64 of a file's bytes, read into one reused 1 MiB buffer: it stays in the CPU cache and
    nothing is allocated per chunk (~2.8 GB/s here, against ~0.6 GB/s for ``f.read`` of 16 MiB
    chunks), which matters now that the loader hashes every shard it reads."""
    h = xxhash.xxh64()
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open_data_file(path) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def check_content_hash(directory: str | os.PathLike, entry: dict, manifest: str | os.PathLike, *,
                       advise_verify: bool = True) -> str:
    """Recompute shard ``entry``'s xxh64 (``tokens.bin`` bytes) and compare it with the one the
    manifest lists; return it. The one content check, shared by the loader (each shard, the
    first time a process reads it) and ``stacklm verify`` (every shard). Why a hash at all:
    a flipped bit that stays inside the vocabulary passes every size and id check and would
    be trained on without a word. A hash that is missing or not 16 hex digits (zeroed,
    garbled) is refused too: a manifest whose hashes cannot be checked vouches for nothing."""
    name = entry.get("name")
    tpath = tokens_path(directory, name)
    want = entry.get("xxh64")
    split_dir = Path(directory)
    # `stacklm verify` itself passes advise_verify=False: it must not tell its user to run it
    verify = f"run `stacklm verify {split_dir}` and " if advise_verify else ""
    if not isinstance(want, str) or not _XXH64_RE.match(want):
        raise DataError(
            f"{manifest}: shard {name!r} lists content hash (field 'xxh64') {want!r}, not 16 hex digits: the manifest "
            f"is damaged, so {tpath.name} cannot be checked; {verify}restore the manifest "
            "from a copy or rebuild with `stacklm prebuild`",
            path=manifest,
        )
    digest = file_xxh64(tpath)
    if digest != want:
        raise DataError(
            f"{tpath}: content hash {digest} differs from {want} listed for shard {name!r} in {manifest}: the file (or the "
            f"manifest) changed after the build; {verify}restore both from a copy or rebuild "
            "with `stacklm prebuild`",
            path=tpath,
        )
    return digest
