"""``bench/dedup_scale.py``'s web-like generator is what its docstring says: every document a
function of its number (a slice generates its records alone, whatever the slicing), exact copies
equal to their parent, near copies sharing about J of their parent's values, power-law cluster
sizes, a planted drift chain whose links are similar and whose ends are not, and band keys the
library's own. Nothing here measures the dedup decision: that is the bench's output."""

from __future__ import annotations

import numpy as np
import pytest

from stacklm.data.dedup.minhash import MinHasher

from tests.helpers.bench import load_bench

N, CHAIN = 20_000, 400


@pytest.fixture(scope="module")
def bench():
    return load_bench("dedup_scale")


def test_web_generator_structure_and_statistics(bench):
    layout = bench.WebLayout(N, chain=CHAIN)
    recs = {(s, w): bench.web_records(layout, 2, s, w, val=0.05, chunk=3_000) for s in ("val", "train") for w in range(2)}
    ids = np.concatenate([r["ids"] for r in recs.values()])
    assert ids.size == N and np.unique(ids).size == N  # every document once, in one slice

    # per document, not per slicing: a 3-way slice holds the same records as the 2-way ones
    again = bench.web_records(layout, 3, "train", 1, val=0.05)
    j = bench._slice_docs(N, 3, "train", 1, 0.05)
    pos = layout.pos_of(j).astype(np.int64)
    assert np.array_equal(layout.doc_of(pos), j)  # the layout is a bijection
    whole_j = np.concatenate([bench._slice_docs(N, 2, "train", w, 0.05) for w in range(2)])
    order = np.argsort(whole_j)
    row = order[np.searchsorted(whole_j[order], j)]
    for key in ("minhash", "bands", "digest"):
        assert np.array_equal(again[key], np.concatenate([recs[("train", w)][key] for w in range(2)])[row])

    # every position's parent, kind and values, group by group
    allpos = np.arange(N, dtype=np.int64)
    vals = np.zeros((N, bench.NUM_PERM), np.uint64)
    digest, parent, kind, jv = np.zeros(N, np.uint64), np.zeros(N, np.int64), np.zeros(N, np.int64), np.zeros(N)
    for sel, starts in layout.groups(allpos):
        vals[sel], digest[sel] = layout.values(allpos[sel], starts)
        parent[sel], kind[sel], jv[sel] = layout.info(allpos[sel], starts)
    # the library's band keys of the values, their low 32 bits as the signature's minhash column
    assert np.array_equal(again["bands"], MinHasher().band_keys(vals[pos])) and np.array_equal(again["minhash"], vals[pos].astype(np.uint32))
    assert np.array_equal(again["digest"], digest[pos])
    sim = (vals == vals[parent]).mean(axis=1)
    exact, near = kind == layout.EXACT, kind == layout.NEAR
    assert (parent[kind != layout.ROOT] < allpos[kind != layout.ROOT]).all()  # copies of earlier members
    assert (sim[exact] == 1).all() and (digest[exact] == digest[parent[exact]]).all()
    assert (digest[near] != digest[parent[near]]).all()
    dev = sim[near] - jv[near]
    assert abs(dev.mean()) < 0.01 and np.abs(dev).max() < 0.25  # binomial(120, J): sd <= 0.046
    assert ((parent[parent[near]] != parent[near]) & (kind[parent[near]] != layout.ROOT)).any()  # copies of copies
    # near copies share only some bands with their parent: a band is equal with probability J^10,
    # on average (1 - jmin^11) / (11 (1 - jmin)) = 0.297 for J ~ U(0.7, 1)
    shared = (MinHasher().band_keys(vals[near]) == MinHasher().band_keys(vals[parent[near]])).mean(axis=1)
    assert abs(shared.mean() - (1 - 0.7**11) / (11 * 0.3)) < 0.02 and (shared == 0).any() and ((shared > 0) & (shared < 1)).mean() > 0.5

    # the chain: every link a candidate of the one before, similarity (10 + 110 x 0.85) / 120, the ends unrelated
    link = sim[1:CHAIN]
    assert abs(link.mean() - (10 + 110 * layout.CHAIN_J) / 120) < 0.01 and (parent[1:CHAIN] == allpos[: CHAIN - 1]).all()
    keys = MinHasher().band_keys(vals[:CHAIN])
    assert (keys[1:] == keys[:-1]).any(axis=1).all()
    assert (vals[0] == vals[CHAIN - 1]).mean() < 0.05

    # power-law cluster sizes: most of the clusters with copies have 2 members, a heavy tail
    sizes = layout.cluster_sizes()
    assert sizes.sum() == N and sizes[0] == CHAIN
    dup = sizes[(sizes > 1)][1:]  # the chain apart
    assert 0.6 < (dup == 2).mean() < 0.8 and dup.max() >= 50
