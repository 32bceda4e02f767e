"""Accuracy of the global near-dedup decision, measured against brute-force Jaccard on a corpus
with planted duplicates.

    python3 bench/dedup_accuracy.py [--quick] [--seed 0] [--json out.json] [--plant char|word] [--datatrove]

The decision measured is the one ``stacklm prebuild`` and ``stacklm dedup-index`` make:
``collect_signatures`` (step 1), the signature columns written as a signature task writes them
(``staged.write_signature_dir``) and ``decision.staged_decision`` (buckets, then the decision). The
one-process reference ``decide_splits`` runs on the same records as a cross-check: the two must
remove the same ids (the bench stops with an error if they do not).

Corpus (``make_corpus``, deterministic for a ``--seed`` and the interpreter's standard library):

* a pool of real documents: ``iter_default_corpus`` (the standard library's code, prose, CJK
  and math text), documents over 6,000 characters cut at line boundaries into pieces of
  800-5,000 characters, pieces of 300-6,000 characters kept; a pool document is dropped when
  its exact Jaccard with an earlier pool document is >= ``UNRELATED_BELOW`` (0.3), so the
  originals below are unrelated to each other;
* ``unrelated``: pool documents alone;
* ``exact``: an original plus one or two copies equal after ``normalize_text`` (verbatim,
  upper-cased, or whitespace changed);
* ``near``: per planted level (0.95 ... 0.5) an original and one copy edited with
  ``tests/helpers/synthetic_edits.inject_edits`` until its exact Jaccard with the original is
  within ``NEAR_TOL`` of the level (else the closest of 20 tries; the realised J is what every
  report uses);
* ``chain``: drift chains A0 ~ A1 ~ A2 ~ ..., each link an edit of the previous document with
  J in 0.85 +- 0.03, extended until J(A0, last) < 0.5 (at least 3 links);

then all documents are shuffled into one part (``bench/p0/<row>``), so the canonical order that
picks a cluster's kept copy is random with respect to the planted structure.

Every J above is on character 7-grams; ``--plant word`` sets them on word 5-grams instead (the
same steps and seed; an edit changes more word 5-grams than character 7-grams, so a corpus
planted on one has lower J on the other).

Ground truth (``GroundTruth``): the exact Jaccard of every pair over the very shingle sets the
signatures estimate (``MinHasher.shingle_set``: 64-bit hashes of the character 7-grams of
``normalize_text(text)``, NUL-padded to one shingle), by counting shared shingles through an
inverted index (a sparse product in numpy; no pair is skipped).

What is reported (``measure``), for the removed documents (``R``) and the kept ones (``K``):

* removals by the J bin of a removed document's most similar *kept* document (its best kept
  partner), per planted kind;
* precision at t: the fraction of R with a kept partner at J >= t (t = 0.8 and 0.7; the S-curve
  of ``minhash.py``'s docstring puts the 50% point at J = 0.75, so that is the threshold the
  LSH settings imply);
* recall at t: over pairs with J >= t whose normalised texts differ, the fraction with at least
  one member removed (a pair with both kept is a missed duplicate); exact copies separately
  (copies removed / copies planted);
* per planted near level: realised J, pairs, pairs resolved, and the S-curve's prediction;
* drift chains: members removed, and how many of them have no kept document at J >= 0.7
  (resp. 0.5) -- removed although not similar to anything kept.

``--datatrove`` then runs datatrove's own MinHash stages and stacklm's word 5-gram decision on
the same corpus and prints the three decisions side by side (``bench/dedup_datatrove.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from stacklm.corpus import iter_default_corpus
from stacklm.data.dedup import decision as decision_mod, staged
from stacklm.data.dedup.global_index import collect_signatures, decide_splits
from stacklm.data.dedup.minhash import MinHasher, candidate_probability, jaccard
from stacklm.data.dedup.verify import DEFAULT_THRESHOLD
from stacklm.data.quality.normalize import normalize_text
from tests.helpers.synthetic_edits import inject_edits

LEVELS = (0.95, 0.9, 0.8, 0.7, 0.6, 0.5)
NEAR_TOL = 0.02  # a near copy's realised J is within this of its level (else the closest of the tries)
LINK_J, LINK_TOL = 0.85, 0.03  # a drift chain's links
CHAIN_END_BELOW = 0.5  # a chain grows until J(first, last) is below this
MIN_LINKS, MAX_LINKS = 3, 15
UNRELATED_BELOW = 0.3  # pool documents are pairwise below this
PRECISION_AT = (0.8, 0.7)
RECALL_AT = (0.9, 0.8)
UNSUPPORTED_BELOW = (0.7, 0.5)  # chain members removed with no kept document at J >= t
J_BINS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)  # the last bin is J == 1 exactly
KINDS = ("unrelated", "exact", "near", "chain")
SIZES = {  # unrelated documents, exact groups, near pairs per level, drift chains
    "full": {"unrelated": 1500, "exact": 150, "near": 100, "chains": 80},
    "quick": {"unrelated": 150, "exact": 15, "near": 10, "chains": 8},
}


# -- ground truth ----------------------------------------------------------------------------------
def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + l)`` for each (s, l)."""
    total = int(lengths.sum())
    offsets = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + offsets


def _cat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


class GroundTruth:
    """Exact Jaccard between documents over ``MinHasher.shingle_set`` (what the signatures
    estimate). Shared-shingle counts come from an inverted index (shingle -> documents): a row
    block's counts against every document are one ``bincount`` over the postings of its
    shingles, so the cost is the sum over shingles of (documents holding it)^2, not n^2 x length."""

    def __init__(self, texts: list[str], hasher: MinHasher | None = None, block_postings: int = 1 << 23) -> None:
        hasher = hasher or MinHasher()
        sets = [hasher.shingle_set(t) for t in texts]
        self.n = len(sets)
        self.sizes = np.array([s.size for s in sets], dtype=np.int64)
        uniq, self._sid = np.unique(np.concatenate(sets), return_inverse=True)
        self._sid = self._sid.reshape(-1)
        self._ptr = np.r_[0, np.cumsum(self.sizes)]
        doc_of = np.repeat(np.arange(self.n), self.sizes)
        df = np.bincount(self._sid, minlength=uniq.size)
        self._post_docs = doc_of[np.argsort(self._sid, kind="stable")]
        self._post_ptr = np.r_[0, np.cumsum(df)]
        self._cost = np.add.reduceat(df[self._sid], self._ptr[:-1]) if self.n else np.zeros(0, np.int64)
        self._block = block_postings

    def blocks(self, rows: np.ndarray | None = None):
        """Row blocks whose postings fit ``block_postings`` (one row alone may exceed it)."""
        rows = np.arange(self.n) if rows is None else np.asarray(rows, dtype=np.int64)
        start, acc = 0, 0
        for k, c in enumerate(self._cost[rows].tolist()):
            if acc and acc + c > self._block:
                yield rows[start:k]
                start, acc = k, 0
            acc += c
        if start < rows.size:
            yield rows[start:]

    def jaccard_rows(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), n) exact Jaccard of each of ``rows`` with every document."""
        rows = np.asarray(rows, dtype=np.int64)
        mine = _ranges(self._ptr[rows], self.sizes[rows])
        owner = np.repeat(np.arange(rows.size), self.sizes[rows])
        sid = self._sid[mine]
        plen = self._post_ptr[sid + 1] - self._post_ptr[sid]
        docs = self._post_docs[_ranges(self._post_ptr[sid], plen)]
        inter = np.bincount(np.repeat(owner, plen) * self.n + docs, minlength=rows.size * self.n).reshape(rows.size, self.n)
        return inter / (self.sizes[rows, None] + self.sizes[None, :] - inter)

    def pairs(self, floor: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every pair i < j with J >= ``floor``: (i, j, J)."""
        out_i, out_j, out_v = [], [], []
        for rows in self.blocks():
            j = self.jaccard_rows(rows)
            j[np.arange(self.n)[None, :] <= rows[:, None]] = 0.0
            a, b = np.nonzero(j >= floor)
            out_i.append(rows[a])
            out_j.append(b)
            out_v.append(j[a, b])
        return _cat(out_i, np.int64), _cat(out_j, np.int64), _cat(out_v, np.float64)

    def best_partner(self, rows: np.ndarray, among: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``rows``: the largest J with a document of the mask ``among`` other than
        itself, and that document (-1 and J 0 when ``among`` holds none)."""
        rows = np.asarray(rows, dtype=np.int64)
        best_j, best_k = np.zeros(rows.size), np.full(rows.size, -1, dtype=np.int64)
        pos = 0
        for block in self.blocks(rows):
            j = self.jaccard_rows(block)
            j[:, ~among] = -1.0
            j[np.arange(block.size), block] = -1.0
            k = j.argmax(axis=1)
            v = j[np.arange(block.size), k]
            best_j[pos : pos + block.size] = np.maximum(v, 0.0)
            best_k[pos : pos + block.size] = np.where(v >= 0, k, -1)
            pos += block.size
        return best_j, best_k


# -- planted corpus --------------------------------------------------------------------------------
def _pieces(doc: str, rng: np.random.Generator) -> list[str]:
    """``doc`` if it is at most 6,000 characters, else its lines grouped into pieces of 800-5,000."""
    if len(doc) <= 6000:
        return [doc]
    out, cur, size, target = [], [], 0, int(rng.integers(800, 5000))
    for line in doc.splitlines(keepends=True):
        cur.append(line)
        size += len(line)
        if size >= target:
            out.append("".join(cur))
            cur, size, target = [], 0, int(rng.integers(800, 5000))
    if cur:
        out.append("".join(cur))
    return out


def real_pool(n: int, rng: np.random.Generator, hasher: MinHasher) -> list[str]:
    """``n`` real documents of 300-6,000 characters, pairwise J < ``UNRELATED_BELOW``."""
    candidates: list[str] = []
    seen: set[str] = set()
    want = int(n * 1.6) + 20  # about a quarter of the stdlib's pieces have a related earlier piece
    for doc in iter_default_corpus():
        for piece in _pieces(doc, rng):
            norm = normalize_text(piece)
            if 300 <= len(piece) <= 6000 and norm not in seen:
                seen.add(norm)
                candidates.append(piece)
        if len(candidates) >= want:
            break
    i, j, _ = GroundTruth(candidates, hasher).pairs(UNRELATED_BELOW)
    related = np.zeros(len(candidates), dtype=bool)
    for a, b in sorted(zip(i.tolist(), j.tolist()), key=lambda p: p[1]):  # keep the earlier of a related pair
        if not related[a]:
            related[b] = True
    pool = [c for c, r in zip(candidates, related) if not r]
    print(f"pool: {len(candidates)} pieces read, {int(related.sum())} dropped as related (J >= {UNRELATED_BELOW}) to an earlier one", file=sys.stderr)
    if len(pool) < n:
        raise SystemExit(f"dedup_accuracy: the embedded corpus gave {len(pool)} unrelated documents, {n} needed; ask for fewer (--quick or smaller sizes)")
    return pool[:n]


def edit_to_jaccard(text: str, target: float, tol: float, rng: np.random.Generator, hasher: MinHasher, tries: int = 20) -> tuple[str, float]:
    """A copy of ``text`` with ``inject_edits`` edits, its exact J with ``text`` within ``tol`` of
    ``target`` (else the closest of ``tries``); returns (copy, J). The number of edits starts at
    what ~``shingle_size`` changed shingles per edit gives and is rescaled by the distance
    (1 - J) / (1 + J) each try."""
    base = hasher.shingle_set(text)
    want = (1 - target) / (1 + target)
    n = max(1, round(base.size * want / hasher.shingle_size))
    best: tuple[str, float] | None = None
    for _ in range(tries):
        copy = inject_edits(text, n, rng)
        j = jaccard(base, hasher.shingle_set(copy))
        if best is None or abs(j - target) < abs(best[1] - target):
            best = (copy, j)
        if abs(j - target) <= tol:
            break
        # rescale by the distance ratio, at most x4 a try (a try of only line duplications can
        # leave J ~ 1) and never past one edit per character
        scaled = n * min(4.0, max(0.25, want / max((1 - j) / (1 + j), 1e-9)))
        step = round(scaled) if round(scaled) != n else n + (1 if j > target else -1)
        n = min(max(1, step), len(text))
    return best


def _exact_copy(text: str, variant: int) -> str:
    """A copy equal to ``text`` after ``normalize_text``: verbatim, upper-cased, or with changed
    whitespace (the variant that would change the normalised text falls back to verbatim)."""
    copy = (text, text.upper(), text.replace(" ", "  ").replace("\n", " \n\t"))[variant % 3]
    return copy if normalize_text(copy) == normalize_text(text) else text


@dataclass
class Corpus:
    """Documents in canonical order and what was planted: ``kind`` (``KINDS``), ``group`` (the
    planted group: an original and its copies, or a chain), ``role`` (0 the original / the
    chain's first document, k the k-th copy / link), ``level`` (a near copy's planted level, a
    chain link's target; NaN otherwise) and ``planted_j`` (a copy's realised J with its
    original, a link's with the previous link; NaN for originals)."""

    texts: list[str]
    kind: np.ndarray
    group: np.ndarray
    role: np.ndarray
    level: np.ndarray
    planted_j: np.ndarray
    chain_end_j: dict[int, float] = field(default_factory=dict)  # chain group -> J(first, last)


def make_corpus(unrelated: int, exact: int, near: int, chains: int, seed: int = 0, levels: tuple[float, ...] = LEVELS, hasher: MinHasher | None = None) -> Corpus:
    """The planted corpus (module docstring), shuffled with ``seed``."""
    hasher = hasher or MinHasher()
    # the pool's piece lengths draw from their own stream, so how far the pool reads does not
    # change the edits and the shuffle
    pool = iter(real_pool(unrelated + exact + near * len(levels) + chains, np.random.default_rng([seed, 1]), hasher))
    rng = np.random.default_rng([seed, 2])
    rows: list[tuple[str, str, int, int, float, float]] = []  # text, kind, group, role, level, planted_j
    ends: dict[int, float] = {}
    group = 0
    nan = float("nan")
    for _ in range(unrelated):
        rows.append((next(pool), "unrelated", group, 0, nan, nan))
        group += 1
    for g in range(exact):
        orig = next(pool)
        rows.append((orig, "exact", group, 0, nan, nan))
        for c in range(1 + g % 2):  # pairs and triples
            rows.append((_exact_copy(orig, g + c), "exact", group, c + 1, nan, 1.0))
        group += 1
    for level in levels:
        for _ in range(near):
            orig = next(pool)
            copy, j = edit_to_jaccard(orig, level, NEAR_TOL, rng, hasher)
            rows += [(orig, "near", group, 0, level, nan), (copy, "near", group, 1, level, j)]
            group += 1
    for _ in range(chains):
        first = next(pool)
        first_set = hasher.shingle_set(first)
        chain = [(first, nan)]
        end_j = 1.0
        while len(chain) <= MIN_LINKS or (end_j >= CHAIN_END_BELOW and len(chain) <= MAX_LINKS):
            nxt, j = edit_to_jaccard(chain[-1][0], LINK_J, LINK_TOL, rng, hasher)
            chain.append((nxt, j))
            end_j = jaccard(first_set, hasher.shingle_set(nxt))
        rows += [(t, "chain", group, k, LINK_J if k else nan, j) for k, (t, j) in enumerate(chain)]
        ends[group] = end_j
        group += 1
    order = rng.permutation(len(rows))
    cols = list(zip(*[rows[i] for i in order])) if rows else [()] * 6
    return Corpus(
        texts=list(cols[0]), kind=np.array(cols[1], dtype=str), group=np.array(cols[2], dtype=np.int64),
        role=np.array(cols[3], dtype=np.int64), level=np.array(cols[4], dtype=np.float64),
        planted_j=np.array(cols[5], dtype=np.float64), chain_end_j=ends,
    )


# -- the decision ----------------------------------------------------------------------------------
def run_decision(texts: list[str], hasher: MinHasher | None = None, cpu: dict[str, float] | None = None) -> np.ndarray:
    """Per document: 0 kept, 1 removed as an exact copy, 2 as a near copy -- by the staged
    decision the commands run, checked equal to ``decide_splits``'s. ``cpu``, when given, gets
    ``"decision"``: the CPU seconds of signing, writing the signature columns and the staged
    decision (not of the cross-check)."""
    hasher = hasher or MinHasher()
    ids = [f"bench/p0/{i}" for i in range(len(texts))]
    start = time.process_time()
    sig = collect_signatures(({"text": t, "doc_id": d, "source": "bench"} for t, d in zip(texts, ids)), {"bench": 0}, hasher)
    code = np.zeros(len(texts), dtype=np.int8)
    with tempfile.TemporaryDirectory(prefix="dedup-accuracy-") as tmp:
        sig_dir = Path(tmp) / "train-w000"
        staged.write_signature_dir(sig, "train", sig_dir)
        removed = decision_mod.staged_decision([sig_dir]).removed.get(0, {})
    if cpu is not None:
        cpu["decision"] = time.process_time() - start
    for reason, c in (("exact", 1), ("near", 2)):
        code[removed.get(reason, np.zeros(0, np.int64))] = c
    ref = decide_splits({"train": [sig]})["train"]
    ref_code = np.zeros(len(texts), dtype=np.int8)
    row = {d: i for i, d in enumerate(ids)}
    for reason, c in (("exact", 1), ("near", 2)):
        ref_code[[row[d] for d in ref[reason]]] = c
    if (ref_code != code).any() or ref["cross_split"]:
        raise SystemExit(f"dedup_accuracy: the staged decision and decide_splits disagree on {int((ref_code != code).sum())} documents (a bug in stacklm/data/dedup)")
    return code


# -- the measures ----------------------------------------------------------------------------------
def _bin_label(lo: float, hi: float) -> str:
    return "1.00 (same set)" if lo == 1.0 else f"[{lo:.2f}, {hi:.2f})"


def measure(corpus: Corpus, truth: GroundTruth, code: np.ndarray) -> dict[str, Any]:
    """Every number of the report (module docstring) for the decision ``code`` (0 kept, 1 exact, 2 near)."""
    removed = code > 0
    kept = ~removed
    r_rows = np.flatnonzero(removed)
    best_j, _ = truth.best_partner(r_rows, kept)
    out: dict[str, Any] = {"docs": truth.n, "removed": int(removed.sum()), "removed_exact": int((code == 1).sum()), "removed_near": int((code == 2).sum())}
    out["planted"] = {k: int((corpus.kind == k).sum()) for k in KINDS}
    edges = list(J_BINS)
    bins = []
    for lo, hi in zip(edges[:-1] + [1.0], edges[1:] + [1.0]):
        sel = (best_j == 1.0) if lo == 1.0 else (best_j >= lo) & (best_j < hi)
        bins.append({"bin": _bin_label(lo, hi), "removed": int(sel.sum()), **{k: int((sel & (corpus.kind[r_rows] == k)).sum()) for k in KINDS}})
    out["removals_by_best_kept_j"] = bins[::-1]
    # the target: nothing removed whose best kept partner is below the threshold minus the
    # estimator's error bound (3 standard errors of the fraction of equal values at the threshold)
    num_perm = MinHasher().num_perm
    out["threshold"] = DEFAULT_THRESHOLD
    out["bound"] = DEFAULT_THRESHOLD - 3 * (DEFAULT_THRESHOLD * (1 - DEFAULT_THRESHOLD) / num_perm) ** 0.5
    out["lowest_removal_j"] = float(best_j.min()) if best_j.size else None
    out["below_bound"] = int((best_j < out["bound"]).sum())
    near_rows = code[r_rows] == 2
    out["precision"] = {
        str(t): {"all": _ratio(int((best_j >= t).sum()), r_rows.size), "near_removals": _ratio(int((best_j[near_rows] >= t).sum()), int(near_rows.sum()))}
        for t in PRECISION_AT
    }
    i, j, v = truth.pairs(min(RECALL_AT))
    norm = [normalize_text(t) for t in corpus.texts]
    differ = np.array([norm[a] != norm[b] for a, b in zip(i.tolist(), j.tolist())], dtype=bool)
    resolved = removed[i] | removed[j]
    out["recall"] = {str(t): _ratio(int((resolved & differ & (v >= t)).sum()), int((differ & (v >= t)).sum())) for t in RECALL_AT}
    copies = (corpus.kind == "exact") & (corpus.role > 0)
    groups = corpus.group[corpus.kind == "exact"]
    # a group of g equal documents should keep one: recall = removed beyond one kept / (g - 1)
    got = sum(min(int(removed[corpus.group == g].sum()), int((corpus.group == g).sum()) - 1) for g in np.unique(groups).tolist())
    out["exact_recall"] = _ratio(got, int(copies.sum()))
    out["near_levels"] = []
    for level in np.unique(corpus.level[(corpus.kind == "near") & (corpus.role == 1)])[::-1].tolist():
        sel = np.flatnonzero((corpus.kind == "near") & (corpus.role == 1) & (corpus.level == level))
        pj = corpus.planted_j[sel]
        origs = [int(np.flatnonzero((corpus.group == g) & (corpus.role == 0))[0]) for g in corpus.group[sel].tolist()]
        res = removed[sel] | removed[origs]
        out["near_levels"].append({
            "level": level, "pairs": int(sel.size), "j_mean": float(pj.mean()), "j_min": float(pj.min()), "j_max": float(pj.max()),
            "within_tol": int((np.abs(pj - level) <= NEAR_TOL + 1e-12).sum()),
            "resolved": int(res.sum()), "s_curve_expected": float(candidate_probability(pj).sum()),
        })
    chain = corpus.kind == "chain"
    links = corpus.planted_j[chain & (corpus.role > 0)]
    ends = np.array(list(corpus.chain_end_j.values()) or [np.nan])
    c_removed = removed[r_rows] & (corpus.kind[r_rows] == "chain")
    out["chains"] = {
        "chains": len(corpus.chain_end_j), "members": int(chain.sum()),
        "link_j_min": float(np.nanmin(links)) if links.size else None, "link_j_max": float(np.nanmax(links)) if links.size else None,
        "end_j_min": float(np.nanmin(ends)), "end_j_max": float(np.nanmax(ends)),
        "removed": int(c_removed.sum()),
        "removed_without_kept_partner": {f"J<{t}": int((c_removed & (best_j < t)).sum()) for t in UNSUPPORTED_BELOW},
    }
    return out


def _ratio(num: int, den: int) -> dict[str, Any]:
    return {"num": num, "den": den, "value": num / den if den else None}


def _fmt(r: dict[str, Any]) -> str:
    return f"{r['num']:,}/{r['den']:,} = {r['value']:.3f}" if r["den"] else "n/a (none)"


def report(m: dict[str, Any], header: str) -> str:
    lines = [header]
    lines.append(f"decision (staged == decide_splits): {m['docs']:,} documents, removed {m['removed']:,} (exact {m['removed_exact']:,}, near {m['removed_near']:,})")
    lines.append("planted documents: " + ", ".join(f"{k} {v:,}" for k, v in m["planted"].items()))
    lines.append("")
    lines.append("removed documents by J of their most similar KEPT document:")
    lines.append(f"  {'J of best kept partner':<24}{'removed':>8}" + "".join(f"{k:>11}" for k in KINDS))
    for b in m["removals_by_best_kept_j"]:
        lines.append(f"  {b['bin']:<24}{b['removed']:>8}" + "".join(f"{b[k]:>11}" for k in KINDS))
    lines.append("")
    if m["lowest_removal_j"] is not None:
        lines.append(f"threshold {m['threshold']} (estimated from {MinHasher().num_perm} MinHash values; 3 standard errors below it: {m['bound']:.3f}): "
                     f"lowest J of a removal's best kept partner {m['lowest_removal_j']:.3f}, removals below {m['bound']:.3f}: {m['below_bound']}")
    for t, p in m["precision"].items():
        lines.append(f"precision at J >= {t} (removed with a kept partner at J >= {t}): all {_fmt(p['all'])}; near removals {_fmt(p['near_removals'])}")
    for t, r in m["recall"].items():
        lines.append(f"recall at J >= {t} (pairs, normalised texts differ, at least one removed): {_fmt(r)}")
    lines.append(f"exact copies: recall {_fmt(m['exact_recall'])}")
    lines.append("")
    lines.append(f"  {'near level':<12}{'pairs':>6}{'realised J mean [min, max]':>30}{f'within {NEAR_TOL}':>13}{'resolved':>10}{'S-curve expects':>17}")
    for lv in m["near_levels"]:
        lines.append(f"  {lv['level']:<12.2f}{lv['pairs']:>6}{lv['j_mean']:>15.3f} [{lv['j_min']:.3f}, {lv['j_max']:.3f}]{lv['within_tol']:>13}"
                     f"{lv['resolved']:>10}{lv['s_curve_expected']:>17.1f}")
    c = m["chains"]
    lines.append("")
    if c["chains"]:
        lines.append(f"drift chains: {c['chains']} chains, {c['members']} documents, link J [{c['link_j_min']:.3f}, {c['link_j_max']:.3f}], J(first, last) [{c['end_j_min']:.4f}, {c['end_j_max']:.4f}]")
        lines.append(f"  chain documents removed: {c['removed']}; of them with no kept document at "
                     + ", ".join(f"{k}: {v}" for k, v in c["removed_without_kept_partner"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small corpus (a sanity run of a few seconds)")
    ap.add_argument("--seed", type=int, default=0)
    for k, v in SIZES["full"].items():
        ap.add_argument(f"--{k}", type=int, default=None, help=f"default {v} ({SIZES['quick'][k]} with --quick)")
    ap.add_argument("--json", type=Path, default=None, help="also write every number here")
    ap.add_argument("--plant", choices=("char", "word"), default="char", help="the shingles whose exact Jaccard the planted levels, links and the pool's "
                    "unrelatedness are set on (default char 7-grams, what the decision reported first uses; word: word 5-grams)")
    ap.add_argument("--datatrove", action="store_true", help="also run datatrove's MinHash stages and stacklm's word 5-gram decision on the same corpus and compare (bench/dedup_datatrove.py)")
    args = ap.parse_args(argv)
    sizes = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in SIZES["quick" if args.quick else "full"].items()}
    hasher = MinHasher()
    t0 = time.perf_counter()
    corpus = make_corpus(sizes["unrelated"], sizes["exact"], sizes["near"], sizes["chains"], args.seed, hasher=MinHasher(shingle=args.plant))
    t1 = time.perf_counter()
    cpu: dict[str, float] = {}
    code = run_decision(corpus.texts, hasher, cpu)
    t2 = time.perf_counter()
    truth = GroundTruth(corpus.texts, hasher)
    m = measure(corpus, truth, code)
    t3 = time.perf_counter()
    m["sizes"], m["seed"], m["plant"] = sizes, args.seed, args.plant
    m["seconds"] = {"corpus": round(t1 - t0, 1), "decision": round(t2 - t1, 1), "truth_and_measures": round(t3 - t2, 1)}
    secs = ", ".join(f"{k} {v} s" for k, v in m["seconds"].items())
    print(report(m, f"near-dedup accuracy: seed {args.seed}, sizes {sizes}, planted on {args.plant} shingles ({secs})"))
    if args.datatrove:
        from bench.dedup_datatrove import compare  # datatrove (the scale extra) only when asked

        m["datatrove"] = compare(corpus, truth, code, cpu["decision"])
    if args.json:
        args.json.write_text(json.dumps(m, indent=1))
    return m


if __name__ == "__main__":
    main()
