"""``stacklm train-tokenizer --config run.yaml`` samples the run's training mix itself (issue 36
part 2): each source's files, format and column, by the mix's weights or by the text each
holds (a ``.jsonl.gz`` by its uncompressed size); ``--input PATH:COLUMN`` gives ad-hoc inputs
their own columns; a hub-kind source reads through ``datasets`` (local files here) and is
refused under ``--weight-by size``; ``tok-eval`` trains its baseline on the same mix sample."""

from __future__ import annotations

import gzip
import json
import os
import random

import pytest

from stacklm.cli import main
from stacklm.tokenizer.bpe import StackTokenizer

BUDGET = 120_000
WEIGHTS = {"code": 0.2, "prose": 0.3, "kernel": 0.4, "hub": 0.1}
WORDS = ["sched", "rcu", "spinlock", "quennet", "flimwise", "the", "and", "of", "über", "日本語"]


def _docs(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 30))) + "." for _ in range(n)]


def _utf8(texts) -> int:
    return sum(len(t.encode()) for t in texts)


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """Three local sources in three formats and columns, plus a hub-kind source (the ``json``
    builder on a local file), each holding more text than its share of the budget; the
    kernel text is a ``.jsonl.gz`` that compresses ~10x, as kernel docs do."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("mix")
    texts: dict[str, int] = {}
    code = [f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(3000)]
    (root / "code").mkdir()
    for j, part in enumerate((code[:1000], code[1000:])):  # two files of 1 : 2, by size within the source
        pq.write_table(pa.table({"id": list(range(len(part))), "content": part}), root / "code" / f"part{j}.parquet")
    texts["code"] = _utf8(code)
    texts["code_parts"] = (_utf8(code[:1000]), _utf8(code[1000:]))
    prose = _docs(1500, 1)
    with open(root / "prose.jsonl", "w", encoding="utf-8") as f:
        for i, d in enumerate(prose):
            f.write(json.dumps({"id": i, "body": d, "meta": {"lang": "en"}}, ensure_ascii=False) + "\n")
    texts["prose"] = _utf8(prose)
    kernel = [f"The scheduler wakes task {i % 50} on CPU {i % 8} after the RCU grace period ends." for i in range(20000)]
    with gzip.open(root / "kernel.jsonl.gz", "wt", encoding="utf-8") as f:
        for d in kernel:
            f.write(json.dumps({"text": d}) + "\n")
    texts["kernel"] = _utf8(kernel)
    hub = _docs(800, 2)
    with open(root / "hub.jsonl", "w", encoding="utf-8") as f:
        for d in hub:
            f.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
    config = root / "run.yaml"
    config.write_text(f"""data:
  pipeline:
    mix:
      name: tokmix
      total_tokens: 1000000
      entries:
        - {{name: code, kind: local, path: code/*.parquet, text_column: content, weight: {WEIGHTS['code']}, domain: code}}
        - {{name: prose, kind: local, path: prose.jsonl, text_column: body, weight: {WEIGHTS['prose']}, domain: prose}}
        - {{name: kernel, kind: local, path: kernel.jsonl.gz, weight: {WEIGHTS['kernel']}, domain: prose}}
        - {{name: hub, kind: hf, path: json, data_files: [hub.jsonl], weight: {WEIGHTS['hub']}, domain: prose}}
""")
    return root, texts


def _train(capsys, *args):
    rc = main(["train-tokenizer", *map(str, args), "--vocab-size", "280", "--no-progress"])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _source_of(name: str) -> str:
    """Which source an audited input belongs to, from its name (not from the audit's own grouping)."""
    for src in ("code", "prose", "kernel"):
        if f"{os.sep}{src}" in name or name.startswith(src):
            return src
    assert "datasets stream json" in name, name
    return "hub"


def _trained(capsys, out_dir, *args):
    """Train; the artifact, its sample audit, the bytes each source gave (summed here over the
    audit's per-input table, by file name) and what the command printed."""
    rc, out, err = _train(capsys, *args, "--out", out_dir)
    assert rc == 0, err
    tok = StackTokenizer.load(out_dir)
    audit = tok.metadata["sample_audit"]
    per_source: dict[str, int] = {}
    for name, counts in audit["per_file"].items():
        per_source[_source_of(name)] = per_source.get(_source_of(name), 0) + counts["bytes_yielded"]
    return tok, audit, per_source, out


def test_config_samples_every_source_by_the_mix_weights(mix, capsys, monkeypatch):
    root, texts = mix
    monkeypatch.chdir(root)  # a config's local globs are relative to the cwd, as for the prebuild
    tok, audit, per_source, out = _trained(capsys, root / "tok", "--config", "run.yaml", "--max-bytes", BUDGET)
    assert sum(per_source.values()) == BUDGET == audit["bytes_yielded"]
    for src, weight in WEIGHTS.items():  # every source by its weight, to a few bytes
        assert abs(per_source[src] / BUDGET - weight) < 1e-3, (src, per_source)
    # within a source, the files by the text they hold (parquet: its column's size in the metadata)
    parts = [audit["per_file"][os.path.join("code", f"part{j}.parquet")]["bytes_yielded"] for j in (0, 1)]
    held = texts["code_parts"]
    assert abs((parts[1] / parts[0]) / (held[1] / held[0]) - 1) < 0.05, (parts, held)
    # the record says how it was read: per source its files, column and weight; the config
    record = tok.metadata["training_sample"]
    assert record["weight_by"] == "mix" and record["config"] == str((root / "run.yaml").resolve())
    columns = {g["name"]: (g["text_column"], g["weight"]) for g in record["groups"]}
    assert columns == {"code": ("content", 0.2), "prose": ("body", 0.3), "kernel": ("text", 0.4), "hub": ("text", 0.1)}
    assert str(root / "kernel.jsonl.gz") in tok.metadata["inputs"]
    lines = out.splitlines()
    assert lines[0].startswith(f"sample: {BUDGET:,} B of text from 5 of 5 input(s) in 4 sources (") and "budget reached" in lines[0]
    assert f"  source 'kernel': {per_source['kernel']:,} B (40.0% of the sample; weight 40.0%)" in out
    # none of the JSON or parquet scaffolding is learned: every token is text of the sources
    learned = b"".join(tok.merged_tokens)
    assert b'"' not in learned and b"{" not in learned and b"body" not in learned

    # tok-eval's baseline trains on this very sample, read again from the config (hash checked)
    (root / "held.txt").write_text(" ".join(_docs(200, 9)))
    rc = main(["tok-eval", "--tokenizer", str(root / "tok"), "--input", str(root / "held.txt"), "--hf-baseline",
               "--train-input", "run.yaml", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert f"trained the HF BpeTrainer baseline on {BUDGET:,} bytes of {root / 'tok'}'s training sample" in captured.out
    rc = main(["tok-eval", "--tokenizer", str(root / "tok"), "--input", str(root / "held.txt"), "--hf-baseline", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 2 and "mix of sources (code, prose, kernel, hub)" in captured.err and "--train-input" in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_weight_by_size_counts_compressed_text_uncompressed_and_refuses_a_stream(mix, capsys, monkeypatch):
    """By size, with ad-hoc inputs each with its own column: the .jsonl.gz weighs its
    uncompressed text (it was 11 % of a sample when counted compressed); a hub-kind source,
    whose size is unknown before reading, is refused in one line naming it."""
    root, texts = mix
    texts = {k: v for k, v in texts.items() if k != "code_parts"}
    monkeypatch.chdir(root)
    tok, audit, per_source, _ = _trained(capsys, root / "tok_size", "--input", "code/*.parquet:content", "--input",
                                         "prose.jsonl:body", "kernel.jsonl.gz", "--max-bytes", BUDGET)
    assert set(per_source) == set(texts) and sum(per_source.values()) == BUDGET
    total = sum(texts.values())
    for src, text in texts.items():  # each by the text it holds (counted here from the documents), within 3%
        assert abs(per_source[src] / BUDGET - text / total) < 0.03, (src, per_source, texts)
    disk = {src: sum(os.path.getsize(p) for p in audit["sources"][g]["inputs"])
            for src, g in (("code", "input:content"), ("prose", "input:body"), ("kernel", "input:text"))}
    assert per_source["kernel"] / BUDGET > 3 * disk["kernel"] / sum(disk.values())  # not its compressed size
    with gzip.open(root / "kernel.jsonl.gz", "rb") as f:
        assert audit["estimates"]["kernel.jsonl.gz"]["uncompressed"] == len(f.read())
    assert {g["name"]: g["text_column"] for g in tok.metadata["training_sample"]["groups"]} == {
        "input:content": "content", "input:body": "body", "input:text": "text"}
    assert tok.metadata["inputs"] == ["code/*.parquet", "prose.jsonl", "kernel.jsonl.gz"]
    # read again from the same PATH:COLUMN inputs (tok-eval's --overlap-sizes: the smaller budget shared the same way)
    rc = main(["tok-eval", "--tokenizer", str(root / "tok_size"), "--input", "prose.jsonl:body", "--overlap-sizes",
               "30000,60000", "--train-input", "code/*.parquet:content", "prose.jsonl:body", "kernel.jsonl.gz", "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "overlap: trained on 30,000 bytes" in captured.out and "overlap: trained on 60,000 bytes" in captured.out
    assert "overlaps" in captured.err  # prose.jsonl (its column left off) is in the training sample

    rc, out, err = _train(capsys, "--config", "run.yaml", "--weight-by", "size", "--out", root / "refused")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "source hub: datasets stream json [train] has no size known before reading; use --weight-by mix" in err
    rc, out, err = _train(capsys, "--config", "run.yaml", "--text-column", "body", "--out", root / "refused")
    assert rc == 2 and "field 'text_column' of each source" in err
    rc, out, err = _train(capsys, "--config", "run.yaml", "--input", "prose.jsonl", "--out", root / "refused")
    assert rc == 2 and "not --config and --input" in err
    rc, out, err = _train(capsys, "--config", "missing.yaml", "--out", root / "refused")
    assert rc == 2 and "missing.yaml" in err and len(err.strip().splitlines()) == 1


def test_a_wrong_column_and_bad_input_specs_are_one_line_with_the_fix(tmp_path, capsys, caplog, monkeypatch):
    """A new user's mistakes (issue 36): a JSON-lines source whose text_column is not in it was 5
    'skipped, counted as missing_text' warnings and then an error naming the file as the source;
    it is one line, before anything is read: under --config the config, the entry's field and
    name, under --input the input and the PATH:COLUMN fix. A column for plain text and an empty
    column after ':' are refused in one line too (the latter said "file 'notes.jsonl:' does not exist")."""
    monkeypatch.chdir(tmp_path)
    with open("notes.jsonl", "w", encoding="utf-8") as f:
        for i, d in enumerate(_docs(150, 3)):
            f.write(json.dumps({"id": i, "body": d}) + "\n")
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("Once upon a time. " * 50)
    (tmp_path / "run.yaml").write_text("data:\n  pipeline:\n    mix:\n      name: m\n      total_tokens: 1000\n      entries:\n"
                                       "        - {name: notes, kind: local, path: notes.jsonl, text_column: txt, weight: 1.0, domain: prose}\n")
    cases = {
        ("--config", "run.yaml"): ["run.yaml: field 'data.pipeline.mix.entries[0].text_column' (source 'notes')",
                                   "column 'txt' is not in notes.jsonl", "['body', 'id']", "Set text_column"],
        ("--input", "notes.jsonl"): ["--input notes.jsonl: column 'text' is not in notes.jsonl", "['body', 'id']",
                                     "--input notes.jsonl:COLUMN (PATH:COLUMN"],
        ("--input", "books/*.txt:body"): ["--input 'books/*.txt:body'", "plain text, which has no columns", "leave ':body' out"],
        ("--input", "notes.jsonl:"): ["--input 'notes.jsonl:'", "the column after ':' is empty", "notes.jsonl:COLUMN"],
    }
    for args, must in cases.items():
        caplog.clear()
        rc, out, err = _train(capsys, *args, "--out", tmp_path / "tok")
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "WARNING" not in err, (args, err)
        assert not [r for r in caplog.records if r.levelname == "WARNING"], (args, caplog.text)
        for text in must:
            assert text in err, (args, text, err)
        assert "source 'notes.jsonl'" not in err and "does not exist" not in err
    assert not (tmp_path / "tok").exists()
    rc, out, err = _train(capsys, "--input", "notes.jsonl:body", "--out", tmp_path / "tok")  # the fix works
    assert rc == 0, err
