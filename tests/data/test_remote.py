"""Shard sets in object storage, tested against a real S3 protocol server on this machine
(moto's server mode over HTTP through s3fs, ``tests/helpers/s3_server.py``); no network."""

from __future__ import annotations

import pytest


def test_s3_server_round_trip_and_injected_slowdown(s3_bucket, s3_server):
    """The harness itself: objects go over HTTP to moto and back; an injected SlowDown is a
    503 the client sees (s3fs retries it) and is counted."""
    fs, bucket = s3_bucket
    fs.pipe(f"{bucket}/a/b.bin", b"hello")
    assert fs.cat(f"{bucket}/a/b.bin") == b"hello"
    s3_server.faults.slow_down(2, method="GET", path_contains="/a/b.bin")
    assert fs.cat(f"{bucket}/a/b.bin") == b"hello"
    assert s3_server.faults.served["slow_down"] == 2


# ---------------------------------------------------------------------------------------
# prebuild to s3://, verify / ledger / inspect from it, mirror, faults
# ---------------------------------------------------------------------------------------
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from stacklm.cli import main as stacklm_main  # noqa: E402
from stacklm.data.storage import remote  # noqa: E402
from stacklm.data.storage.dataset import PackedMemmapDataset  # noqa: E402
from stacklm.errors import RemoteError
from tests.helpers.datamodule import BATCH, SEQ_LEN, crash_and_resume, stream_pipeline  # noqa: E402


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Each test its own cache root (staging and mirrors), and quick backoff."""
    monkeypatch.setenv("STACKLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    return tmp_path / "cache"


def _config():
    from stacklm.data.pipeline import PipelineConfig

    return PipelineConfig.from_dict({**stream_pipeline(total_tokens=20_000), "seq_len": SEQ_LEN, "batch_size": BATCH})


def _build(tokenizer_dir, out) -> dict:
    from stacklm.prebuild import prebuild

    return prebuild(_config(), tokenizer_dir, out, tokens_per_shard=SEQ_LEN * 64, progress=False)


@pytest.fixture(scope="module")
def local_build(tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("local")
    _build(tokenizer_dir, out)
    return out


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_prebuild_to_s3_equals_a_local_build_and_every_reader_takes_it(s3_bucket, tokenizer_dir, local_build, cache_dir, capsys):
    fs, bucket = s3_bucket
    url = f"s3://{bucket}/runs/a"
    _build(tokenizer_dir, url)
    remote_files = {p[len(f"{bucket}/runs/a/"):]: fs.cat_file(p) for p in fs.find(f"{bucket}/runs/a")}
    assert remote_files == _tree(local_build)  # the same files, byte for byte (manifests are deterministic)
    assert not (cache_dir / "staging").exists() or not any((cache_dir / "staging").iterdir())  # staging removed

    assert stacklm_main(["verify", url, "--no-progress"]) == 0
    assert f"{url} [train]: OK" in capsys.readouterr().out
    assert stacklm_main(["ledger", url]) == 0
    assert f"{url} [val]" in capsys.readouterr().out
    assert stacklm_main(["inspect", url, "--row", "3"]) == 0
    ds = PackedMemmapDataset(url)
    local = PackedMemmapDataset(local_build)
    assert ds.url == url and len(ds) == len(local)
    assert (ds.rows(range(len(ds))) == local.rows(range(len(local)))).all()

    # the same command again: complete there, nothing built or uploaded
    fs.rm(f"{bucket}/runs/a/train/shard_00000.tokens.bin")  # would be uploaded again by a re-run that uploads
    _build(tokenizer_dir, url)
    assert not fs.exists(f"{bucket}/runs/a/train/shard_00000.tokens.bin")


def test_killed_upload_leaves_no_finished_set_and_the_rerun_completes_it(s3_bucket, tokenizer_dir, local_build):
    from tests.helpers.s3_server import upload_killed_after

    fs, bucket = s3_bucket
    url = f"s3://{bucket}/killed"
    with upload_killed_after(5), pytest.raises(KeyboardInterrupt):
        _build(tokenizer_dir, url)
    assert len(fs.find(f"{bucket}/killed")) == 5 and not fs.exists(f"{bucket}/killed/manifest.json")
    with pytest.raises(RemoteError, match=r"manifest.json is missing: .* is not a finished shard set"):
        PackedMemmapDataset(url)
    staged = remote.staging_dir(url)
    assert (staged / "manifest.json").exists()  # the build had finished locally: the re-run only uploads
    _build(tokenizer_dir, url)
    assert not staged.exists()
    assert stacklm_main(["verify", url, "--no-progress"]) == 0


def test_mirror_checks_each_download_and_leaves_no_half_file(s3_bucket, tokenizer_dir, local_build, cache_dir):
    fs, bucket = s3_bucket
    url = f"s3://{bucket}/m"
    fs.put(str(local_build) + "/", f"{bucket}/m", recursive=True)
    local = remote.mirror(url)
    assert _tree(local / "train").keys() >= {"manifest.json", "shard_00000.tokens.bin", "shard_00000.meta.bin"}

    # a killed download leaves a temporary file: the next mirror removes it
    (local / "train" / ".tmp-shard_00001.tokens.bin.999").write_bytes(b"half")
    # the object changes after the build (same size, other bytes): refused, naming the URL; nothing under its name
    key = f"{bucket}/m/train/shard_00001.tokens.bin"
    data = bytearray(fs.cat_file(key))
    data[10] ^= 1
    fs.pipe(key, bytes(data))
    m = json.loads((local / "train" / "manifest.json").read_bytes())
    m["shards"][1]["xxh64"] = "0" * 16  # make the cache think its copy is stale, so it downloads
    (local / "train" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(RemoteError, match=rf"s3://{key}: downloaded .* content hash .* \(twice\)"):
        remote.mirror(url)
    assert not (local / "train" / "shard_00001.tokens.bin").exists()
    assert not (local / "train" / "manifest.json").exists()  # the split is not a finished mirror now
    assert not list((local / "train").glob(".tmp-*"))


def test_throttling_is_retried_with_backoff_and_counted(s3_bucket, s3_server, local_build, monkeypatch, capsys):
    """503 SlowDown from the server on a shard GET: s3fs and botocore are told not to retry
    (one attempt each) so the retries seen are this package's, with backoff, counted."""
    import s3fs

    fs, bucket = s3_bucket
    fs.put(str(local_build) + "/", f"{bucket}/t", recursive=True)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        s3_server.faults.slow_down(3, method="GET", path_contains="/t/train/shard_00000.tokens.bin")
        before = remote.RETRIES["count"]
        local = remote.mirror(f"s3://{bucket}/t")
        assert s3_server.faults.served["slow_down"] == 3
        assert remote.RETRIES["count"] - before == 3
        assert capsys.readouterr().err.count("retry ") == 3
        assert (local / "train" / "shard_00000.tokens.bin").exists()
        # throttled for longer than the retries last: one error naming the URL
        s3_server.faults.slow_down(100, path_contains="/t/manifest.json")
        with pytest.raises(RemoteError, match=rf"s3://{bucket}/t/manifest.json: reading failed after {remote.MAX_ATTEMPTS} attempts"):
            remote.mirror(f"s3://{bucket}/t")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_bad_credentials_and_a_missing_bucket_are_one_error_naming_the_url(s3_bucket, s3_server, local_build, monkeypatch):
    import s3fs

    fs, bucket = s3_bucket
    with pytest.raises(RemoteError, match=r"s3://no-such-bucket-27/x/manifest.json: the bucket s3://no-such-bucket-27 does not exist"):
        PackedMemmapDataset("s3://no-such-bucket-27/x")
    # a bucket whose name holds "bucket": a missing object in it is missing, not a missing bucket
    # (the word was looked for in the message, which names the URL: every first build there failed)
    fs.mkdir(f"my-bucket-{bucket}")
    assert remote.read_bytes(f"s3://my-bucket-{bucket}/new/manifest.json", missing_ok=True) is None
    remote.check_reachable(f"s3://my-bucket-{bucket}/new")
    with pytest.raises(RemoteError, match=r"s3://no-such-bucket-27/new: the bucket s3://no-such-bucket-27 does not exist"):
        remote.check_reachable("s3://no-such-bucket-27/new")
    fs.put(str(local_build) + "/", f"{bucket}/c", recursive=True)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "wrongkey")
    s3_server.faults.bad_keys.add("wrongkey")
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        with pytest.raises(RemoteError, match=rf"s3://{bucket}/c/manifest.json: access denied while reading .*check the credentials"):
            remote.mirror(f"s3://{bucket}/c")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.slow
def test_lightning_fit_from_s3_with_two_workers_is_killed_and_resumes_exactly(s3_bucket, tokenizer_dir, local_build, tmp_path):
    """A real Trainer, 2 loader workers, data_dir=s3://...: crashed after a checkpoint and
    resumed by a fresh Trainer, the resumed run serves exactly the batches the uninterrupted one
    did after the checkpoint, and those equal a local-directory run's (same content). The resume
    guard compares content: the s3 data's identity is the local copy's."""
    from stacklm.datamodule import StackDataModule
    from stacklm.datamodule.resume.identity import data_identity

    fs, bucket = s3_bucket
    url = f"s3://{bucket}/fit"
    fs.put(str(local_build) + "/", f"{bucket}/fit", recursive=True)
    kw = dict(mode="shards", data_dir=url, pipeline=None, num_workers=2)
    full, resumed = crash_and_resume(tokenizer_dir, tmp_path / "s3", 12, 5, **kw)
    assert resumed == full[5:]
    local_full, _ = crash_and_resume(tokenizer_dir, tmp_path / "local", 12, 5, **{**kw, "data_dir": str(local_build)})
    assert full == local_full
    common = dict(mode="shards", tokenizer=str(tokenizer_dir), pipeline=None, seq_len=SEQ_LEN, batch_size=BATCH)
    s3_id = data_identity(StackDataModule(data_dir=url, **common))
    local_id = data_identity(StackDataModule(data_dir=str(local_build), **common))
    assert s3_id["data"] == local_id["data"] and s3_id["where"] == url


def _mirror_in_child(url: str, cache: str, env: dict) -> str:
    import os

    os.environ.update(env)
    os.environ["STACKLM_CACHE_DIR"] = cache
    from stacklm.data.storage import remote as r

    return str(r.mirror(url))


@pytest.mark.slow
def test_processes_of_a_node_download_each_shard_once_and_start_up_lists_nothing(s3_bucket, s3_server, local_build, cache_dir):
    """Three processes (as the DDP ranks of a node) mirror the same URL at once into one cache:
    each shard object is fetched once in all, and no request lists the prefix."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    fs, bucket = s3_bucket
    fs.put(str(local_build) + "/", f"{bucket}/node", recursive=True)
    s3_server.faults.requests.clear()
    url = f"s3://{bucket}/node"
    with ProcessPoolExecutor(3, mp_context=mp.get_context("spawn")) as pool:
        dirs = list(pool.map(_mirror_in_child, [url] * 3, [str(cache_dir)] * 3, [s3_server.env()] * 3))
    assert len(set(dirs)) == 1
    gets = [p for m, p in s3_server.faults.requests if m == "GET" and p.endswith(".tokens.bin")]
    n_shards = sum(len(PackedMemmapDataset(local_build, s).shard_names) for s in ("train", "val"))
    assert len(gets) == len(set(gets)) == n_shards
    assert not [p for m, p in s3_server.faults.requests if m == "GET" and p.rstrip("/").endswith(bucket)]  # no ListObjects
    assert (PackedMemmapDataset(url).rows(range(4)) == PackedMemmapDataset(local_build).rows(range(4))).all()


def test_cli_prebuild_to_s3_then_a_different_build_is_refused_naming_the_url(s3_bucket, tokenizer_dir, local_build, tmp_path, capsys):
    fs, bucket = s3_bucket
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"data": {"tokenizer": str(tokenizer_dir),
                                        "pipeline": {**stream_pipeline(total_tokens=20_000), "seq_len": SEQ_LEN, "batch_size": BATCH}}}))
    url = f"s3://{bucket}/cli"
    args = ["prebuild", "--config", str(cfg), "--out", url, "--no-progress", "--tokens-per-shard"]
    assert stacklm_main(args + [str(SEQ_LEN * 64)]) == 0
    assert f"{url}" in capsys.readouterr().out
    assert fs.cat_file(f"{bucket}/cli/manifest.json") == (local_build / "manifest.json").read_bytes()
    assert stacklm_main(args + [str(SEQ_LEN * 32)]) != 0
    err = capsys.readouterr().err
    assert f"{url}/manifest.json belongs to a different build" in err and "tokens_per_shard" in err
    assert "staging" not in err and not remote.staging_dir(url).exists()


def test_cache_limit_evicts_the_least_recently_used_mirror_not_one_in_use(s3_bucket, local_build, cache_dir, monkeypatch, capsys):
    fs, bucket = s3_bucket
    for name in ("a", "b", "c"):
        fs.put(str(local_build) + "/", f"{bucket}/{name}", recursive=True)
    # what a mirror holds: the shard set (not the build's dedup evidence, which readers do not fetch)
    size = sum(p.stat().st_size for p in local_build.rglob("*") if p.is_file() and "dedup-evidence" not in p.parts)
    tokens = sum(p.stat().st_size for p in local_build.rglob("*.tokens.bin"))  # what a mirror is sized by before download
    monkeypatch.setenv("STACKLM_CACHE_MAX_BYTES", str(size + tokens // 2))  # room for one set, not two
    a = remote.mirror(f"s3://{bucket}/a")
    remote._IN_USE.pop(str(a)).close()  # the process that read it is done
    b = remote.mirror(f"s3://{bucket}/b")  # in use from here on (this process)
    assert not a.exists() and b.exists()
    assert "evicted" in capsys.readouterr().err
    c = remote.mirror(f"s3://{bucket}/c")  # b is open here: kept, and the excess is said
    assert b.exists() and c.exists() and "open in running processes" in capsys.readouterr().err
    monkeypatch.setenv("STACKLM_CACHE_MAX_BYTES", str(tokens // 2))
    with pytest.raises(RemoteError, match=rf"s3://{bucket}/a needs .* bytes of local cache but STACKLM_CACHE_MAX_BYTES"):
        remote.mirror(f"s3://{bucket}/a")
