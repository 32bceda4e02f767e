"""How much text a tokenizer input holds before it is read (``text_sizes``), how a budget is
shared between inputs by it (``open_text_mix``), and what the sample audit says about it
(issue 36 part 2): compressed files by their uncompressed size, a short input's shortfall
passed to the others, "input exhausted" only when it is, and one line for many small files."""

from __future__ import annotations

import gzip
import io
import json
import random

import pytest

from stacklm.data.sources.text_input import TextGroup, open_text_input, open_text_mix
from stacklm.data.sources.text_sizes import HEAD_BYTES, uncompressed_size


@pytest.fixture(scope="module")
def raw() -> bytes:
    """~3 MiB of random words: compresses ~3x, so reading the first MiB of output does not
    reach the end of the compressed file."""
    rng = random.Random(0)
    words = [f"w{rng.randrange(1 << 20):x}" for _ in range(4000)]
    return "".join(" ".join(rng.choice(words) for _ in range(12)) + "\n" for _ in range(40_000)).encode()


def test_compressed_files_are_sized_uncompressed(tmp_path, raw):
    import zstandard

    assert len(raw) > 2 * HEAD_BYTES
    single = tmp_path / "one.txt.gz"
    single.write_bytes(gzip.compress(raw))
    assert uncompressed_size(str(single)) == (len(raw), "gzip ISIZE")
    # two members: the trailer holds only the last one's size, 1/50 of the file; the ratio wins
    multi = tmp_path / "two.txt.gz"
    cut = len(raw) * 49 // 50
    multi.write_bytes(gzip.compress(raw[:cut]) + gzip.compress(raw[cut:]))
    size, how = uncompressed_size(str(multi))
    assert how == "sampled ratio" and abs(size / len(raw) - 1) < 0.1
    framed = tmp_path / "framed.txt.zst"
    framed.write_bytes(zstandard.ZstdCompressor().compress(raw))  # the frame header holds the size
    assert uncompressed_size(str(framed)) == (len(raw), "zstd frame")
    streamed = tmp_path / "streamed.txt.zst"  # written as a stream: no size in the header
    buf = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(buf, closefd=False) as w:
        w.write(raw)
    streamed.write_bytes(buf.getvalue())
    size, how = uncompressed_size(str(streamed))
    assert how == "sampled ratio" and abs(size / len(raw) - 1) < 0.1
    small = tmp_path / "small.txt.gz"
    small.write_bytes(gzip.compress(raw[:5000]))
    assert uncompressed_size(str(small)) == (5000, "measured")
    # a budget shared between the plain and the compressed copy: half each, not by disk size
    plain = tmp_path / "plain.txt"
    plain.write_bytes(raw)
    sample = open_text_input([str(plain), str(single)], 200_000)
    assert sum(len(c.encode()) for c in sample) == 200_000
    assert [sample.audit.per_file[str(p)]["bytes_yielded"] for p in (plain, single)] == [100_000, 100_000]


def _lines(path, n: int, text: str | None, extra: str = "") -> None:
    with open(path, "a", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"text": text if text is None else f"{text} {i}.", "meta": extra}) + "\n")


def test_a_short_input_passes_its_share_on_and_the_state_says_what_was_read(tmp_path):
    """Weights 0.8 / 0.2 where the 0.8 source holds little: it is read first (``plan``) and
    all its text taken, the rest goes to the other, and the budget is filled; past every
    input's text the sample says "input exhausted"; an input that held less than its estimate
    leaves the budget short, said with what the inputs stopped at their shares still hold."""
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    big.write_text("many words here " * 6000)  # 96,000 B
    small.write_text("few words " * 1000)  # 10,000 B
    groups = [TextGroup("big", (str(big),), weight=0.2), TextGroup("small", (str(small),), weight=0.8)]
    sample = open_text_mix(groups, 50_000)
    assert sum(len(c.encode()) for c in sample) == 50_000
    audit = sample.audit
    assert audit.per_file[str(small)]["bytes_yielded"] == 10_000 and audit.per_file[str(big)]["bytes_yielded"] == 40_000
    assert audit.complete == {str(small): True, str(big): False}
    assert "budget reached" in audit.summary()[0]

    sample = open_text_mix(groups, 500_000)
    assert sum(len(c.encode()) for c in sample) == 106_000
    head = sample.audit.summary()[0]
    assert head.startswith("sample: 106,000 B of text from 2 of 2 input(s) in 2 sources (106,000 B read; budget 500,000 B, ")
    assert head.endswith("input exhausted: every input read to its end)")

    # a JSON file whose first MiB is all text and whose rest holds none: estimated at ~2x its text
    lying = tmp_path / "lying.jsonl"
    _lines(lying, 30_000, "the quick brown fox jumps over")
    _lines(lying, 12_000, None, "x" * 80)
    texts = sum(len(f"the quick brown fox jumps over {i}.") for i in range(30_000))
    plain = tmp_path / "plain.txt"
    plain.write_text("plain words " * 100_000)  # 1.2 MB
    sample = open_text_input([str(plain), str(lying)], 2_000_000)
    got = sum(len(c.encode()) for c in sample)
    audit = sample.audit
    assert audit.estimates[str(lying)]["text"] > 1.3 * texts  # the estimate was high
    assert audit.per_file[str(lying)]["bytes_yielded"] == texts and audit.complete[str(lying)]
    assert not audit.complete[str(plain)] and got < 2_000_000
    head = audit.summary()[0]
    assert f"budget not filled: {2_000_000 - got:,} B short, while 1 input(s) stopped at their share hold ~" in head
    assert "input exhausted" not in head


def test_many_small_files_collapse_to_the_largest_and_one_line(tmp_path):
    for i in range(60):
        (tmp_path / f"f{i:02d}.txt").write_text(f"file {i} says hello. " * (10 + i))
    sample = open_text_input(str(tmp_path / "*.txt"), None)
    total = sum(len(c.encode()) for c in sample)
    audit = sample.audit
    lines = audit.summary()
    assert len(lines) < 16, lines
    assert lines[0] == f"sample: {total:,} B of text from 60 of 60 input(s) ({total:,} B read; no budget, every input read to its end)"
    listed = [ln for ln in lines if ".txt: " in ln]
    assert [ln.split(":")[0].strip().rsplit("/", 1)[-1] for ln in listed] == [f"f{i}.txt" for i in range(59, 49, -1)]
    rest = sum(audit.per_file[str(tmp_path / f"f{i:02d}.txt")]["bytes_yielded"] for i in range(50))
    assert f"  ... and 50 more input(s): {rest:,} B ({rest / total:.1%} of the sample)" in "\n".join(lines)
    assert len(audit.to_dict()["per_file"]) == 60  # the full table stays in the artifact's metadata
