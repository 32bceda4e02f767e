"""Exact word n-grams for decontamination: the normalization, their 64-bit hashes, the shared index.

**Words.** A text is NFKC-normalized, then its words are the runs of ``\\w`` characters
(letters, digits, ``_``), each casefolded. So ``"The Answer,\\nIS 42!"`` and ``"the answer is
42"`` are the same four words: case, punctuation and line breaks never hide an overlap. This is
the NFKC + ``casefold`` of ``normalize.py`` (dedup, holdout), plus punctuation removal, which an
n-gram match needs (a training copy of a test question rarely keeps every comma) and a
duplicate test does not.

**Hashes.** Each word is hashed from its UTF-8 bytes with a polynomial hash over numpy prefix
sums (no Python loop per word), mixed by the splitmix64 finalizer; an n-gram's hash combines
its ``n`` word hashes with ``n`` fixed odd multipliers, mixed again. The hashes are the same in
every process (no ``PYTHONHASHSEED``), so one index serves every loader worker and prebuild task.

**The index** of the evaluation sets (``NgramIndex``) is a sorted ``uint64`` array of the
n-gram hashes (one entry per distinct n-gram and set), beside the set of each entry and the
position of the n-gram's words in the stored, normalized evaluation text. A lookup is a
``searchsorted``; every hash hit is then *confirmed* by comparing the document's n words with
the stored words, so a hash collision can never count a document as contaminated: no false
hit. Distinct n-grams are told apart when building by two independent 64-bit hashes, so an
evaluation n-gram is lost (a miss) only if two distinct n-grams agree on 128 bits. Not a Bloom
filter: no false positive rate to tune, and the confirmation makes the answer exact.

The index is written once as plain ``.npy`` files (read back with ``allow_pickle=False``,
memory-mapped, so workers on one machine share the pages) plus a ``meta.json``, in a folder
named by a content hash of the evaluation sets and ``n`` (``index_key``); a second process that
finds the folder loads it instead of building it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import unicodedata
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_WORD = re.compile(r"\w+")
_M64 = (1 << 64) - 1
_P = 0x100000001B3  # the FNV prime: odd, so it has an inverse mod 2**64
_P_INV = pow(_P, -1, 1 << 64)
FILES = ("hashes", "hashes2", "sets", "pos", "starts", "ends", "text")


def nfkc(text: str) -> str:
    return text if unicodedata.is_normalized("NFKC", text) else unicodedata.normalize("NFKC", text)


# ASCII text (most of it) takes a faster path with the same result: there NFKC is the identity,
# ``\w`` is [A-Za-z0-9_] and casefold is lower, so mapping every other character to a space and
# splitting finds the same words as the regex (tests/data/test_decontam.py checks both paths).
_ASCII_NON_WORD = {c: " " for c in range(128) if not (chr(c).isalnum() or chr(c) == "_")}


def words_of(text: str) -> list[str]:
    """The normalized words of ``text`` (module doc): ``\\w`` runs of its NFKC form, casefolded."""
    if text.isascii():
        return text.translate(_ASCII_NON_WORD).lower().split()
    found = _WORD.findall(nfkc(text))
    if not found:
        return []
    # casefold is context-free and never yields a space, so one call over the joined words
    # gives each word's casefold (C speed instead of a Python call per word)
    return " ".join(found).casefold().split(" ")


def word_spans(text: str) -> tuple[str, list[tuple[int, int]]]:
    """``(NFKC text, [(start, end)] of each word in it)``: where ``words_of``'s words lie, for cutting."""
    t = nfkc(text)
    return t, [m.span() for m in _WORD.finditer(t)]


def _fmix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on uint64 (wrap-around multiplication is intended)."""
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * np.uint64(0xBF58476D1CE4E5B9)
        x = x ^ (x >> np.uint64(27))
        x = x * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class _Powers:
    """``P**j`` and ``P**-j`` mod 2**64 for j < size, grown by doubling (shared by all calls)."""

    def __init__(self) -> None:
        self.pow = np.ones(1, dtype=np.uint64)
        self.inv = np.ones(1, dtype=np.uint64)

    def upto(self, size: int) -> tuple[np.ndarray, np.ndarray]:
        if size > len(self.pow):
            n = max(size, 2 * len(self.pow), 1 << 16)
            self.pow = self._cum(_P, n)
            self.inv = self._cum(_P_INV, n)
        return self.pow, self.inv

    @staticmethod
    def _cum(base: int, n: int) -> np.ndarray:
        steps = np.full(n, base, dtype=np.uint64)
        steps[0] = 1
        with np.errstate(over="ignore"):
            return np.cumprod(steps, dtype=np.uint64)


_POWERS = _Powers()


def _multipliers(n: int, salt: int) -> np.ndarray:
    ks = _fmix(np.arange(n, dtype=np.uint64) + np.uint64(salt))
    return ks | np.uint64(1)


def word_hashes(words: Sequence[str]) -> np.ndarray:
    """One uint64 per word (the polynomial hash of its UTF-8 bytes, mixed)."""
    return joined_word_hashes(" ".join(words).encode())[0] if words else np.zeros(0, dtype=np.uint64)


def joined_word_hashes(data: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(hashes, starts, ends)`` of the space-separated words of ``data`` (byte offsets): the
    words must be non-empty (one space between two). Also near dedup's word shingles
    (``stacklm.data.dedup.shingles``), which hash many documents' words in one call."""
    b = np.frombuffer(data, dtype=np.uint8)
    pw, inv = _POWERS.upto(len(b) + 1)
    spaces = np.flatnonzero(b == 32)
    starts = np.concatenate(([0], spaces + 1))
    ends = np.concatenate((spaces, [len(b)]))
    with np.errstate(over="ignore"):
        prefix = np.zeros(len(b) + 1, dtype=np.uint64)
        np.cumsum((b.astype(np.uint64) + np.uint64(1)) * pw[: len(b)], dtype=np.uint64, out=prefix[1:])
        h = (prefix[ends] - prefix[starts]) * inv[starts]
        return _fmix(h ^ (ends - starts).astype(np.uint64)), starts, ends


def ngram_hashes(wh: np.ndarray, n: int, salt: int = 0) -> np.ndarray:
    """The hash of every n-gram ``wh[i:i+n]`` (length ``len(wh) - n + 1``, empty when shorter)."""
    m = len(wh) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    mult = _multipliers(n, 0x5EED + salt)
    with np.errstate(over="ignore"):
        acc = wh[:m] * mult[0]
        for k in range(1, n):
            acc += wh[k : k + m] * mult[k]
    return _fmix(acc ^ np.uint64(n))


# --------------------------------------------------------------------------- the index
class NgramIndex:
    """The evaluation sets' n-grams (module doc): ``lookup`` gives, for one document's words,
    every position whose n-gram is an evaluation n-gram, with the sets that hold it (confirmed)."""

    def __init__(self, folder: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        self.folder = folder
        self.meta = meta
        self.n = int(meta["n"])
        self.sets: list[str] = list(meta["sets"])
        self.content_hash: str = meta["content_hash"]
        self.hashes, self.set_of, self.pos = arrays["hashes"], arrays["sets"], arrays["pos"]
        self.starts, self.ends, self.text = arrays["starts"], arrays["ends"], arrays["text"]

    def __len__(self) -> int:
        return len(self.hashes)

    @classmethod
    def load(cls, folder: str | os.PathLike) -> NgramIndex:
        folder = Path(folder)
        meta = json.loads((folder / "meta.json").read_text())
        # memory-mapped: every process on the machine shares the page cache; never unpickled
        arrays = {name: np.load(folder / f"{name}.npy", mmap_mode="r", allow_pickle=False) for name in FILES}
        return cls(folder, arrays, meta)

    def lookup(self, words: Sequence[str]) -> list[tuple[int, int]]:
        """``[(position, set index)]``: every n-gram of ``words`` that an evaluation set holds,
        confirmed word for word (a position appears once per set that holds its n-gram)."""
        n, size = self.n, len(self.hashes)
        if len(words) < n or not size:
            return []
        data = " ".join(words).encode()
        wh, dstart, dend = joined_word_hashes(data)
        g = ngram_hashes(wh, n)
        at = np.searchsorted(self.hashes, g)
        cand = np.flatnonzero(at < size)
        cand = cand[self.hashes[at[cand]] == g[cand]]
        if not len(cand):
            return []
        # every (position, entry) pair whose hashes agree: an entry run per hash, usually of one
        pairs_i, pairs_j = [], []
        j = at[cand]
        live = cand
        while len(live):
            pairs_i.append(live)
            pairs_j.append(j)
            j = j + 1
            keep = j < size
            live, j = live[keep], j[keep]
            keep = self.hashes[j] == g[live]
            live, j = live[keep], j[keep]
        pi, pj = np.concatenate(pairs_i), np.concatenate(pairs_j)
        order = np.lexsort((pj, pi))
        pi, pj = pi[order], pj[order]
        p = self.pos[pj].astype(np.int64)
        es, ee = self.starts[p].tolist(), self.ends[p + n - 1].tolist()
        ds, de = dstart[pi].tolist(), dend[pi + n - 1].tolist()
        sets = self.set_of[pj].tolist()
        text = self.text
        out: list[tuple[int, int]] = []
        for i, a, b, c, d, s in zip(pi.tolist(), es, ee, ds, de, sets):
            # the confirmation, word for word (the bytes of the n words): a collision never counts
            if b - a == d - c and text[a:b].tobytes() == data[c:d]:
                out.append((i, s))
        return out


def build_index(folder: str | os.PathLike, n: int, sets: Sequence[tuple[str, Iterable[str]]], spec_key: str) -> NgramIndex:
    """Write the index of ``sets`` (``(name, texts)``; each text one evaluation record) into
    ``folder`` (named by ``spec_key``) and load it. Written to a temporary sibling and renamed, so
    a reader never sees half an index; when another process won the rename, its copy is used."""
    folder = Path(folder)
    blob = bytearray()
    starts: list[int] = []
    ends: list[int] = []
    all_h: list[np.ndarray] = []
    all_h2: list[np.ndarray] = []
    all_set: list[np.ndarray] = []
    all_pos: list[np.ndarray] = []
    records: dict[str, int] = {}
    for s, (name, texts) in enumerate(sets):
        records[name] = 0
        for text in texts:
            records[name] += 1
            words = words_of(text)
            if len(words) < n:
                continue
            base = len(starts)
            offset = len(blob)
            data = " ".join(words).encode()
            blob += data + b"\n"
            lens = np.fromiter((len(w.encode()) for w in words), dtype=np.int64, count=len(words))
            st = offset + np.concatenate(([0], np.cumsum(lens + 1)[:-1]))
            starts.extend(st.tolist())
            ends.extend((st + lens).tolist())
            wh = word_hashes(words)
            all_h.append(ngram_hashes(wh, n))
            all_h2.append(ngram_hashes(wh, n, salt=1))
            m = len(words) - n + 1
            all_set.append(np.full(m, s, dtype=np.uint16))
            all_pos.append(np.arange(base, base + m, dtype=np.uint64))
    cat = (lambda parts, dt: np.concatenate(parts).astype(dt) if parts else np.zeros(0, dtype=dt))
    h, h2, st_, pos = cat(all_h, np.uint64), cat(all_h2, np.uint64), cat(all_set, np.uint16), cat(all_pos, np.uint64)
    order = np.lexsort((pos, st_, h2, h))  # by hash, then the second hash, the set, the position
    h, h2, st_, pos = h[order], h2[order], st_[order], pos[order]
    # one entry per distinct (n-gram, set): repeated boilerplate would cost a confirmation each
    keep = np.ones(len(h), dtype=bool)
    if len(h) > 1:
        keep[1:] = (h[1:] != h[:-1]) | (h2[1:] != h2[:-1]) | (st_[1:] != st_[:-1])
    arrays = {"hashes": h[keep], "hashes2": h2[keep], "sets": st_[keep], "pos": pos[keep],
              "starts": np.asarray(starts, dtype=np.uint64), "ends": np.asarray(ends, dtype=np.uint64),
              "text": np.frombuffer(bytes(blob), dtype=np.uint8)}
    digest = hashlib.sha256()
    for name in FILES:
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    meta = {"n": n, "sets": [name for name, _ in sets], "spec_key": spec_key, "records": records,
            "ngrams": int(keep.sum()), "content_hash": digest.hexdigest()[:16]}
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name in FILES:
            np.save(tmp / f"{name}.npy", arrays[name], allow_pickle=False)
        (tmp / "meta.json").write_text(json.dumps(meta, sort_keys=True))
        try:
            os.rename(tmp, folder)
        except OSError:  # another process wrote the same index first (same key, same content)
            if not (folder / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return NgramIndex.load(folder)
