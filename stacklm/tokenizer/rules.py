"""The encoding rules of byte-level BPE in pure Python: the merge loop and lone-surrogate repair.

One merge loop serves every rule: repeatedly merge the adjacent pair with the lowest score,
leftmost first, where ``score(left, right)`` is the rule's priority of that pair (``None``:
never merged). tiktoken's rule (``StackTokenizer``, tiktoken-style imports) scores a pair by
the rank of its concatenation; Hugging Face BPE by the pair's merge index
(``ForeignBPETokenizer``). It is the reference the Rust encoders are tested against, so it
stays small and obviously right; ``merge_long`` is the same rule in O(n log n) for the long
chunks adversarial input makes.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

Score = Callable[[Any, Any], "int | None"]

# Above this many parts merge with a heap, not a rescan: the rescan is O(n^2) in the parts of
# one pre-tokenizer chunk, which adversarial input (a 100 kB run of one character) makes long.
SHORT_PARTS = 64


def merge_short(parts: list, score: Score) -> list:
    """Repeatedly merge the adjacent pair with the lowest score, leftmost first (O(n^2))."""
    while len(parts) > 1:
        best = None
        bi = -1
        for i in range(len(parts) - 1):
            r = score(parts[i], parts[i + 1])
            if r is not None and (best is None or r < best):
                best, bi = r, i
        if best is None:
            break
        parts[bi : bi + 2] = [parts[bi] + parts[bi + 1]]
    return parts


def merge_long(parts: list, score: Score) -> list:
    """Same result as ``merge_short`` in O(n log n): linked parts and a heap of
    ``(score, start, mid, end)`` candidates (start order == leftmost-first ties). A part only
    grows by absorbing its right neighbour, so a candidate is stale exactly when ``start`` or
    ``mid`` is gone or no longer ends where it did when pushed; stale ones are skipped."""
    n = len(parts)
    val = list(parts)
    nxt = list(range(1, n + 1))
    prv = list(range(-1, n - 1))
    alive = [True] * n
    heap = []
    for i in range(n - 1):
        r = score(val[i], val[i + 1])
        if r is not None:
            heap.append((r, i, i + 1, i + 2))
    heapq.heapify(heap)
    while heap:
        _, s, m, stop = heapq.heappop(heap)
        if not (alive[s] and m < n and alive[m] and nxt[s] == m and nxt[m] == stop):
            continue
        val[s] = val[s] + val[m]
        alive[m] = False
        nxt[s] = stop
        if stop < n:
            prv[stop] = s
            r2 = score(val[s], val[stop])
            if r2 is not None:
                heapq.heappush(heap, (r2, s, stop, nxt[stop]))
        p = prv[s]
        if p >= 0:
            r3 = score(val[p], val[s])
            if r3 is not None:
                heapq.heappush(heap, (r3, p, s, stop))
    out = []
    i = 0
    while i < n:
        out.append(val[i])
        i = nxt[i]
    return out


def merge(parts: list, score: Score) -> list:
    """``parts`` merged by ``score`` (see the module docstring); ``parts`` may be modified."""
    return merge_short(parts, score) if len(parts) <= SHORT_PARTS else merge_long(parts, score)


def replace_lone_surrogates(text: str) -> str:
    """Replace lone surrogates (a Python str can hold them, UTF-8 cannot) with U+FFFD, the
    way tiktoken does (a UTF-16 round trip, so a well-formed surrogate *pair* becomes the
    character it spells); every encoder here must agree with tiktoken on them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
