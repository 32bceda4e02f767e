"""Shard format, the crash-safe writer, manifest reading/merging, and their errors."""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest

from stacklm import atomic
from stacklm.data.storage import manifest as mf
from stacklm.data.storage import shards as sh
from stacklm.errors import DataError, ShardWriteError


def _files(d):
    return sorted(os.listdir(d))


def test_dtype_follows_the_vocab():
    assert sh.token_dtype(32768) == np.dtype("<u2")
    assert sh.token_dtype(65536) == np.dtype("<u2")
    assert sh.token_dtype(65537) == np.dtype("<u4")
    with pytest.raises(ValueError):
        sh.token_dtype(0)


@pytest.mark.parametrize("vocab", [1000, 100_000])
def test_write_then_read_round_trip(tmp_path, vocab):
    dtype = sh.token_dtype(vocab)
    rng = np.random.default_rng(0)
    windows = rng.integers(0, vocab, size=(5, 16))
    info = sh.write_shard(tmp_path, 3, windows, dtype)
    assert info.name == "shard_00003" and info.n_seq == 5
    assert _files(tmp_path) == ["shard_00003.meta.bin", "shard_00003.tokens.bin"]
    assert sh.read_meta(sh.meta_path(tmp_path, info.name)) == (5, 16)
    assert (tmp_path / "shard_00003.tokens.bin").stat().st_size == 5 * 16 * dtype.itemsize
    assert info.xxh64 == sh.file_xxh64(sh.tokens_path(tmp_path, info.name))
    assert sh.check_shard_files(tmp_path, info.name, dtype, 16, 5) == 5
    back = sh.open_tokens(tmp_path, info.name, dtype, 5, 16)
    np.testing.assert_array_equal(back, windows)
    assert sh.list_shard_files(tmp_path) == ["shard_00003"]


def test_ids_that_do_not_fit_the_dtype_are_refused(tmp_path):
    with pytest.raises(ValueError, match="uint16"):
        sh.write_shard(tmp_path, 0, np.array([[1, 70_000]]), np.dtype("<u2"))
    assert _files(tmp_path) == []


@pytest.mark.parametrize("fail_on_call", [1, 2])  # 1: the tokens file, 2: the meta file
def test_disk_full_leaves_nothing_visible(tmp_path, monkeypatch, fail_on_call):
    calls = {"n": 0}
    real = atomic._write_all

    def full_disk(f, data):
        calls["n"] += 1
        if calls["n"] == fail_on_call:
            f.write(bytes(memoryview(data).cast("B")[:3]))  # a partial write, then ENOSPC
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, data)

    monkeypatch.setattr(atomic, "_write_all", full_disk)
    with pytest.raises(ShardWriteError) as exc:
        sh.write_shard(tmp_path, 0, np.ones((4, 8), dtype=np.int64), np.dtype("<u2"))
    msg = str(exc.value)
    assert "disk is full" in msg and "shard_00000" in msg and "re-run" in msg
    assert isinstance(exc.value, OSError)
    assert _files(tmp_path) == []  # no shard, no meta, no temp file


def test_temp_files_are_never_shards_and_get_removed(tmp_path):
    (tmp_path / f"{sh.TMP_MARK}shard_00000.tokens.bin.123").write_bytes(b"xx")
    assert sh.list_shard_files(tmp_path) == []
    assert sh.remove_temp_files(tmp_path) == 1
    assert _files(tmp_path) == []


def test_meta_and_size_errors_name_the_file(tmp_path):
    dtype = np.dtype("<u2")
    sh.write_shard(tmp_path, 0, np.ones((4, 8)), dtype)
    tokens = sh.tokens_path(tmp_path, "shard_00000")
    meta = sh.meta_path(tmp_path, "shard_00000")
    with pytest.raises(DataError, match="seq_len=8 but the manifest says 16"):
        sh.check_shard_files(tmp_path, "shard_00000", dtype, 16)
    with pytest.raises(DataError, match="n_seq=4 but the manifest lists 5"):
        sh.check_shard_files(tmp_path, "shard_00000", dtype, 8, 5)
    with open(tokens, "r+b") as f:
        f.truncate(40)
    with pytest.raises(DataError, match="truncated") as exc:
        sh.check_shard_files(tmp_path, "shard_00000", dtype, 8, 4)
    assert exc.value.path == str(tokens) and "stacklm prebuild" in str(exc.value)
    meta.write_bytes(b"\x00" * 9)
    with pytest.raises(DataError, match="is 9 bytes"):
        sh.read_meta(meta)
    meta.unlink()
    with pytest.raises(DataError, match="meta.bin is missing"):
        sh.check_shard_files(tmp_path, "shard_00000", dtype, 8)
    tokens.unlink()
    with pytest.raises(DataError, match="tokens.bin is missing"):
        sh.check_shard_files(tmp_path, "shard_00000", dtype, 8)


def test_shard_errors_survive_pickling():
    import pickle

    err = pickle.loads(pickle.dumps(ShardWriteError("disk full", path="/x/shard_00001.tokens.bin")))
    assert isinstance(err, ShardWriteError) and err.path == "/x/shard_00001.tokens.bin" and str(err) == "disk full"


# ---------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------
def _minimal_manifest(**kw):
    m = {"format": mf.FORMAT, "version": mf.VERSION, "seq_len": 8, "dtype": "uint16", "vocab_size": 100,
         "bos_id": 97, "eos_id": 98, "pad_id": 99, "tokenizer_hash": "ab"}
    m.update(kw)
    return m


def test_manifest_round_trip_is_deterministic_bytes(tmp_path):
    m = _minimal_manifest(z=1, a={"y": 2, "b": [1, 2]})
    mf.write_manifest(tmp_path, m)
    first = (tmp_path / "manifest.json").read_bytes()
    mf.write_manifest(tmp_path, dict(reversed(list(m.items()))))
    assert (tmp_path / "manifest.json").read_bytes() == first
    assert mf.read_manifest(tmp_path) == m
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_manifest_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        mf.read_manifest(tmp_path / "nope")
    with pytest.raises(DataError, match="is empty"):
        mf.read_manifest(tmp_path)
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "shard_00000.tokens.bin").write_bytes(b"")
    with pytest.raises(DataError, match="not a finished shard set"):
        mf.read_manifest(tmp_path / "train")
    (tmp_path / ".prebuild").mkdir()  # a prebuild in progress (or killed): say how to resume
    with pytest.raises(DataError, match="has not finished.*resume"):
        mf.read_manifest(tmp_path / "train")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="not readable JSON"):
        mf.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(_minimal_manifest(format="other")))
    with pytest.raises(DataError, match="not a stacklm shard manifest"):
        mf.read_manifest(tmp_path)
    broken = _minimal_manifest()
    del broken["tokenizer_hash"]
    (tmp_path / "manifest.json").write_text(json.dumps(broken))
    with pytest.raises(DataError, match="tokenizer_hash"):
        mf.read_manifest(tmp_path)


def test_counts_merge_across_tasks():
    a = {"web": {"tokens": 60, "docs": 3, "target_weight": 0.6, "realized_weight": 0.5, "status": "budget_met"}}
    b = {"web": {"tokens": 40, "docs": 2, "target_weight": 0.6, "realized_weight": 0.7, "status": "ran_dry"},
         "code": {"tokens": 100, "docs": 1, "target_weight": 0.4, "realized_weight": 1.0, "status": "budget_met"}}
    merged = mf.merge_realized([a, b], {"web": 0.6, "code": 0.4})
    assert merged["web"]["tokens"] == 100 and merged["web"]["docs"] == 5
    assert merged["web"]["realized_weight"] == 0.5 and merged["code"]["realized_weight"] == 0.5
    assert merged["web"]["status"] == ["budget_met", "ran_dry"]
    packing = mf.merge_packing([
        {"strategy": "best_fit", "seq_len": 10, "windows": 2, "pad_tokens": 1, "pad_fraction": 0.05, "docs_cut": 1},
        {"strategy": "best_fit", "seq_len": 10, "windows": 3, "pad_tokens": 4, "pad_fraction": 0.13, "docs_cut": 0},
    ])
    assert packing == {"strategy": "best_fit", "seq_len": 10, "windows": 5, "pad_tokens": 5, "docs_cut": 1, "pad_fraction": 0.1}
    stats = mf.sum_counts([{"filter": {"web": {"kept": 2, "too_short": 1}}}, {"filter": {"web": {"kept": 3}}}])
    assert stats == {"filter": {"web": {"kept": 5, "too_short": 1}}}


def test_drop_summary_folds_stage_reasons():
    stats = {
        "source": {"web": {"kept": 10, "invalid_utf8_replaced": 3, "surrogates_replaced": 1, "dropped_empty": 2}},
        "filter": {"web": {"kept": 8, "too_short": 1, "repeated_lines": 1}},
        "dedup": {"web": {"kept": 6, "exact_dup": 1, "near_dup": 1}},
    }
    realized = {"web": {"tokens": 5, "truncated_docs": 1, "truncated_tokens": 7, "empty_docs": 0}}
    d = mf.drop_summary(stats, realized)["web"]
    assert d["filtered"] == 2 and d["exact_dup"] == 1 and d["near_dup"] == 1
    assert d["bytes_replaced"] == 4 and d["dropped_empty"] == 2
    assert d["truncated_to_budget"] == 1 and d["tokens_cut_by_budget"] == 7


def test_config_differences_name_the_fields():
    old = {"seed": 0, "mix": {"entries": [{"name": "a", "weight": 1.0}], "total_tokens": 5}}
    new = {"seed": 1, "mix": {"entries": [{"name": "a", "weight": 0.5}], "total_tokens": 5}, "x": 2}
    assert mf.config_differences(old, new) == ["mix.entries[0].weight (1.0 -> 0.5)", "seed (0 -> 1)", "x (absent -> 2)"]
    assert mf.config_differences(old, old) == []


def test_tokenizer_hash_ignores_metadata_but_not_ids(tmp_path):
    from stacklm.tokenizer.bpe import StackTokenizer

    tok = StackTokenizer([b"ab", b"abc"], vocab_size=300, metadata={"train_seconds": 1.0})
    same = StackTokenizer([b"ab", b"abc"], vocab_size=300, metadata={"train_seconds": 2.0})
    other = StackTokenizer([b"ab", b"bc"], vocab_size=300)
    tok.save(tmp_path / "tokenizer.stacklm.json")
    assert mf.tokenizer_hash(tok) == mf.tokenizer_hash(same) == mf.tokenizer_hash(StackTokenizer.load(tmp_path))
    assert mf.tokenizer_hash(tok) != mf.tokenizer_hash(other)
    with pytest.raises(TypeError, match=r"StackTokenizer\.load\(path\)"):  # data/ takes it loaded, never loads one
        mf.tokenizer_hash(tmp_path)


def test_hub_revisions_are_resolved_when_reachable(monkeypatch):
    import huggingface_hub

    mix = {"entries": [
        {"name": "web", "kind": "hf", "path": "org/web", "revision": None},
        {"name": "local", "kind": "json", "path": "json"},
        {"name": "syn", "kind": "synthetic", "path": None},
    ]}

    class Info:
        sha = "0123abcd"

    asked = []
    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, repo, revision=None, timeout=None: asked.append((repo, revision)) or Info())
    assert mf.resolve_revisions(mix) == {"web": "0123abcd"}
    assert asked == [("org/web", None)]

    def offline(self, repo, revision=None, timeout=None):
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", offline)
    assert mf.resolve_revisions(mix) == {"web": None}
    sources = mf.source_list({"entries": [{"name": "web", "weight": 1.0}]}, {"web": {"tokens": 3, "docs": 1}}, {}, {"web": "0123abcd"})
    assert sources[0]["resolved_revision"] == "0123abcd" and sources[0]["tokens"] == 3
