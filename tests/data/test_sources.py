"""Sources, the byte-loss audit, the data-mix registry and (rank, worker) sharding.

Everything reads files the tests write into tmp_path (real stdlib text via the synthetic
corpus); the hub path is exercised through ``load_dataset("json", data_files=...)`` and the
offline fallback with the hub forced offline. Nothing touches the network.
"""

from __future__ import annotations

import gzip
import json
import os
import warnings
import zlib
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
import zstandard

from stacklm.data.audit import ByteAudit, clean_text, record_audit
from stacklm.data.quality.filters import FilterNode
from stacklm.data.registry import STACK_100M, DataMix, SourceConfig, get_mix
from stacklm.errors import ConfigError
from stacklm.data.sources import (
    HFStreamSource,
    LocalFileSource,
    ShardSpec,
    SyntheticSource,
    assign_parts,
    open_source,
    owns_row,
    synthetic_duplicate_of,
    synthetic_text,
)
from stacklm.errors import SourceError, SourceNotFoundError, TextColumnError
from stacklm.data.stats import StageStats
from tests.helpers.resume import check_save_load_state

SHARD_GRID = [(1, 1), (1, 2), (2, 1), (2, 3), (3, 2), (4, 4)]


# ---------------------------------------------------------------------------------------
# helpers


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """60 real prose documents (distinct) for file fixtures."""
    originals = [synthetic_text(i, "prose", seed=7) for i in range(70) if synthetic_duplicate_of(i, 7) is None]
    assert len(set(originals)) == len(originals) >= 60
    return originals[:60]


def _jsonl_bytes(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def write_jsonl(path, rows, frames: int = 1) -> str:
    data = _jsonl_bytes(rows)
    if str(path).endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    elif str(path).endswith(".zst"):
        # Several concatenated frames, as streaming writers produce.
        cctx = zstandard.ZstdCompressor()
        lines = data.splitlines(keepends=True)
        step = max(1, len(lines) // frames)
        with open(path, "wb") as f:
            for i in range(0, len(lines), step):
                f.write(cctx.compress(b"".join(lines[i : i + step])))
    else:
        with open(path, "wb") as f:
            f.write(data)
    return str(path)


def drain(node) -> list[dict]:
    return list(node)


def check_resume(make, cuts) -> None:
    """Stop a fresh node after each cut, restore a second fresh node, continue: identical.
    The state is small and plain: it is restored from its JSON round trip."""
    check_save_load_state(make, cuts, state_round_trip="json")


# ---------------------------------------------------------------------------------------
# registry


def test_stack_100m_mix_is_the_issue_mix():
    mix = get_mix("stack-100m")
    assert mix is STACK_100M and mix.total_tokens == 20_000_000_000
    got = {e.name: (e.kind, e.path, e.config_name, e.data_dir, e.text_column, e.weight, e.domain) for e in mix.entries}
    assert got == {
        "fineweb-edu": ("hf", "HuggingFaceFW/fineweb-edu", "sample-100BT", None, "text", 0.70, "prose"),
        "cosmopedia-v2": ("hf", "HuggingFaceTB/smollm-corpus", "cosmopedia-v2", None, "text", 0.15, "prose"),
        "starcoderdata-python": ("hf", "bigcode/starcoderdata", None, "python", "content", 0.10, "code"),
        "finemath": ("hf", "HuggingFaceTB/finemath", "finemath-4plus", None, "text", 0.05, "math"),
    }
    budgets = mix.token_budgets()
    assert sum(budgets.values()) == 20_000_000_000
    assert budgets["fineweb-edu"] == 14_000_000_000 and budgets["finemath"] == 1_000_000_000


def test_mix_round_trips_through_yaml_and_pins_revisions():
    text = yaml.safe_dump(STACK_100M.to_dict())
    again = DataMix.from_dict(yaml.safe_load(text))
    assert again == STACK_100M
    pinned = STACK_100M.pinned({"finemath": "0123abcd"})
    assert pinned["finemath"].revision == "0123abcd" and pinned["fineweb-edu"].revision is None
    assert DataMix.from_dict(pinned.to_dict())["finemath"].revision == "0123abcd"


@pytest.mark.parametrize(
    "change, words",
    [
        ({"filters": "strict"}, ["'fineweb-edu'", "'filters'", "none"]),
        ({"weight": -0.1}, ["'fineweb-edu'", "'weight'"]),
        ({"kind": "s3"}, ["'fineweb-edu'", "'kind'", "s3"]),
        ({"domain": "legal"}, ["'fineweb-edu'", "'domain'", "'legal'", "filters"]),
        ({"domain": None}, ["'fineweb-edu'", "'domain'", "required"]),
        ({"text_colum": "text"}, ["'fineweb-edu'", "text_colum"]),
        ({"path": None}, ["'fineweb-edu'", "'path'"]),
    ],
)
def test_mix_validation_names_entry_and_field(change, words):
    data = STACK_100M.to_dict()
    data["entries"][0].update(change)
    with pytest.raises(ConfigError) as err:
        DataMix.from_dict(data)
    for word in words:
        assert word in str(err.value)


def test_mix_rejects_duplicate_names():
    e = STACK_100M.entries[0]
    with pytest.raises(ConfigError, match="twice"):
        DataMix("x", 10, (SourceConfig(**{**e.to_dict(), "weight": 0.5}), SourceConfig(**{**e.to_dict(), "weight": 0.5})))


# ---------------------------------------------------------------------------------------
# audit


def test_clean_text_counts_every_repair_exactly():
    body = "A perfectly ordinary sentence about tokenizers and data. " * 3
    raw = body.encode() + b"\xff\xfe" + b" caf\xc3 " + "\ufffd kept".encode() + b"\x00\x00 end"
    text, audit = clean_text(raw)
    # \xff and \xfe are two invalid sequences, the truncated \xc3 a third; the genuine U+FFFD is not counted.
    assert audit == ByteAudit(invalid_utf8=3, nul_bytes=2, lone_surrogates=0, drop=None)
    assert text == body + "\ufffd\ufffd caf\ufffd \ufffd kept end"
    text, audit = clean_text("ok \ud800 and \udfff" + " words" * 20)
    assert audit.lone_surrogates == 2 and "\ufffd and \ufffd" in text
    text.encode("utf-8")  # valid now
    assert clean_text(" \n\t ")[1].drop == "dropped_empty"
    assert clean_text(b"")[1].drop == "dropped_empty"
    assert clean_text(bytes(range(256)) * 20)[1].drop == "dropped_binary"


def test_clean_text_leaves_valid_text_untouched():
    for doc in (synthetic_text(1), "日本語のテキスト。" * 10, "plain ascii"):
        text, audit = clean_text(doc)
        assert text == doc and not audit.repaired and audit.drop is None
        assert clean_text(doc.encode())[0] == doc


def test_record_audit_counts_per_source():
    stats = StageStats("source")
    kept = [record_audit(stats, "s", clean_text(x)[1]) for x in (b"fine text here", b"bad \xff byte in a longer text", b"  ")]
    assert kept == [True, True, False]
    assert stats.to_dict() == {"s": {"kept": 2, "invalid_utf8_replaced": 1, "docs_repaired": 1, "dropped_empty": 1}}


# ---------------------------------------------------------------------------------------
# synthetic corpus


def test_synthetic_corpus_is_deterministic_with_injected_duplicates():
    docs = drain(SyntheticSource("syn", "prose", seed=3, num_docs=220))
    assert docs == drain(SyntheticSource("syn", "prose", seed=3, num_docs=220))
    assert docs != drain(SyntheticSource("syn", "prose", seed=4, num_docs=220))
    assert [d["doc_id"] for d in docs] == [f"syn/synthetic/{i}" for i in range(220)]
    by_text = Counter(d["text"] for d in docs)
    for i, doc in enumerate(docs):
        dup = synthetic_duplicate_of(i, 3)
        if dup is None:
            assert by_text[doc["text"]] == 1 + sum(
                1 for k in range(220) if synthetic_duplicate_of(k, 3) == ("exact", i)
            )
            continue
        kind, j = dup
        assert j < i and synthetic_duplicate_of(j, 3) is None
        if kind == "exact":
            assert (i + 1) % 97 == 0 and doc["text"] == docs[j]["text"]
        else:
            assert (i + 1) % 53 == 0 and doc["text"] != docs[j]["text"]
            a, b = set(docs[j]["text"].split()), set(doc["text"].split())
            assert len(a & b) / len(a | b) > 0.8  # lightly edited
    # Real text, not a repeated template: compresses like text does (~30%), not like a loop.
    originals = "".join(d["text"] for i, d in enumerate(docs) if synthetic_duplicate_of(i, 3) is None).encode()
    assert len(zlib.compress(originals, 6)) / len(originals) > 0.15


@pytest.mark.parametrize("domain", ["code", "math"])
def test_synthetic_domains_use_real_text(domain):
    docs = drain(SyntheticSource("s", domain, num_docs=30))
    assert all(d["domain"] == domain and len(d["text"]) > 80 for d in docs)
    if domain == "code":
        assert sum("def " in d["text"] or "import " in d["text"] for d in docs) > 20


def test_synthetic_resume_is_exact():
    check_resume(lambda: SyntheticSource("s", "prose", num_docs=40, shard=ShardSpec(1, 2, 0, 2)), [0, 3, 10])


# ---------------------------------------------------------------------------------------
# local files


@pytest.fixture()
def local_files(tmp_path, texts):
    """The same 60 documents spread over every supported format."""
    d = tmp_path / "data"
    d.mkdir()
    rows = [{"id": i, "text": t} for i, t in enumerate(texts)]
    write_jsonl(d / "a.jsonl", rows[:10])
    write_jsonl(d / "b.jsonl.gz", rows[10:25])
    write_jsonl(d / "c.jsonl.zst", rows[25:40], frames=3)
    pq.write_table(pa.table({"id": [r["id"] for r in rows[40:55]], "text": [r["text"] for r in rows[40:55]]}), d / "d.parquet", row_group_size=4)
    for i, r in enumerate(rows[55:]):
        (d / f"e{i}.txt").write_text(r["text"])
    return d


def test_local_files_read_every_format(local_files, texts):
    docs = drain(LocalFileSource("loc", str(local_files / "*"), "prose"))
    assert [d["text"] for d in docs] == texts
    assert {d["source"] for d in docs} == {"loc"} and {d["domain"] for d in docs} == {"prose"}
    assert docs[0]["doc_id"] == "loc/a.jsonl/0" and docs[12]["doc_id"] == "loc/b.jsonl.gz/2"
    assert docs[44]["doc_id"] == "loc/d.parquet/4" and docs[-1]["doc_id"] == "loc/e4.txt/0"
    assert len({d["doc_id"] for d in docs}) == len(docs)


def test_local_resume_is_exact_across_formats(local_files):
    # cuts inside each format and exactly on file boundaries
    check_resume(lambda: LocalFileSource("loc", str(local_files / "*"), "prose"), [0, 4, 10, 17, 25, 33, 40, 47, 56, 60])


def test_local_audit_counts_bad_bytes_empties_and_blank_lines(tmp_path):
    good = "Some sentence of real words for the audit test. " * 4
    lines = [
        json.dumps({"text": good}).encode(),
        b'{"text": "' + good.encode() + b'\xff\xc0 tail"}',  # invalid UTF-8 inside the JSON string
        json.dumps({"text": "nul\u0000 inside " + good}).encode(),
        json.dumps({"text": "   "}).encode(),
        json.dumps({"text": None}).encode(),
        b"",
        json.dumps({"text": "lone \ud800 surrogate " + good}).encode(),
    ]
    (tmp_path / "x.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    node = LocalFileSource("audit", str(tmp_path / "x.jsonl"), "prose")
    docs = drain(node)
    assert [d["doc_id"] for d in docs] == ["audit/x.jsonl/0", "audit/x.jsonl/1", "audit/x.jsonl/2", "audit/x.jsonl/5"]
    assert docs[1]["text"] == good + "\ufffd\ufffd tail"
    assert docs[2]["text"] == "nul inside " + good
    assert docs[3]["text"] == "lone \ufffd surrogate " + good
    assert node.stats.to_dict()["audit"] == {
        "kept": 4, "invalid_utf8_replaced": 2, "nul_removed": 1, "surrogates_replaced": 1,
        "docs_repaired": 3, "dropped_empty": 1, "null_text": 1, "blank_lines_skipped": 1,
        "records_read": 6,  # the non-blank lines: the token ledger's "read"
    }
    # provenance: the record is the 0-based line (blank lines count), unlike doc_id's row
    assert [(d["file"], d["record"]) for d in docs] == [(0, 0), (0, 1), (0, 2), (0, 6)]


# ---------------------------------------------------------------------------------------
# bad input


def test_glob_matching_nothing_names_the_glob(tmp_path):
    pattern = str(tmp_path / "nope" / "*.jsonl")
    with pytest.raises(SourceNotFoundError) as err:
        next(LocalFileSource("ghost", pattern, "prose"))
    assert pattern in str(err.value) and "'ghost'" in str(err.value)
    entry = SourceConfig(name="ghost", kind="local", path=pattern, weight=1.0, domain="prose")
    with pytest.raises(FileNotFoundError):
        next(open_source(entry))


def test_misspelt_text_column_names_column_available_and_source(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"id": 1, "content": "x" * 300}])
    with pytest.raises(TextColumnError) as err:
        next(LocalFileSource("src", path, "prose", text_column="contnet"))
    msg = str(err.value)
    assert "'contnet'" in msg and "['content', 'id']" in msg and "'src'" in msg and path in msg and "'content'?" in msg
    pq.write_table(pa.table({"body": ["x" * 300]}), tmp_path / "t.parquet")
    with pytest.raises(TextColumnError, match=r"'text'.*\['body'\]"):
        next(LocalFileSource("pq", str(tmp_path / "t.parquet"), "prose"))


def test_empty_sources_raise_instead_of_yielding_nothing(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(SourceError, match="contains no rows"):
        next(LocalFileSource("empty", str(tmp_path / "empty.jsonl"), "prose"))
    write_jsonl(tmp_path / "blank.jsonl", [{"text": ""}] * 30)
    with pytest.raises(SourceError, match="first 20 rows"):
        next(LocalFileSource("blank", str(tmp_path / "blank.jsonl"), "prose", first_rows_check=20))
    with pytest.raises(SourceError, match="all 30 rows"):
        next(LocalFileSource("blank", str(tmp_path / "blank.jsonl"), "prose"))


def test_corrupt_compressed_files_name_source_and_file(tmp_path, texts):
    rows = [{"text": t} for t in texts]
    gz = tmp_path / "bad.jsonl.gz"
    gz.write_bytes(gzip.compress(_jsonl_bytes(rows))[:-300] + b"\x00garbage" * 20)
    zst = tmp_path / "bad.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(_jsonl_bytes(rows))[:400] + os.urandom(300))
    for path in (gz, zst):
        with pytest.raises(SourceError) as err:
            drain(LocalFileSource("broken", str(path), "prose"))
        assert "'broken'" in str(err.value) and str(path) in str(err.value) and err.value.file == str(path)


def test_binary_garbage_is_an_error_in_jsonl_and_a_counted_drop_in_txt(tmp_path):
    rng_bytes = zlib.compress(os.urandom(1), 0) + bytes((i * 97 + 13) % 256 for i in range(5000))
    (tmp_path / "garbage.jsonl").write_bytes(rng_bytes)
    with pytest.raises(SourceError, match=r"garbage\.jsonl, line 1: not valid JSON"):
        next(LocalFileSource("bin", str(tmp_path / "garbage.jsonl"), "prose"))
    (tmp_path / "a_garbage.txt").write_bytes(rng_bytes)
    (tmp_path / "b_good.txt").write_text("A real document. " * 30)
    node = LocalFileSource("bin", str(tmp_path / "*.txt"), "prose")
    assert [d["doc_id"] for d in drain(node)] == ["bin/b_good.txt/0"]
    assert node.stats.get("bin", "dropped_binary") == 1 and node.stats.get("bin", "invalid_utf8_replaced") > 500


def test_unsupported_file_type_names_the_file(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match=r"x\.csv"):
        next(LocalFileSource("csv", str(tmp_path / "x.csv"), "prose"))


def test_100mb_document_is_read_and_dropped_by_the_length_filter(tmp_path):
    big = b'{"text": "' + b"many words " * 9_600_000 + b'"}\n'  # ~105 MB on one line
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as f:
        f.write(big)
        f.write(_jsonl_bytes([{"text": "A normal document after the giant one, long enough to pass. " * 5}]))
    del big
    node = FilterNode(LocalFileSource("big", str(path), "prose"))
    docs = drain(node)
    assert [d["doc_id"] for d in docs] == ["big/big.jsonl/1"]
    assert node.stats.get("big", "too_long") == 1 and node.source.stats.get("big", "kept") == 2


# ---------------------------------------------------------------------------------------
# Hugging Face streaming (on local files, then the hub forced offline)


@pytest.fixture()
def json_parts(tmp_path, texts):
    paths = []
    for k in range(3):
        rows = [{"meta": k, "text": t} for t in texts[k * 12 : (k + 1) * 12]]
        paths.append(write_jsonl(tmp_path / f"part{k}.jsonl", rows))
    return paths


def test_hf_stream_reads_validates_and_resumes(json_parts, texts):
    make = lambda: HFStreamSource("hfj", "json", "prose", data_files=json_parts)  # noqa: E731
    docs = drain(make())
    assert [d["text"] for d in docs] == texts[:36]
    assert docs[13]["doc_id"] == "hfj/shard00001/1"
    check_resume(make, [0, 5, 12, 30])
    with pytest.raises(TextColumnError) as err:
        next(HFStreamSource("hfj", "json", "prose", data_files=json_parts, text_column="txt", fallback_offline=True))
    assert "'txt'" in str(err.value) and "['meta', 'text']" in str(err.value) and "'hfj'" in str(err.value)


def test_hf_stream_errors_after_open_propagate_even_with_fallback(tmp_path, texts):
    rows = [{"text": t} for t in texts[:30]]
    path = write_jsonl(tmp_path / "ok.jsonl", [{"text": ""}] * 25)
    with pytest.raises(SourceError, match="first 25 rows"):
        next(HFStreamSource("e", "json", "prose", data_files=[path], fallback_offline=True, first_rows_check=25))
    bad = tmp_path / "trunc.jsonl.gz"
    bad.write_bytes(gzip.compress(_jsonl_bytes(rows) * 40)[:-2000])
    with pytest.raises(SourceError, match="'t'"):
        drain(HFStreamSource("t", "json", "prose", data_files=[str(bad)], fallback_offline=True))


@pytest.fixture()
def hub_offline(monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_hub_offline_falls_back_loudly_and_resumes(hub_offline):
    entry = SourceConfig(**{**STACK_100M["finemath"].to_dict(), "num_docs": 12})
    with pytest.raises(SourceError, match=r"HuggingFaceTB/finemath") as err:
        next(open_source(entry))
    assert "fallback" not in str(err.value) and "synthetic" not in str(err.value)  # never suggested as the fix
    node = open_source(entry, fallback_offline=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        docs = drain(node)
    assert any("OFFLINE FALLBACK" in str(w.message) and "finemath" in str(w.message) for w in caught)
    assert node.is_fallback and len(docs) == 12
    assert {d["source"] for d in docs} == {"finemath"} and {d["domain"] for d in docs} == {"math"}
    assert docs[0]["doc_id"] == "finemath/synthetic-fallback/0"
    assert node.stats.get("finemath", "fallback_offline") == 1 and node.stats.get("finemath", "kept") == 12
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_resume(lambda: open_source(entry, fallback_offline=True), [0, 5])


def test_fallback_is_only_for_an_unreachable_hub(tmp_path, hub_offline):
    missing = str(tmp_path / "missing.jsonl")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback would warn: it must not happen here
        with pytest.raises(SourceError, match="missing.jsonl") as err:
            next(HFStreamSource("m", "json", "prose", data_files=[missing], fallback_offline=True))
    assert "'m'" in str(err.value)


# ---------------------------------------------------------------------------------------
# sharding by (rank, worker)


@pytest.mark.parametrize("num_parts", [1, 2, 5, 8, 13])
def test_assign_parts_covers_every_row_once(num_parts):
    rows_per_part = [3 + (p * 7) % 5 for p in range(num_parts)]
    everything = [(p, r) for p in range(num_parts) for r in range(rows_per_part[p])]
    for world, workers in SHARD_GRID:
        seen = []
        for rank in range(world):
            for worker in range(workers):
                spec = ShardSpec(rank, world, worker, workers)
                parts, strided = assign_parts(num_parts, spec)
                assert strided == (num_parts < spec.count and spec.count > 1)
                g = 0
                for p in parts:
                    for r in range(rows_per_part[p]):
                        if not strided or owns_row(g, spec):
                            seen.append((p, r))
                        g += 1
        assert sorted(seen) == everything, (num_parts, world, workers)


def test_shards_of_real_sources_cover_every_document_once(tmp_path, texts, json_parts):
    many = tmp_path / "many"
    many.mkdir()
    for k in range(9):
        write_jsonl(many / f"f{k}.jsonl.zst", [{"text": t} for t in texts[k * 5 : k * 5 + 4 + k % 3]])
    makers = {
        "files": lambda s: LocalFileSource("m", str(many / "*.zst"), "prose", shard=s),
        "one-file": lambda s: LocalFileSource("o", json_parts[0], "prose", shard=s),
        "hf": lambda s: HFStreamSource("h", "json", "prose", data_files=json_parts, shard=s),
        "synthetic": lambda s: SyntheticSource("s", "math", num_docs=23, shard=s),
    }
    for name, make in makers.items():
        full = [d["doc_id"] for d in make(None)]
        for world, workers in SHARD_GRID:
            got = []
            for rank in range(world):
                for worker in range(workers):
                    node = make(ShardSpec(rank, world, worker, workers))
                    got += [d["doc_id"] for d in node]
            assert sorted(got) == sorted(full) and len(set(got)) == len(got), (name, world, workers)


def test_shard_spec_validates_and_reads_the_environment(monkeypatch):
    assert ShardSpec(1, 2, 2, 3).index == 5 and ShardSpec(1, 2, 2, 3).count == 6
    with pytest.raises(ValueError):
        ShardSpec(2, 2, 0, 1)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert ShardSpec.current() == ShardSpec()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert ShardSpec.current() == ShardSpec(3, 4, 0, 1)


def test_near_edit_survives_deletions_before_substitutions():
    # regression: a substitution drew its source word from the pre-deletion word count
    from stacklm.data.sources import synthetic_text

    assert synthetic_text(5564, "code", 2)
    for i in range(52, 3000, 53):  # every near-duplicate slot of a seed
        assert synthetic_text(i, "code", 2)


class _HubDocIds(torch.utils.data.IterableDataset):
    """Each loader worker opens the source as its own (rank, worker) reader, as stream mode does."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __iter__(self):
        for doc in HFStreamSource("one", "parquet", "prose", data_files=self.files, shard=ShardSpec.current()):
            yield doc["doc_id"]


@pytest.mark.parametrize("n_files", [1, 3])
def test_datasets_streams_are_not_split_again_by_loader_workers(tmp_path, texts, n_files):
    """Inside a DataLoader worker ``datasets`` would keep only its shards ``worker::num_workers``
    on top of stacklm's own split (worker 1 of 2 reading a 1-file source would get nothing):
    every row must arrive exactly once."""
    rows = texts[:60]
    files = []
    for k in range(n_files):
        path = tmp_path / f"p{k}.parquet"
        pq.write_table(pa.table({"text": rows[k::n_files]}), path)
        files.append(str(path))
    loader = torch.utils.data.DataLoader(_HubDocIds(files), batch_size=None, num_workers=2)
    got = list(loader)
    assert len(got) == len(set(got)) == len(rows)
