"""Word n-gram shingles for near dedup (``dedup.shingle: word``): datatrove's words, the S-curve
against brute-force word 5-gram Jaccard, planted copies in-flight and in the global pass for 1
and 3 readers, config errors, and the default config's hash."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from datatrove.utils.text import simplify_text

from stacklm.data.dedup import shingles as shingles_mod
from stacklm.data.dedup.global_index import id_keys
from stacklm.data.dedup.minhash import MinHasher, NearDeduper, candidate_probability, jaccard, share_a_band
from stacklm.data.pipeline import PipelineConfig, build_pipeline
from stacklm.data.quality.normalize import normalize_text
from stacklm.errors import ConfigError
from stacklm.prebuild.dedup_pass import build_dedup_index
from tests.helpers.dedup_corpus import dedup_config, write_split_corpus
from tests.helpers.synthetic_edits import edits_for_jaccard, inject_word_edits


def datatrove_words(text: str) -> list[str]:
    """The reference: datatrove's own ``simplify_text`` (every step, defaults) of the normalised text, split."""
    return simplify_text(normalize_text(text)).split()


def word_ngrams(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = datatrove_words(text)
    return set(zip(*(words[i:] for i in range(n))))


def punctuation_and_numbers_changed(text: str) -> str:
    """A copy whose every ASCII punctuation mark is a space and every number another number: the
    same words for datatrove (and word shingles), a far copy for character 7-grams (J ~0.1-0.5)."""
    return re.sub(r"[!-/:-@\[-`{-~]", " ", re.sub(r"\d+([.,]\d+)?", "42", text))


@pytest.fixture(scope="module")
def prose(real_docs) -> list[str]:
    """Distinct real documents of 40+ words (stdlib code, docstrings, pydoc topics)."""
    out, seen = [], set()
    for d in real_docs:
        key = normalize_text(d)
        if len(key.split()) >= 40 and key not in seen:
            seen.add(key)
            out.append(d[:6000])
    return out


def test_word_shingles_are_datatroves_word_ngrams(prose, monkeypatch):
    """Words as datatrove's simplify_text leaves them (case, digits, punctuation, diacritics,
    ligatures), one hash per distinct 5-gram; a document under 5 words is one padded shingle;
    cutting huge documents into passes changes no signature value."""
    hasher = MinHasher(shingle="word")
    assert hasher.config() == {"shingle": "word", "shingle_size": 5, "num_bands": 12, "rows_per_band": 10, "seed": 0}
    odd = ["", "a", "Two words", "Café naïve RÉSUMÉ: 3.14, ﬁne 1,000 Straße!", "é" * 3 + " \ud800 x — y … z",
           "x " * 70_000, " ".join(prose[:40])]
    for text in prose[:150] + odd:
        words = datatrove_words(text)
        prepared = hasher.prepare(text).split(" ")
        assert prepared == (words if len(words) >= 5 else words + ["\0"] * (5 - len(words))), text[:60]
        assert hasher.shingle_set(text).size == (len(word_ngrams(text)) if len(words) >= 5 else 1)
    texts = prose[:30] + odd
    expected = hasher.signatures(texts)
    monkeypatch.setattr(shingles_mod, "_PASS_CHARS", 700)  # the 140 kB and 100 kB texts in many pieces
    assert np.array_equal(MinHasher(shingle="word").signatures(texts), expected)
    # short documents: padded to one shingle, so equal words are a duplicate and other words are not
    assert share_a_band(*hasher.keys(["", " ,;. "])).all() and share_a_band(*hasher.keys(["A b!", "a, B"])).all()
    assert not share_a_band(*hasher.keys(["a b", "a c"])).any()
    assert MinHasher(3, shingle="word").shingle_set("one two three four").size == 2


def test_word_s_curve_against_brute_force_jaccard(prose):
    """Real documents with word-level edits: the candidate rate per bin of exact word 5-gram
    Jaccard (brute force on datatrove's words) follows 1 - (1 - J^10)^12."""
    rng = np.random.default_rng(11)
    hasher = MinHasher(shingle="word")

    def grams(text: str) -> set[tuple[str, ...]]:  # the words are datatrove's (previous test); the 5-grams by brute force
        words = hasher.prepare(text).split(" ")
        return set(zip(*(words[i:] for i in range(5))))

    bases, copies, sims = [], [], []
    for i in rng.choice(len(prose), min(300, len(prose)), replace=False):
        base = prose[int(i)]
        base_set = grams(base)
        for lo, hi in ((0.85, 1.0), (0.1, 0.45), (0.1, 0.45), (0.5, 0.7), (0.65, 0.9)):
            copy = inject_word_edits(base, edits_for_jaccard(len(base_set), rng.uniform(lo, hi), 5, rng), rng)
            bases.append(base)
            copies.append(copy)
            sims.append(jaccard_of_sets(base_set, grams(copy)))
    sims = np.array(sims)
    caught = share_a_band(hasher.keys(bases), hasher.keys(copies))
    assert (sims >= 0.9).sum() >= 150 and (sims < 0.5).sum() >= 200
    assert caught[sims >= 0.9].mean() >= 0.95
    assert caught[sims < 0.5].mean() <= 0.015
    rates = []
    for lo, hi in ((0.5, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9)):
        sel = (sims >= lo) & (sims < hi)
        assert sel.sum() >= 40, (lo, sel.sum())
        measured, predicted = caught[sel].mean(), candidate_probability(sims[sel]).mean()
        rates.append(measured)
        assert abs(measured - predicted) < 3 * np.sqrt(predicted * (1 - predicted) / sel.sum()) + 0.05, (lo, measured, predicted)
    assert rates == sorted(rates)
    # the hashed sets are the brute-force ones: MinHasher's own exact Jaccard agrees
    for b, c, s in list(zip(bases, copies, sims))[:100]:
        assert abs(jaccard(hasher.shingle_set(b), hasher.shingle_set(c)) - s) < 1e-12


def jaccard_of_sets(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def test_word_near_deduper_finds_word_edited_copies_and_keeps_unrelated(prose):
    nd = NearDeduper(shingle="word")
    base = [d for d in prose if len(d.split()) >= 200][:150]  # 2 word edits: word 5-gram J >= 0.9
    kept = ~nd.is_duplicate_batch(base, "code")
    assert kept.mean() > 0.9
    rng = np.random.default_rng(12)
    copies = [inject_word_edits(base[i], 2, rng) for i in range(0, len(base), 3) if kept[i]]
    copies += [punctuation_and_numbers_changed(base[i]) for i in range(1, len(base), 3) if kept[i]]
    assert nd.is_duplicate_batch(copies, "web").all()
    assert not NearDeduper().query_batch([punctuation_and_numbers_changed(b) for b in base[1::3]]).all()  # char 7-grams miss some
    unrelated = [d for d in prose if d not in set(base)][:150]
    assert nd.query_batch(unrelated).mean() < 0.1  # unrelated real text passes
    assert nd.stats.to_dict()["web"] == {"near_dup": len(copies)}
    state = nd.state_dict()
    resumed = NearDeduper(shingle="word")
    resumed.load_state_dict(state)
    assert resumed.is_duplicate(copies[0]) and not resumed.is_duplicate(unrelated[-1] + " a new ending")
    with pytest.raises(ValueError, match=r"shingle=word \(this deduper: char\)"):
        NearDeduper().load_state_dict(state)
    char_state = NearDeduper().state_dict()
    del char_state["config"]["shingle"]  # a checkpoint from before word shingles: char shingles
    NearDeduper().load_state_dict(char_state)


@pytest.fixture(scope="module")
def word_corpus(tmp_path_factory):
    """write_split_corpus's 60 documents with exact and near copies, plus a 4th file (read last
    in the canonical order) with a copy of 12 of those whose planted copy is exact, with
    punctuation and numbers changed: a near copy for word shingles only. Returns (glob, the 12
    groups of original, exact copy and punctuation copy)."""
    root = tmp_path_factory.mktemp("word_corpus")
    glob, pair_of = write_split_corpus(root)
    members: dict[int, list[str]] = {}
    for text, pair in pair_of.items():
        members.setdefault(pair, []).append(text)
    groups = [members[i] + [punctuation_and_numbers_changed(members[i][0])] for i in range(1, 60, 2)][:12]
    (root / "z_punct.jsonl").write_text("".join(json.dumps({"text": g[2]}) + "\n" for g in groups))
    return glob, groups


def test_global_pass_with_word_shingles_is_the_same_for_1_and_3_readers(word_corpus):
    glob, groups = word_corpus
    cfg = dedup_config(glob, shingle="word")
    one, three = build_dedup_index(cfg, ("train",), 1), build_dedup_index(cfg, ("train",), 3)
    assert one.content_hash == three.content_hash and one.counts() == three.counts()
    counts = one.counts()["train"]
    assert counts["exact"] + counts["near"] >= 42 and counts["exact"] >= 25 and counts["near"] >= 12  # an exact copy of a near-removed document is near
    # every punctuation copy is removed as a near copy (a char 7-gram pass removes 1 of the 12)
    assert one.lookup("train", id_keys([f"std/z_punct.jsonl/{r}" for r in range(len(groups))])).tolist() == [2] * len(groups)
    assert one.meta["dedup"]["shingle"] == "word" and one.meta["dedup"]["shingle_size"] == 5


def test_stream_in_flight_dedup_uses_word_shingles(word_corpus, tokenizer_512):
    glob, groups = word_corpus
    pipe = build_pipeline(dedup_config(glob, shingle="word"), tokenizer_512)
    node = pipe.chains["std"]["dedup"]
    node.reset(None)
    kept = {d["text"] for d in node}
    # original, exact copy, punctuation copy: at most one survives, whichever came first (none
    # when another document of the corpus is a near copy of the original); with char 7-grams the
    # punctuation copy survives beside its original
    assert all(sum(t in kept for t in group) <= 1 for group in groups)
    assert sum(sum(t in kept for t in group) == 1 for group in groups) >= 10


def test_shingle_config_errors_and_default_hash():
    base = {"seq_len": 128, "batch_size": 2, "seed": 0, "holdout_fraction": 0.0,
            "mix": {"name": "t", "total_tokens": 1000, "entries": [{"name": "std", "kind": "local", "path": "c/*.jsonl", "weight": 1.0, "domain": "code"}]}}
    bad = [({"shingle": "words"}, "field 'data.pipeline.dedup.shingle' must be one of ('char', 'word'), got 'words'; did you mean 'word'?"),
           ({"shingle_size": 0}, "field 'dedup.shingle_size' must be an integer >= 1 or null (the char n-gram's length; null: 7), got 0"),
           ({"shingle": "word", "shingle_size": -2}, "(the word n-gram's length; null: 5), got -2"),
           ({"shingle_size": "5"}, "field 'data.pipeline.dedup.shingle_size' must be an integer, got '5'")]
    for dedup, message in bad:
        with pytest.raises(ConfigError) as e:
            PipelineConfig.from_dict({**base, "dedup": dedup}, "data.pipeline")
        assert message in str(e.value) and "\n" not in str(e.value)
    # the hash main computed for these configs before the option existed: resumes and prebuilds still match
    default = PipelineConfig.from_dict(base)
    assert default.config_hash() == "2ddb001d181d1b04c9f4f9ca094ce632ea812b1a7a35f5627ac762d173feb08b"  # main at 6faf564
    assert PipelineConfig.from_dict({**base, "dedup": {"shingle": "char", "shingle_size": 7}}).config_hash() == default.config_hash()
    word = PipelineConfig.from_dict({**base, "dedup": {"shingle": "word"}})
    assert word.config_hash() != default.config_hash()
    assert PipelineConfig.from_dict({**base, "dedup": {"shingle": "word", "shingle_size": 5}}).config_hash() == word.config_hash()
    assert PipelineConfig.from_dict(word.to_dict()) == word and "shingle" not in default.to_dict()["dedup"]
