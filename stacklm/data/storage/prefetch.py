"""Streaming a remote shard set through a bounded local cache, ahead of the reader.

``remote.mirror`` downloads a whole shard set before the first batch, and the global row
permutation needs all of it every epoch. With ``shard_window=K`` the epoch's order is
shard-local (``dataset.window_permutation``: shards shuffled, rows shuffled within windows of K
shards), so a reader needs at most two windows at a time and this module can keep only those
(and what fits ahead of them) on disk:

* ``ShardCache`` (picklable, one per split): the split's URL, its local directory under the
  mirror (manifests and provenance side files are there, the token files come and go), the
  byte limit. ``ensure(shard)`` is the reader's side: the tokens file is there, or the reader
  waits for it (a loader worker; the rank's main process fetches it itself when no prefetcher
  runs, e.g. ``stacklm inspect``).
* ``Prefetcher`` (a thread in each rank's main process, one per loader iteration): it knows
  this rank's plan for the epoch (``ShardsLoader._plan``: the rows of every step), so it knows
  each shard's first and last step; it downloads the shards in order of first use, as far
  ahead as the limit allows, and releases a shard once the consumer (the trainer) has taken
  the batch of its last step. Loader workers never download: they wait for the file.
* Node-wide, through files in the split directory, so the ranks of a node (and the loader
  workers, which only read) share one copy of each shard:
  ``.hold-<shard>``: a shared POSIX lock (``lockf``) per process that still needs the shard;
  ``.rsv-<shard>``: a download in flight, an exclusive lock held by its downloader, the file
  sized (sparse) to the shard's bytes so the accounting counts it before the bytes land;
  ``.cache.lock``: taken around every decision (take a hold, reserve, evict). A shard is
  evicted only when no process holds it, and only when a download needs the room.
  POSIX locks, not ``flock``: a forked loader worker inherits the parent's descriptors, and an
  inherited ``flock`` would stay held until the worker exits; ``lockf`` locks belong to the
  process and are never inherited.
* The bound: the token files plus the reservations of the downloads in flight never exceed
  ``limit`` bytes (checked under ``.cache.lock`` before every download); a loader worker maps a
  shard only for the batch it is reading (never after the batch its rank's last use of the
  shard), so an evicted file's blocks are never held by a reader. A download is checked like
  the mirror's (temporary name, xxh64 against the manifest, rename).
* Progress is guaranteed when ``limit >= 2 x K x`` the largest shard and each window holds at
  least one global step of rows: the shards a blocked reader's step needs and those still held
  are all alive at that step, at most two windows (``check_bounds``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stacklm import atomic
from stacklm.data.storage import remote
from stacklm.data.storage.shards import tokens_path

CACHE_LOCK = ".cache.lock"
WAIT_S = 900.0  # a reader waiting this long for a shard gives up naming it (the retries of one download take < 3 min)
POLL_S = 0.002
_PROCESS_LOCK = threading.Lock()  # POSIX locks do not exclude threads of one process: this does
_HELD: dict[str, list] = {}  # hold file -> [open file, count] of this process
_DOWNLOADING: set[str] = set()  # reservation files this process is downloading


def _lock(f, exclusive: bool, wait: bool) -> bool:
    try:
        fcntl.lockf(f, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
        return True
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
        raise


class ShardCache:
    """One split of a remote shard set, read through a bounded local cache (see the module)."""

    def __init__(self, url: str, local: str | os.PathLike, manifest: dict[str, Any], limit: int | None) -> None:
        from stacklm.data.storage.shards import parse_dtype

        self.url, self.local = url, Path(local)
        self.entries = list(manifest["shards"])
        item = parse_dtype(manifest["dtype"], where=remote.join(url, remote.MANIFEST)).itemsize
        self.sizes = [int(e["n_seq"]) * int(manifest["seq_len"]) * item for e in self.entries]
        self.limit = limit
        self.rest_bytes = 0  # what the rest of the set (val split, manifests, side files) takes of the configured limit
        self.owner = os.getpid()  # the rank's main process: the one that downloads
        self.prefetching = False  # set while a ``Prefetcher`` runs in ``owner``
        self.downloads = 0  # shards this process downloaded (bench, tests)
        self.peak = 0  # the most bytes counted against the limit, at a reservation in this process
        self._names: dict[str, int] | None = None  # tokens file name -> shard number

    # -- files -------------------------------------------------------------------------------
    def tokens(self, s: int) -> Path:
        return tokens_path(self.local, self.entries[s]["name"])

    def _hold_file(self, s: int) -> Path:
        return self.local / f".hold-{self.entries[s]['name']}"

    def _rsv_file(self, s: int) -> Path:
        return self.local / f".rsv-{self.entries[s]['name']}"

    def _error_file(self) -> Path:
        return self.local / f".prefetch-error.{self.owner}"

    def used_bytes(self) -> int:
        """What the bound counts: the token files and the reservations of downloads in flight."""
        n = 0
        for e in os.scandir(self.local):
            if e.name.endswith(".tokens.bin") and not e.name.startswith("."):
                n += e.stat().st_size
            elif e.name.startswith(".rsv-"):
                n += e.stat().st_size
        return n

    class _NodeLock:
        def __init__(self, cache: "ShardCache") -> None:
            self.path = cache.local / CACHE_LOCK

        def __enter__(self):
            _PROCESS_LOCK.acquire()
            self.f = open(self.path, "a+")
            _lock(self.f, True, True)
            return self

        def __exit__(self, *exc):
            self.f.close()  # releases the lock
            _PROCESS_LOCK.release()

    # -- holds -------------------------------------------------------------------------------
    def hold(self, s: int) -> None:
        """This process needs shard ``s``: no process evicts it until ``release(s)``. Call under
        the node lock."""
        key = str(self._hold_file(s))
        if key in _HELD:
            _HELD[key][1] += 1
            return
        f = open(key, "a+")
        _lock(f, False, True)
        _HELD[key] = [f, 1]

    def release(self, s: int) -> None:
        with _PROCESS_LOCK:
            key = str(self._hold_file(s))
            entry = _HELD.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] <= 0:
                entry[0].close()
                del _HELD[key]

    def _held_elsewhere(self, path: Path) -> bool:
        """Another process holds ``path`` (a hold or reservation file)? Not for this process's own."""
        if str(path) in _HELD or str(path) in _DOWNLOADING:
            return True
        if not path.exists():
            return False
        with open(path, "a+") as f:
            free = _lock(f, True, False)
        return not free

    def _evict(self, need: int) -> int:
        """Remove shards no process holds, oldest first, until ``need`` bytes are freed; stale
        reservations of killed downloaders go too. Under the node lock."""
        freed = 0
        for e in os.scandir(self.local):
            if e.name.startswith(".rsv-"):
                rsv = Path(e.path)
                if not self._held_elsewhere(rsv):
                    name = e.name[len(".rsv-"):]
                    for t in self.local.glob(f"{atomic.TMP_MARK}{name}.tokens.bin.*"):
                        t.unlink(missing_ok=True)
                    freed += e.stat().st_size
                    rsv.unlink(missing_ok=True)
        if freed >= need:
            return freed
        index = self._index()
        candidates = []
        for e in os.scandir(self.local):  # what is there (bounded by the limit), not every shard of the set
            s = index.get(e.name)
            if s is not None:
                candidates.append((e.stat().st_mtime, s))
        for _, s in sorted(candidates):
            if freed >= need:
                break
            if self._held_elsewhere(self._hold_file(s)):
                continue
            self.tokens(s).unlink(missing_ok=True)
            self._hold_file(s).unlink(missing_ok=True)  # holds are taken under the node lock too: none is lost
            freed += self.sizes[s]
        return freed

    def _index(self) -> dict[str, int]:
        if self._names is None:
            self._names = {self.tokens(s).name: s for s in range(len(self.entries))}
        return self._names

    # -- downloading -------------------------------------------------------------------------
    def try_fetch(self, s: int, *, force: bool = False) -> str:
        """One attempt at getting shard ``s`` into the cache (the caller holds it already):
        ``"there"``, ``"busy"`` (another process downloads it: look again), ``"full"`` (no room
        until readers move on), or ``"fetched"`` (downloaded here). ``force``: over the limit
        rather than ``"full"`` (a main process reading without a prefetcher)."""
        tpath, rsv = self.tokens(s), self._rsv_file(s)
        with self._NodeLock(self):
            if tpath.exists():
                return "there"
            if rsv.exists() and self._held_elsewhere(rsv):
                return "busy"
            if self.limit is not None and not rsv.exists():
                over = self.used_bytes() + self.sizes[s] - self.limit
                if over > 0 and self._evict(over) < over and not force:
                    return "full"
            f = open(rsv, "a+")
            _lock(f, True, True)
            os.ftruncate(f.fileno(), self.sizes[s])  # sparse: counted, no blocks
            self.peak = max(self.peak, self.used_bytes())
            _DOWNLOADING.add(str(rsv))
        try:
            for t in self.local.glob(f"{atomic.TMP_MARK}{tpath.name}.*"):  # a killed download of this shard
                t.unlink(missing_ok=True)
            remote._download_shard(self.url, self.local, self.entries[s], self.sizes[s], meta=False)
            self.downloads += 1
        finally:
            with self._NodeLock(self):
                rsv.unlink(missing_ok=True)
                _DOWNLOADING.discard(str(rsv))
                f.close()
        return "fetched"

    def ensure(self, s: int) -> Path:
        """The reader's side: shard ``s``'s tokens file, once it is in the cache. A loader
        worker waits for the prefetcher; the owner process without a running prefetcher
        fetches it itself."""
        tpath = self.tokens(s)
        if tpath.exists():
            return tpath
        if os.getpid() == self.owner and not self.prefetching:
            with self._NodeLock(self):
                self.hold(s)
            try:
                while self.try_fetch(s, force=True) == "busy":
                    time.sleep(POLL_S * 10)
            finally:
                self.release(s)
            return tpath
        t0 = time.monotonic()
        while not tpath.exists():
            err = self._error_file()
            if err.exists():
                raise remote.RemoteError(err.read_text(errors="replace").strip() or f"{self.url}: the prefetcher failed",
                                         path=self.url)
            if time.monotonic() - t0 > WAIT_S:
                raise remote.RemoteError(
                    f"{remote.join(self.url, tpath.name)}: a reader waited {WAIT_S:.0f}s for this shard and it never reached "
                    f"the cache {self.local}; check the endpoint and network, and that STACKLM_CACHE_MAX_BYTES / "
                    "data.cache_max_bytes holds 2 x shard_window shards", path=self.url)
            time.sleep(POLL_S)
        return tpath


def check_bounds(cache: ShardCache, shard_rows: Sequence[int], window: int, step_rows: int, where: str) -> None:
    """Refuse a limit or window under which the readers could wait on each other forever
    (see the module): ``limit >= 2 x window x`` the largest shard, a window >= one global step."""
    from stacklm.errors import DataConfigError

    rows = np.asarray(shard_rows, dtype=np.int64)
    if cache.limit is not None:
        need = 2 * window * max(cache.sizes)
        if cache.limit < need:
            # the configured limit, not what is left of it (which the rest of the set can take below zero)
            configured = cache.limit + cache.rest_bytes
            left = (f"; the rest of the set (val split, manifests, side files) holds {cache.rest_bytes:,} of it, "
                    f"which leaves the streamed train split {max(cache.limit, 0):,}") if cache.rest_bytes else ""
            raise DataConfigError(
                f"{where}: cache limit {configured:,} bytes (STACKLM_CACHE_MAX_BYTES / data.cache_max_bytes){left}: below "
                f"2 x shard_window ({window}) x the largest shard ({max(cache.sizes):,} bytes) = {need:,}, and a reader needs "
                f"two windows at a time; raise the limit to at least {need + cache.rest_bytes:,} or lower data.shard_window")
    smallest = int(np.sort(rows)[:window].sum())
    if smallest < step_rows:
        raise DataConfigError(
            f"{where}: shard_window {window} can hold as few as {smallest} rows, fewer than one global step of "
            f"{step_rows} rows (ranks x batch_size): a step would need more than two windows; raise data.shard_window")


class Prefetcher:
    """Downloads this rank's shards in order of first use, ahead of the consumer, within the
    cache limit; releases each once the consumer has taken its last step (see the module)."""

    def __init__(self, cache: ShardCache, step_shards: Sequence[np.ndarray]) -> None:
        self.cache = cache
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for t, shards in enumerate(step_shards):
            for s in shards.tolist():
                first.setdefault(s, t)
                last[s] = t
        self.order = sorted(first, key=lambda s: (first[s], s))
        self.last = last
        self.consumed = 0  # steps the consumer has taken
        self._held: set[int] = set()
        self._cond = threading.Condition()
        self._stop = False
        self.error: BaseException | None = None
        cache._error_file().unlink(missing_ok=True)
        if cache.limit is not None:  # a warm cache of a larger limit (or a whole mirror) shrinks to this one's
            with cache._NodeLock(cache):
                over = cache.used_bytes() - cache.limit
                if over > 0:
                    cache._evict(over)
        cache.prefetching = True
        self._thread = threading.Thread(target=self._run, name="stacklm-prefetch", daemon=True)
        self._thread.start()

    def advance(self, consumed: int) -> None:
        """The consumer has taken ``consumed`` steps: release the shards whose last step is among them."""
        with self._cond:
            self.consumed = consumed
            for s in [s for s in self._held if self.last[s] < consumed]:
                self._held.discard(s)
                self.cache.release(s)
            self._cond.notify_all()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        cache = self.cache
        try:
            for s in self.order:
                with self._cond:
                    if self._stop:
                        return
                    if self.last[s] < self.consumed:
                        continue  # already past (a resume inside the plan)
                    with cache._NodeLock(cache):
                        cache.hold(s)
                    self._held.add(s)
                while True:
                    state = cache.try_fetch(s)
                    if state in ("there", "fetched"):
                        break
                    with self._cond:  # full: wait for the consumer to move on (or busy: look again soon)
                        if self._stop:
                            return
                        self._cond.wait(0.05 if state == "full" else POLL_S * 10)
        except BaseException as e:  # noqa: BLE001 - handed to the readers: the consumer raises it
            self.error = e
            try:
                atomic.atomic_write_bytes(cache._error_file(), str(e).encode(), fsync_parent=False)
            except OSError:
                pass
            print(f"stacklm: prefetching {cache.url} failed: {e}", file=sys.stderr)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(60)
        with self._cond:
            for s in self._held:
                self.cache.release(s)
            self._held.clear()
        self.cache.prefetching = False
