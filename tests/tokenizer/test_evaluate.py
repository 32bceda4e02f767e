"""Evaluation report (compression per domain, merge overlap) and the HF baseline trainer."""

from __future__ import annotations

import math

import pytest
import regex
import tiktoken

from stacklm import corpus
from stacklm.tokenizer.evaluate import (
    CompressionRow,
    as_encoder,
    compression_report,
    domain_texts_from_corpus,
    format_report,
    measure_compression,
    merge_overlap,
    merge_overlap_rows,
    merges_as_bytes,
    merges_of,
)
from stacklm.data.sources.text_input import domain_texts_from_files
from stacklm.tokenizer.hf_baseline import byte_level_to_bytes, hf_merges_as_bytes, train_hf_bpe
from stacklm.tokenizer.specials import GPT4_PATTERN, SPECIAL_TOKENS

PROBE = "Hello, world!\r\n\tdef f(x):  return x**2  # 日本語 😀 1234567 it's <|assistant|> done\n"


def byte_tokens(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@pytest.fixture(scope="module")
def prose():
    docs = list(corpus.iter_prose(400_000))
    return docs[: len(docs) // 2], docs[len(docs) // 2 :]  # (train, held out)


@pytest.fixture(scope="module")
def hf_1024(prose):
    return train_hf_bpe(prose[0], vocab_size=1024)


# ----------------------------------------------------------------------------- compression


def test_byte_level_tokenizer_scores_exactly_one_byte_per_token():
    texts = ["plain ascii", "naïve café", "日本語 😀"]
    row = measure_compression(byte_tokens, texts, "mixed", name="bytes")
    n_bytes = sum(len(t.encode()) for t in texts)
    n_chars = sum(len(t) for t in texts)
    assert (row.n_texts, row.n_bytes, row.n_chars, row.n_tokens) == (3, n_bytes, n_chars, n_bytes)
    assert row.bytes_per_token == 1.0
    assert row.chars_per_token == pytest.approx(n_chars / n_bytes)
    assert row.chars_per_token < 1.0  # multi-byte characters


def test_known_counts_for_a_word_tokenizer():
    row = measure_compression(str.split, ["ab cd", "efgh"], "toy")
    assert (row.n_bytes, row.n_chars, row.n_tokens) == (9, 9, 3)
    assert row.bytes_per_token == 3.0 and row.tokenizer == "split"


def test_tiktoken_adapter_counts_special_strings_as_text():
    enc = tiktoken.Encoding(
        "bytes-only",
        pat_str=GPT4_PATTERN,
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={"<|assistant|>": 256},
    )
    encoder = as_encoder(enc)
    assert encoder.name == "bytes-only"
    assert encoder.encode("a<|assistant|>") == list(b"a<|assistant|>")  # not [97, 256]
    row = measure_compression(enc, [PROBE] * 300, "probe")  # > one batch
    assert row.n_tokens == row.n_bytes == 300 * len(PROBE.encode())


def test_generic_objects_are_adapted():
    class EncodeOnly:
        def encode(self, text):
            return [0] * len(text)

    class Ids:
        def __init__(self, ids):
            self.ids = ids

    class BatchWithIds:
        name = "batchy"

        def encode_batch(self, texts):
            return [Ids([1, 2]) for _ in texts]

    assert measure_compression(EncodeOnly(), ["abc"], "d").n_tokens == 3
    row = measure_compression(BatchWithIds(), ["x", "y", "z"], "d")
    assert (row.tokenizer, row.n_tokens) == ("batchy", 6)
    with pytest.raises(TypeError, match="tiktoken.Encoding"):
        as_encoder(42)
    with pytest.raises(TypeError, match="sequence of token ids"):
        measure_compression(lambda s: "not ids", ["abc"], "d")


def test_report_covers_every_domain_and_tokenizer_and_formats(hf_1024):
    texts = {"prose": ["hello world " * 50], "code": ["def f(x):\n    return x\n" * 20], "cjk": []}
    pairs = lambda s: [0] * ((len(s.encode()) + 1) // 2)  # noqa: E731 - a 2-bytes-per-token toy
    rows = compression_report({"bytes": byte_tokens, "pairs": pairs, "hf": hf_1024}, texts)
    assert [(r.domain, r.tokenizer) for r in rows] == [
        (d, t) for d in ("prose", "code", "cjk") for t in ("bytes", "pairs", "hf")
    ]
    by = {(r.domain, r.tokenizer): r for r in rows}
    assert by["prose", "pairs"].bytes_per_token == 2.0
    assert by["prose", "hf"].bytes_per_token > 1.5  # merges learned from real prose apply
    assert math.isnan(by["cjk", "bytes"].bytes_per_token)
    overlaps = merge_overlap_rows([(1, 2), (3, 4)], [(3, 4), (5, 6)], ns=(1, 2), names=("10MB", "1MB"))
    report = format_report(rows, overlaps, title="tok-eval")
    lines = report.splitlines()
    assert lines[0] == "tok-eval"
    assert "bytes/tok" in lines[1] and "chars/tok" in lines[1] and "tokens vs bytes" in lines[1]
    prose_pairs = next(line for line in lines if line.startswith("prose") and " pairs " in line)
    assert "2.000" in prose_pairs and "0.500x" in prose_pairs  # half the tokens of the reference
    assert any(line.startswith("cjk") and "n/a" in line for line in lines)
    assert "n/a: no text for domain(s) cjk" in report
    assert "10MB" in report and "50.0%" in report and "0.0%" in report
    assert by["code", "hf"].to_dict()["bytes_per_token"] == by["code", "hf"].bytes_per_token


def test_domain_texts_from_corpus_and_files(tmp_path):
    texts = domain_texts_from_corpus(["prose", "math"], max_bytes=20_000)
    assert set(texts) == {"prose", "math"}
    for docs in texts.values():
        assert 0 < sum(len(d.encode()) for d in docs) <= 20_000
    (tmp_path / "a.txt").write_bytes(b"some prose \xff here\n" * 100)
    (tmp_path / "b.py").write_text("x = 1\n" * 100)
    texts, audits = domain_texts_from_files({"prose": str(tmp_path / "*.txt"), "code": [str(tmp_path / "b.py")]}, 1000)
    assert sum(len(t.encode()) for t in texts["prose"]) == 1000
    assert audits["prose"].total("invalid_utf8_replaced") > 0
    assert "".join(texts["code"]) == "x = 1\n" * 100
    with pytest.raises(FileNotFoundError, match="nope"):
        domain_texts_from_files({"prose": str(tmp_path / "nope*.txt")})


# ----------------------------------------------------------------------------- merges


def test_merge_overlap_on_constructed_lists():
    a = [(b"a", b"b"), (b"c", b"d"), (b"e", b"f"), (b"g", b"h")]
    b = [(b"c", b"d"), (b"a", b"b"), (b"x", b"y"), (b"g", b"h")]
    assert merge_overlap(a, a, 4) == 1.0
    assert merge_overlap(a, b, 2) == 1.0  # order inside the first N does not matter
    assert merge_overlap(a, b, 3) == pytest.approx(2 / 3)
    assert merge_overlap(a, b, 4) == 0.75
    assert merge_overlap(a, b, 100) == 0.75  # clamped to the common length
    assert merge_overlap(a, [(b"q", b"r")] * 4, 4) == 0.0
    with pytest.raises(ValueError, match="n must be >= 1"):
        merge_overlap(a, b, 0)
    with pytest.raises(ValueError, match="empty"):
        merge_overlap(a, [], 10)
    rows = merge_overlap_rows(a, b, ns=(1, 3, 10, 100))
    assert [(r.n, round(r.fraction, 3)) for r in rows] == [(1, 0.0), (3, 0.667), (4, 0.75)]


def test_id_pair_merges_are_compared_by_bytes():
    # Same merges, learned in a different order: the third merge has different ids in the
    # two runs ((256, 33) vs (257, 33)) but it is the same byte pair (b"hi", b"!").
    run_a = [(104, 105), (120, 121), (256, 33)]
    run_b = [(120, 121), (104, 105), (257, 33)]
    assert merges_as_bytes(run_a) == [(b"h", b"i"), (b"x", b"y"), (b"hi", b"!")]
    assert merge_overlap(run_a, run_b, 3) == 1.0
    with pytest.raises(ValueError, match="merge 0 .* not created yet"):
        merges_as_bytes([(256, 1)])
    # one side as merged tokens only: pairs are joined before comparing
    assert merge_overlap(run_a, [b"xy", b"hi!", b"zz"], 3) == pytest.approx(2 / 3)
    with pytest.raises(TypeError, match="merges_of"):
        merge_overlap(["Ġ t"], ["Ġ t"], 1)  # HF strings must go through hf_merges_as_bytes


# ----------------------------------------------------------------------------- HF baseline


def test_hf_baseline_trains_on_real_text_and_round_trips(prose, hf_1024):
    tok = hf_1024
    assert tok.get_vocab_size() == 1024
    vocab = tok.get_vocab()
    assert [vocab[s] for s in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    for text in [PROBE, prose[1][0], "".join(corpus.iter_cjk(2000)), "a\r\n\r\n  b\t\tc   "]:
        enc = tok.encode(text)
        assert tok.decode(enc.ids, skip_special_tokens=False) == text
        assert not set(enc.ids) & set(range(len(SPECIAL_TOKENS)))  # specials in text stay bytes
    # the pre-tokenizer splits exactly like our pattern
    pieces = [byte_level_to_bytes(p).decode() for p, _ in tok.pre_tokenizer.pre_tokenize_str(PROBE)]
    assert pieces == regex.findall(GPT4_PATTERN, PROBE)
    # it compresses held-out prose well beyond bytes
    assert measure_compression(tok, prose[1], "prose").bytes_per_token > 2.5


def test_hf_merges_resolve_like_our_id_layout(prose, hf_1024):
    merges = hf_merges_as_bytes(hf_1024)
    assert len(merges) == 1024 - 256 - len(SPECIAL_TOKENS)
    # Rebuild the merges as id pairs in our layout and resolve them back: identical bytes.
    ids = {bytes([b]): b for b in range(256)}
    id_pairs = []
    for left, right in merges:
        id_pairs.append((ids[left], ids[right]))
        ids[left + right] = 256 + len(id_pairs) - 1
    assert merges_as_bytes(id_pairs) == merges
    assert merges_of(hf_1024) == [a + b for a, b in merges]
    smaller = hf_merges_as_bytes(train_hf_bpe(prose[0][: len(prose[0]) // 4], vocab_size=1024))
    assert merge_overlap(merges, merges, 500) == 1.0
    assert 0.5 < merge_overlap(merges, smaller, 100) <= 1.0


def test_transformers_adapter_matches_tokenizers(prose, hf_1024):
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=hf_1024)
    texts = prose[1][:20]
    a = measure_compression(hf_1024, texts, "prose")
    b = measure_compression(wrapped, texts, "prose", name="transformers")
    assert b.tokenizer == "transformers"
    assert a.n_tokens == b.n_tokens and a.n_tokens > 0


def test_hf_baseline_rejects_bad_input():
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_hf_bpe(["text"], vocab_size=100)
    with pytest.raises(ValueError, match="empty"):
        train_hf_bpe([], vocab_size=512)
    with pytest.raises(ValueError, match="not a byte-level token"):
        byte_level_to_bytes("日")


def test_compression_row_is_plain_data():
    row = CompressionRow("prose", "t", 1, 10, 8, 4)
    assert row.to_dict() == {
        "domain": "prose",
        "tokenizer": "t",
        "n_texts": 1,
        "n_bytes": 10,
        "n_chars": 8,
        "n_tokens": 4,
        "vocab_size": None,
        "bytes_per_token": 2.5,
        "chars_per_token": 2.0,
    }


def test_evaluates_our_trained_tokenizer_beside_the_hf_baseline(prose, hf_1024):
    from stacklm.tokenizer.training import train_from_iterable

    ours = train_from_iterable(prose[0], vocab_size=1024).tokenizer
    smaller = train_from_iterable(prose[0][: len(prose[0]) // 4], vocab_size=1024).tokenizer
    texts = {"prose": prose[1][:30], "code": list(corpus.iter_code(30_000))}
    rows = compression_report({"stacklm": ours, "hf": hf_1024}, texts)
    by = {(r.domain, r.tokenizer): r for r in rows}
    for domain in texts:  # same pattern, vocab and data: compression within 2% of HF
        assert by[domain, "stacklm"].n_tokens == pytest.approx(by[domain, "hf"].n_tokens, rel=0.02)
        assert by[domain, "stacklm"].n_tokens == sum(len(ours.encode(t)) for t in texts[domain])
    assert merges_of(ours)[:5] == [bytes(t) for t in ours.merged_tokens[:5]]
    assert merge_overlap(merges_of(ours), merges_of(hf_1024), 500) > 0.9
    rows_overlap = merge_overlap_rows(merges_of(ours), merges_of(smaller), ns=(100, 10_000), names=("full", "quarter"))
    assert [r.n for r in rows_overlap] == [100, 759]
    assert 0.0 < rows_overlap[-1].fraction < 1.0
    with pytest.raises(TypeError, match="exposes no merges"):
        merges_of(byte_tokens)
