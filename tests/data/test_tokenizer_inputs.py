"""Any text input, wherever text is read (issue 14 item 1): ``train-tokenizer`` and ``tok-eval``
take text files, JSON lines (plain/.gz/.zst), parquet and ``datasets`` datasets; JSON read as
text and binary files are refused; ``tok-eval``'s baselines train on the data given and
``--compare`` takes plain tiktoken ranks files with ``--pattern``."""

from __future__ import annotations

import gzip
import json
import os
import random

import pytest

from stacklm.cli import main
from stacklm.tokenizer.bpe import StackTokenizer
from stacklm.data.sources.text_input import open_text_input
from stacklm.errors import TextInputError

WORDS = ["zorblax", "quennet", "flimwise", "drabbleton", "ostrovar", "the", "and", "of", "über", "日本語"]


def _docs(n: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + "." for _ in range(n)]


DOCS = _docs()
DOC_BYTES = sum(len(d.encode()) for d in DOCS)


def _write_jsonl(path, docs, column="text", opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, column: d, "meta": {"quote": '"x"'}}) + "\n")
    return str(path)


def _write_zst(path, docs):
    import zstandard

    raw = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(raw))
    return str(path)


def _write_parquet(path, docs, column="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), column: docs}), path)
    return str(path)


def _train(capsys, out, *args):
    rc = main(["train-tokenizer", *args, "--vocab-size", "300", "--no-progress", "--out", str(out)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# ----------------------------------------------------------------------------- train-tokenizer
def test_every_record_format_trains_on_the_text_field_only(tmp_path, capsys):
    """jsonl, .jsonl.gz, .jsonl.zst, parquet and a `datasets` builder over local files: the same
    documents, so the same merges; none of JSON's quoting is learned, and the sample audit
    counts exactly the documents' bytes."""
    inputs = {
        "jsonl": ["--input", _write_jsonl(tmp_path / "d.jsonl", DOCS)],
        "gz": ["--input", _write_jsonl(tmp_path / "d.jsonl.gz", DOCS, opener=gzip.open)],
        "zst": ["--input", _write_zst(tmp_path / "d.jsonl.zst", DOCS)],
        "parquet": ["--input", _write_parquet(tmp_path / "d.parquet", DOCS, "content"), "--text-column", "content"],
        "dataset_json": ["--dataset", "json", "--data-files", str(tmp_path / "d.jsonl")],
        "dataset_parquet": ["--dataset", "parquet", "--data-files", str(tmp_path / "d.parquet"), "--text-column", "content"],
    }
    merges = {}
    for name, args in inputs.items():
        rc, out, err = _train(capsys, tmp_path / name, *args)
        assert rc == 0, (name, err)
        tok = StackTokenizer.load(tmp_path / name)
        audit = tok.metadata["sample_audit"]
        assert audit["bytes_yielded"] == DOC_BYTES, name
        assert sum(c.get("documents", 0) for c in audit["per_file"].values()) == len(DOCS), name
        merges[name] = tok.merged_tokens
        learned = b"".join(tok.merged_tokens)
        assert b'"' not in learned and b"{" not in learned and b"\\u" not in learned, name
        assert f"records: {len(DOCS):,} documents read" in out
    assert all(m == merges["jsonl"] for m in merges.values())
    corpus = " ".join(DOCS).encode()
    assert all(t in corpus for t in merges["jsonl"])  # every learned token is text of the documents


def test_null_texts_are_skipped_and_counted(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    _write_jsonl(path, DOCS)
    with open(path, "a") as f:
        f.write(json.dumps({"text": None}) + "\n" + json.dumps({"text": ""}) + "\n\n")
    sample = open_text_input([str(path)], None)
    assert "".join(sample) == "".join(DOCS)
    counts = sample.audit.per_file[str(path)]
    assert counts["documents"] == len(DOCS)
    assert counts["records_invalid"] == 1 and counts["records_empty"] == 1 and counts["blank_lines"] == 1  # null, "", blank


def test_text_files_and_code_are_read_as_text_compressed_too(tmp_path):
    text = "\n".join(DOCS)
    (tmp_path / "a.txt").write_text(text)
    (tmp_path / "b.py").write_text("def f(x):\n    return x\n")
    with gzip.open(tmp_path / "c.txt.gz", "wt") as f:
        f.write(text)
    sample = open_text_input([str(tmp_path / "a.txt"), str(tmp_path / "b.py"), str(tmp_path / "c.txt.gz")], None)
    assert "".join(sample) == text + "def f(x):\n    return x\n" + text


@pytest.mark.parametrize("name", ["data.txt", "data"])
def test_json_read_as_text_is_refused_with_the_fix(tmp_path, capsys, name):
    path = _write_jsonl(tmp_path / name, DOCS)
    rc, _, err = _train(capsys, tmp_path / "out", "--input", path)
    assert rc == 2
    assert path in err and "JSON lines" in err and ".jsonl" in err and "--text-column" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    # on purpose: --raw-text trains on the JSON itself
    rc, _, err = _train(capsys, tmp_path / "raw", "--input", path, "--raw-text")
    assert rc == 0, err
    assert b'"' in b"".join(StackTokenizer.load(tmp_path / "raw").merged_tokens)


def test_pretty_printed_json_is_refused(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text(json.dumps({"docs": DOCS[:3]}, indent=2))
    with pytest.raises(TextInputError, match="looks like JSON"):
        open_text_input([str(path)], None)


@pytest.mark.parametrize("kind", ["random", "gzip_named_txt", "nuls"])
def test_binary_files_are_refused(tmp_path, capsys, kind):
    path = tmp_path / "blob.txt"
    if kind == "random":
        path.write_bytes(random.Random(0).randbytes(20_000))
    elif kind == "gzip_named_txt":
        path.write_bytes(gzip.compress("\n".join(DOCS).encode()))
    else:
        path.write_bytes(b"text\x00\x00\x00\x00" * 1000)
    rc, _, err = _train(capsys, tmp_path / "out", "--input", str(path))
    assert rc == 2
    assert str(path) in err and "does not look like text" in err


def test_a_few_bad_bytes_are_still_text(tmp_path):
    path = tmp_path / "mostly.txt"
    path.write_bytes(("\n".join(DOCS)).encode() + b"\xff\xfe\x00 tail")
    sample = open_text_input([str(path)], None)
    assert "tail" in "".join(sample)
    assert sample.audit.total("invalid_utf8_replaced") == 2 and sample.audit.total("nul_bytes_removed") == 1


def test_record_errors_name_the_file_the_line_and_the_fix(tmp_path, capsys):
    path = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    rc, _, err = _train(capsys, tmp_path / "o1", "--input", path, "--text-column", "body")
    assert rc == 2 and "'body'" in err and "whose columns are ['id', 'meta', 'text']" in err and f"--input {path}:COLUMN" in err
    with open(path, "a") as f:
        f.write("{not json\n")
    rc, out, err = _train(capsys, tmp_path / "o2", "--input", path)  # a bad line is skipped and counted (on_invalid: skip)
    assert rc == 0 and "records_invalid=1" in out + err, out + err
    parquet = _write_parquet(tmp_path / "p.parquet", DOCS)
    rc, _, err = _train(capsys, tmp_path / "o3", "--input", parquet, "--text-column", "txt")
    assert rc == 2 and "'txt'" in err and "'text'" in err
    rc, _, err = _train(capsys, tmp_path / "o4", "--input", str(tmp_path / "missing*.jsonl"))
    assert rc == 2 and "missing*.jsonl" in err


def test_budget_counts_bytes_across_formats(tmp_path):
    files = [_write_jsonl(tmp_path / "a.jsonl", DOCS[:100]), _write_parquet(tmp_path / "b.parquet", DOCS[100:])]
    sample = open_text_input(files, 5000)
    assert sum(len(c.encode()) for c in sample) == 5000
    assert sample.audit.budget_reached


# ----------------------------------------------------------------------------- tok-eval
@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from stacklm.corpus import iter_default_corpus
    from stacklm.tokenizer.training import train_from_iterable
    from stacklm.chat.template_export import export_all

    out = tmp_path_factory.mktemp("tok")
    tok = train_from_iterable(iter_default_corpus(200_000), 600).tokenizer
    tok.save(out / "tokenizer.stacklm.json")
    export_all(tok, out)
    return out


def _eval(capsys, *args):
    rc = main(["tok-eval", *args, "--no-progress"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_tok_eval_baselines_train_on_the_tokenizers_own_sample_never_the_evaluation_text(tmp_path, capsys, tok_dir):
    """Issue 32.7b: a tokenizer trained on text A, evaluated on text B. The HF baseline and the
    overlap trainings train on A (the artifact's recorded sample, checked by hash), not on B
    (they trained on B and the baseline "won"); without a usable record they are refused."""
    from stacklm.tokenizer import evaluate
    from stacklm.tokenizer.hf_baseline import train_hf_bpe
    from stacklm.tokenizer.training import train_from_iterable

    a = _write_jsonl(tmp_path / "a.jsonl", DOCS)
    b = _write_jsonl(tmp_path / "b.jsonl", _docs(200, seed=1))
    rc, _, err = _train(capsys, tmp_path / "tokA", "--input", a, "--max-bytes", "6000")
    assert rc == 0, err
    record = StackTokenizer.load(tmp_path / "tokA").metadata["training_sample"]
    assert record["inputs"] == [os.path.abspath(a)] and record["max_bytes"] == record["bytes"] == 6000
    report = tmp_path / "r.json"
    rc, _, err = _eval(capsys, "--tokenizer", str(tmp_path / "tokA"), "--input", b, "--hf-baseline")
    # the paths an artifact records are shown, never opened: the user names the files
    assert rc == 2 and "give them with --train-input" in err and os.path.abspath(a) in err, err
    rc, out, err = _eval(capsys, "--tokenizer", str(tmp_path / "tokA"), "--input", b, "--hf-baseline",
                         "--overlap-sizes", "2000,6000", "--json", str(report), "--train-input", a)
    assert rc == 0, err
    assert f"HF BpeTrainer baseline on 6,000 bytes of {tmp_path / 'tokA'}'s training sample ({os.path.abspath(a)}; 6,000 bytes in all)" in out
    data = json.loads(report.read_text())
    assert data["baselines"]["hf-bpe@300"] == {"trained_on": "the tokenizer's training sample", "bytes": 6000,
                                                "sha256": record["sha256"]}
    # independently: a baseline trained here on A's 6,000 bytes tokenizes B exactly as the table says, one on B does not
    on_a = train_hf_bpe(open_text_input(a, 6000), 300)
    on_b = train_hf_bpe(open_text_input(b), 300)
    row = next(r for r in data["rows"] if r["tokenizer"] == "hf-bpe@300")
    b_texts = list(open_text_input(b))
    assert row["n_tokens"] == evaluate.measure_compression(on_a, b_texts, "input").n_tokens
    assert row["n_tokens"] != evaluate.measure_compression(on_b, b_texts, "input").n_tokens
    small, large = (train_from_iterable(open_text_input(a, n), 300).tokenizer.merged_tokens for n in (2000, 6000))
    assert data["overlap"] == [o.to_dict() for o in evaluate.merge_overlap_rows(
        small, large, names=("2,000 B sample", "6,000 B sample"))]
    # --hf-baseline-bytes caps the baseline at the first bytes of the same sample
    rc, out, err = _eval(capsys, "--tokenizer", str(tmp_path / "tokA"), "--input", b, "--hf-baseline", "--hf-baseline-bytes",
                         "3000", "--json", str(report), "--train-input", a)
    capped = json.loads(report.read_text())["baselines"]["hf-bpe@300"]
    assert rc == 0 and capped["trained_on"].endswith("(its first bytes)") and 0 < capped["bytes"] <= 3000, (err, capped)
    # unavailable: an artifact without a record (tok_dir), then A changed inside the sample
    rc, _, err = _eval(capsys, "--tokenizer", str(tok_dir), "--input", b, "--hf-baseline")
    assert rc == 2 and "field 'metadata.training_sample' is missing" in err and "never on the evaluation text" in err
    assert len(err.strip().splitlines()) == 1
    _write_jsonl(a, ["zorblax changed"] + DOCS[1:])
    rc, _, err = _eval(capsys, "--tokenizer", str(tmp_path / "tokA"), "--input", b, "--overlap-sizes", "2000,6000",
                       "--train-input", a)
    assert rc == 2 and "field 'metadata.training_sample.sha256'" in err and "the files changed or moved" in err, err
    os.remove(a)
    rc, _, err = _eval(capsys, "--tokenizer", str(tmp_path / "tokA"), "--input", b, "--hf-baseline", "--train-input", a)
    assert rc == 2 and "its training sample cannot be read again" in err and "does not exist" in err, err


def test_tok_eval_domains_and_datasets(tmp_path, capsys, tok_dir):
    jsonl = _write_jsonl(tmp_path / "d.jsonl", DOCS[:100])
    parquet = _write_parquet(tmp_path / "p.parquet", DOCS[100:], "content")
    (tmp_path / "t.txt").write_text("\n".join(DOCS))
    report = tmp_path / "r.json"
    rc, _, err = _eval(capsys, "--tokenizer", str(tok_dir), "--domain-file", f"prose={tmp_path / 't.txt'}",
                       f"records={jsonl}", "--dataset", "parquet", "--data-files", parquet, "--text-column", "content",
                       "--dataset-domain", "pq", "--json", str(report))
    assert rc == 2 and "'content'" in err  # one --text-column for every record input: d.jsonl has 'text'
    rc, _, err = _eval(capsys, "--tokenizer", str(tok_dir), "--domain-file", f"prose={tmp_path / 't.txt'}",
                       "--dataset", "parquet", "--data-files", parquet, "--text-column", "content",
                       "--dataset-domain", "pq", "--json", str(report))
    assert rc == 0, err
    rows = {r["domain"]: r for r in json.loads(report.read_text())["rows"]}
    assert rows["pq"]["n_bytes"] == sum(len(d.encode()) for d in DOCS[100:])
    assert rows["prose"]["n_bytes"] == len("\n".join(DOCS).encode())


def test_compare_takes_plain_tiktoken_files_with_a_pattern(tmp_path, capsys, tok_dir):
    from stacklm.tokenizer.export import tiktoken_ranks_bytes

    tok = StackTokenizer.load(tok_dir)
    plain = tmp_path / "plain.tiktoken"  # no sidecar: what OpenAI and others publish
    plain.write_bytes(tiktoken_ranks_bytes(tok.mergeable_ranks))
    data = tmp_path / "t.txt"
    data.write_text("\n".join(DOCS))
    rc, _, err = _eval(capsys, "--tokenizer", str(tok_dir), "--compare", str(plain), "--input", str(data))
    assert rc == 2 and "--pattern" in err and "cl100k" in err
    rc, _, err = _eval(capsys, "--tokenizer", str(tok_dir), "--compare", str(plain), "--pattern", "(", "--input", str(data))
    assert rc == 2 and "neither a known name" in err
    report = tmp_path / "r.json"
    for pattern in ("cl100k", "o200k", "gpt2", tok.pattern):
        rc, _, err = _eval(capsys, "--tokenizer", str(tok_dir), "--compare", str(plain), "--pattern", pattern,
                           "--input", str(data), "--json", str(report))
        assert rc == 0, (pattern, err)
        rows = {r["tokenizer"]: r for r in json.loads(report.read_text())["rows"]}
        assert rows["plain.tiktoken"]["n_tokens"] > 0
    # same ranks and the same pattern: exactly our token count
    assert rows["plain.tiktoken"]["n_tokens"] == rows["stacklm"]["n_tokens"]


def test_library_domain_texts_read_records(tmp_path):
    from stacklm.data.sources.text_input import domain_texts_from_files

    jsonl = _write_jsonl(tmp_path / "d.jsonl", DOCS, column="body")
    texts, audits = domain_texts_from_files({"records": jsonl}, None, text_column="body")
    assert texts["records"] == DOCS  # one chunk per (short) document, in order
    assert audits["records"].per_file[jsonl]["documents"] == len(DOCS)


def _four_inputs(tmp_path):
    """The shape a user brings: kernel-docs-like prose, Python docs, Python code and Chinese
    JSON lines, of very different sizes."""
    kernel = tmp_path / "kernel_docs.txt"
    kernel.write_text("".join(f"The scheduler wakes task {i} on CPU {i % 8} after the RCU grace period.\n" for i in range(6000)))
    pydocs = tmp_path / "python_docs.txt"
    pydocs.write_text("".join(f"os.path.join(a, *p) joins path component {i} intelligently.\n" for i in range(2000)))
    code = tmp_path / "code.py"
    code.write_text("".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(1000)))
    zh = tmp_path / "zh_man.jsonl"
    with open(zh, "w", encoding="utf-8") as f:
        for i in range(1500):
            f.write(json.dumps({"text": f"第{i}节：命令行工具的使用说明与参数。"}, ensure_ascii=False) + "\n")
    return [str(kernel), str(pydocs), str(code), str(zh)]


def _text_bytes(path: str) -> int:
    """The text a file holds, counted here: a text file's bytes, a JSON-lines file's `text` fields."""
    if not path.endswith(".jsonl"):
        return os.path.getsize(path)
    with open(path, encoding="utf-8") as f:
        return sum(len(json.loads(line)["text"].encode()) for line in f)


def test_budget_takes_every_input_in_proportion_to_its_text(tmp_path):
    """Shares follow the text each file holds (the JSON file's keys and quotes are not text),
    exactly as recorded: each file's share of what is left by its estimate."""
    files = _four_inputs(tmp_path)
    budget = 100_000
    sample = open_text_input(files, budget)
    assert sum(len(c.encode()) for c in sample) == budget
    audit = sample.audit
    texts = [_text_bytes(p) for p in files]
    estimates = [audit.estimates[p]["text"] for p in files]
    assert estimates[:3] == texts[:3] and abs(estimates[3] / texts[3] - 1) < 0.02  # the JSON file's by its first MiB
    left, expected = budget, []  # each file's share of what is left, by the recorded estimates
    for i in range(len(files)):
        share = left if i == len(files) - 1 else int(left * (estimates[i] / sum(estimates[i:])))
        expected.append(share)
        left -= share
    got = [audit.per_file[p]["bytes_yielded"] for p in files]
    assert got == expected and all(g > 0 for g in got)
    for g, t in zip(got, texts):  # every input in proportion to its text, to within 1%
        assert abs(g / budget - t / sum(texts)) < 0.01
    lines = audit.summary()
    for p, g in zip(files, got):
        assert any(line.strip().startswith(f"{p}: {g:,} B") for line in lines), lines
    assert audit.to_dict()["file_sizes"] == {p: os.path.getsize(p) for p in files}
    assert "budget reached" in lines[0] and "from 4 of 4 input(s)" in lines[0]


def test_tok_eval_against_references_with_vocab_sizes_and_a_training_overlap_warning(tmp_path, capsys, tok_dir, monkeypatch):
    """References a user has at hand: an HF tokenizer.json and a tiktoken ranks file, each row
    with its vocabulary size; a tiktoken encoding name read from tiktoken's cache (offline here:
    one line saying how to get it); and a warning when the evaluation files are ones the
    tokenizer trained on."""
    from stacklm.tokenizer.hf_baseline import train_hf_bpe

    train_file = _write_jsonl(tmp_path / "train.jsonl", DOCS)
    held_out = _write_jsonl(tmp_path / "held.jsonl", _docs(200, seed=1))
    assert main(["train-tokenizer", "--input", train_file, "--vocab-size", "400", "--out", str(tmp_path / "tok"),
                 "--no-progress"]) == 0
    hf = train_hf_bpe(DOCS, vocab_size=350)
    hf.save(str(tmp_path / "ref_tokenizer.json"))
    report = tmp_path / "r.json"
    rc, out, err = _eval(capsys, "--tokenizer", str(tmp_path / "tok"), "--input", held_out, "--compare",
                         str(tmp_path / "ref_tokenizer.json"), str(tok_dir / "tokenizer.tiktoken"), "--json", str(report))
    assert rc == 0, err
    header = next(line for line in out.splitlines() if line.startswith("domain"))
    assert "vocab" in header.split()
    rows = {r["tokenizer"]: r for r in json.loads(report.read_text())["rows"]}
    assert rows["stacklm"]["vocab_size"] == 400 and rows["ref_tokenizer.json"]["vocab_size"] == hf.get_vocab_size()
    assert rows["tokenizer.tiktoken"]["vocab_size"] == 600
    assert "overlaps" not in err  # held-out files: no warning
    rc, out, err = _eval(capsys, "--tokenizer", str(tmp_path / "tok"), "--input", train_file)
    assert rc == 0 and "warning: the evaluation text overlaps" in err and "train.jsonl" in err
    rc, out, err = _eval(capsys, "--tokenizer", str(tok_dir), "--max-bytes-per-domain", "20000")  # trained on the embedded corpus? no metadata
    assert "overlaps" not in err

    import tiktoken

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    rc, out, err = _eval(capsys, "--tokenizer", str(tmp_path / "tok"), "--input", held_out, "--compare", "gpt2")
    assert rc != 0 and "--compare gpt2: tiktoken has no cached copy" in err and "Traceback" not in err
