"""The offline synthetic corpus: deterministic documents made of real text, with known duplicates.

Document ``index`` of a domain is a few real segments (paragraphs, code blocks, formula
groups of the embedded standard-library corpus, ``stacklm.corpus.stdlib``) drawn with a seed,
so documents share little text unless they are injected copies: every 97th is an exact copy
of an earlier original and every 53rd otherwise a light edit of one (``synthetic_duplicate_of``
is the ground truth dedup tests check against). Random access by index, so a source node over
it needs one int of state (``stacklm.data.sources.SyntheticSource``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from stacklm.corpus import stdlib

_POOL_BYTES = {"prose": 700_000, "code": 2_000_000, "math": None}  # ~1 s to load each
SYNTHETIC_DOMAINS = tuple(_POOL_BYTES)
EXACT_DUP_EVERY = 97
NEAR_DUP_EVERY = 53
_DUP_LOOKBACK = 5_000  # duplicates copy a recent document, as crawls do


@lru_cache(maxsize=None)
def _pool(domain: str) -> tuple[str, ...]:
    """Real text segments (paragraphs / code blocks / formula groups) of the embedded corpus."""
    if domain == "code":
        segments = []
        for doc in stdlib.iter_code(_POOL_BYTES["code"]):
            lines = doc.splitlines()
            segments += ["\n".join(lines[i : i + 40]) for i in range(0, len(lines), 40)]
    else:
        src = stdlib.iter_prose(_POOL_BYTES["prose"]) if domain == "prose" else stdlib.iter_math(None)
        segments = [p.strip() for doc in src for p in doc.split("\n\n")]
    segments = [s for s in segments if len(s) >= 80]
    if not segments:  # pragma: no cover - a stripped Python without its stdlib sources
        raise RuntimeError(f"synthetic corpus: no real {domain} text found in the standard library")
    return tuple(segments)


def synthetic_duplicate_of(index: int, seed: int = 0) -> tuple[str, int] | None:
    """``("exact" | "near", j)`` when document ``index`` copies earlier original ``j``, else None.

    Every 97th document (index 96, 193, ...) is an exact copy, every 53rd otherwise a light
    edit; ``j`` is always an original (never itself a copy). Ground truth for dedup tests.
    """
    pos = index + 1
    kind = "exact" if pos % EXACT_DUP_EVERY == 0 else "near" if pos % NEAR_DUP_EVERY == 0 else None
    if kind is None:
        return None
    rng = np.random.default_rng([seed, index, 1])
    j = int(rng.integers(max(0, index - _DUP_LOOKBACK), index))
    while synthetic_duplicate_of_slot(j):
        j -= 1
    return kind, j


def synthetic_duplicate_of_slot(index: int) -> bool:
    pos = index + 1
    return pos % EXACT_DUP_EVERY == 0 or pos % NEAR_DUP_EVERY == 0


def near_edit(text: str, rng: np.random.Generator, rate: float = 0.03) -> str:
    """A light edit: ~``rate`` of the words substituted, deleted or doubled (at least one)."""
    words = text.split(" ")
    n_edits = max(1, int(len(words) * rate))
    positions = sorted(set(rng.integers(0, len(words), n_edits).tolist()), reverse=True)
    for pos, op, other in zip(positions, rng.integers(0, 3, len(positions)), rng.integers(0, len(words), len(positions))):
        if op == 0:
            words[pos] = words[other % len(words)]  # earlier deletions may have shortened the list
        elif op == 1 and len(words) > 1:
            del words[pos]
        else:
            words.insert(pos, words[pos])
    return " ".join(words)


def _original_text(index: int, domain: str, seed: int) -> str:
    pool = _pool(domain)
    rng = np.random.default_rng([seed, index, 0])
    lo, hi = {"prose": (3, 9), "code": (1, 4), "math": (2, 6)}[domain]
    picks = rng.integers(0, len(pool), int(rng.integers(lo, hi)))
    return "\n\n".join(pool[i] for i in picks.tolist())


def synthetic_text(index: int, domain: str = "prose", seed: int = 0) -> str:
    """Document ``index`` of the synthetic corpus: several real segments drawn at random (so
    documents share little text unless they are injected duplicates)."""
    dup = synthetic_duplicate_of(index, seed)
    if dup is None:
        return _original_text(index, domain, seed)
    kind, j = dup
    base = _original_text(j, domain, seed)
    return base if kind == "exact" else near_edit(base, np.random.default_rng([seed, index, 2]))
