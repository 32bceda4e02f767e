"""What near dedup compares: the shingles of a document, as 64-bit hashes, vectorised.

Two kinds (``dedup.shingle`` in the pipeline config, ``MinHasher(shingle=...)``):

- ``char`` (default, ``shingle_size`` 7): every character ``shingle_size``-gram of
  ``normalize_text(text)`` (NFKC, casefolded, whitespace collapsed). A document shorter than
  one shingle is padded with NULs to one shingle, so empty documents are near-duplicates of
  each other. Hashed with a polynomial rolling hash (prefix sums, so the cost does not grow
  with k) and the murmur3 64-bit finaliser, in cache-sized chunks.
- ``word`` (``shingle_size`` 5: FineWeb's and datatrove's ``MinhashConfig.n_grams``): every
  ``shingle_size`` consecutive words of the text as datatrove's ``MinhashDedupSignature``
  words it. **The same as datatrove**: its ``simplify_text`` with the default
  ``TextNormConfig`` (lowercase, every run of digits -> ``0``, datatrove's punctuation set ->
  spaces, whitespace collapsed, NFD with combining marks (``Mn``) removed), words taken in
  order, an n-gram is n consecutive words. **What differs**: (1) the text is
  ``normalize_text``-ed first (NFKC and casefold: full-width letters, ligatures and ``ß``
  compare equal to their plain forms), the same normalisation exact dedup uses; (2) words are
  split at whitespace, not by datatrove's per-language tokenizer (spaCy for English): the text
  has no punctuation left by then, so they differ only where spaCy splits a word on its own,
  e.g. ``cannot`` -> ``can not``, and in text written without spaces (Chinese, Japanese) where
  a word here is a whole run between spaces and datatrove's tokenizer for the language cuts
  it; (3) an n-gram is hashed from its words' hashes (below), not
  with xxhash64 of the words joined by spaces, and the signature is one-permutation MinHash
  (``minhash``), not datatrove's 112 permutations; (4) a document with fewer than n words
  is one shingle of its words padded with NUL words, as the char path pads a short document,
  so short copies are found (datatrove gives such a document no signature: it is never
  removed). The normalisation steps are datatrove's own code (``datatrove.utils.text``, the
  ``scale`` extra), except two done here with the same result: the combining-mark removal
  (one ``regex`` substitution instead of a Python loop over characters) and the whitespace
  collapse (``str.split``, which the word split does anyway, instead of a regex).

  Hashing, per pass of documents (no Python loop per word or shingle), with decontamination's
  word n-gram hashes (``stacklm.data.quality.ngrams``: the one home of word n-gram hashing):
  the pass's words are UTF-8 encoded into one buffer, each word hashed by a polynomial over
  its bytes (prefix sums) and its length, avalanched; an n-gram's hash is its n word hashes
  times n fixed odd constants (one per position), summed and avalanched.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator, Sequence
from functools import lru_cache

import numpy as np

from stacklm.data.quality.ngrams import joined_word_hashes, ngram_hashes
from stacklm.data.quality.normalize import normalize_text

SHINGLES = ("char", "word")
DEFAULT_SHINGLE_SIZES = {"char": 7, "word": 5}
_CHUNK = 1 << 16  # shingles hashed per numpy step: keeps temporaries in L2 cache
_PASS_CHARS = 1 << 16  # characters per pass: small temporaries stay in cache and bound memory on huge documents


def default_shingle_size(shingle: str) -> int:
    if shingle not in DEFAULT_SHINGLE_SIZES:
        raise ValueError(f"shingle must be one of {SHINGLES}, got {shingle!r}")
    return DEFAULT_SHINGLE_SIZES[shingle]


def _fmix64(h: np.ndarray, tmp: np.ndarray | None = None) -> np.ndarray:
    """murmur3's 64-bit finaliser, in place (full avalanche: every output bit depends on all)."""
    tmp = np.empty_like(h) if tmp is None else tmp[: h.size]
    for mult in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        np.right_shift(h, np.uint64(33), out=tmp)
        np.bitwise_xor(h, tmp, out=h)
        np.multiply(h, np.uint64(mult), out=h)
    np.right_shift(h, np.uint64(33), out=tmp)
    np.bitwise_xor(h, tmp, out=h)
    return h


def _powers(base: int, n: int) -> np.ndarray:
    """``base**i mod 2^64`` for ``i < n``."""
    return np.cumprod(np.r_[np.uint64(1), np.full(n - 1, base, dtype=np.uint64)], dtype=np.uint64)


class _Shingles:
    """What both kinds share: texts in passes of about ``_PASS_CHARS`` characters. A subclass
    gives ``pieces`` (a prepared text cut so that every shingle lies whole in a piece) and
    ``_hash_pieces`` (the (row, hash) arrays of a pass's pieces)."""

    def pieces(self, text: str) -> Iterator[str]:
        raise NotImplementedError

    def _hash_pieces(self, pieces: list[str], rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def passes(self, texts: Sequence[str]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(row, shingle hash) arrays for every shingle of every prepared text, a bounded number
        of characters at a time (a huge text is cut into overlapping pieces)."""
        pieces: list[str] = []
        rows: list[int] = []
        chars = 0
        for row, text in enumerate(texts):
            for piece in self.pieces(text):
                pieces.append(piece)
                rows.append(row)
                chars += len(piece)
                if chars >= _PASS_CHARS:
                    yield self._hash_pieces(pieces, rows)
                    pieces, rows, chars = [], [], 0
        if pieces:
            yield self._hash_pieces(pieces, rows)


class CharShingles(_Shingles):
    """Character ``size``-grams of the normalised text (module docstring)."""

    def __init__(self, size: int, base: int) -> None:
        self.size = int(size)
        inv = pow(base, -1, 1 << 64)  # base is odd, so it is invertible mod 2^64
        n = _CHUNK + self.size
        self._pow = _powers(base, n)
        self._inv_pow = _powers(inv, n)

    def prepare(self, text: str, normalized: bool = False) -> str:
        """Normalised text (``normalized=True``: already ``normalize_text``-ed), NUL-padded to
        at least one shingle."""
        norm = text if normalized else normalize_text(text)
        return norm if len(norm) >= self.size else norm.ljust(self.size, "\0")

    def _window_hashes(self, cps: np.ndarray) -> np.ndarray:
        """64-bit hash of every ``size``-window of a ``uint32`` code point array."""
        k = self.size
        n = cps.size - k + 1
        out = np.empty(max(n, 0), dtype=np.uint64)
        size = min(max(n, 0), _CHUNK)
        buf = np.empty(size + k, dtype=np.uint64)
        prefix = np.empty(size + k, dtype=np.uint64)
        tmp = np.empty(size, dtype=np.uint64)
        for s in range(0, n, _CHUNK):
            m = min(_CHUNK, n - s)
            c = buf[: m + k - 1]
            c[:] = cps[s : s + m + k - 1]
            np.multiply(c, self._pow[: m + k - 1], out=c)  # c_i * B^i
            prefix[0] = 0
            np.cumsum(c, out=prefix[1 : m + k])  # P[i] = sum_{j<i} c_j B^j (mod 2^64)
            w = out[s : s + m]
            np.subtract(prefix[k : k + m], prefix[:m], out=w)  # sum_{j<k} c_{i+j} B^{i+j}
            np.multiply(w, self._inv_pow[:m], out=w)  # ... * B^-i: the same for equal windows
            _fmix64(w, tmp)
        return out

    def pieces(self, text: str) -> Iterator[str]:
        """A prepared text in overlapping pieces of at most ``_PASS_CHARS`` shingles."""
        k = self.size
        n_shingles = len(text) - k + 1
        if n_shingles <= _PASS_CHARS:
            yield text
            return
        for s in range(0, n_shingles, _PASS_CHARS):
            yield text[s : min(n_shingles, s + _PASS_CHARS) + k - 1]

    def _hash_pieces(self, pieces: list[str], rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        k = self.size
        cps = np.frombuffer("".join(pieces).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        hashes = self._window_hashes(cps)
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
        ends = np.cumsum(lengths)
        if len(pieces) > 1:  # drop the k-1 windows that straddle two pieces
            straddle = (ends[:-1, None] - k + 1 + np.arange(k - 1)).ravel()
            keep = np.ones(hashes.size, dtype=bool)
            keep[straddle] = False
            hashes = hashes[keep]
        return np.repeat(np.asarray(rows, dtype=np.int64), lengths - k + 1), hashes


@lru_cache(maxsize=1)
def _datatrove_text():
    """datatrove's ``simplify_text``, its config without the last two steps, and the regex of
    combining marks (``Mn``) that step drops; imported on first use (the ``scale`` extra)."""
    import regex

    from stacklm.optional import require

    text_mod = require("datatrove.utils.text", "scale", "dedup.shingle 'word' (datatrove's word normalisation)")
    # without its whitespace step (a regex, the slowest of them): ``str.split`` below collapses the same runs
    config = text_mod.TextNormConfig(norm_whitespace=False, norm_unicode_diacritics=False)
    return text_mod.simplify_text, config, regex.compile(r"\p{Mn}+")


def simplify_words(norm: str) -> str:
    """``norm`` (``normalize_text``-ed) as datatrove's ``simplify_text`` (default
    ``TextNormConfig``) leaves it, words joined by single spaces (module docstring)."""
    simplify, no_diacritics, marks = _datatrove_text()
    # datatrove's steps up to the whitespace: lowercase, digits -> 0, punctuation -> spaces
    text = simplify(norm, no_diacritics)
    if not text.isascii():  # NFD, then drop combining marks: datatrove's last step, without a loop per character
        text = marks.sub("", unicodedata.normalize("NFD", text))
    return " ".join(text.split())


def _word_pieces(text: str, k: int, size: int) -> Iterator[str]:
    """``text`` (words joined by single spaces) in pieces of about ``size`` characters cut at
    spaces, each holding at least ``k`` words and starting ``k - 1`` words before the previous
    one ended, so every n-gram lies whole in some piece."""
    start = 0
    while len(text) - start > size:
        kth = start - 1
        for _ in range(k):  # the end of the k-th word from start
            kth = text.find(" ", kth + 1)
            if kth < 0:
                break
        if kth < 0:
            break
        cut = max(text.rfind(" ", start, start + size), kth)
        yield text[start:cut]
        back = cut
        for _ in range(k - 1):
            back = text.rfind(" ", start, back)
        start = back + 1
    yield text[start:]


class WordShingles(_Shingles):
    """Word ``size``-grams, the words as datatrove's MinHash takes them (module docstring)."""

    def __init__(self, size: int) -> None:
        self.size = int(size)
        _datatrove_text()  # a missing extra is refused when the deduper is built, not at its first document

    def prepare(self, text: str, normalized: bool = False) -> str:
        """The words (``simplify_words``) joined by single spaces, padded with NUL words to at
        least one n-gram (a NUL never survives ``simplify_text``: it is in its punctuation)."""
        words = simplify_words(text if normalized else normalize_text(text))
        n_words = words.count(" ") + 1 if words else 0
        if n_words < self.size:
            words = " ".join(([words] if words else []) + ["\0"] * (self.size - n_words))
        return words

    def pieces(self, text: str) -> Iterator[str]:
        return _word_pieces(text, self.size, _PASS_CHARS)

    def _hash_pieces(self, pieces: list[str], rows: list[int]) -> tuple[np.ndarray, np.ndarray]:
        k = self.size
        # every word of the pass hashed at once, then every n-gram (decontamination's hashes)
        words = joined_word_hashes(" ".join(pieces).encode("utf-8", "surrogatepass"))[0]
        grams = ngram_hashes(words, k)
        piece_words = np.fromiter((p.count(" ") + 1 for p in pieces), dtype=np.int64, count=len(pieces))
        piece_of = np.repeat(np.arange(len(pieces)), piece_words)
        whole = piece_of[: grams.size] == piece_of[k - 1 :]  # an n-gram inside one piece, not across two
        return np.asarray(rows, dtype=np.int64)[piece_of[: grams.size][whole]], grams[whole]


def make_shingles(shingle: str, size: int, base: int) -> CharShingles | WordShingles:
    """The shingler of ``shingle`` (``char``|``word``) and ``size``; ``base`` is the char path's
    rolling-hash base (``MinHasher`` draws it from its seed)."""
    if shingle == "char":
        return CharShingles(size, base)
    if shingle == "word":
        return WordShingles(size)
    raise ValueError(f"shingle must be one of {SHINGLES}, got {shingle!r}")
