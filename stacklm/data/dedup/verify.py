"""Verified near-duplicate removal: candidate pairs checked on the full MinHash signature, and
a removal rule with no chaining.

LSH banding (``minhash``) makes two documents *candidates* when they share one band key; on
web text a shared band is weak evidence (P = 0.29 at Jaccard 0.7, 0.07 at 0.6), and taking
connected components over candidate pairs chains: A~B and B~C removed C for A although A and
C may share nothing. Here:

1. **verified edges** (``star_edges``): the members of one band bucket, in canonical order,
   are compared on the whole signature (``num_perm`` values: the fraction of equal values
   estimates the Jaccard similarity, standard error sqrt(J(1-J)/num_perm), 0.037 at J = 0.8
   with 120 values); a pair with at least ``need_equal(threshold)`` equal values is an edge.
   Each member is compared with the ``WINDOW`` members before it (all pairs of a bucket of up
   to 9, and a drift chain's neighbours) and with the bucket's first member; members that
   fail the first are compared with the first of *them*, and so on, for at most
   ``MAX_CENTRES`` centres (a big cluster of copies of one document is one star; a bucket of
   k unrelated documents that share a band by chance costs O(k) per centre, never O(k^2)).
   The edges are a function of the bucket's members and their canonical order, so of neither
   the slicing nor the number of tasks.
2. **the rule** (``first_fit``): documents in canonical order; a document is removed when
   it has an edge to an earlier document that is *kept*, and then it names that document
   (the one with the most equal values) as the copy it duplicates. That is the
   lexicographically first maximal independent set of the verified graph: every removed
   document is verified-similar to a kept one, no two kept documents are verified-similar,
   and a drift chain A0~A1~A2~... keeps A0, A2, A4, ... (each one not similar to a kept
   document). ``staged`` computes the same set in partitioned passes (roots, their
   neighbours, then this function on the small remainder).

Why these numbers: the default threshold 0.75 is the S-curve's 50 % point of the default
12 x 10 banding (``minhash``), so verification removes the candidates the banding itself
calls unlikely, and is 4 standard errors (0.027 each) below J = 0.9: a pair at J >= 0.9 fails
verification with probability < 1e-4 (recall at J >= 0.9 is the banding's, 0.994+). A pair
at J = 0.6 passes with probability ~4e-4 (binomial, 90 of 120 values), and is a candidate
with probability 0.07.
"""

from __future__ import annotations

import math

import numpy as np

from stacklm.data.dedup.exact import in_sorted, run_starts

DEFAULT_THRESHOLD = 0.75
MAX_CENTRES = 8  # centres compared per bucket (rows left after them stay unverified in that band)
WINDOW = 8  # each bucket member is also compared with the members just before it
_BLOCK = 1 << 16  # signature rows compared at once (64k x 120 x 4 B x 2 = 63 MB of temporaries)


def need_equal(threshold: float, num_perm: int) -> int:
    """Equal MinHash values a verified pair needs: the smallest count whose fraction is >= ``threshold``."""
    return max(1, math.ceil(threshold * num_perm - 1e-9))


def equal_counts(sig, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per pair ``(a[i], b[i])`` of rows of ``sig`` (an (n, P) array or anything indexable by
    row arrays, e.g. a memory-mapped column), the number of equal values; in blocks."""
    out = np.empty(a.size, dtype=np.int64)
    for s in range(0, a.size, _BLOCK):
        x, y = np.asarray(sig[a[s : s + _BLOCK]]), np.asarray(sig[b[s : s + _BLOCK]])
        out[s : s + _BLOCK] = (x == y).sum(axis=1)
    return out


def star_edges(bucket: np.ndarray, equal_of, need: int, max_centres: int = MAX_CENTRES, window: int = WINDOW) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """The verified edges of buckets given as rows sorted by (bucket, canonical order):
    ``bucket`` the bucket number of each row (non-decreasing), ``equal_of(a, b)`` the equal
    value counts of row pairs. Each row is compared with the ``window`` rows before it in its
    bucket (every pair of a bucket of up to ``window + 1``; a drift chain's neighbours) and
    with the bucket's centres (the first row, then the first of the rows that failed it, ...:
    at most ``max_centres``; a large cluster of copies of one document). Returns ``(earlier
    rows, later rows, equal counts, rows compared with no centre)``, each edge once."""
    los, his, eqs = [], [], []
    for o in range(1, window + 1):
        later = np.arange(o, bucket.size)
        later = later[bucket[later] == bucket[later - o]]
        if not later.size:
            break
        eq = equal_of(later - o, later)
        ok = eq >= need
        los.append(later[ok] - o)
        his.append(later[ok])
        eqs.append(eq[ok])
    rows = np.arange(bucket.size)
    for _ in range(max_centres):
        if rows.size < 2:
            rows = rows[:0]
            break
        b = bucket[rows]
        head = run_starts(b)
        centre = rows[np.maximum.accumulate(np.where(head, np.arange(rows.size), 0))]
        member = ~head
        cand, cen = rows[member], centre[member]
        far = cand - cen > window  # nearer pairs were compared above
        eq = np.full(cand.size, -1, np.int64)
        eq[far] = equal_of(cen[far], cand[far]) if far.any() else eq[far]
        done = np.zeros(cand.size, dtype=bool)
        if (~far).any():  # a near pair's count is known: look it up rather than compare again
            eq[~far] = np.where(_edge_in(cen[~far], cand[~far], los, his), need, 0)
        ok = eq >= need
        los.append(cen[ok & far])
        his.append(cand[ok & far])
        eqs.append(eq[ok & far])
        done |= ok
        rows = cand[~done]
        # a row alone in its bucket now has nothing left to be compared with
        if rows.size:
            b = bucket[rows]
            alone = run_starts(b) & np.append(run_starts(b)[1:], True)
            rows = rows[~alone]
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    return cat(los, np.int64), cat(his, np.int64), cat(eqs, np.int64), int(rows.size)


def _edge_in(a: np.ndarray, b: np.ndarray, los: list[np.ndarray], his: list[np.ndarray]) -> np.ndarray:
    """Whether each row pair ``(a, b)`` is among the edges found so far."""
    if not los:
        return np.zeros(a.size, dtype=bool)
    lo, hi = np.concatenate(los), np.concatenate(his)
    width = int(max(hi.max(initial=0), b.max(initial=0))) + 1
    return in_sorted(a * width + b, np.sort(lo * width + hi))


def first_fit(n: int, lo: np.ndarray, hi: np.ndarray, eq: np.ndarray, removed_before: np.ndarray | None = None,
              tiebreak: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rule over ``n`` documents numbered in canonical order, edges ``lo < hi`` with equal
    counts ``eq``; ``removed_before`` (bool, optional) marks documents removed already (exact
    copies): never kept, so never the reason for a removal. Returns ``(removed, kept_of,
    equal)``: per document whether this rule removes it, and for those the kept document with
    the most equal values (ties: the smallest ``tiebreak``, default the document number) and
    that count (-1 elsewhere).

    One pass in canonical order over the edges sorted by their later end: O(n + edges) however
    the edges chain (a 100,000-long drift chain is 100,000 steps, not 100,000 rounds)."""
    lo, hi, eq = (np.asarray(x, dtype=np.int64) for x in (lo, hi, eq))
    tb = np.arange(n, dtype=np.int64) if tiebreak is None else np.asarray(tiebreak)
    # per later end: its earlier neighbours, best first (most equal values, then smallest tiebreak)
    order = np.lexsort((tb[lo], -eq, hi))
    lo, hi, eq = lo[order], hi[order], eq[order]
    kept = np.ones(n, dtype=bool) if removed_before is None else ~np.asarray(removed_before, dtype=bool)
    removed = np.zeros(n, dtype=bool)
    kept_of = np.full(n, -1, dtype=np.int64)
    equal = np.full(n, -1, dtype=np.int64)
    starts = np.flatnonzero(run_starts(hi))
    ends = np.append(starts[1:], hi.size)
    kept_l = kept.tolist()  # plain lists: the loop reads one element at a time
    lo_l = lo.tolist()
    for d, s, e in zip(hi[starts].tolist(), starts.tolist(), ends.tolist()):
        if not kept_l[d]:
            continue
        for k in range(s, e):
            if kept_l[lo_l[k]]:
                kept_l[d] = False
                removed[d] = True
                kept_of[d] = lo_l[k]
                equal[d] = eq[k]
                break
    return removed, kept_of, equal
