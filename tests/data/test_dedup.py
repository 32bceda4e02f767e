"""Exact dedup (normalised text, compact store) and MinHash-LSH near dedup, on real text."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest

from stacklm.corpus import iter_prose
from stacklm.data.quality import normalize as normalize_mod
from stacklm.data.dedup import ExactDeduper, U64HashSet, normalize_text
from stacklm.data.dedup import minhash as minhash_mod
from stacklm.data.dedup import shingles as shingles_mod
from stacklm.data.dedup.minhash import (
    MinHasher,
    NearDeduper,
    candidate_probability,
    jaccard,
    share_a_band,
)
from tests.helpers.synthetic_edits import edits_for_jaccard, inject_edits


@pytest.fixture(scope="module")
def docs(real_docs) -> list[str]:
    """~2400 distinct real documents: the shared mixed sample plus stdlib docstrings (exact
    duplicates removed)."""
    out, seen = [], set()
    for d in real_docs + list(iter_prose(1_000_000)):
        key = normalize_text(d)
        if len(key) >= 40 and key not in seen:
            seen.add(key)
            out.append(d)
    return out


def _state_is_compact(state: dict) -> None:
    """One numpy array (the table); everything else a few plain ints/bools (and the shingle kind's name)."""
    assert isinstance(state["table"], np.ndarray) and state["table"].dtype == np.uint64
    for key, value in state.items():
        if isinstance(value, dict):
            flat = [n for v in value.values() for n in (v.values() if isinstance(v, dict) else [v])]
            assert all(isinstance(n, (int, str)) for n in flat) and len(flat) < 50, key
        elif key != "table":
            assert isinstance(value, (int, bool)), (key, type(value))


# ---------------------------------------------------------------------------------------
# normalisation and the compact set
# ---------------------------------------------------------------------------------------
def test_normalize_text_nfkc_casefold_whitespace():
    assert normalize_text("  Hello,\t\tWORLD \n\n ﬁne\u00a0Straße ") == "hello, world fine strasse"
    assert normalize_text("Cafe\u0301") == normalize_text("Café")  # NFKC composes
    assert normalize_text("\x1c a\u2003b \u3000") == "a b"  # every str.isspace character
    assert normalize_text("") == normalize_text(" \n\t ") == ""


def test_normalize_text_huge_documents_in_slices(monkeypatch):
    rng = np.random.default_rng(0)
    words = ["Alpha", "béta", "GAMMA\n", "δ", "x" * 50, "\t", "  ", "end."]
    text = "".join(words[i] + (" " if i % 3 else "") for i in rng.integers(0, len(words), 5000))
    expected = normalize_text(text)
    monkeypatch.setattr(normalize_mod, "_NORMALIZE_SLICE", 37)  # cut inside words and whitespace runs
    assert normalize_text(text) == expected
    assert normalize_text("y" * 500) == "y" * 500  # no whitespace to cut at


def test_u64_hash_set_matches_python_set():
    rng = np.random.default_rng(1)
    table, reference = U64HashSet(), set()
    for size in (1, 5, 40, 300, 5000, 20000):
        keys = rng.integers(1, 2**64 - 1, size, dtype=np.uint64, endpoint=True)
        keys[: size // 3] = keys[size // 3 : 2 * (size // 3)]  # repeats inside the batch
        if reference:
            keys[-1] = next(iter(reference))  # and a key already stored
        expected = []
        for k in keys.tolist():
            expected.append(k not in reference)
            reference.add(k)
        assert table.add(keys).tolist() == expected
        assert len(table) == len(reference)
        assert table.contains(np.array(sorted(reference), dtype=np.uint64)).all()
        others = [k for k in rng.integers(1, 2**64 - 1, 1000, dtype=np.uint64).tolist() if k not in reference]
        assert not table.contains(np.array(others, dtype=np.uint64)).any()
        assert 0.5 <= len(table) / table.capacity <= 0.75 or table.capacity == U64HashSet.MIN_CAPACITY
    with pytest.raises(ValueError, match="nonzero"):
        table.add(np.array([0], dtype=np.uint64))


# ---------------------------------------------------------------------------------------
# exact dedup
# ---------------------------------------------------------------------------------------
def test_exact_catches_normalised_variants_and_keeps_distinct(docs):
    ex = ExactDeduper()
    base = docs[:200]
    assert not ex.is_duplicate_batch(base, "code").any()
    variants = [d.upper() for d in base[:50]] + ["  " + d.replace(" ", " \n\t ") + "\n" for d in base[50:100]]
    assert ex.is_duplicate_batch(variants, "code").all()
    assert ex.is_duplicate("x " + base[0], "web") is False  # a real change is not a duplicate
    assert ex.is_duplicate("X  " + base[0].upper(), "web") is True
    assert ex.stats.to_dict() == {"code": {"kept": 200, "exact_dup": 100}, "web": {"kept": 1, "exact_dup": 1}}
    assert ex.query_batch([base[7].title(), "never seen"]).tolist() == [True, False]  # counts nothing
    assert ex.stats.total("kept") == 201 and len(ex) == 201


def test_exact_batch_equals_one_by_one(docs):
    stream = docs[:300] + docs[100:150] + [docs[5].lower(), "", " \n ", ""]
    order = np.random.default_rng(2).permutation(len(stream))
    stream = [stream[i] for i in order]
    one = ExactDeduper()
    singles = [one.is_duplicate(t) for t in stream]
    batched = ExactDeduper()
    got = np.concatenate([batched.is_duplicate_batch(stream[i : i + 64]) for i in range(0, len(stream), 64)])
    assert got.tolist() == singles
    assert sum(singles) == 50 + 1 + 2  # copies, the lowercased one, and two more empty documents


def test_exact_store_is_at_most_16_bytes_per_unique_doc(docs):
    ex = ExactDeduper()
    texts = docs + [f"{d}\n# variant {i}" for i, d in enumerate(docs)] * 2
    for i in range(0, len(texts), 97):
        ex.is_duplicate_batch(texts[i : i + 97])
        if len(ex) >= 12:
            assert ex.bytes_per_doc <= 16.0, (len(ex), ex.nbytes)
    assert len(ex) == 2 * len(docs) > 1000
    assert ex.nbytes == ex.state_dict()["table"].nbytes


def test_exact_state_round_trip_continues_identically(docs):
    stream = docs[:400] + docs[200:300]
    stream = [stream[i] for i in np.random.default_rng(3).permutation(len(stream))]
    full = ExactDeduper()
    expected = full.is_duplicate_batch(stream)
    first = ExactDeduper()
    head = first.is_duplicate_batch(stream[:250])
    state = first.state_dict()
    _state_is_compact(state)
    resumed = ExactDeduper()
    resumed.load_state_dict(state)
    tail = np.array([resumed.is_duplicate(t) for t in stream[250:]])
    assert np.concatenate([head, tail]).tolist() == expected.tolist()
    assert resumed.stats.to_dict() == full.stats.to_dict()
    bad = dict(state, size=3)
    with pytest.raises(ValueError, match="inconsistent"):
        ExactDeduper().load_state_dict(bad)


# ---------------------------------------------------------------------------------------
# near dedup: hashing
# ---------------------------------------------------------------------------------------
def test_shingle_sets_are_the_distinct_character_ngrams(docs):
    hasher = MinHasher()
    k = hasher.shingle_size
    for text in docs[:40] + ["", "ab", "é" * 3 + "\ud800"]:
        norm = hasher.prepare(text)
        assert hasher.shingle_set(text).size == len({norm[i : i + k] for i in range(len(norm) - k + 1)})


def test_chunked_hashing_matches_whole(monkeypatch, docs):
    """Cutting huge documents into passes/chunks must not change a single signature value."""
    texts = [" ".join(docs[:60]), docs[0], "", "short", docs[1]]
    expected = MinHasher().signatures(texts)
    monkeypatch.setattr(shingles_mod, "_PASS_CHARS", 1000)
    monkeypatch.setattr(shingles_mod, "_CHUNK", 333)
    monkeypatch.setattr(minhash_mod, "_CHUNK", 333)
    got = MinHasher().signatures(texts)
    assert np.array_equal(got, expected)
    monkeypatch.setattr(minhash_mod, "_KEEP_SHINGLES", 0)  # short documents re-hashed, not cached
    assert np.array_equal(MinHasher().signatures(texts), expected)
    assert not (got == minhash_mod._EMPTY).any()  # densified: no empty bins, even for ""


def test_s_curve_values():
    assert candidate_probability(0.9) > 0.99
    assert candidate_probability(0.5) < 0.012
    assert abs(candidate_probability(0.75) - 0.5) < 0.01
    assert candidate_probability(np.array([0.0, 1.0])).tolist() == [0.0, 1.0]


def test_near_accuracy_against_exact_jaccard(docs):
    """Real documents with injected edits: recall >= 0.95 for J >= 0.9, FP <= 1% for J < 0.5."""
    rng = np.random.default_rng(4)
    hasher = MinHasher()
    k = hasher.shingle_size
    bases, copies, sims = [], [], []
    for i in rng.choice(len(docs), 400, replace=False):
        base = docs[int(i)][:6000]
        base_set = hasher.shingle_set(base)
        for lo, hi in ((0.85, 1.0), (0.2, 0.5), (0.2, 0.5), (0.6, 0.85)):  # both thresholds and between
            target = rng.uniform(lo, hi)
            n_edits = edits_for_jaccard(base_set.size, target, k, rng)
            copy = inject_edits(base, n_edits, rng)
            bases.append(base)
            copies.append(copy)
            sims.append(jaccard(base_set, hasher.shingle_set(copy)))
    sims = np.array(sims)
    caught = share_a_band(hasher.keys(bases), hasher.keys(copies))
    high, low = sims >= 0.9, sims < 0.5
    assert high.sum() >= 200 and low.sum() >= 400
    assert caught[high].mean() >= 0.95
    assert caught[low].mean() <= 0.01
    middle = (sims >= 0.7) & (sims < 0.8)  # the S-curve's steep part: measured ~ predicted
    assert abs(caught[middle].mean() - candidate_probability(sims[middle]).mean()) < 0.15


# ---------------------------------------------------------------------------------------
# near dedup: the streaming deduper
# ---------------------------------------------------------------------------------------
def test_near_catches_copies_and_keeps_distinct(docs):
    nd = NearDeduper()
    base = [d for d in docs if len(d) >= 300][:150]
    kept = ~nd.is_duplicate_batch(base, "code")
    rng = np.random.default_rng(5)
    copies = [base[i].upper().replace(" ", "  ") for i in range(0, 150, 3) if kept[i]]
    copies += [base[i][:150] + "#" + base[i][151:] for i in range(1, 150, 3) if kept[i]]  # one character
    assert nd.is_duplicate_batch(copies, "web").all()
    fresh = [d for d in docs if len(d) >= 300][150:250]
    assert nd.query_batch(fresh).mean() < 0.1  # unrelated real text mostly passes
    stats = nd.stats.to_dict()
    assert stats["web"] == {"near_dup": len(copies)}
    assert stats["code"]["kept"] + stats["code"].get("near_dup", 0) == 150


def test_every_near_drop_has_a_similar_kept_document(docs):
    """No false drops on real text: each dropped document has J >= 0.5 with an earlier kept one."""
    hasher = MinHasher()
    stream = docs[:600]
    dup = NearDeduper().is_duplicate_batch(stream)
    sets = [hasher.shingle_set(t) for t in stream]
    for j in np.flatnonzero(dup):
        best = max(jaccard(sets[j], sets[i]) for i in range(j) if not dup[i])
        assert best >= 0.5, (j, best)


def test_near_batch_equals_one_by_one_including_inside_batch_dups(docs):
    rng = np.random.default_rng(6)
    stream = list(docs[:200])
    for i in range(0, 200, 7):  # near copies, some of them inside the same batch as the original
        stream.insert(i + int(rng.integers(1, 5)), inject_edits(docs[i], 1, rng))
    stream += [docs[3], "", "", "tiny"]
    one = NearDeduper()
    singles = [one.is_duplicate(t) for t in stream]
    batched = NearDeduper()
    got = np.concatenate([batched.is_duplicate_batch(stream[i : i + 50]) for i in range(0, len(stream), 50)])
    assert got.tolist() == singles
    assert batched.stats.to_dict() == one.stats.to_dict()
    assert sum(singles) >= 20


def test_near_index_is_at_most_200_bytes_per_kept_doc(docs):
    nd = NearDeduper()
    for i in range(0, len(docs), 128):
        nd.is_duplicate_batch(docs[i : i + 128])
        assert nd.bytes_per_doc <= 200, (len(nd), nd.nbytes)
    assert len(nd) > 1000


def test_index_full_warns_once_and_keeps_answering(docs, caplog):
    pool = [d for d in docs if len(d) >= 300][:80]
    distinct = [d for d, dup in zip(pool, NearDeduper().is_duplicate_batch(pool)) if not dup][:40]
    nd = NearDeduper(max_docs=10)
    with pytest.warns(RuntimeWarning, match="index is full") as record, caplog.at_level(logging.WARNING):
        dup1 = nd.is_duplicate_batch(distinct[:25], "web")
        dup2 = np.array([nd.is_duplicate(t, "web") for t in distinct[25:]])
    assert len([w for w in record if "index is full" in str(w.message)]) == 1
    assert len([r for r in caplog.records if "index is full" in r.getMessage()]) == 1
    assert not dup1.any() and not dup2.any()
    assert len(nd) == 10 and nd.n_unindexed == 30 and nd.is_full
    assert nd.stats.to_dict()["web"] == {"kept": 40, "index_full": 30}
    assert nd.is_duplicate(distinct[3].upper(), "web")  # indexed: still caught
    assert not nd.is_duplicate(distinct[30], "web")  # not indexed: passes (and is counted)
    # restored state remembers that it already warned
    resumed = NearDeduper(max_docs=10)
    resumed.load_state_dict(nd.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not resumed.is_duplicate(distinct[35])


def test_near_state_round_trip_continues_identically(docs):
    rng = np.random.default_rng(7)
    stream = list(docs[:300]) + [inject_edits(d, 2, rng) for d in docs[:300:4]]
    stream = [stream[i] for i in rng.permutation(len(stream))]
    full = NearDeduper(max_docs=250)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        expected = full.is_duplicate_batch(stream)
    first = NearDeduper(max_docs=250)
    head = first.is_duplicate_batch(stream[:200])
    state = first.state_dict()
    _state_is_compact(state)
    resumed = NearDeduper(max_docs=250)
    resumed.load_state_dict(state)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        tail = resumed.is_duplicate_batch(stream[200:])
    assert np.concatenate([head, tail]).tolist() == expected.tolist()
    assert resumed.stats.to_dict() == full.stats.to_dict()
    assert resumed.n_unindexed == full.n_unindexed > 0
    with pytest.raises(ValueError, match="shingle_size=7 .this deduper: 5."):
        NearDeduper(shingle_size=5).load_state_dict(state)


def test_empty_odd_and_huge_documents():
    nd, ex = NearDeduper(), ExactDeduper()
    odd = ["", " \n\t", "a", "\x00\x00bin\x00", "\ud800 lone surrogate", "日本語のテキスト", bytes(range(256)).decode("latin-1")]
    ex_dups = ex.is_duplicate_batch(odd)
    assert ex_dups.tolist() == [False, True, False, False, False, False, False]
    nd_dups = nd.is_duplicate_batch(odd)
    assert nd_dups[1] and not nd_dups[[0, 2, 3, 4, 5, 6]].any()
    rng = np.random.default_rng(8)
    vocab = np.array(["".join(rng.choice(list("abcdefghij"), 6)) for _ in range(3000)])
    huge = " ".join(rng.choice(vocab, 1_200_000))  # ~8.4 MB, many passes
    assert not ex.is_duplicate(huge) and not nd.is_duplicate(huge)
    edited = huge[:4_000_000] + " inserted words " + huge[4_000_000:]
    assert not ex.is_duplicate(edited)
    assert nd.is_duplicate(edited)
    assert ex.is_duplicate(huge.upper()) and nd.is_duplicate(huge.upper())


def test_prenormalised_texts_give_the_same_decisions(real_docs):
    from stacklm.data.dedup import ExactDeduper, NearDeduper, normalize_text

    texts = real_docs[:300] + real_docs[:20] + [t.upper() for t in real_docs[20:40]]
    norm = [normalize_text(t) for t in texts]
    a, b = ExactDeduper(), ExactDeduper()
    assert (a.is_duplicate_batch(texts) == b.is_duplicate_batch(norm, normalized=True)).all()
    c, d = NearDeduper(), NearDeduper()
    assert (c.is_duplicate_batch(texts) == d.is_duplicate_batch(norm, normalized=True)).all()
