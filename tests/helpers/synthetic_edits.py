"""Test and benchmark data generation for near dedup: copies edited to a chosen Jaccard similarity.

Not used by the pipeline, so it lives with the test helpers, not in the library.
``tests/data/test_dedup.py`` and ``bench/dedup.py`` measure the MinHash S-curve against exact Jaccard on real documents with these edits, which move a copy's
similarity anywhere in [0, 1] (character edits and whole-line deletions/duplications).
"""

from __future__ import annotations

import numpy as np


def edits_for_jaccard(n_shingles: int, target: float, shingle_size: int, rng: np.random.Generator) -> int:
    """About how many ``inject_edits`` edits move a copy to Jaccard ``target`` (each edit
    touches ~``shingle_size`` shingles; jittered x0.5-1.5 so copies spread around it)."""
    return max(1, round(n_shingles * (1 - target) / (shingle_size * (1 + target)) * rng.uniform(0.5, 1.5)))


def inject_edits(text: str, n_edits: int, rng: np.random.Generator) -> str:
    """``text`` with ``n_edits`` random edits: character substitutions, insertions and
    deletions, and whole-line deletions and duplications. For measuring accuracy against exact
    Jaccard (tests, ``bench/dedup.py``): the edits move a copy's similarity anywhere in [0, 1]."""
    chars = list(text)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 _().,:=\n"
    for _ in range(n_edits):
        if not chars:
            chars.append(alphabet[int(rng.integers(len(alphabet)))])
            continue
        op = int(rng.integers(10))
        pos = int(rng.integers(len(chars)))
        if op < 4:
            chars[pos] = alphabet[int(rng.integers(len(alphabet)))]
        elif op < 6:
            chars.insert(pos, alphabet[int(rng.integers(len(alphabet)))])
        elif op < 8:
            del chars[pos]
        else:  # line-level: delete or duplicate the line around pos
            start = pos
            while start > 0 and chars[start - 1] != "\n":
                start -= 1
            end = pos
            while end < len(chars) and chars[end] != "\n":
                end += 1
            line = chars[start : end + 1]
            if op == 8:
                del chars[start : end + 1]
            else:
                chars[end + 1 : end + 1] = line
    return "".join(chars)


def inject_word_edits(text: str, n_edits: int, rng: np.random.Generator) -> str:
    """``text`` with ``n_edits`` random word-level edits: a word replaced by a new one, a new
    word inserted, a word deleted, or a run of 3-8 words repeated (words joined by single
    spaces). Each edit touches about n word n-grams, so the copy's word-shingle similarity
    moves anywhere in [0, 1] (``tests/data/test_word_shingles.py``)."""
    words = text.split()
    # every draw at once (one generator call per edit dominated the cost)
    ops, where, run = rng.integers(10, size=n_edits), rng.random(n_edits), rng.integers(3, 9, size=n_edits)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    new = ["".join(w) for w in letters[rng.integers(26, size=(n_edits, 6))]]
    for op, u, r, fresh in zip(ops.tolist(), where.tolist(), run.tolist(), new):
        pos = int(u * len(words))  # < len(words); 0 for an empty list
        if not words or op < 2:
            words.insert(pos, fresh)
        elif op < 6:
            words[pos] = fresh
        elif op < 9:
            del words[pos]
        else:
            words[pos:pos] = words[pos : pos + r]
    return " ".join(words)
