"""`stacklm dedup-index --executor local|slurm|ray` (issue 22 item 7): stream mode's global dedup
index built by the prebuild's datatrove dedup stages plus a one-task ``index`` stage is the file
the in-process pool writes (same arrays, same ``content_hash``, same meta) for every ``--tasks``
and engine; a failing task ends the run with one line naming the stage, the task and its log,
and a re-run resumes from the completed tasks."""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from stacklm.cli import main as stacklm_main
from stacklm.data.dedup.global_index import DedupIndex
from tests.helpers.dedup_corpus import dedup_config, write_split_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The planted exact, near and cross-split pairs (``write_split_corpus``): (glob, pair_of)."""
    return write_split_corpus(tmp_path_factory.mktemp("dedup_index_corpus"))


def write_yaml(path: Path, pipeline: dict) -> Path:
    path.write_text(yaml.safe_dump({"data": {"pipeline": json.loads(json.dumps(pipeline))}}))
    return path


def split_config(tmp_path: Path, glob: str, **dedup) -> Path:
    """Both splits (holdout 0.5: the near pairs straddle train and val, so ``cross_split`` is used)."""
    return write_yaml(tmp_path / "c.yaml", dataclasses.replace(dedup_config(glob, **dedup), holdout_fraction=0.5).to_dict())


def dedup_index(*argv) -> int:
    return stacklm_main(["dedup-index", *map(str, argv)])


def pool_index(cfg: Path, out: Path, *extra) -> DedupIndex:
    """The reference: today's in-process dedup-index, one worker."""
    assert dedup_index("--config", cfg, "--out", out, "--workers", 1, *extra) == 0
    return DedupIndex.load(out)


def assert_same_index(got: DedupIndex, want: DedupIndex) -> None:
    assert got.content_hash == want.content_hash
    assert got.splits.keys() == want.splits.keys()
    for split, per in want.splits.items():
        for reason, ids in per.items():
            assert np.array_equal(got.splits[split][reason], ids), (split, reason)
    assert got.meta == want.meta  # docs, removed counts, the dedup config, the read volume


def assert_same_evidence(got: Path, want: Path) -> None:
    """The evidence beside two index files (``X.evidence.npz``) holds the same rows, one per removed
    document of the index (counted from the index itself), each naming a kept document."""
    from stacklm.data.dedup.evidence import DedupEvidence, evidence_path

    a, b = DedupEvidence.load(evidence_path(got)), DedupEvidence.load(evidence_path(want))
    assert a.splits.keys() == b.splits.keys()
    for split, cols in b.splits.items():
        for name, col in cols.items():
            assert np.array_equal(a.splits[split][name], col), (split, name)
    index = DedupIndex.load(got)
    assert len(a) == sum(n for per in index.counts().values() for n in per.values())
    for split, cols in a.splits.items():
        removed = set(cols["removed"].tolist())
        assert not removed & set(cols["kept"].tolist())  # a kept document is never one removed


def assert_clean_beside(out: Path) -> None:
    """The work folder is gone; the logs stay beside the file."""
    assert not out.with_name(out.name + ".work").exists()
    assert (out.with_name(out.name + ".datatrove-logs") / "dedup-index" / "completions" / "00000").exists()


def s3_index(s3_bucket, url: str, tmp_path: Path) -> DedupIndex:
    """The index object at ``url`` on moto's S3 server, downloaded and loaded."""
    fs, _ = s3_bucket
    local = tmp_path / "downloaded" / url.rsplit("/", 1)[1]
    local.parent.mkdir(exist_ok=True)
    fs.invalidate_cache()
    fs.get_file(url, str(local))
    why = url.rsplit("/", 1)[0] + "/" + local.name.removesuffix(".npz") + ".evidence.npz"
    fs.get_file(why, str(local.with_name(local.name.removesuffix(".npz") + ".evidence.npz")))  # uploaded beside it
    return DedupIndex.load(local)


def assert_uploaded_from(stage: Path, name: str) -> None:
    """A URL's run: the staged file went once uploaded, its work folder too; the logs stay in the staging folder."""
    assert not (stage / name).exists()
    assert_clean_beside(stage / name)


# ---------------------------------------------------------------------------- fast
def test_local_executor_writes_the_pools_index(corpus, tmp_path, capsys, s3_bucket, monkeypatch):
    """Exact dedup only (one bucket task), one split, T = 2: the file equals the pool's, and the
    command prints the pool's summary lines. The pool writes to a URL (moto's S3 server): in
    the cache's staging folder, then one upload; nothing is left staged."""
    from stacklm.data.storage import remote

    glob, _ = corpus
    monkeypatch.setenv("STACKLM_CACHE_DIR", str(tmp_path / "cache"))
    cfg = write_yaml(tmp_path / "c.yaml", dedup_config(glob, near=False).to_dict())
    url = f"s3://{s3_bucket[1]}/pool/dedup.npz"
    assert dedup_index("--config", cfg, "--out", url, "--workers", 1, "--splits", "train") == 0
    want = s3_index(s3_bucket, url, tmp_path)
    assert not remote.staging_dir(url, "dedup-index").exists()
    pool_out, pool_err = capsys.readouterr()
    assert f"stacklm dedup-index: uploaded dedup.npz to {url}" in pool_err
    assert want.counts()["train"]["exact"] >= 20  # the planted exact pairs (30 in all) found
    out = tmp_path / "idx" / "dedup.npz"  # its folder is made
    assert dedup_index("--config", cfg, "--out", out, "--splits", "train", "--executor", "local", "--tasks", 2) == 0
    assert_same_index(DedupIndex.load(out), want)
    assert_same_evidence(out, tmp_path / "downloaded" / "dedup.npz")
    printed = capsys.readouterr().out
    assert printed.splitlines()[-2] == pool_out.splitlines()[-2].replace(url, str(out))
    # stream mode reads a local index only: the URL run says to copy it, not to set the URL
    assert pool_out.splitlines()[-1].startswith(f"stream mode: copy {url} to a local file")
    assert printed.splitlines()[-1].startswith(f"stream mode: set data.pipeline.dedup.index: {out} (sha256 {want.content_hash[:16]}")
    assert_clean_beside(out)


def test_engine_flags_are_checked_before_anything_is_written(corpus, tmp_path, capsys, s3_bucket, monkeypatch):
    glob, _ = corpus
    cfg = split_config(tmp_path, glob)
    out = tmp_path / "dedup.npz"
    # a URL the run cannot serve: one line, before any work (no folder named 'nosuch:' here, nothing staged)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STACKLM_CACHE_DIR", str(tmp_path / "cache"))
    url = f"s3://{s3_bucket[1]}/dedup.npz"
    for args, message in [
        (("--out", "nosuch://b/dedup.npz", "--executor", "local", "--tasks", 1), "nosuch://b/dedup.npz: Protocol not known: nosuch"),
        (("--out", "s3://no-such-bucket-32/dedup.npz"), "the bucket s3://no-such-bucket-32 does not exist"),
        (("--out", f"s3://{s3_bucket[1]}/", "--executor", "local", "--tasks", 1),
         f"--out s3://{s3_bucket[1]}/ names no file; give the index file's URL, e.g. s3://{s3_bucket[1]}/dedup.npz"),
        (("--out", url, "--executor", "slurm", "--tasks", 1, "--partition", "cpu", "--wait"),
         f"--out {url} with --executor slurm: the tasks run on other nodes and build into a staging folder"),
        (("--out", out, "--stage-dir", tmp_path / "stage"), f"--stage-dir is for a URL --out; {out} is a local path"),
    ]:
        assert dedup_index("--config", cfg, *args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("stacklm dedup-index: error: ") and message in err[0], (args, err)
    assert s3_bucket[0].find(s3_bucket[1]) == []
    assert dedup_index("--config", cfg, "--out", out, "--tasks", 2) == 2
    assert "--tasks is for --executor local/slurm/ray; the pool's processes are --workers N" in capsys.readouterr().err
    assert dedup_index("--config", cfg, "--out", out, "--executor", "local") == 2
    assert "--executor local needs --tasks T" in capsys.readouterr().err
    assert dedup_index("--config", cfg, "--out", out, "--executor", "local", "--tasks", 1, "--wait") == 2
    assert "--wait is for --executor slurm" in capsys.readouterr().err
    assert dedup_index("--config", cfg, "--out", out, "--executor", "slurm", "--tasks", 1) == 2
    assert "--executor slurm needs a partition: pass --partition NAME" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.yaml"]  # no index, no work folder, no logs


def test_the_chain_has_each_stages_resources_and_a_new_plan_starts_afresh(corpus, tmp_path):
    """The executors as built (nothing runs): signatures -> buckets -> decision -> index, each
    with its own Slurm resources (``index``: a one-task stage of its own); the work folder and
    logs beside the file. Built again for another plan, an older run's completion marks go."""
    from stacklm.prebuild import load_config
    from stacklm.scale.datatrove_executors import dedup_index_executors, stage_chain
    from stacklm.scale.resources import ClusterPlan, ClusterSettings, parse_stage_resources

    glob, _ = corpus
    config, _ = load_config(split_config(tmp_path, glob))
    out = tmp_path / "dedup.npz"
    plan = ClusterPlan.resolve(ClusterSettings(partition="cpu"), stage_flags=parse_stage_resources(["index=cpus:1,mem_gb:3,time:00:10:00"]))
    chain = stage_chain(dedup_index_executors(config, out, tasks=3, splits=("train", "val"), executor="slurm", cluster=plan, dedup_ranges=2))
    assert [ex.stacklm_stage for ex in chain] == ["signatures", "buckets", "decision", "index"]
    assert [ex.job_name for ex in chain] == ["stacklm-dedup-sig", "stacklm-dedup-buckets", "stacklm-dedup-decide", "stacklm-dedup-index"]
    assert [(ex.tasks, ex.cpus_per_task, ex.mem_per_cpu_gb, ex.time) for ex in chain] == [
        (6, 2, 4, "04:00:00"), (26, 1, 4, "04:00:00"), (1, 1, 8, "12:00:00"), (1, 1, 3, "00:10:00")]
    logs = tmp_path / "dedup.npz.datatrove-logs"
    assert [ex.logging_dir.path for ex in chain] == [f"{logs}/{d}" for d in ("dedup-sig", "dedup-buckets", "dedup-decide", "dedup-index")]
    assert json.loads((tmp_path / "dedup.npz.work" / "plan.json").read_text())["tasks"] == 3
    assert plan.table("slurm", [ex.stacklm_stage for ex in chain]).endswith("; index cpus:1,mem_gb:3,time:00:10:00")
    mark = logs / "dedup-sig" / "completions" / "00000"
    mark.parent.mkdir(parents=True)
    mark.touch()
    dedup_index_executors(config, out, tasks=3, splits=("train", "val"), dedup_ranges=2)  # the same plan: resumes
    assert mark.exists()
    dedup_index_executors(config, out, tasks=2, splits=("train", "val"), dedup_ranges=2)  # another T: afresh
    assert not mark.exists() and json.loads((tmp_path / "dedup.npz.work" / "plan.json").read_text())["tasks"] == 2
    # the tasks write local files: a URL is refused (it was a local folder named 's3:'), naming the command that uploads
    from stacklm.errors import PrebuildError

    with pytest.raises(PrebuildError, match=r"s3://b/dedup.npz: the executors write into a local folder .* run `stacklm dedup-index --out URL`"):
        dedup_index_executors(config, "s3://b/dedup.npz", tasks=1)


def test_a_failing_task_names_itself_and_a_rerun_resumes(corpus, tmp_path, capsys, s3_bucket, monkeypatch):
    """A corrupt input read by signature task 1 (train, worker 1 of 2) ends the run with exit 2
    and one line naming the stage, the task and its (local) log; task 0 completed; nothing is
    uploaded. With the file fixed, the re-run skips task 0 and uploads the index the pool
    writes of the fixed corpus."""
    glob, _ = corpus
    pipeline = dedup_config(glob, near=False).to_dict()
    pipeline["mix"]["entries"][0]["weight"] = 0.9
    pipeline["mix"]["entries"].append({"name": "gz", "kind": "local", "path": str(tmp_path / "gz" / "*.jsonl.gz"), "weight": 0.1, "domain": "prose"})
    (tmp_path / "gz").mkdir()
    whole = {}
    for i in range(2):  # two files, two readers: g1 is worker 1's
        whole[i] = gzip.compress("".join(json.dumps({"text": f"gz file {i} document {k} " * 30}) + "\n" for k in range(50)).encode())
        (tmp_path / "gz" / f"g{i}.jsonl.gz").write_bytes(whole[i] if i == 0 else whole[i][: len(whole[i]) // 2])
    cfg = write_yaml(tmp_path / "c.yaml", pipeline)
    # to a URL (moto's S3 server): staged in this machine's cache (the local executor's default), uploaded at the end
    from stacklm.data.storage import remote

    monkeypatch.setenv("STACKLM_CACHE_DIR", str(tmp_path / "cache"))
    url = f"s3://{s3_bucket[1]}/idx/dedup.npz"
    stage = remote.staging_dir(url, "dedup-index")
    args = ("--config", cfg, "--out", url, "--splits", "train", "--executor", "local", "--tasks", 2, "--workers", 1)
    assert dedup_index(*args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stacklm dedup-index: error:")]
    logs = stage / "dedup.npz.datatrove-logs" / "dedup-sig"
    assert len(errors) == 1, errors
    assert re.match(r"stacklm dedup-index: error: datatrove stage 'signatures' task 1 \(split train, worker 1 of 2\) raised SourceError: "
                    rf"source 'gz': failed reading {re.escape(str(tmp_path / 'gz' / 'g1.jsonl.gz'))}.*; its log: "
                    rf"{re.escape(str(logs / 'logs' / 'task_00001.log'))}\. The run stopped \(1 of 2 tasks of 'signatures' completed\)", errors[0])
    assert s3_bucket[0].find(s3_bucket[1]) == [] and (logs / "completions" / "00000").exists()
    first_log = (logs / "logs" / "task_00000.log").read_text()

    (tmp_path / "gz" / "g1.jsonl.gz").write_bytes(whole[1])
    assert dedup_index(*args) == 0
    assert (logs / "logs" / "task_00000.log").read_text() == first_log  # task 0 was not run again
    assert (logs / "completions" / "00001").exists()
    assert_same_index(s3_index(s3_bucket, url, tmp_path), pool_index(cfg, tmp_path / "pool.npz", "--splits", "train"))
    assert_uploaded_from(stage, "dedup.npz")


# ---------------------------------------------------------------------------- every engine, exact + near, both splits
@pytest.fixture(scope="module")
def split_pool(corpus, tmp_path_factory) -> tuple[Path, DedupIndex, Path]:
    """``split_config`` of the corpus and the pool's index of it, built once for the module:
    (config file, index, its path). Every engine below must write exactly this index."""
    root = tmp_path_factory.mktemp("split_pool")
    cfg = split_config(root, corpus[0])
    return cfg, pool_index(cfg, root / "pool.npz"), root / "pool.npz"


@pytest.mark.slow
def test_local_executor_index_is_the_pools_for_one_and_three_tasks(split_pool, tmp_path):
    cfg, want, pool = split_pool
    c = want.counts()
    assert c["train"]["cross_split"] >= 5 and c["train"]["near"] + c["val"]["near"] > 0  # every reason is exercised
    for tasks in (1, 3):
        out = tmp_path / f"local{tasks}.npz"
        assert dedup_index("--config", cfg, "--out", out, "--executor", "local", "--tasks", tasks) == 0
        assert_same_index(DedupIndex.load(out), want)
        assert_same_evidence(out, pool)
        assert_clean_beside(out)


@pytest.mark.slow
def test_fake_slurm_index_is_the_pools(split_pool, tmp_path, slurm, capsys, s3_bucket):
    cfg, want, _ = split_pool
    out, stage = f"s3://{s3_bucket[1]}/slurm.npz", tmp_path / "stage"  # written in --stage-dir, uploaded after --wait
    assert dedup_index("--config", cfg, "--out", out, "--stage-dir", stage, "--executor", "slurm", "--tasks", 2, "--partition", "cpu",
                       "--stage-resources", "index=cpus:1,mem_gb:3,time:00:10:00", "--wait", "--poll-seconds", 0.1) == 0
    assert_same_index(s3_index(s3_bucket, out, tmp_path), want)
    assert_uploaded_from(stage, "slurm.npz")
    stages = [j for j in slurm.jobs() if "launch_pickled_pipeline" in j["script"]]
    assert [(j["name"], len(j["array"]), j["state"]) for j in stages] == [
        ("stacklm-dedup-sig", 4, "COMPLETED"), ("stacklm-dedup-buckets", 13, "COMPLETED"),
        ("stacklm-dedup-decide", 1, "COMPLETED"), ("stacklm-dedup-index", 1, "COMPLETED")]
    o = stages[-1]["options"]
    assert (o["cpus-per-task"], o["mem-per-cpu"], o["time"]) == ("1", "3G", "00:10:00")
    printed = capsys.readouterr()
    assert ("stacklm dedup-index: per-task resources: signatures cpus:2,mem_gb:8,time:04:00:00; buckets cpus:1,mem_gb:4,time:04:00:00; "
            "decision cpus:1,mem_gb:8,time:12:00:00; index cpus:1,mem_gb:3,time:00:10:00") in printed.err.splitlines()
    assert f"{out}: every slurm task completed" in printed.out and f"stream mode: copy {out} to a local file" in printed.out


def test_ray_index_is_the_pools(split_pool, tmp_path, ray_cluster, s3_bucket):
    """On a local 2-CPU Ray cluster (~8 s to start, ~8 s to run here): not slow."""
    cfg, want, _ = split_pool
    out, stage = f"s3://{s3_bucket[1]}/ray.npz", tmp_path / "stage"  # written in --stage-dir, then uploaded
    assert dedup_index("--config", cfg, "--out", out, "--stage-dir", stage, "--executor", "ray", "--tasks", 2, "--cpus-per-task", 1,
                       "--stage-resources", "index=cpus:2") == 0
    assert_same_index(s3_index(s3_bucket, out, tmp_path), want)
    assert_uploaded_from(stage, "ray.npz")
    log = (stage / "ray.npz.datatrove-logs" / "dedup-index" / "logs" / "task_00000.log").read_text()
    assert "stacklm stage 'index' task 0: asked for cpus:2,mem_gb:not reserved,time:none; given {'ray': {'CPU': 2.0}}" in log
