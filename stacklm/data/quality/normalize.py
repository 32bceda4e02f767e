"""The one text normalisation of dedup and holdout: two texts that normalise alike are one document.

Unicode NFKC, ``str.casefold`` (full lowercasing), every run of Unicode whitespace (what
``str.split()`` splits on) collapsed to one space, leading and trailing whitespace stripped.
Exact dedup, near dedup and the train/val holdout all use this definition, so a copy that
differs only in case, whitespace or Unicode form is a duplicate and can never land in both
splits.
"""

from __future__ import annotations

import re
import unicodedata

# Normalise huge documents in slices cut at whitespace, so ``str.split`` never builds a list of
# tens of millions of words at once (a 100 MB document would need ~1 GB for that list).
_NORMALIZE_SLICE = 1 << 22
_SPACE = re.compile(r"\s")  # same characters as str.isspace / str.split


def normalize_text(text: str) -> str:
    """NFKC, casefolded, whitespace runs collapsed to one space, stripped (see module doc)."""
    if not unicodedata.is_normalized("NFKC", text):
        text = unicodedata.normalize("NFKC", text)
    text = text.casefold()
    if len(text) <= _NORMALIZE_SLICE:
        return " ".join(text.split())
    pieces: list[str] = []
    start, n = 0, len(text)
    while start < n:
        end = min(n, start + _NORMALIZE_SLICE)
        if end < n and not text[end].isspace():  # move the cut to the next whitespace
            m = _SPACE.search(text, end)
            end = m.start() if m else n
        piece = " ".join(text[start:end].split())
        if piece:
            pieces.append(piece)
        start = end
    return " ".join(pieces)
