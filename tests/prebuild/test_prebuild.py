"""stacklm prebuild: manifests, stream == shards, refusal, disk full, SIGKILL resume,
--workers determinism, and the datatrove executor."""

from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stacklm import atomic
from stacklm.cli import main as stacklm_main
from stacklm.cli.prebuild_commands import add_prebuild_subcommands
from stacklm.data.storage import manifest as mf
from stacklm.data.storage import shards as sh
from stacklm.data.storage.dataset import PackedMemmapDataset, verify_shard_set
from stacklm.data.pipeline import PipelineConfig, build_pipeline
from stacklm.data.packing.nodes import DELIVERY_KEY
from stacklm.prebuild import load_config, prebuild
from stacklm.errors import DataError, PrebuildError, ShardWriteError
from tests.helpers.prebuild import REPO, SEQ_LEN, TOKENS_PER_SHARD, TOTAL, data_section, config, tree, own_config


@pytest.fixture(scope="module")
def tok_dir(tokenizer_2048, saved_tokenizer_dir):
    return saved_tokenizer_dir(tokenizer_2048)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from stacklm.tokenizer.bpe import StackTokenizer

    return StackTokenizer.load(tok_dir)


@pytest.fixture(scope="module")
def ref(tmp_path_factory, tok_dir):
    out = tmp_path_factory.mktemp("ref") / "shards"
    prebuild(config(), tok_dir, out, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    return out


def test_manifests_describe_and_add_up(ref, tok):
    top = mf.read_manifest(ref)
    cfg = config()
    assert top["dtype"] == "uint16" and top["vocab_size"] == 2048 and top["seq_len"] == SEQ_LEN
    assert (top["bos_id"], top["eos_id"], top["pad_id"]) == (tok.bos_id, tok.eos_id, tok.pad_id)
    assert top["tokenizer_hash"] == mf.tokenizer_hash(tok)
    assert top["filter_config_hash"] == cfg.filters.config_hash()
    assert top["seed"] == 0 and top["packing_strategy"] == "best_fit"
    assert [s["name"] for s in top["sources"]] == ["web", "code", "math"]
    for s in top["sources"]:
        assert {"kind", "path", "config_name", "data_dir", "revision", "split", "text_column"} <= set(s)
        assert abs(s["realized_weight"] - s["target_weight"]) < 1e-9  # budgets are met exactly
    for split, budget in (("train", TOTAL), ("val", round(TOTAL * 0.05))):
        m = mf.read_manifest(ref / split)
        assert m["split"] == split and m["budget"] == budget
        assert sum(r["tokens"] for r in m["realized"].values()) == budget
        assert m["n_seq"] == sum(s["n_seq"] for s in m["shards"]) == top["splits"][split]["n_seq"]
        assert m["n_tokens"] == m["n_seq"] * SEQ_LEN
        assert [s["name"] for s in m["shards"]] == [f"shard_{i:05d}" for i in range(len(m["shards"]))]
        assert all(s["n_seq"] == 8 for s in m["shards"][:-1])
        assert set(m["drops"]["web"]) >= {"filtered", "exact_dup", "near_dup", "bytes_replaced"}
        assert m["packing"]["windows"] == m["n_seq"] and 0 <= m["packing"]["pad_fraction"] < 0.2
    train = mf.read_manifest(ref / "train")
    for src, d in train["drops"].items():  # the summary is the stage counts, folded
        assert d["exact_dup"] == train["stats"]["dedup"][src].get("exact_dup", 0)
        assert d["filtered"] == sum(n for r, n in train["stats"]["filter"][src].items() if r != "kept")
    assert sum(r["docs"] for r in train["realized"].values()) == sum(s["docs"] for s in top["sources"])
    assert train["holdout"]["docs_skipped_for_the_other_split"] > 0
    assert top["holdout"]["val_sequences"] == mf.read_manifest(ref / "val")["n_seq"] > 0
    assert not (ref / ".prebuild").exists()
    assert verify_shard_set(ref, tokenizer=tok, progress=False)["train"]["rows"] == train["n_seq"]


@pytest.mark.parametrize("split", ["train", "val"])
def test_shards_replay_the_stream_batch_for_batch(ref, tok, split):
    ds = PackedMemmapDataset(ref, split, tokenizer=tok)
    stream = build_pipeline(config(), tok, split).batches
    n = 0
    for k, batch in enumerate(stream):
        got = ds.get_batch(range(4 * k, min(4 * k + 4, len(ds))))  # drop_last=False: a short last batch
        assert set(batch) == set(got) | {DELIVERY_KEY}  # the stream's delivery counts ride along
        for key in got:
            assert torch.equal(batch[key], got[key]), (k, key)
        n += 1
    assert n == -(-len(ds) // 4) > 0


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_in_a_log(tmp_path, tok_dir, capsys, monkeypatch):
    from stacklm.progress_lines import SECONDS_ENV, STYLE_ENV

    monkeypatch.setenv(STYLE_ENV, "bar")  # as on a terminal
    prebuild(config(total=4000), tok_dir, tmp_path / "o", tokens_per_shard=TOKENS_PER_SHARD, splits=("train",), progress=True)
    err = capsys.readouterr().err
    assert "tok/s" in err and "web=0.6" in err and "prebuild:" in err and "\r" in err
    # stderr redirected (capsys: not a terminal): a line at every job report (STACKLM_PROGRESS_SECONDS=0)
    monkeypatch.delenv(STYLE_ENV)
    monkeypatch.setenv(SECONDS_ENV, "0")
    top = prebuild(config(total=4000), tok_dir, tmp_path / "p", tokens_per_shard=TOKENS_PER_SHARD, splits=("train",), progress=True)
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err, repr(err)
    lines = [line for line in err.splitlines() if " prebuild p: " in line]
    phases = [line.split(": ", 1)[1] for line in lines if ": global dedup pass" in line]  # no progress of its own
    assert [p.split(" in ")[0] for p in phases] == ["global dedup pass: signing and deciding (no progress lines until it ends)",
                                                     "global dedup pass done"], lines
    lines = [line for line in lines if ": global dedup pass" not in line]
    assert len(lines) >= 4, err  # the job's first report, one per shard, the last, done
    parsed = [PROGRESS_LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [bool(p["done"]) for p in parsed] == [False] * (len(lines) - 1) + [True], lines
    # the done line: the tokens the shards hold (the ledger's delivered, per source), of a budget of 4,000
    delivered = sum(s["tokens"]["delivered"] for s in top["ledger"]["train"]["sources"].values())
    done = parsed[-1]
    assert (int(done["tokens"].replace(",", "")), done["budget"], done["end"]) == (delivered, "4,000", "budget met"), lines[-1]
    assert int(done["shards"]) == top["splits"]["train"]["shards"]
    assert err.splitlines()[-1].startswith("prebuild: ")  # then the summary


# a progress line of a prebuild of OUT 's' or 'p': its counts, and the outcome on the done line (else the ETA)
PROGRESS_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d prebuild [sp]: (?P<done>done  )?tokens (?P<tokens>[\d,]+)/(?P<budget>[\d,]+) "
                           r"\(\d+%\)  docs [\d,]+  shards (?P<shards>\d+)  MB/s [\d.e+-]+  elapsed \d+:\d\d:\d\d  "
                           r"(?:ETA \S+|(?P<end>budget met|sources ran dry)(?P<dry>: [a-z ]+| \(ran dry: [a-z ]+\))?)"
                           r"(  mix web=0\.\d+ code=0\.\d+ math=0\.\d+)?$")


def test_rerun_is_a_noop_and_other_builds_are_refused(ref, tok_dir, tmp_path):
    before = tree(ref)
    prebuild(config(), tok_dir, ref, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    assert tree(ref) == before
    with pytest.raises(PrebuildError, match=r"seed \(0 -> 1\)"):
        prebuild(config(seed=1), tok_dir, ref, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    with pytest.raises(PrebuildError, match=r"mix.total_tokens \(40000 -> 30000\)"):
        prebuild(config(total=30_000), tok_dir, ref, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    with pytest.raises(PrebuildError, match="workers: built with 1, this run has 2"):
        prebuild(config(), tok_dir, ref, workers=2, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    from stacklm.corpus import iter_default_corpus
    from stacklm.tokenizer.training import train_from_iterable

    other = train_from_iterable(iter_default_corpus(300_000), 2048).tokenizer
    with pytest.raises(PrebuildError, match="tokenizer: built with sha256"):
        prebuild(config(), other, ref, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    assert tree(ref) == before
    from stacklm.prebuild import PrebuildPlan, lock_out_dir, prepare

    busy = PrebuildPlan(config(), other, tmp_path / "busy", tokens_per_shard=TOKENS_PER_SHARD)
    prepare(busy)
    held = lock_out_dir(busy.out)  # another prebuild holds the directory
    with pytest.raises(PrebuildError, match="another `stacklm prebuild` is writing"):
        prebuild(config(), other, busy.out, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    held.close()
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(PrebuildError, match="not empty and holds no stacklm prebuild"):
        prebuild(config(), tok_dir, tmp_path / "foreign", progress=False)


def test_disk_full_mid_build_then_resume(ref, tok_dir, tmp_path, monkeypatch):
    out = tmp_path / "shards"
    calls = {"n": 0}
    real = atomic._write_all

    def fills_up(f, data):
        calls["n"] += (out / ".prebuild" / "dedup-index").is_dir()  # counted once the dedup index is in place
        if calls["n"] == 16:  # mid-train, inside some shard or checkpoint write
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, data)

    monkeypatch.setattr(atomic, "_write_all", fills_up)
    with pytest.raises(ShardWriteError, match="disk is full.*re-run the same command"):
        prebuild(config(), tok_dir, out, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    # nothing half-written is visible: no manifest, no temp file, every shard is whole and right
    assert not (out / "manifest.json").exists() and not (out / "train" / "manifest.json").exists()
    assert not [p for p in out.rglob("*") if p.name.startswith(sh.TMP_MARK)]
    visible = sh.list_shard_files(out / "train")
    assert visible
    for name in visible:
        assert (out / "train" / f"{name}.tokens.bin").read_bytes() == (ref / "train" / f"{name}.tokens.bin").read_bytes()
        assert (out / "train" / f"{name}.meta.bin").exists()
    with pytest.raises(DataError, match="has not finished"):
        PackedMemmapDataset(out)
    monkeypatch.setattr(atomic, "_write_all", real)
    prebuild(config(), tok_dir, out, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    assert tree(out) == tree(ref)


def _count(d: Path) -> int:
    return len(list(d.glob("*.meta.bin"))) if d.is_dir() else 0


def test_sigkill_twice_then_resume_is_byte_identical(tmp_path, tok_dir):
    """A real process killed at two different points; the third run finishes the job."""
    total = 80_000
    cfg_file = own_config(tmp_path, tok_dir, total)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "stacklm", "prebuild", "--config", str(cfg_file), "--out", str(out),
           "--tokens-per-shard", str(TOKENS_PER_SHARD), "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def run_and_kill_when(ready) -> int:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if ready():
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return _count(out / "train")
            time.sleep(0.005)
        raise AssertionError(f"the run ended before it could be killed: rc={proc.wait()} {proc.stderr.read().decode()[-2000:]}")

    first = run_and_kill_when(lambda: _count(out / "train") >= 4)
    assert not (out / "manifest.json").exists()
    second = run_and_kill_when(lambda: _count(out / "train") >= first + 25)
    assert second > first + 20 and not (out / "manifest.json").exists()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    expected = tmp_path / "uninterrupted"
    prebuild(config(total=total), tok_dir, expected, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    got, want = tree(out), tree(expected)
    assert got.keys() == want.keys()
    assert [k for k in want if got[k] != want[k]] == []


def test_workers_are_deterministic_and_datatrove_merges_the_same(tmp_path, tok_dir, tok):
    """`--workers 2` (two processes) and datatrove's LocalPipelineExecutor with 2 tasks per
    split (4 tasks) are independent runs of the same N: byte-identical shard sets."""
    from stacklm.scale.datatrove_executors import prebuild_executors

    pool_out = tmp_path / "pool"
    prebuild(config(), tok_dir, pool_out, workers=2, tokens_per_shard=TOKENS_PER_SHARD, progress=False)
    dt_out = tmp_path / "dt"
    main, merge = prebuild_executors(config(), tok_dir, dt_out, tasks=2, tokens_per_shard=TOKENS_PER_SHARD, workers=1)
    assert main.world_size == 4
    merge.run()
    assert tree(dt_out) == tree(pool_out)
    assert sorted(p.name for p in (tmp_path / "dt.datatrove-logs" / "main" / "completions").iterdir()) == [f"{r:05d}" for r in range(4)]
    # the merged manifest adds up across tasks
    train = mf.read_manifest(dt_out / "train")
    assert sum(r["tokens"] for r in train["realized"].values()) == TOTAL
    names = [s["name"] for s in train["shards"]]
    assert names == sorted(names) and len(set(names)) == len(names)
    workers_of = {int(n.split("_")[1]) % 2 for n in names}
    assert workers_of == {0, 1}
    assert train["n_seq"] == sum(s["n_seq"] for s in train["shards"]) == train["packing"]["windows"]
    report = verify_shard_set(dt_out, tokenizer=tok, progress=False)
    assert report["train"]["rows"] == train["n_seq"] and report["val"]["rows"] > 0
    # each shard-writing task says in its datatrove log how far it got (here: only its final line)
    logs = "".join(p.read_text() for p in (tmp_path / "dt.datatrove-logs" / "main" / "logs").glob("*.log"))
    for task in (0, 1):
        rows = sum(s["n_seq"] for s in train["shards"] if int(s["name"].split("_")[1]) % 2 == task)
        assert f"stacklm train task {task}: done, {rows:,} windows of {SEQ_LEN} tokens" in logs


def test_datatrove_task_progress_reports_every_interval(monkeypatch):
    """A shard-writing datatrove task logs its progress every interval, not only when it ends."""
    from datatrove.utils.logging import logger

    from stacklm.scale.datatrove_steps import TaskProgress

    now = [0.0]
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), format="{message}")
    try:
        progress = TaskProgress("stacklm train task 3", 128, shards=[], interval=2.0, clock=lambda: now[0])
        for _ in range(10):  # 10 windows, 0.5 s apart
            now[0] += 0.5
            progress.window()
        progress.report(final=True)
    finally:
        logger.remove(sink)
    assert [line.split(",")[0] for line in lines] == ["stacklm train task 3: 4 windows of 128 tokens",
                                                       "stacklm train task 3: 8 windows of 128 tokens",
                                                       "stacklm train task 3: done"]


def test_cli_subcommands_and_demo_config(ref, tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="stacklm")
    add_prebuild_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["verify", str(ref), "--no-progress"])
    assert args.func(args) == 0
    assert "[train]: OK" in capsys.readouterr().out
    # user errors go through the one CLI error path: one line, exit status 2
    assert stacklm_main(["verify", str(tmp_path), "--no-progress"]) == 2
    assert "is empty" in capsys.readouterr().err
    assert stacklm_main(["prebuild", "--config", "demo", "--out", str(tmp_path / "x"),
                         "--tokenizer", str(tmp_path / "missing")]) == 2
    assert "train one with `stacklm train-tokenizer" in capsys.readouterr().err
    # a repeated --config is refused (argparse kept the last file alone); the trainer merges them into one
    for command in (["prebuild"], ["dedup-index"], ["prebuild-datatrove", "--out", "x"], ["train-tokenizer", "--out", "x"]):
        with pytest.raises(SystemExit) as exit_:
            stacklm_main([*command, "--config", "run.yaml", "--config", "stages.yaml"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
        assert (f"stacklm {command[0]}: error: argument --config: given twice (run.yaml, then stages.yaml): this command reads one "
                "config file; merge them as the trainer does with `stacklm-train fit --config run.yaml --config stages.yaml "
                "--print_config > merged.yaml` and pass --config merged.yaml") in err, err
    demo, settings = load_config("demo")  # StackDataModule layout: data.pipeline
    assert demo.seq_len == 256 and demo.batch_size == 4 and [e.kind for e in demo.mix.entries] == ["synthetic"] * 3
    assert settings["tokenizer"] == "artifacts/demo/tokenizer" and settings["out"] == "artifacts/demo/shards"
    own, settings = load_config(own_config(tmp_path, "tok"))  # the same layout: data.pipeline
    assert own.seq_len == SEQ_LEN and settings["tokenizer"] == "tok" and settings["out"] is None
    with pytest.raises(PrebuildError, match=r"'data\.pipeline\.dedup\.nera'; did you mean 'near'"):
        load_config(own_config(tmp_path, "tok", dedup={"nera": False}))


def test_a_dry_source_is_a_warning_in_the_manifest(tmp_path, tok_dir, capsys, monkeypatch):
    from stacklm.progress_lines import SECONDS_ENV, STYLE_ENV

    section = data_section(total=30_000)
    section["mix"]["entries"][2]["num_docs"] = 6  # math: far too few documents for its 10%
    # in a log, with a line due only every hour: the one progress line is the done line, with the build's totals
    monkeypatch.setenv(STYLE_ENV, "lines")
    monkeypatch.setenv(SECONDS_ENV, "3600")
    with pytest.warns(RuntimeWarning, match="source 'math' ran dry in train job 0"):
        top = prebuild(PipelineConfig.from_dict(section), tok_dir, tmp_path / "s", tokens_per_shard=TOKENS_PER_SHARD, progress=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if " prebuild s: " in line and "global dedup pass" not in line]
    assert len(lines) == 1 and PROGRESS_LINE.match(lines[0]), lines
    done = PROGRESS_LINE.match(lines[0])
    realized = sum(r["tokens"] for split in ("train", "val") for r in mf.read_manifest(tmp_path / "s" / split)["realized"].values())
    assert int(done["tokens"].replace(",", "")) == realized and done["done"], lines
    assert int(done["shards"]) == sum(s["shards"] for s in top["splits"].values()) > 1, lines
    assert realized == 30_000 + 1_500 and (done["end"], done["dry"]) == ("budget met", " (ran dry: math)"), lines  # web and code filled math's share
    dry = [w for w in top["warnings"] if w["kind"] == "ran_dry" and w["split"] == "train"]
    assert [w["source"] for w in dry] == ["math"]
    assert dry[0]["delivered_share"] < dry[0]["target_share"] == pytest.approx(0.1)
    assert dry[0]["tokens"] < dry[0]["planned_tokens"]
    assert top["offline_fallback"] == [] and mf.read_manifest(tmp_path / "s" / "train")["warnings"] == dry
