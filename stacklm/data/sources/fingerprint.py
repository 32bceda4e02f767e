"""What a saved decision was made from: a cheap fingerprint of every source of a mix, and the
check that the corpus a run reads is still that one.

Why: a global dedup index (``stacklm dedup-index``) lists removed documents by *position*
(``source/part/row`` ids), so applied to a corpus that changed since it was built it drops the
wrong documents and keeps copies twice, without a word (one record inserted at the top of one
file of a 50-document corpus: two duplicated texts kept twice, four unique documents dropped).
The index records ``corpus_fingerprint`` of what it was built from and ``check_corpus`` refuses
it, in one line naming the source and the file, when the corpus differs.

What is recorded, per source:

* local files (``kind: local``; an ``hf`` source whose ``path`` is a local folder or a packaged
  builder with local ``data_files``): every file as ``[label, size, sample hash]``; the label is
  the path relative to the files' common folder (the reader's part label, so a corpus copied to
  another machine still matches); the sample hash is xxh3-64 over the file's first and last
  16 KiB and up to 30 blocks of 4 KiB spread evenly between (at most 152 KiB read per file, once
  per process while its size, mtime and inode stay the same). A
  file added, removed, renamed, grown or shrunk is caught, and so is any edit in a sampled
  block; an edit that keeps the file's size and falls between the sampled blocks is not (a full
  hash would read the whole corpus at every start).
* a hub stream (an id): the arguments that name it (``path``, ``config_name``, ``data_dir``,
  ``data_files``, ``revision``, ``split``). Pin ``revision`` to a commit for a binding that
  holds; without one the default branch may move under the index, which nothing local can see.
* the synthetic corpus: its ``seed``, ``num_docs`` and domain, and a hash of its first 16
  documents (the generator reads the running Python's standard library).

Cost, paid by every process that applies an index (each rank and each loader worker): a stat
per file, and at most 32 reads of 4-16 KiB per file the first time the process sees it. Timed by
hand for issue 32 (500 files of 2 MiB, warm page cache): 0.09 CPU-s, 0.22 s wall per process; a
cold cache reads up to 152 KiB per file.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from typing import Any

import xxhash

from stacklm.data.sources.files import glob_files
from stacklm.data.sources.hub import PACKAGED_BUILDERS
from stacklm.errors import ConfigError

EDGE_BYTES = 16 << 10  # head and tail of each file, hashed whole
BLOCK_BYTES = 4 << 10
INNER_BLOCKS = 30  # blocks spread between head and tail
SYNTHETIC_PROBE_DOCS = 16


def file_sample_hash(path: str) -> str:
    """xxh3-64 (hex) of the file's size, head, tail and ``INNER_BLOCKS`` evenly spread blocks;
    read once per process while the file's size, mtime and inode stay the same."""
    st = os.stat(path)
    return _sample_hash(os.path.abspath(path), st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=1 << 16)
def _sample_hash(path: str, size: int, mtime_ns: int, inode: int) -> str:
    h = xxhash.xxh3_64()
    h.update(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        if size <= 2 * EDGE_BYTES + INNER_BLOCKS * BLOCK_BYTES:
            h.update(f.read())
            return h.hexdigest()
        h.update(f.read(EDGE_BYTES))
        span = size - 2 * EDGE_BYTES - BLOCK_BYTES
        for k in range(INNER_BLOCKS):
            f.seek(EDGE_BYTES + span * k // (INNER_BLOCKS - 1))
            h.update(f.read(BLOCK_BYTES))
        f.seek(size - EDGE_BYTES)
        h.update(f.read(EDGE_BYTES))
    return h.hexdigest()


def _files(paths: Iterable[str]) -> list[list[Any]]:
    """``[label, size, sample hash]`` per file, labels relative to the files' common folder."""
    paths = list(paths)
    if not paths:
        return []
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    out = []
    for p in paths:
        out.append([os.path.relpath(os.path.abspath(p), root), os.path.getsize(p), file_sample_hash(p)])
    return out


def _local_hub_files(entry: Any) -> list[str] | None:
    """The local files an ``hf`` entry reads (a local folder, or a packaged builder's local
    ``data_files``); None for a hub id (nothing local to fingerprint)."""
    path = entry.path if isinstance(entry.path, str) else None
    if path is None:
        return None
    folder = os.path.expanduser(path)
    if path in PACKAGED_BUILDERS:
        base = None
    elif os.path.isdir(folder):
        base = folder
    else:
        return None
    if entry.data_files:
        patterns = [p if base is None else os.path.join(base, p) for p in entry.data_files if "://" not in p]
    else:
        patterns = [os.path.join(base, "**", "*")] if base is not None else []
    return [p for p in glob_files(patterns) if not os.path.basename(p).startswith(".")]


def source_fingerprint(entry: Any) -> dict[str, Any]:
    """The fingerprint of one ``SourceConfig`` (module docstring)."""
    if entry.kind == "local":
        return {"kind": "local", "files": _files(glob_files(entry.paths))}
    if entry.kind == "synthetic":
        from stacklm.corpus.synthetic import synthetic_text

        probe = xxhash.xxh3_64()
        for i in range(min(SYNTHETIC_PROBE_DOCS, entry.num_docs if entry.num_docs is not None else SYNTHETIC_PROBE_DOCS)):
            probe.update(synthetic_text(i, entry.domain, entry.seed).encode("utf-8", "surrogatepass"))
        return {"kind": "synthetic", "seed": entry.seed, "num_docs": entry.num_docs, "domain": entry.domain, "probe": probe.hexdigest()}
    named = {k: getattr(entry, k) for k in ("path", "config_name", "data_dir", "data_files", "revision", "split")}
    named = {k: list(v) if isinstance(v, tuple) else v for k, v in named.items()}
    local = _local_hub_files(entry)
    return {"kind": "hf", "names": named, **({"files": _files(local)} if local is not None else {})}


def corpus_fingerprint(entries: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """``{source name: source_fingerprint}`` for the mix's entries (JSON-able)."""
    return {e.name: source_fingerprint(e) for e in entries}


def corpus_difference(recorded: Mapping[str, Any], entries: Iterable[Any]) -> str | None:
    """The first way the sources ``entries`` differ from the ``recorded`` fingerprint, in words
    naming the source and the file, or None when they match. Sources the record has and the
    mix does not are no difference (their documents are never read)."""
    for entry in entries:
        was = recorded.get(entry.name)
        if was is None:
            return f"source {entry.name!r} is not in it (it was built from {sorted(recorded)})"
        now = source_fingerprint(entry)
        if was.get("kind") != now["kind"]:
            return f"source {entry.name!r} was kind {was.get('kind')!r}, it is {now['kind']!r} now"
        for key in ("names", "seed", "num_docs", "domain", "probe"):
            if was.get(key) != now.get(key):
                what = "its generated text" if key == "probe" else key
                return f"source {entry.name!r}: {what} was {was.get(key)!r}, it is {now.get(key)!r} now"
        if "files" in was or "files" in now:
            problem = _files_difference(was.get("files") or [], now.get("files") or [])
            if problem:
                return f"source {entry.name!r}: {problem}"
    return None


def _files_difference(was: list[list[Any]], now: list[list[Any]]) -> str | None:
    before = {label: (size, digest) for label, size, digest in was}
    after = {label: (size, digest) for label, size, digest in now}
    for label in sorted(before.keys() | after.keys()):
        if label not in after:
            return f"file {label} was read to build it and is gone"
        if label not in before:
            return f"file {label} was not there when it was built"
        (size0, digest0), (size1, digest1) = before[label], after[label]
        if size0 != size1:
            return f"file {label} was {size0:,} bytes, it is {size1:,} now"
        if digest0 != digest1:
            return f"file {label} has the same size ({size1:,} bytes) but different content"
    return None


def check_corpus(recorded: Mapping[str, Any] | None, entries: Iterable[Any], what: str, fix: str) -> None:
    """Refuse, in one ``ConfigError`` line, a saved artifact (``what``: e.g. ``dedup.index:
    dedup.npz``) whose recorded corpus fingerprint differs from the sources ``entries`` (or
    that records none: it was built before the binding existed); ``fix`` ends the line."""
    if recorded is None:
        raise ConfigError(f"{what} records no fingerprint of the corpus it was built from (it is older than that check); {fix}")
    problem = corpus_difference(recorded, entries)
    if problem:
        raise ConfigError(f"{what} was built from a different corpus: {problem}; {fix}")
