"""The from-scratch trainer, the fast backend and the id layout they must both produce."""

from __future__ import annotations

import random
import warnings

import pytest

from stacklm.corpus import iter_cjk, iter_default_corpus
from stacklm.tokenizer.training import train_from_iterable
from stacklm.tokenizer.specials import GPT4_PATTERN, SPECIAL_TOKENS
from stacklm.tokenizer.train import count_chunks, train_bpe, train_naive


def _adversarial_docs() -> list[str]:
    rng = random.Random(7)
    docs = []
    # many exact ties: every pair appears the same number of times
    docs.append(" ".join("".join(rng.choice("abcdefgh") for _ in range(6)) for _ in range(3000)))
    docs.append("ab cd ef gh " * 500 + "ba dc fe hg " * 500)
    # long repeats (runs that merge into themselves)
    docs.append("a" * 5000 + " " + "ab" * 3000 + " " + "aaa bbb " * 400 + "=" * 2000)
    # CJK, emoji (4-byte sequences, ZWJ sequences), CRLF and tabs
    docs.append("统一码联盟是一个非营利组织。日本語のテキスト、한국어 텍스트。" * 200)
    docs.append("👩‍💻 code 🚀🚀 launch 😀😃😄 fin\r\n" * 300 + "🇫🇷🇩🇪 flags\t\ttabs\r\n\r\n" * 200)
    docs.append("line one\r\nline two\r\n\tindented\r\n    spaces   \r\n" * 300)
    docs.append("3.14159 2.71828 1234567890 ٣٤٥ ½ ⅔ x²+y²=z² " * 200)
    docs.extend(iter_cjk(30_000))
    return docs


def _python_vs_fast(docs, vocab_size):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slow = train_from_iterable(docs, vocab_size, backend="python")
        fast = train_from_iterable(docs, vocab_size, backend="fast")
    return slow, fast


def test_fast_backend_matches_python_trainer_on_real_text():
    docs = list(iter_default_corpus(1_200_000))
    slow, fast = _python_vs_fast(docs, 4096)
    assert slow.n_merges == fast.n_merges == 4096 - 256 - len(SPECIAL_TOKENS)
    assert slow.tokenizer.merged_tokens == fast.tokenizer.merged_tokens


def test_fast_backend_matches_python_trainer_on_adversarial_text():
    slow, fast = _python_vs_fast(_adversarial_docs(), 4096)
    assert slow.n_merges > 500
    assert slow.tokenizer.merged_tokens == fast.tokenizer.merged_tokens
    assert slow.shortfall == fast.shortfall


def test_heap_trainer_equals_naive_rescan():
    docs = list(iter_default_corpus(150_000)) + _adversarial_docs()[:3]
    counts = count_chunks(docs, GPT4_PATTERN)
    heap = train_bpe(counts, 300)
    naive = train_naive(counts, 300)
    assert heap.merges == naive.merges
    assert heap.pair_counts == naive.pair_counts
    # the tie-break rule: counts never increase, and equal counts come in ascending pair order
    for i in range(1, len(heap.merges)):
        assert heap.pair_counts[i] <= heap.pair_counts[i - 1] or heap.merges[i][0] >= 256 or heap.merges[i][1] >= 256


def test_tie_break_picks_smallest_pair():
    from collections import Counter

    counts = Counter({"ab": 5, "cd": 5, "ba": 5})
    out = train_bpe(counts, 3)
    assert out.merges == [(ord("a"), ord("b")), (ord("b"), ord("a")), (ord("c"), ord("d"))]


def test_id_layout_and_shortfall_fillers():
    docs = ["hello world " * 50, "the quick brown fox " * 20]
    with pytest.warns(UserWarning, match="ran short"):
        res = train_from_iterable(docs, vocab_size=1024)
    tok = res.tokenizer
    assert tok.vocab_size == 1024
    assert res.shortfall == 1024 - 256 - 9 - res.n_merges > 0
    assert tok.n_unused == res.shortfall
    assert [tok.special_ids[s] for s in SPECIAL_TOKENS] == list(range(1024 - 9, 1024))
    assert tok.token_id("<|unused_0|>") == 256 + res.n_merges
    assert tok.token_id(f"<|unused_{res.shortfall - 1}|>") == 1024 - 10
    assert tok.decode([tok.bos_id]) == "<|bos|>"


def test_default_vocab_puts_specials_on_top_ids():
    with pytest.warns(UserWarning, match="ran short"):
        tok = train_from_iterable(list(iter_default_corpus(200_000)), vocab_size=32768).tokenizer
    assert tok.vocab_size == 32768
    assert tok.special_ids == {s: 32759 + i for i, s in enumerate(SPECIAL_TOKENS)}


def test_empty_corpus_is_a_clear_error():
    with pytest.raises(ValueError, match="empty training corpus"):
        train_from_iterable([], vocab_size=512)
    with pytest.raises(ValueError, match="empty training corpus"):
        train_from_iterable(["", ""], vocab_size=512, backend="python")


def test_one_distinct_word_gives_warned_shortfall():
    with pytest.warns(UserWarning, match="ran short"):
        res = train_from_iterable(["banana"] * 1000, vocab_size=600, backend="python")
    # a+n -> an; b+an -> ban (smallest pair among the three count-1 ties); an+a -> ana;
    # ban+ana -> banana: four merges and then no pair is left
    assert res.n_merges == 4
    assert res.tokenizer.encode("banana") == [256 + 3]


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        train_from_iterable(["x"], backend="gpu")
    with pytest.raises(ValueError, match="vocab_size"):
        train_from_iterable(["x"], vocab_size=100)
    with pytest.raises(ValueError, match="<\\|name\\|>"):
        train_from_iterable(["x"], special_tokens=["bos"])


def test_lone_surrogates_are_replaced_and_counted():
    res = train_from_iterable(["abc \ud800 abc " * 20], vocab_size=300, backend="fast")
    assert res.surrogates_replaced == 20
    assert res.tokenizer.metadata["surrogates_replaced"] == 20


@pytest.mark.parametrize("backend", ["python", "fast"])
def test_training_with_stderr_redirected_writes_plain_lines(backend, capsys, monkeypatch):
    """Not a terminal (capsys): reading and merging as plain lines, the bytes and merges true."""
    import re

    from stacklm.progress_lines import SECONDS_ENV

    monkeypatch.setenv(SECONDS_ENV, "0")  # a line at every chance
    docs = list(iter_default_corpus(60_000))
    size = sum(len(d.encode("utf-8")) for d in docs)
    res = train_from_iterable(iter(docs), 400, backend=backend, progress=True, total_bytes=size)
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err, repr(err[-500:])
    head = rf"^\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d train-tokenizer\[{backend}\]: "
    lines = err.splitlines()
    assert all(re.match(head, line) for line in lines), err
    reading = [line for line in lines if re.match(head + "reading", line)]
    assert reading and all(re.search(rf"  bytes [\d,]+/{size:,} \(\d+%\)  MB/s [\d.]+  elapsed \S+  ETA \S+$", r) for r in reading), reading
    (read,) = [line for line in lines if re.match(head + "input read", line)]
    assert f"  bytes {res.bytes_seen:,}/{size:,} (100%)" in read and res.bytes_seen == size  # every byte, counted apart
    assert f"now merging {400 - 256 - len(SPECIAL_TOKENS)} merges" in read
    merges = [line for line in lines if re.match(head + "merg", line)]
    assert merges[-1].split(": ", 1)[1].startswith(f"merged  merges {res.n_merges:,}/{res.n_merges:,} (100%)"), merges
    if backend == "python":  # each merge is seen: lines on the way
        assert len(merges) > 2 and "ETA" in merges[0]
