"""stream_sample / sample_texts: exact byte budget, clean cuts, byte-loss audit, bounded memory."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from stacklm import corpus
from stacklm.data.sources.text_sample import COUNTERS, sample_texts, stream_sample

# Bytes with every kind of loss: 2 stray bytes, a NUL, an encoded lone surrogate, a truncated
# 3-byte sequence, plus a genuine U+FFFD and a valid euro sign that must survive untouched.
DIRTY = b"ok \xff\xfe bad \x00nul \xed\xa0\x80 sur \xe2\x82 trunc \xe2\x82\xac real\xef\xbf\xbd end"
DIRTY_CLEAN = "ok \ufffd\ufffd bad nul \ufffd sur \ufffd trunc \u20ac real\ufffd end"


def utf8(s: str) -> int:
    return len(s.encode("utf-8"))


def losses(audit, name):
    c = audit.per_file[name]
    return c["invalid_utf8_replaced"], c["nul_bytes_removed"], c["lone_surrogates_replaced"]


def write(path, data: bytes | str):
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return str(path)


def test_whole_file_round_trips_with_word_boundary_chunks(tmp_path):
    text = "".join(corpus.iter_prose(200_000))
    path = write(tmp_path / "prose.txt", text)
    sample = stream_sample(path, None, chunk_bytes=4096)
    chunks = list(sample)
    assert "".join(chunks) == text
    assert len(chunks) > 40
    assert all(0 < utf8(c) <= 4096 for c in chunks)
    # every cut sits where a whitespace run starts: the next chunk opens with whitespace
    # and the previous one does not end with it (so " word" stays whole)
    for prev, nxt in zip(chunks, chunks[1:]):
        assert nxt[0].isspace() and not prev[-1].isspace(), (prev[-20:], nxt[:20])
    audit = sample.audit
    assert audit.per_file[path]["bytes_yielded"] == utf8(text) == audit.bytes_yielded
    assert audit.per_file[path]["bytes_read"] == utf8(text)
    assert audit.per_file[path]["forced_cuts"] == 0
    assert not audit.budget_reached


@pytest.fixture(scope="module")
def code_docs():
    return list(corpus.iter_code(60_000))


@pytest.mark.parametrize("max_bytes", [1, 999, 4096, 10_000, 123_457])
def test_budget_is_exact_across_several_files_and_globs(tmp_path, max_bytes, code_docs):
    docs = code_docs
    (tmp_path / "sub").mkdir()
    names = []
    for i, doc in enumerate(docs[:6]):
        folder = tmp_path / "sub" if i % 2 else tmp_path
        names.append(write(folder / f"f{i}.py", doc))
    sample = stream_sample([str(tmp_path / "*.py"), str(tmp_path / "sub" / "**" / "*.py")], max_bytes, chunk_bytes=1024)
    chunks = list(sample)
    total = sum(utf8(c) for c in chunks)
    available = sum(utf8(d) for d in docs[:6])
    assert total == min(max_bytes, available)
    assert sample.audit.budget_reached == (max_bytes <= available)
    # the sample is a prefix of the files' text in resolved order (top-level glob first)
    order = sorted(n for n in names if "/sub/" not in n) + sorted(n for n in names if "/sub/" in n)
    expected = "".join(open(n, encoding="utf-8").read() for n in order)
    assert "".join(chunks) == expected[: len("".join(chunks))]
    per_file_sum = sum(c["bytes_yielded"] for c in sample.audit.per_file.values())
    assert per_file_sum == total
    # reads stop close to the budget: the audit never counts far past what was used
    assert sample.audit.total("bytes_read") <= total + 2 * 4096 + 1024


def test_budget_never_splits_a_multibyte_character(tmp_path):
    text = "€ab " * 1000  # '€' is 3 bytes: budgets landing inside it come up short, never split
    path = write(tmp_path / "euro.txt", text)
    for max_bytes in range(1, 40):
        chunks = list(stream_sample(path, max_bytes, chunk_bytes=16))
        got = "".join(chunks).encode("utf-8")
        assert text.encode("utf-8").startswith(got)
        boundary = max(p for p in range(max_bytes + 1) if p % 6 not in (1, 2))  # not inside '€'
        assert len(got) == boundary, (max_bytes, got)
        assert max_bytes - 2 <= len(got) <= max_bytes
        assert all(utf8(c) <= 16 for c in chunks)


def test_multibyte_text_chunks_fit_and_cut_at_character_boundaries(tmp_path):
    text = "日本語のテキスト🙂 " * 700 + "漢字" * 3000  # a long space-free CJK run at the end
    path = write(tmp_path / "cjk.txt", text)
    sample = stream_sample(path, None, chunk_bytes=1000, read_bytes=777)  # blocks straddle chars
    chunks = list(sample)
    assert "".join(chunks) == text
    assert all(0 < utf8(c) <= 1000 for c in chunks)
    assert sample.audit.per_file[path]["forced_cuts"] == 18000 // 999  # 18,000 B run, 333 chars/chunk
    assert losses(sample.audit, path) == (0, 0, 0)


@pytest.mark.parametrize("read_bytes", [1, 2, 3, 5, 7, 64])
def test_invalid_utf8_nul_and_surrogates_are_replaced_and_counted(tmp_path, read_bytes):
    path = write(tmp_path / "dirty.txt", DIRTY)
    sample = stream_sample(path, None, chunk_bytes=8, read_bytes=read_bytes)
    chunks = list(sample)
    # identical to decoding the whole file at once, however the blocks cut the sequences
    assert "".join(chunks) == DIRTY_CLEAN
    assert all(utf8(c) <= 8 for c in chunks)
    assert losses(sample.audit, path) == (3, 1, 1)
    assert sample.audit.per_file[path]["bytes_read"] == len(DIRTY)
    summary = "\n".join(sample.audit.summary())
    assert "dirty.txt" in summary and "invalid_utf8_replaced=3" in summary and "nul_bytes_removed=1" in summary
    data = json.loads(json.dumps(sample.audit.to_dict()))  # metadata-ready
    assert data["totals"]["lone_surrogates_replaced"] == 1 and set(data["totals"]) == set(COUNTERS)


def test_audit_is_kept_per_file(tmp_path):
    clean = write(tmp_path / "a_clean.txt", "all good here\n" * 50)
    dirty = write(tmp_path / "b_dirty.txt", DIRTY * 3)
    sample = stream_sample(str(tmp_path / "*.txt"), None)
    assert "".join(sample) == "all good here\n" * 50 + DIRTY_CLEAN * 3
    assert losses(sample.audit, clean) == (0, 0, 0)
    assert losses(sample.audit, dirty) == (9, 3, 3)
    assert sample.audit.total("invalid_utf8_replaced") == 9
    summary = sample.audit.summary()
    assert not any("a_clean.txt" in line for line in summary)  # only lossy files are listed
    assert any("b_dirty.txt" in line for line in summary)


def test_single_line_without_spaces_streams_with_bounded_memory(tmp_path):
    path = tmp_path / "one_line.txt"
    block = b"x" * (1 << 20)
    with open(path, "wb") as f:
        for _ in range(30):  # 30 MiB, no whitespace, no newline
            f.write(block)
    chunk_bytes = 256 * 1024
    tracemalloc.start()
    try:
        sample = stream_sample(str(path), None, chunk_bytes=chunk_bytes)
        n_chunks = total = biggest = 0
        for chunk in sample:
            n_chunks += 1
            total += len(chunk)
            biggest = max(biggest, len(chunk))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert total == 30 << 20
    assert biggest <= chunk_bytes
    assert peak < 16 * chunk_bytes + (1 << 20), f"peak {peak / 2**20:.1f} MiB for 30 MiB input"
    assert sample.audit.per_file[str(path)]["forced_cuts"] == n_chunks - 1 == 119


def test_budget_cut_mid_word_is_recorded(tmp_path):
    path = write(tmp_path / "w.txt", "alpha beta gamma")
    sample = stream_sample(path, 8)
    assert list(sample) == ["alpha be"]
    assert sample.audit.budget_cut_mid_word and sample.audit.budget_reached
    sample = stream_sample(path, 10)
    assert "".join(sample) == "alpha beta"
    assert not sample.audit.budget_cut_mid_word


def test_missing_inputs_raise_naming_them(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing_here"):
        stream_sample(str(tmp_path / "nothing_here" / "*.txt"), 100)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        stream_sample(str(tmp_path / "missing.txt"), 100)
    with pytest.raises(IsADirectoryError, match=r"\*\*/\*\.txt"):
        stream_sample(str(tmp_path), 100)
    with pytest.raises(ValueError, match="max_bytes"):
        stream_sample(write(tmp_path / "ok.txt", "x"), 0)


def test_empty_corpus_is_reported_to_the_caller(tmp_path):
    empty = write(tmp_path / "empty.txt", b"")
    nuls = write(tmp_path / "nuls.txt", b"\x00" * 100)
    sample = stream_sample([empty, nuls], 1000)
    assert list(sample) == []
    assert sample.audit.bytes_yielded == 0
    assert sample.audit.per_file[nuls]["nul_bytes_removed"] == 100
    with pytest.raises(ValueError, match="empty corpus.*empty.txt.*nul_bytes_removed"):
        sample.audit.raise_if_empty()


def test_duplicate_matches_are_read_once_and_reported(tmp_path):
    path = write(tmp_path / "a.txt", "hello world")
    sample = stream_sample([path, str(tmp_path / "*.txt")], None)
    assert "".join(sample) == "hello world"
    assert sample.audit.duplicate_paths == [path]


def test_sample_texts_budget_and_audit_on_real_corpus():
    sample = sample_texts(corpus.iter_default_corpus(), 300_001, chunk_bytes=8192)
    chunks = list(sample)
    assert sum(utf8(c) for c in chunks) == 300_001
    assert all(utf8(c) <= 8192 for c in chunks)
    counts = sample.audit.per_file["<texts>"]
    assert counts["documents"] > 1 and counts["bytes_yielded"] == 300_001
    assert sample.audit.budget_reached


def test_sample_texts_replaces_lone_surrogates_and_nul():
    texts = ["good text", "bad \ud800 surrogate\x00 and \udcff escape", ""]
    sample = sample_texts(texts, None, source="mem")
    out = list(sample)
    assert out == ["good text", "bad \ufffd surrogate and \ufffd escape"]  # one chunk per document
    assert losses(sample.audit, "mem") == (0, 1, 2)
    assert sample.audit.per_file["mem"]["documents"] == 3
    with pytest.raises(TypeError, match="item 1 is bytes"):
        list(sample_texts(["ok", b"raw"], None))


def test_random_inputs_keep_every_rule(tmp_path):
    """Seeded fuzz: any text, chunk size, block size and budget gives a prefix of the cleaned
    text, chunks within the limit, and the exact budget unless a character would be split."""
    import random

    rng = random.Random(1234)
    alphabet = ["a", "b", "Z", "7", " ", "  ", "\n", "\r\n", "\t", "é", "€", "日", "🙂", "\u3000", ".", "\x00"]
    for case in range(60):
        text = "".join(rng.choice(alphabet) * rng.randint(1, 30) for _ in range(rng.randint(0, 80)))
        raw = text.encode("utf-8")
        if case % 3 == 0 and raw:  # sprinkle invalid bytes
            at = rng.randrange(len(raw))
            raw = raw[:at] + rng.choice([b"\xff", b"\xed\xa0\x80", b"\xe2\x82", b"\xc0"]) + raw[at:]
        clean = "".join(stream_sample(write(tmp_path / f"c{case}.txt", raw), None, read_bytes=1 << 16))
        chunk_bytes = rng.randint(4, 64)
        max_bytes = rng.choice([None, rng.randint(1, max(1, len(raw) + 10))])
        sample = stream_sample(str(tmp_path / f"c{case}.txt"), max_bytes, chunk_bytes, read_bytes=rng.randint(1, 50))
        chunks = list(sample)
        joined = "".join(chunks)
        assert clean.startswith(joined)
        assert all(0 < utf8(c) <= chunk_bytes for c in chunks)
        target = utf8(clean) if max_bytes is None else min(max_bytes, utf8(clean))
        assert target - 3 <= utf8(joined) <= target
        if utf8(joined) < target:  # only when the next character does not fit
            assert utf8(joined) + utf8(clean[len(joined)]) > target
        assert sample.audit.bytes_yielded == utf8(joined)
        # a cut inside a word or inside a whitespace run happens only as a counted forced cut
        clean_cuts = sum(p[-1].isspace() != n[0].isspace() for p, n in zip(chunks, chunks[1:]))
        forced = sample.audit.total("forced_cuts")
        assert max(0, len(chunks) - 1) - clean_cuts == forced
