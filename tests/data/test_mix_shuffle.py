"""Budgeted mixing, shuffle buffer and holdout: exactness, determinism, exact resume."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from torchdata.nodes import IterableWrapper

from stacklm.corpus import iter_default_corpus
from stacklm.data.quality.holdout import HoldoutNode, filter_split, holdout_split
from stacklm.data.mix.mix import MixNode, TokenBudgetMixer, mix_budgeted, split_budget
from stacklm.data.doc_refs import decode_docs, encode_docs
from stacklm.data.shuffle import ShuffleNode, shuffle_docs
from stacklm.data.stats import StageStats
from tests.helpers.resume import check_save_load_state


def _docs(source, n, lo, hi, seed):
    rng = np.random.default_rng(seed)
    return [
        {
            "ids": rng.integers(0, 1000, size=int(rng.integers(lo, hi)), dtype=np.int32),
            "source": source,
            "domain": "code" if source == "code" else "prose",
            "doc_id": f"{source}-{i}",
        }
        for i in range(n)
    ]


def _same_stream(a, b):
    return len(a) == len(b) and all(x["doc_id"] == y["doc_id"] and np.array_equal(x["ids"], y["ids"]) for x, y in zip(a, b))


def _sources():
    return {
        "web": _docs("web", 3000, 5, 60, 0),
        "code": _docs("code", 400, 100, 900, 1),
        "math": _docs("math", 600, 10, 120, 2),
    }


WEIGHTS = {"web": 0.6, "code": 0.3, "math": 0.1}


def _tokens_by_source(stream):
    out = {}
    for d in stream:
        out[d["source"]] = out.get(d["source"], 0) + len(d["ids"])
    return out


# ---------------------------------------------------------------------------------------
# Mix
# ---------------------------------------------------------------------------------------
def test_split_budget_is_exact():
    for total in (1, 7, 1000, 20_000_000_001):
        shares = split_budget(total, np.array([0.7, 0.15, 0.1, 0.05]))
        assert shares.sum() == total and (shares >= 0).all()
    assert split_budget(10, np.array([1.0, 1.0, 1.0])).tolist() == [4, 3, 3]


def test_budgets_are_met_exactly_and_truncation_is_counted():
    srcs = _sources()
    mixer = TokenBudgetMixer(list(srcs), WEIGHTS, 50_000, seed=3)
    stream = list(mixer(srcs))
    got = _tokens_by_source(stream)
    assert got == {"web": 30_000, "code": 15_000, "math": 5_000}
    r = mixer.realized()
    assert {k: v["tokens"] for k, v in r.items()} == got
    assert all(v["status"] == "budget_met" for v in r.values())
    assert {k: v["docs"] for k, v in r.items()} == {s: sum(d["source"] == s for d in stream) for s in srcs}
    # the last document of each source was cut to the budget (random lengths: an exact fit is unlikely)
    for s in srcs:
        last = [d for d in stream if d["source"] == s][-1]
        original = next(d for d in srcs[s] if d["doc_id"] == last["doc_id"])
        assert r[s]["truncated_tokens"] == len(original["ids"]) - len(last["ids"])
        assert r[s]["truncated_docs"] == int(len(original["ids"]) > len(last["ids"]))
        np.testing.assert_array_equal(last["ids"], original["ids"][: len(last["ids"])])
    st = mixer.stats()
    assert isinstance(st, StageStats) and st.total("kept") == len(stream)


def test_a_source_that_runs_dry_drops_out_and_the_rest_renormalise():
    srcs = _sources()
    srcs["math"] = srcs["math"][:20]  # ~1300 tokens, far below its 10% of 50k
    math_tokens = sum(len(d["ids"]) for d in srcs["math"])
    mixer = TokenBudgetMixer(list(srcs), WEIGHTS, 50_000, seed=0)
    got = _tokens_by_source(mixer(srcs))
    assert got["math"] == math_tokens
    assert sum(got.values()) == 50_000  # the total is still met
    deficit = 5_000 - math_tokens
    extra = split_budget(deficit, np.array([0.6, 0.3]))
    assert got["web"] == 30_000 + extra[0] and got["code"] == 15_000 + extra[1]
    r = mixer.realized()
    assert r["math"]["status"] == "ran_dry" and r["math"]["planned_budget"] == 5_000


def test_a_late_dry_source_reopens_a_source_that_had_met_its_budget():
    # "a" meets its 1000-token budget with its first document; "b" (500 tokens) runs dry later.
    srcs = {"a": [{**d, "ids": np.arange(1000, dtype=np.int32)} for d in _docs("a", 5, 1, 2, 0)], "b": _docs("b", 10, 50, 51, 1)}
    mixer = TokenBudgetMixer(["a", "b"], {"a": 0.5, "b": 0.5}, 2000, seed=0)
    stream = list(mixer(srcs))
    assert _tokens_by_source(stream) == {"a": 1500, "b": 500}
    r = mixer.realized()
    assert r["a"]["status"] == "budget_met" and r["a"]["budget"] == 1500 and r["b"]["status"] == "ran_dry"
    assert r["a"]["truncated_docs"] == 1 and r["a"]["truncated_tokens"] == 500


def test_all_sources_dry_ends_the_stream_short():
    srcs = {"a": _docs("a", 10, 5, 10, 0), "b": _docs("b", 10, 5, 10, 1)}
    total = sum(len(d["ids"]) for s in srcs.values() for d in s)
    stream = list(mix_budgeted(srcs, {"a": 1.0, "b": 1.0}, total * 10, seed=0))
    assert sum(len(d["ids"]) for d in stream) == total and len(stream) == 20


def test_mix_tracks_token_weights_along_the_stream():
    """Short web docs vs long code docs at 50/50 tokens: every quarter of the stream stays
    near 50/50 (a document-weighted sampler would front-load code)."""
    srcs = {"web": _docs("web", 5000, 5, 40, 0), "code": _docs("code", 400, 300, 700, 1)}
    stream = list(mix_budgeted(srcs, {"web": 0.5, "code": 0.5}, 100_000, seed=1))
    cum = np.cumsum([len(d["ids"]) for d in stream])
    for q in (0.25, 0.5, 0.75):
        part = stream[: int(np.searchsorted(cum, q * cum[-1])) + 1]
        share = _tokens_by_source(part)["code"] / sum(len(d["ids"]) for d in part)
        assert 0.4 < share < 0.6, (q, share)


def test_mix_is_deterministic_per_seed():
    a = list(mix_budgeted(_sources(), WEIGHTS, 20_000, seed=5))
    b = list(mix_budgeted(_sources(), WEIGHTS, 20_000, seed=5))
    c = list(mix_budgeted(_sources(), WEIGHTS, 20_000, seed=6))
    assert _same_stream(a, b)
    assert [d["doc_id"] for d in a] != [d["doc_id"] for d in c]


def test_mix_rejects_bad_weights():
    with pytest.raises(ValueError, match="exactly the sources"):
        TokenBudgetMixer(["a", "b"], {"a": 1.0}, 10)
    with pytest.raises(ValueError, match=r"\['b'\].*positive"):
        TokenBudgetMixer(["a", "b"], {"a": 1.0, "b": 0.0}, 10)


def _mix_node(srcs, total=30_000, seed=9):
    return MixNode({k: IterableWrapper(v) for k, v in srcs.items()}, WEIGHTS, total, seed)


def test_mix_node_matches_plain_and_resumes_exactly():
    srcs = _sources()
    srcs["math"] = srcs["math"][:30]  # a source runs dry mid-stream, too

    def check_state(r):
        assert set(r.state["sources"]) == set(srcs)  # children's states ride along
        assert r.state["mixer"]["tokens"].sum() == sum(len(d["ids"]) for d in r.head)

    def check_restored(r):
        assert r.restored.realized() == r.interrupted.realized()

    def check_resumed(r):
        assert r.restored.realized() == r.uninterrupted.realized()  # as after a run never stopped

    full = check_save_load_state(
        lambda: _mix_node(srcs), lambda n: (0, 1, 50, n // 2, n - 1, n), state_round_trip="pickle",
        check_state=check_state, check_restored=check_restored, check_resumed=check_resumed,
    )
    assert _same_stream(full, list(mix_budgeted(srcs, WEIGHTS, 30_000, seed=9)))


# ---------------------------------------------------------------------------------------
# Shuffle
# ---------------------------------------------------------------------------------------
def test_shuffle_is_a_seeded_permutation():
    docs = _docs("web", 500, 1, 30, 0)
    a = list(shuffle_docs(docs, 64, seed=1))
    b = list(shuffle_docs(docs, 64, seed=1))
    c = list(shuffle_docs(docs, 64, seed=2))
    assert sorted(d["doc_id"] for d in a) == sorted(d["doc_id"] for d in docs)
    assert _same_stream(a, b)
    assert [d["doc_id"] for d in a] != [d["doc_id"] for d in c]
    order = [int(d["doc_id"].split("-")[1]) for d in a]
    assert order != sorted(order)
    # it mixes within the buffer's reach: far from the identity, but bounded displacement forward
    assert max(o - i for i, o in enumerate(order)) <= 63  # no input comes out more than buffer_size-1 places early
    assert np.mean(np.abs(np.array(order) - np.arange(len(order)))) > 10


def test_buffer_codec_round_trips_compactly():
    docs = _docs("web", 50, 0, 30, 0) + _docs("code", 50, 1, 30, 1)
    docs[3] = {**docs[3], "extra": 7}
    enc = encode_docs(docs)
    assert enc["ids"].dtype == np.uint16 and enc["ids"].ndim == 1 and len(enc["offsets"]) == 101  # ids < 65536
    assert enc["fields"]["source"]["table"] == ["code", "web"] and enc["fields"]["source"]["codes"].dtype == np.int32
    dec = decode_docs(pickle.loads(pickle.dumps(enc)))
    assert len(dec) == len(docs)
    for x, y in zip(dec, docs):
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) if k == "ids" else x[k] == y[k] for k in x)
        assert x["ids"].dtype == np.int32
    big = [{"ids": np.array([70_000, 5], dtype=np.int32), "source": "web", "doc_id": "b"}]
    enc = encode_docs(big)
    assert enc["ids"].dtype == np.int32 and np.array_equal(decode_docs(enc)[0]["ids"], big[0]["ids"])


def _shuffle_node(docs, seed=4):
    return ShuffleNode(IterableWrapper(docs), buffer_size=40, seed=seed)


def test_shuffle_node_resumes_exactly():
    docs = _docs("web", 300, 1, 50, 3)

    def compact_buffer(r):
        buf = r.state["shuffle"]["buffer"]
        assert isinstance(buf["ids"], np.ndarray) and buf["ids"].dtype in (np.uint16, np.int32)
        assert len(buf["offsets"]) - 1 == (min(39, 300 - r.stop) if r.stop else 0)  # topped up to 40, one popped

    full = check_save_load_state(
        lambda: _shuffle_node(docs), (0, 1, 39, 40, 150, 280, 299, 300), state_round_trip="pickle", check_state=compact_buffer,
    )
    assert _same_stream(full, list(shuffle_docs(docs, 40, seed=4)))


def test_shuffle_state_is_small():
    docs = _docs("web", 2000, 100, 101, 0)  # 100 tokens each
    node = ShuffleNode(IterableWrapper(docs), buffer_size=1000, seed=0)
    next(node)
    state = node.state_dict()["shuffle"]
    size = len(pickle.dumps(state))
    tokens = int(state["buffer"]["offsets"][-1])
    # ids at 2 bytes/token (uint16) + offsets/codes + doc_id strings; far below pickled per-doc dicts
    assert size < 2 * tokens + 40 * 1000
    per_doc = len(pickle.dumps(docs[:999]))
    assert size < per_doc


# ---------------------------------------------------------------------------------------
# Holdout
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def texts():
    return list(iter_default_corpus(1_500_000))


def test_holdout_is_deterministic_and_disjoint(texts):
    docs = [{"text": t, "source": "stdlib", "domain": "prose", "doc_id": str(i)} for i, t in enumerate(texts)]
    train = list(filter_split(docs, "train", 0.1, seed=0))
    val_stats = StageStats("holdout")
    val = list(filter_split(docs, "val", 0.1, seed=0, stats=val_stats))
    ids_t, ids_v = {d["doc_id"] for d in train}, {d["doc_id"] for d in val}
    assert not ids_t & ids_v and len(ids_t | ids_v) == len(docs)
    assert 0.05 < len(val) / len(docs) < 0.15
    assert val_stats.get("stdlib", "kept") == len(val) and val_stats.get("stdlib", "holdout_other_split") == len(train)
    # same text -> same split, also after case/whitespace changes; the seed changes the split
    for t in texts[:200]:
        s = holdout_split(t, 0.1, 0)
        assert holdout_split(t, 0.1, 0) == s
        assert holdout_split("  " + t.upper().replace(" ", "\n  ") + "\n", 0.1, 0) == s
    assert [holdout_split(t, 0.5, 0) for t in texts[:200]] != [holdout_split(t, 0.5, 1) for t in texts[:200]]
    assert {holdout_split(t, 0.0, 0) for t in texts[:50]} == {"train"}
    assert {holdout_split(t, 1.0, 0) for t in texts[:50]} == {"val"}
    # a larger fraction only moves documents from train to val (nested holdouts)
    small = {i for i, t in enumerate(texts) if holdout_split(t, 0.05, 0) == "val"}
    large = {i for i, t in enumerate(texts) if holdout_split(t, 0.2, 0) == "val"}
    assert small <= large


def test_holdout_splits_match_the_former_normalisation(texts, monkeypatch):
    """The holdout now normalises with dedup's guarded ``normalize_text``; it must split every
    document exactly as its former inline normalisation did, or old val sets would leak into train."""
    import unicodedata

    import xxhash

    from stacklm.data.quality import normalize as normalize_mod

    def former_split(text: str, fraction: float, seed: int) -> str:
        norm = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
        h = xxhash.xxh64_intdigest(norm.encode("utf-8", errors="surrogatepass"), seed=seed)
        return "val" if h < int(fraction * 2.0**64) else "train"

    odd = ["\x1c a\u2003b \u3000", "Cafe\u0301 ﬁne\u00a0Straße", "ok \ud800 lone", "", " \n\t ", "ＡＢＣ　ｄｅｆ"]
    for text in texts + odd:
        for fraction, seed in ((0.1, 0), (0.5, 3)):
            assert holdout_split(text, fraction, seed) == former_split(text, fraction, seed)
    monkeypatch.setattr(normalize_mod, "_NORMALIZE_SLICE", 41)  # the sliced path of huge documents too
    for text in texts[:300] + odd:
        assert holdout_split(text, 0.5, 7) == former_split(text, 0.5, 7)


def test_holdout_node_resumes_and_names_the_problem(texts):
    docs = [{"text": t, "source": "stdlib", "domain": "prose", "doc_id": str(i)} for i, t in enumerate(texts[:300])]

    def build():
        return HoldoutNode(IterableWrapper(docs), "val", 0.3, seed=1)

    def counts_continue(r):
        assert r.restored.stats.get("stdlib", "kept") == len(r.full)
        assert r.restored.stats.get("stdlib", "holdout_other_split") == len(docs) - len(r.full)

    full = check_save_load_state(build, lambda n: [n // 2], check_resumed=counts_continue)
    assert [d["doc_id"] for d in full] == [d["doc_id"] for d in filter_split(docs, "val", 0.3, seed=1)]

    bad = HoldoutNode(IterableWrapper([{"ids": np.zeros(3, np.int32), "source": "web", "doc_id": "w1"}]), "train", 0.1)
    with pytest.raises(KeyError, match="doc 'w1' of source 'web'.*before tokenization"):
        next(bad)
    with pytest.raises(ValueError, match="split must be one of"):
        HoldoutNode(IterableWrapper(docs), "test", 0.1)
