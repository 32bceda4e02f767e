"""Provenance of every prebuilt row (stacklm.data.storage.provenance): for a prebuild of local jsonl and
parquet files, every segment of every row is exactly the tokens of its record's text at its
``doc_offset``, every delivered record is covered once and whole, ``stacklm inspect DIR --row N
--json`` prints it, and a prebuild killed midway resumes to the same side files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stacklm.cli import main as stacklm_main
from stacklm.data.storage import manifest as mf
from stacklm.data.pipeline import PipelineConfig
from stacklm.data.storage.provenance import decode_rows, encode_rows, prov_path, row_provenance
from stacklm.prebuild import prebuild
from tests.helpers.ledger import SEQ_LEN, data_section, write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return root, write_corpus(root)


def _build(root: Path, tok, out: Path, strategy: str, **kw) -> Path:
    cfg = PipelineConfig.from_dict(data_section(root, total=6000, strategy=strategy))
    prebuild(cfg, tok, out, tokens_per_shard=SEQ_LEN * 8, progress=False, **kw)
    return out


@pytest.fixture(scope="module", params=["best_fit", "greedy"])
def built(request, corpus, tokenizer_512, tmp_path_factory):
    root, _ = corpus
    return request.param, _build(root, tokenizer_512, tmp_path_factory.mktemp(request.param) / "shards", request.param)


def test_every_segment_is_its_records_tokens(built, corpus, tokenizer_512):
    tok = tokenizer_512
    strategy, out = built
    _, records = corpus
    text_of = {(src, f, r): v for src, rows in records.items() for f, r, v in rows}
    for split in ("train", "val"):
        m = mf.read_manifest(out / split)
        prov = m["provenance"]
        assert prov["sources"] == ["web", "books"] and prov["files"] == {"web": ["a.jsonl", "b.jsonl"], "books": ["c.parquet"]}
        covered: dict[tuple, list[tuple[int, int]]] = {}
        offsets_seen = set()
        for row in range(int(m["n_seq"])):
            got = row_provenance(out, row, split)
            ids = got["input_ids"]
            assert len(ids) == SEQ_LEN
            end = 0
            for seg in got["segments"]:
                key = (seg["source"], seg["file"], seg["record"])
                wrapped = [tok.bos_id, *tok.encode(text_of[key]), tok.eos_id]
                a, b, off = seg["row_start"], seg["row_end"], seg["doc_offset"]
                assert a == end and b > a  # back to back from token 0
                end = b
                piece = ids[a:b]
                # a document the mix budget cut ends in <eos> early: compare its content, then the <eos>
                if piece[-1] == tok.eos_id and off + (b - a) < len(wrapped):
                    assert piece[:-1] == wrapped[off : off + (b - a) - 1], (split, row, seg)
                else:
                    assert piece == wrapped[off : off + (b - a)], (split, row, seg)
                covered.setdefault(key, []).append((off, b - a))
                offsets_seen.add(off > 0)
            assert all(t == tok.pad_id for t in ids[end:])  # only padding after the last piece
        # every delivered document is there once, whole (its pieces tile it from offset 0)
        for key, parts in covered.items():
            parts.sort()
            assert parts[0][0] == 0, key
            assert all(o1 + n1 == o2 for (o1, n1), (o2, _) in zip(parts, parts[1:])), (key, parts)
        docs = sum(r["docs"] for r in m["realized"].values())
        assert len(covered) == docs
        assert True in offsets_seen or split == "val"  # documents longer than a row are cut: offsets > 0


def test_inspect_row_json_cli(built, capsys, tokenizer_512):
    strategy, out = built
    assert stacklm_main(["inspect", str(out), "--row", "3", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == {k: v for k, v in row_provenance(out, 3).items()}
    assert set(got) >= {"row", "input_ids", "segments"} and got["row"] == 3
    assert set(got["segments"][0]) == {"source", "file", "record", "row_start", "row_end", "doc_offset"}
    # out of range: one line, exit 2
    n = mf.read_manifest(out / "train")["n_seq"]
    assert stacklm_main(["inspect", str(out), "--row", str(n)]) == 2
    assert "out of range" in capsys.readouterr().err


def test_side_files_are_small_and_round_trip(built):
    _, out = built
    m = mf.read_manifest(out / "train")
    token_bytes = int(m["n_seq"]) * SEQ_LEN * 2
    assert 0 < m["provenance"]["bytes"] == sum(prov_path(out / "train", s["name"]).stat().st_size for s in m["shards"])
    # round trip of the codec on one shard
    name = m["shards"][0]["name"]
    ptr, pieces = decode_rows(prov_path(out / "train", name).read_bytes())
    rows = [[tuple(p) for p in pieces[ptr[i] : ptr[i + 1]].tolist()] for i in range(len(ptr) - 1)]
    ptr2, pieces2 = decode_rows(encode_rows(rows))
    assert np.array_equal(ptr, ptr2) and np.array_equal(pieces, pieces2)
    assert token_bytes > 0  # (the <= 2% budget is measured at realistic sizes by bench/provenance.py)
    # the side files sit beside the shards without disturbing the readers
    from stacklm.data.storage.dataset import PackedMemmapDataset, verify_shard_set

    assert len(PackedMemmapDataset(out, "train")) == int(m["n_seq"])
    assert verify_shard_set(out, progress=False)["train"]["rows"] == int(m["n_seq"])


def test_killed_prebuild_resumes_to_the_same_side_files(corpus, tokenizer_512, tmp_path, monkeypatch):
    root, _ = corpus
    ref = _build(root, tokenizer_512, tmp_path / "ref", "best_fit", splits=("train",))
    import stacklm.prebuild.jobs as jobs

    real, calls = jobs.write_shard, []

    def crash_after_two(*a, **kw):
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated kill")
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(jobs, "write_shard", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        _build(root, tokenizer_512, tmp_path / "resumed", "best_fit", splits=("train",))
    monkeypatch.setattr(jobs, "write_shard", real)
    _build(root, tokenizer_512, tmp_path / "resumed", "best_fit", splits=("train",))
    files = sorted(p.name for p in (ref / "train").iterdir())
    assert any(f.endswith(".prov.npz") for f in files)
    assert files == sorted(p.name for p in (tmp_path / "resumed" / "train").iterdir())
    for f in files:
        assert (ref / "train" / f).read_bytes() == (tmp_path / "resumed" / "train" / f).read_bytes(), f


def test_without_provenance_no_side_files_and_a_clear_error(corpus, tokenizer_512, tmp_path, capsys):
    root, _ = corpus
    out = _build(root, tokenizer_512, tmp_path / "plain", "best_fit", splits=("train",), provenance=False)
    assert not list((out / "train").glob("*.prov.npz"))
    assert "provenance" not in mf.read_manifest(out / "train")
    assert stacklm_main(["inspect", str(out), "--row", "0", "--json"]) == 2
    assert "without it" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["best_fit", "greedy"])
def test_packer_pieces_resume_exactly_and_tile_every_document(strategy):
    """The pieces are part of the packer's state: a pack node restored at any point (empty
    buffer, mid-buffer, the end) continues with the same windows *and* the same pieces; and
    the pieces of the whole stream tile every document exactly once."""
    from torchdata.nodes import IterableWrapper, Mapper

    from stacklm.data.packing.nodes import PackNode
    from tests.helpers.resume import check_save_load_state

    bos, eos, pad = 1024, 1025, 1026
    rng = np.random.default_rng(3)
    docs = [{"ids": rng.integers(0, 1024, size=int(rng.integers(1, 40)) if i % 7 else 90).astype(np.int32),
             "source": ("a", "b")[i % 2], "file": i % 3, "record": i} for i in range(120)]

    def build():
        pack = PackNode(IterableWrapper(docs), 48, strategy, bos, eos, pad, 6, sources=["a", "b"], provenance=True)
        return Mapper(pack, lambda w: (w, np.array(pack.last_origin.pieces, dtype=np.int64)))

    full = check_save_load_state(build, lambda n: (0, 1, 5, n // 2, n - 1, n), state_round_trip="pickle")
    seen: dict[int, list[tuple[int, int]]] = {}
    for window, pieces in full:
        for src, f, rec, a, b, off in pieces.tolist():
            d = docs[rec]
            assert (src, f) == (("a", "b").index(d["source"]), d["file"])
            wrapped = np.concatenate([[bos], d["ids"], [eos]])
            assert np.array_equal(window[a:b], wrapped[off : off + b - a])
            seen.setdefault(rec, []).append((off, b - a))
    for rec, parts in seen.items():
        parts.sort()
        assert parts[0][0] == 0 and sum(n for _, n in parts) == len(docs[rec]["ids"]) + 2
    assert sorted(seen) == list(range(len(docs)))


def test_whole_split_readers_agree_and_refuse_a_mix_without_a_provenance_source(built):
    """``row_source_counts`` and ``RowSources`` read the side files through one shared reader: a
    source list missing one of the side files' sources is one ``DataError`` from both (the
    second raised a NameError before: its error class had been folded into ``DataError``)."""
    from stacklm.data.storage import manifest as mf
    from stacklm.data.storage.provenance import RowSources, row_source_counts
    from stacklm.errors import DataError

    _, out = built
    split = out / "train"
    sources = mf.read_manifest(split)["provenance"]["sources"]
    tokens, _ = row_source_counts(split, sources)
    rows = RowSources.load(split, sources)
    assert tokens.sum() > 0 and rows is not None
    for reader in (row_source_counts, RowSources.load):
        with pytest.raises(DataError, match="provenance names sources"):
            reader(split, sources[1:])
