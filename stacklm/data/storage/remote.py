"""Shard sets in object storage (``s3://``, ``gs://``, ``hf://``: any fsspec URL).

Why a local copy and not reads through fsspec: the shards-mode loader's hot path is a memmap
(``PackedMemmapDataset``), a random row of a global permutation per index; a remote read per
row would be a request per row. So a remote shard set is *mirrored* into a local cache
directory and memory-mapped from there: a local path keeps exactly today's code path, a remote
one is "cache, then the same memmap".

* **Writing** (``upload_shard_set``, driven by ``stacklm.prebuild.build.prebuild_remote``):
  the build runs into a local staging directory exactly as
  a local build (crash-safe and resumable there), then uploads each shard (side file, tokens,
  meta last), then each split's manifest, then the top manifest last. An object store PUT is
  visible only complete, and a reader trusts only what a manifest lists, so a crash at any
  point leaves no shard set a reader takes for finished; the re-run resumes from the staging
  directory (or re-uploads, identically).
* **Reading** (``mirror``): start-up reads the manifests only (no listing of the prefix); each
  listed shard not already in the cache is downloaded to a temporary name, its xxh64 checked
  against the manifest (``shards.file_xxh64``, the loader's own content check), then renamed into
  place, so a crash leaves no half file under a shard name. One lock file per mirror makes the
  processes of a node (DDP ranks; loader workers never download: the mirror is complete before
  they start) download each shard once; the others wait and find it there.
* **Bounded** (``STACKLM_CACHE_MAX_BYTES``): before downloading, the least recently used other
  mirrors under the cache root that no process has open are evicted until the new one fits; a
  single shard set larger than the limit is refused with its size (the loader's global
  shuffle reads every shard every epoch, so a smaller cache would download the set again
  each epoch) unless its train split is streamed (``stream``, ``shard_window``): then only
  its manifests and side files are mirrored here and ``prefetch`` fetches the token files
  ahead of the reader into a cache the limit bounds.
* **Faults** (``call``): throttling (``SlowDown``, 503) and transient errors are retried with
  exponential backoff and jitter, each retry counted (``RETRIES``) and said on stderr; wrong
  credentials, a missing bucket or a missing object are one ``RemoteError`` naming the URL
  and the fix.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from stacklm import atomic
from stacklm.data.storage.manifest import MANIFEST_NAME as MANIFEST
from stacklm.data.storage.shards import file_xxh64, meta_path, parse_dtype, remove_temp_files, tokens_path
from stacklm.errors import RemoteError

T = TypeVar("T")

_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
MAX_ATTEMPTS = 8  # tries of one request (the first and 7 retries)
BACKOFF_S = 0.25  # first retry delay; doubled each time, jittered, capped at BACKOFF_MAX_S
BACKOFF_MAX_S = 20.0
RETRIES = {"count": 0}  # retries taken in this process (counted, and each one said on stderr)
_IN_USE: dict[str, Any] = {}  # mirror dir -> open file holding a shared lock while this process reads it
_CREDENTIALS_FIX = ("check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or the fsspec "
                    "storage options) and the bucket name")


def is_remote(path: Any) -> bool:
    """True for a URL with a protocol other than ``file://`` (a ``Path`` is always local)."""
    if not isinstance(path, str):
        return False
    m = _URL_RE.match(path)
    return bool(m) and m.group(1).lower() not in ("file", "local")


def file_url_path(path: Any) -> Any:
    """The local path a ``file://`` URL names (``file:///data/out`` -> ``/data/out``), else ``path``
    unchanged: a local URL is written where it says, not into a folder named ``file:``."""
    if isinstance(path, str) and path[:7].lower() == "file://":
        from urllib.parse import unquote, urlparse

        parsed = urlparse(path)
        return unquote((parsed.netloc if parsed.netloc not in ("", "localhost") else "") + parsed.path) or "/"
    return path


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def filesystem(url: str):
    """The fsspec filesystem of ``url`` (cached by fsspec); a missing protocol package is one
    line naming what to install."""
    try:
        import fsspec
    except ImportError:
        raise RemoteError(f"{url}: remote data dirs need fsspec and the protocol's package: pip install 'stacklm[s3]'", path=url) from None
    try:
        return fsspec.core.url_to_fs(url)[0]
    except ImportError as e:
        raise RemoteError(f"{url}: no fsspec filesystem for this URL ({e}); install its package (s3://: pip install "
                          "'stacklm[s3]'; gs://: gcsfs; hf://: huggingface_hub)", path=url) from None
    except ValueError as e:  # fsspec: "Protocol not known: ..."
        raise RemoteError(f"{url}: {e}; give a local path or a URL of an fsspec protocol (s3://, gs://, hf://, ...)", path=url) from None


def _transient(e: BaseException) -> bool:
    """Worth retrying: throttling, 5xx, dropped connections, timeouts. Not: access denied, a
    missing bucket or object, a bad request."""
    if isinstance(e, (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    text = f"{type(e).__name__} {e}"
    if any(s in text for s in ("SlowDown", "reduce your request rate", "Throttl", "ServiceUnavailable", "InternalError",
                               "RequestTimeout", "503", "500 ", "Connection", "timed out", "ClientPayloadError")):
        return True
    return isinstance(e, OSError) and e.errno in (errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET,
                                                  getattr(errno, "EREMOTEIO", errno.EIO))


def bucket_of(url: str) -> str:
    m = _URL_RE.match(url)
    rest = url[m.end():] if m else url
    return f"{m.group(0) if m else ''}{rest.split('/', 1)[0]}"


def _final_error(e: BaseException, url: str, what: str, attempts: int) -> RemoteError:
    if isinstance(e, PermissionError):
        return RemoteError(f"{url}: access denied while {what} ({e}); {_CREDENTIALS_FIX}", path=url)
    if isinstance(e, FileNotFoundError):
        bucket = bucket_of(url)
        try:
            bucket_there = filesystem(url).exists(bucket)
        except Exception:  # noqa: BLE001 - asking is best effort; the message below stands anyway
            bucket_there = True
        if not bucket_there:
            err = RemoteError(f"{url}: the bucket {bucket} does not exist (or these credentials cannot see it); {_CREDENTIALS_FIX}", path=url)
            err.bucket_missing = True  # ``call(missing_ok=True)`` raises this one (the message names the URL: no test on it)
            return err
        return RemoteError(f"{url} does not exist ({what})", path=url)
    tried = f" after {attempts} attempts" if attempts > 1 else ""
    return RemoteError(f"{url}: {what} failed{tried}: {type(e).__name__}: {e}; check the endpoint and network (or {_CREDENTIALS_FIX})", path=url)


def call(fn: Callable[[], T], url: str, what: str, *, missing_ok: bool = False) -> T | None:
    """``fn()`` with retries on throttling and transient errors (exponential backoff with
    jitter); a permanent failure is a ``RemoteError`` naming ``url``. ``missing_ok``: a missing
    object (the bucket being there) returns None."""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            return fn()
        except RemoteError:
            raise
        except Exception as e:  # noqa: BLE001 - sorted into transient / permanent right here
            if missing_ok and isinstance(e, FileNotFoundError):
                err = _final_error(e, url, what, attempt)
                if getattr(err, "bucket_missing", False):
                    raise err from e
                return None
            if not _transient(e) or attempt == MAX_ATTEMPTS:
                raise _final_error(e, url, what, attempt) from e
            delay = min(BACKOFF_MAX_S, BACKOFF_S * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
            RETRIES["count"] += 1
            print(f"stacklm: {url}: {what} failed ({type(e).__name__}: {str(e)[:120]}); retry {attempt}/{MAX_ATTEMPTS - 1} "
                  f"in {delay:.2f}s", file=sys.stderr)
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def read_bytes(url: str, *, missing_ok: bool = False) -> bytes | None:
    fs = filesystem(url)
    return call(lambda: fs.cat_file(url), url, "reading", missing_ok=missing_ok)


def read_json(url: str) -> dict[str, Any]:
    data = read_bytes(url, missing_ok=True)
    if data is None:
        raise RemoteError(f"{url} is missing: {url.rsplit('/', 1)[0]} is not a finished shard set (prebuild writes the "
                          f"manifest last); build one with `stacklm prebuild --config CONFIG --out {url.rsplit('/', 1)[0]}`", path=url)
    try:
        out = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RemoteError(f"{url} is not readable JSON ({e}); rebuild with `stacklm prebuild`", path=url) from None
    if not isinstance(out, dict):
        raise RemoteError(f"{url}: expected a JSON object; rebuild with `stacklm prebuild`", path=url)
    return out


def put_file(local: Path, url: str) -> None:
    fs = filesystem(url)
    call(lambda: fs.put_file(str(local), url), url, f"uploading {local.name}")


# ---------------------------------------------------------------------------------------
# Writing: build locally, upload, manifests last
# ---------------------------------------------------------------------------------------
def cache_root() -> Path:
    return Path(os.environ.get("STACKLM_CACHE_DIR") or Path.home() / ".cache" / "stacklm")


def _key(url: str) -> str:
    return hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]


def staging_dir(url: str, command: str = "") -> Path:
    """Where ``prebuild --out URL`` builds before uploading (resumed from there after a crash);
    ``command``: another command's own folder for the same URL (``prebuild-datatrove``'s state is
    not ``prebuild``'s, so one must never resume the other's)."""
    return cache_root() / "staging" / (f"{command}-{_key(url)}" if command else _key(url))


def check_reachable(url: str) -> None:
    """One request before any work is started for ``url``: its protocol has a filesystem here
    and its bucket is there with these credentials; otherwise the ``RemoteError`` naming the fix.
    ``url`` itself need not exist yet."""
    fs = filesystem(url)
    call(lambda: fs.info(url), url, "checking", missing_ok=True)


def upload_shard_set(local: Path, url: str) -> int:
    """Upload a finished local shard set to ``url``: per split every shard's side file, tokens,
    meta, then the split manifest; the dedup evidence; the top manifest last. Returns the files
    uploaded."""
    top = json.loads((local / MANIFEST).read_bytes())
    n = 0
    for name, entry in top.get("splits", {}).items():
        split_local, split_url = local / entry["path"], join(url, entry["path"])
        m = json.loads((split_local / MANIFEST).read_bytes())
        for shard in m["shards"]:
            files = [p for p in (split_local / f"{shard['name']}.prov.npz",) if p.exists()]
            files += [tokens_path(split_local, shard["name"]), meta_path(split_local, shard["name"])]
            for p in files:
                put_file(p, join(split_url, p.name))
                n += 1
        put_file(split_local / MANIFEST, join(split_url, MANIFEST))
        n += 1
    from stacklm.data.dedup.evidence import BUILD_EVIDENCE_DIR, build_evidence_files

    for p in build_evidence_files(local):  # why each document was removed (``stacklm inspect --why``)
        put_file(p, join(url, f"{BUILD_EVIDENCE_DIR}/{p.name}"))
        n += 1
    put_file(local / MANIFEST, join(url, MANIFEST))
    return n + 1


# ---------------------------------------------------------------------------------------
# Reading: the local mirror
# ---------------------------------------------------------------------------------------
def mirror_dir(url: str) -> Path:
    return cache_root() / "remote" / _key(url)


def _max_bytes() -> int | None:
    v = os.environ.get("STACKLM_CACHE_MAX_BYTES")
    if not v:
        return None
    try:
        return int(float(v))
    except ValueError:
        raise RemoteError(f"STACKLM_CACHE_MAX_BYTES={v!r} is not a number of bytes; set e.g. 200e9") from None


def _split_bytes(m: dict[str, Any]) -> int:
    item = parse_dtype(m["dtype"], where=MANIFEST).itemsize
    return sum(int(s["n_seq"]) for s in m["shards"]) * int(m["seq_len"]) * item


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _evict_for(target: Path, need: int, limit: int, url: str) -> list[Path]:
    """Remove least recently used mirrors (not ``target``, not open in any process) until
    ``need`` more bytes fit under ``limit``; returns what was removed."""
    if need > limit:
        raise RemoteError(f"{url} needs {need:,} bytes of local cache but STACKLM_CACHE_MAX_BYTES is {limit:,}: the loader's "
                          "global shuffle reads every shard each epoch; raise the limit (or point STACKLM_CACHE_DIR at a "
                          "bigger disk), or stream the train split through a smaller cache with data.shard_window", path=url)
    others = [p for p in (target.parent.iterdir() if target.parent.is_dir() else ()) if p.is_dir() and p != target]
    used = {p: _du(p) for p in others}
    total = sum(used.values()) + (_du(target) if target.exists() else 0)
    removed = []
    for p in sorted(others, key=lambda p: (p / ".used").stat().st_mtime if (p / ".used").exists() else 0):
        if total + need <= limit:
            break
        with open(p / ".inuse", "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a process reads it now
            shutil.rmtree(p, ignore_errors=True)
        total -= used[p]
        removed.append(p)
        print(f"stacklm: cache {target.parent}: evicted {p.name} ({used[p]:,} bytes, least recently used) to fit {url}", file=sys.stderr)
    if total + need > limit:  # what is left is open in running processes: never pulled from under them, but said
        print(f"stacklm: cache {target.parent}: {total + need:,} bytes with {url}, over STACKLM_CACHE_MAX_BYTES={limit:,}: "
              "the other mirrors are open in running processes; they are evicted once those end", file=sys.stderr)
    return removed


def _download_shard(split_url: str, split_local: Path, entry: dict[str, Any], expect_bytes: int, *, meta: bool = True) -> None:
    """tokens (hash-checked) to a temporary name, renamed into place; then meta (meta last, as
    ``write_shard`` does; ``meta=False``: the streamed cache reads the row count from the
    manifest and skips it). A hash mismatch is downloaded once more, then refused naming the URL."""
    name = entry["name"]
    fs = filesystem(split_url)
    tpath = tokens_path(split_local, name)
    turl = join(split_url, tpath.name)
    tmp = split_local / f"{atomic.TMP_MARK}{tpath.name}.{os.getpid()}"
    for attempt in (1, 2):
        try:
            call(lambda: fs.get_file(turl, str(tmp)), turl, "downloading")
            size = tmp.stat().st_size
            digest = file_xxh64(tmp)
            if size == expect_bytes and digest == entry.get("xxh64"):
                os.replace(tmp, tpath)
                break
        finally:
            tmp.unlink(missing_ok=True)
        if attempt == 2:
            raise RemoteError(f"{turl}: downloaded {size:,} bytes with content hash {digest}, but the manifest lists "
                              f"{expect_bytes:,} bytes with {entry.get('xxh64')} (twice): the object changed after the build; "
                              f"rebuild with `stacklm prebuild --out {split_url.rsplit('/', 1)[0]}`", path=turl)
        RETRIES["count"] += 1
        print(f"stacklm: {turl}: download did not match the manifest's size/hash; downloading again", file=sys.stderr)
    if not meta:
        return
    murl = join(split_url, meta_path(split_local, name).name)
    atomic.atomic_write_bytes(meta_path(split_local, name), read_bytes(murl), fsync_parent=False)


def mirror(url: str, *, manifests_only: bool = False, stream: Sequence[str] = (), limit: int | None = None) -> Path:
    """The local mirror of the shard set at ``url`` (a top directory or one split), complete and
    content-checked; only what changed since the last mirror is downloaded. See the module.

    ``stream``: splits whose token files are *not* downloaded here but streamed through the
    bounded cache (``prefetch``): their manifests and provenance side files are mirrored, token
    files of shards whose hash changed are removed, the rest stays as a warm start. ``limit``:
    the cache limit in bytes (default ``STACKLM_CACHE_MAX_BYTES``)."""
    local = mirror_dir(url)
    local.mkdir(parents=True, exist_ok=True)
    top = read_json(join(url, MANIFEST))
    if "shards" in top:
        splits = {"": top}
    else:
        splits = {name: read_json(join(url, e["path"], MANIFEST)) for name, e in top.get("splits", {}).items()}
        for name in splits:
            if not re.fullmatch(r"[A-Za-z0-9_.-]+", top["splits"][name]["path"]) or top["splits"][name]["path"] in (".", ".."):
                raise RemoteError(f"{join(url, MANIFEST)}: field 'splits.{name}.path' is not a plain directory name; rebuild", path=url)
    with open(local / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the node's other processes wait here, then find every shard in place
        in_use = _IN_USE.get(str(local))
        if in_use is None:
            in_use = _IN_USE[str(local)] = open(local / ".inuse", "a+")
            fcntl.flock(in_use, fcntl.LOCK_SH)
        (local / ".used").touch()
        if not manifests_only:
            limit = _max_bytes() if limit is None else limit
            if limit is not None:
                need = sum(_split_bytes(m) for m in splits.values())
                if stream:  # the streamed splits take what the limit leaves them, and evict among themselves
                    need = min(need, limit) - (_du(local) if local.exists() else 0)
                _evict_for(local, max(0, need), limit, url)
        for name, m in splits.items():
            rel = top["splits"][name]["path"] if name else ""
            split_local, split_url = (local / rel, join(url, rel)) if rel else (local, url)
            split_local.mkdir(parents=True, exist_ok=True)
            if not manifests_only:
                _sync_split(split_url, split_local, m, tokens=(name or m.get("split")) not in stream)
            if rel:
                atomic.atomic_write_bytes(split_local / MANIFEST, json.dumps(m).encode(), fsync_parent=False)
        atomic.atomic_write_bytes(local / MANIFEST, json.dumps(top).encode())  # last: the mirror is whole
    return local


def _sync_split(split_url: str, split_local: Path, m: dict[str, Any], *, tokens: bool = True) -> None:
    """Bring one split's mirror up to date. ``tokens=False`` (a streamed split): everything but
    the token and meta files, which ``prefetch`` fetches as the reader needs them; its files and
    in-flight downloads (other ranks of the node may stream already) are left alone, but a
    cached token file whose shard changed is removed."""
    if tokens:
        remove_temp_files(split_local)  # of a download killed midway (we hold the mirror's lock: no one else writes)
    old_path = split_local / MANIFEST
    old = {}
    if old_path.exists():
        raw = old_path.read_bytes()
        try:
            old = {s["name"]: s.get("xxh64") for s in json.loads(raw).get("shards", [])}
        except (ValueError, AttributeError, TypeError):
            old = {}
        # Until the new one is written, a changed split is not a finished mirror. An unchanged one
        # keeps its manifest: another process of the node may be opening the split right now
        # (it mirrored first and reads outside the lock); removing it failed that reader.
        if raw != json.dumps(m).encode():
            old_path.unlink()
    item = parse_dtype(m["dtype"], where=join(split_url, MANIFEST)).itemsize
    seq_len = int(m["seq_len"])
    wanted = set()
    prov = bool(m.get("provenance"))
    for entry in m["shards"]:
        name = entry["name"]
        expect = int(entry["n_seq"]) * seq_len * item
        tpath, mpath = tokens_path(split_local, name), meta_path(split_local, name)
        wanted |= {tpath.name, mpath.name, f"{name}.prov.npz"}
        if not tokens:
            fresh = old.get(name) == entry.get("xxh64")
            if not fresh or (tpath.exists() and tpath.stat().st_size != expect):
                tpath.unlink(missing_ok=True)  # another version's copy: fetched again when read
            mpath.unlink(missing_ok=True)  # not used by a streamed split (rows come from the manifest)
            fresh = fresh and not (prov and not (split_local / f"{name}.prov.npz").exists())
        else:
            fresh = (old.get(name) == entry.get("xxh64") and tpath.exists() and tpath.stat().st_size == expect and mpath.exists())
        if not fresh and tokens:  # meta first: a tokens file without its meta is no shard, even for a moment
            mpath.unlink(missing_ok=True)
            tpath.unlink(missing_ok=True)
            _download_shard(split_url, split_local, entry, expect)
        ppath = split_local / f"{name}.prov.npz"
        if prov and (not fresh or not ppath.exists()):
            atomic.atomic_write_bytes(ppath, read_bytes(join(split_url, ppath.name)), fsync_parent=False)
    for p in split_local.iterdir():  # shards of an older version of the set, half files of a killed run
        if not tokens and p.name.startswith("."):
            continue  # the streamed cache's locks, reservations and in-flight downloads
        if p.is_file() and p.name not in wanted and p.name not in (MANIFEST, ".lock", ".inuse", ".used"):
            p.unlink()
    atomic.fsync_dir(split_local)


def local_path(path: str | os.PathLike, **kw) -> str | os.PathLike:
    """``path`` itself when local; the local mirror of a remote URL (``mirror``)."""
    return str(mirror(path, **kw)) if is_remote(path) else file_url_path(path)
