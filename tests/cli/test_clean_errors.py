"""Every user error of both command lines (``stacklm`` and ``python -m trainer fit``) ends in one
or two lines naming the file/field/package and the fix, exit status 2, no traceback; ``--debug``
shows the traceback. Also: the prebuild summary on stdout (its numbers are the manifest's and the
shards'), and progress that moves more often than once per shard."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.cli import run_trainer

ROOT = Path(__file__).resolve().parents[2]
SEQ_LEN = 32


@pytest.fixture(scope="module")
def tok_dir(tokenizer_512, saved_tokenizer_dir):
    return saved_tokenizer_dir(tokenizer_512)


def pipeline(total=6000, entries=None):
    return {
        "seq_len": SEQ_LEN, "batch_size": 2, "shuffle_buffer": 16, "pack_buffer_docs": 8, "holdout_fraction": 0.05,
        "tokenize_batch_docs": 8, "num_threads": 1,
        "mix": {"name": "t", "total_tokens": total, "entries": entries or [
            {"name": "web", "kind": "synthetic", "weight": 0.7, "domain": "prose", "seed": 1, "num_docs": 800},
            {"name": "code", "kind": "synthetic", "weight": 0.3, "domain": "code", "seed": 4, "num_docs": 800},
        ]},
    }


def write_config(tmp_path: Path, tok_dir, name="c.yaml", **pipe_overrides) -> Path:
    pipe = pipeline()
    for key, value in pipe_overrides.items():
        if key == "entries":
            pipe["mix"]["entries"] = value
        else:
            pipe[key] = value
    path = tmp_path / name
    path.write_text(json.dumps({"data": {"tokenizer": str(tok_dir), "pipeline": pipe}}))  # JSON is YAML
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from stacklm.cli import main

    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def assert_clean(rc: int, err: str, *must: str) -> None:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("WARNING ")]
    assert rc == 2, err
    assert 1 <= len(lines) <= 2, err
    assert "Traceback" not in err
    assert lines[0].startswith("stacklm"), err
    for text in must:
        assert text in err, (text, err)


def bad_jsonl(tmp_path: Path) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text("not json\nalso not json\n")
    return path


def local_entry(path: Path) -> list[dict]:
    return [{"name": "mine", "kind": "local", "weight": 1.0, "domain": "prose", "path": str(path)}]


def hf_entry(path: str, data_files: str) -> list[dict]:
    return [{"name": "web", "kind": "hf", "weight": 1.0, "domain": "prose", "path": path, "data_files": data_files}]


# --- stacklm --------------------------------------------------------------------------------
CASES = {
    "missing config file": (lambda tmp, tok: ["--config", str(tmp / "nope.yaml")], ["nope.yaml", "no such config file"]),
    "pipeline key typo": (lambda tmp, tok: ["--config", str(write_config(tmp, tok, shufle_buffer=4))],
                          ["shufle_buffer", "did you mean 'shuffle_buffer'"]),
    "bad value": (lambda tmp, tok: ["--config", str(write_config(tmp, tok, strategy="bestfit"))], ["strategy", "best_fit"]),
    "missing source file": (lambda tmp, tok: ["--config", str(write_config(tmp, tok, entries=local_entry(tmp / "gone.jsonl")))],
                            ["gone.jsonl", "matched no files"]),
    "broken source": (lambda tmp, tok: ["--config", str(write_config(tmp, tok, entries=local_entry(bad_jsonl(tmp))))],
                      ["bad.jsonl", "source 'mine'", "valid record"]),
    "broken source in a pool worker": (
        lambda tmp, tok: ["--config", str(write_config(tmp, tok, entries=local_entry(bad_jsonl(tmp)))), "--workers", "2"],
        ["bad.jsonl", "source 'mine'", "valid record"]),
    # datasets says StopIteration (json) or "all the data_files are invalid: {'train': []}" (parquet)
    "hf json data_files match nothing": (
        lambda tmp, tok: ["--config", str(write_config(tmp, tok, entries=hf_entry("json", str(tmp / "nope" / "*.jsonl"))))],
        ["source 'web'", "kind hf", "nope/*.jsonl", "matched no files", "check data_files"]),
    "hf parquet data_files match nothing": (
        lambda tmp, tok: ["--config", str(write_config(tmp, tok, entries=hf_entry("parquet", str(tmp / "*.parquet"))))],
        ["source 'web'", "kind hf", "*.parquet", "matched no files"]),
    "hf folder data_files match nothing": (
        lambda tmp, tok: ["--config", str(write_config(tmp, tok, entries=hf_entry(str(tmp), "sub/*.parquet")))],
        ["source 'web'", "'sub/*.parquet'", "matched no files", "relative to the folder"]),
    "missing tokenizer": (lambda tmp, tok: ["--config", str(write_config(tmp, tok)), "--tokenizer", str(tmp / "no-tok")],
                          ["no-tok", "train-tokenizer"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prebuild_user_errors_are_one_line(case, tmp_path, tok_dir, capsys):
    make_args, must = CASES[case]
    args = ["prebuild", *make_args(tmp_path, tok_dir), "--out", str(tmp_path / "out"), "--no-progress"]
    rc, out, err = run_cli(capsys, *args)
    assert_clean(rc, err, *must)
    assert out == ""
    with pytest.raises(Exception) as info:  # --debug: the exception itself (the traceback)
        run_cli(capsys, "--debug", *args)
    assert any(text in str(info.value) for text in must)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_wrong_text_column_is_one_line_naming_the_config_field(fmt, tmp_path, tok_dir, capsys, caplog):
    """Was, for JSON lines: 3 'skipped, counted as missing_text' warnings, then an error naming
    neither the config nor the field. Now, as for parquet: one line with the config file, the
    entry's field, the file's columns and the fix, before any row is read."""
    rows = [{"id": i, "body": f"note {i} about the scheduler"} for i in range(150)]
    if fmt == "jsonl":
        path = tmp_path / "notes.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "notes.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    entries = [{**local_entry(path)[0], "weight": 0.5}, {"name": "web", "kind": "synthetic", "weight": 0.5, "domain": "prose",
                                                         "num_docs": 50}]
    cfg = write_config(tmp_path, tok_dir, entries=entries[::-1])  # the file's source is entries[1]
    rc, out, err = run_cli(capsys, "prebuild", "--config", str(cfg), "--out", str(tmp_path / "out"), "--no-progress")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "WARNING" not in err, err
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert err.startswith(f"stacklm prebuild: error: {cfg}: field 'data.pipeline.mix.entries[1].text_column' (source 'mine'): "
                          f"column 'text' is not in {path}, whose columns are ['body', 'id']."), err
    assert "Set text_column to the column" in err


def test_debug_shows_the_traceback_in_a_real_process(tmp_path, tok_dir):
    cfg = write_config(tmp_path, tok_dir, shufle_buffer=4)
    base = [sys.executable, "-m", "stacklm.cli", "prebuild", "--config", str(cfg), "--out", str(tmp_path / "o")]
    res = subprocess.run(base, cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 2 and len(res.stderr.splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
    res = subprocess.run([*base, "--debug"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 1 and "Traceback (most recent call last)" in res.stderr and "shufle_buffer" in res.stderr


def test_disk_full_while_writing_shards(tmp_path, tok_dir, capsys, monkeypatch):
    from stacklm import atomic

    real, calls = atomic._write_all, {"n": 0}

    def fills_up(f, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(f, data)

    monkeypatch.setattr(atomic, "_write_all", fills_up)
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "prebuild", "--config", str(write_config(tmp_path, tok_dir)), "--out", str(out),
                         "--tokens-per-shard", str(SEQ_LEN * 8), "--no-progress")
    assert_clean(rc, err, "disk is full", str(out), "re-run the same command")


def test_a_raw_os_error_gets_its_fix(tmp_path, tok_dir, capsys, monkeypatch):
    """An OSError from a place that does not translate it (here: the manifests) still ends in one
    line naming the file and the fix for its errno."""
    from stacklm.prebuild import build

    target = tmp_path / "out" / "manifest.json"

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(target))

    monkeypatch.setattr(build, "finalize", full)
    rc, _, err = run_cli(capsys, "prebuild", "--config", str(write_config(tmp_path, tok_dir)), "--out", str(tmp_path / "out"),
                         "--no-progress")
    assert_clean(rc, err, str(target), "the disk is full", "free space")


def test_missing_optional_dependency(tmp_path, tok_dir, capsys, monkeypatch):
    """A hub source without `datasets`, the datatrove executor without `datatrove`: the package
    and the extra that installs it, in one line."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` -> ModuleNotFoundError
    hf = [{"name": "hub", "kind": "hf", "weight": 1.0, "domain": "prose", "path": "some/dataset"}]
    rc, _, err = run_cli(capsys, "prebuild", "--config", str(write_config(tmp_path, tok_dir, entries=hf)),
                         "--out", str(tmp_path / "out"), "--no-progress")
    assert_clean(rc, err, "'datasets'", 'pip install "stacklm[hf]"')

    monkeypatch.setitem(sys.modules, "datatrove", None)
    monkeypatch.delitem(sys.modules, "stacklm.scale.datatrove_steps", raising=False)
    monkeypatch.delitem(sys.modules, "stacklm.scale.datatrove_executors", raising=False)
    rc, _, err = run_cli(capsys, "prebuild-datatrove", "--config", str(write_config(tmp_path, tok_dir)),
                         "--out", str(tmp_path / "dt"), "--tasks", "1")
    assert_clean(rc, err, "'datatrove'", 'pip install "stacklm[scale]"')


def test_user_error_messages():
    from stacklm.errors import is_user_error, user_error_message

    raw = ModuleNotFoundError("No module named 'wandb'", name="wandb")  # a direct import, not via require
    assert is_user_error(raw) and 'pip install "stacklm[wandb]"' in user_error_message(raw)
    lightning_style = ModuleNotFoundError("`WandbLogger` requires `wandb` to be installed.")
    assert is_user_error(lightning_style) and "stacklm[wandb]" in user_error_message(lightning_style)
    assert not is_user_error(ModuleNotFoundError("No module named 'numpyy'", name="numpyy"))  # a bug, not an extra
    msg = user_error_message(PermissionError(errno.EACCES, "Permission denied", "/data/x"))
    assert msg.startswith("'/data/x': permission denied") and "\n" not in msg
    from stacklm.errors import StackLMError

    assert user_error_message(StackLMError("a\nb\nc")).count("\n") == 1  # never more than two lines
    # Lightning refusing a setting is the user's to fix; a ValueError raised in any other code is a bug
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    assert is_user_error(MisconfigurationException("`max_epochs` must be ...")), "Lightning's own class"
    assert user_error_message(MisconfigurationException("x\ny")) == "the trainer settings: x\n  y"
    try:
        raise ValueError("a bug of ours")
    except ValueError as e:
        assert not is_user_error(e)


# --- python -m trainer fit ------------------------------------------------------------------
def trainer_config(tmp_path: Path, tok_dir, **data) -> Path:
    doc = {
        "data": {"mode": "stream", "tokenizer": str(tok_dir), "seq_len": SEQ_LEN, "batch_size": 2, "num_workers": 0,
                 "pipeline": pipeline(), **data},
        "model": {"config": {"vocab_size": 512, "seq_len": SEQ_LEN, "n_layer": 1, "n_head": 2, "d_model": 32}},
        "trainer": {"accelerator": "cpu", "max_steps": 1, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "limit_val_batches": 1,
                    "default_root_dir": str(tmp_path)},  # in-process fits save config.yaml there, not in the cwd
    }
    path = tmp_path / "train.yaml"
    path.write_text(json.dumps(doc))
    return path


@pytest.fixture(autouse=True)
def _plain_argv(monkeypatch):
    """In-process runs of the trainer's main(argv): sys.argv is pytest's, which LightningCLI
    would warn about (it expects either argv or args)."""
    monkeypatch.setattr(sys, "argv", ["stacklm-train"])
    monkeypatch.setenv("STACKLM_DEBUG", "0")  # restored (removed) after the test, also when main sets it


def test_trainer_pipeline_typo_is_refused_by_print_config(tmp_path, tok_dir):
    """The real entry point; parse time: --print_config already refuses it, with the nearest name."""
    cfg = trainer_config(tmp_path, tok_dir)
    doc = json.loads(cfg.read_text())
    doc["data"]["pipeline"]["shufle_buffer"] = 4
    cfg.write_text(json.dumps(doc))
    base = [sys.executable, "-m", "trainer", "fit", "--config", str(cfg), "--print_config"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, env=env)
    assert res.returncode == 2, res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert str(cfg) in lines[0] and "did you mean 'shuffle_buffer'" in lines[0] and res.stdout == ""
    res = subprocess.run([*base, "--debug"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert res.returncode == 1 and "Traceback (most recent call last)" in res.stderr


@pytest.mark.parametrize("edit, must", [
    (lambda d: d["trainer"].update(max_stepz=3), ["max_stepz", "did you mean 'trainer.max_steps'"]),
    (lambda d: d["model"]["config"].update(n_layers=3), ["n_layers", "did you mean 'n_layer'"]),
    (lambda d: d["data"].update(batch_size="abc"), ["data.batch_size", "abc"]),
    (lambda d: d["data"]["pipeline"].update(strategy="bestfit"), ["data.pipeline", "strategy"]),
])
def test_trainer_config_errors_are_one_line(edit, must, tmp_path, tok_dir, capsys):
    cfg = trainer_config(tmp_path, tok_dir)
    doc = json.loads(cfg.read_text())
    edit(doc)
    cfg.write_text(json.dumps(doc))
    code, _, err = run_trainer(capsys, "fit", "--config", str(cfg), "--print_config")
    assert code == 2 and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("stacklm-train fit: error: ") and str(cfg) in lines[0], err
    for text in must:
        assert text in lines[0], (text, err)


def test_a_pipeline_key_given_as_a_flag_is_one_line_saying_where_it_goes(tmp_path, tok_dir, capsys):
    """`--data.pipeline.KEY VALUE` reached the pipeline check as jsonargparse's NestedArg, and the
    error showed that internal object; it now names the flag and the second-config-file way."""
    cfg = trainer_config(tmp_path, tok_dir)
    code, _, err = run_trainer(capsys, "fit", "--config", str(cfg), "--data.pipeline.holdout_fraction", "0.5", "--print_config")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "NestedArg" not in err, err
    assert "--data.pipeline.holdout_fraction: the pipeline's keys are not command-line flags" in lines[0], err
    assert "set holdout_fraction: 0.5 in a second config file given after the first (--config my.yaml --config more.yaml)" in lines[0]


def test_trainer_run_time_user_error(tmp_path, tok_dir):
    """A StackLMError raised while the Trainer sets the data up (no prebuilt shards there), from
    the real entry point (in-process, Lightning's loggers hold pytest's captured streams)."""
    cfg = trainer_config(tmp_path, tok_dir, mode="shards", data_dir=str(tmp_path / "no-shards"))
    base = [sys.executable, "-m", "trainer", "fit", "--config", str(cfg)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("STACKLM_DEBUG", None)
    res = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, env=env)
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(errors) == 1, res.stderr[-3000:]
    assert errors[0].startswith("stacklm-train fit: error: ") and "no-shards" in errors[0]
    res = subprocess.run([*base, "--debug"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert res.returncode == 1 and "Traceback (most recent call last)" in res.stderr and "no-shards" in res.stderr


def test_a_setting_lightning_refuses_is_one_line_and_only_the_pipeline_that_runs_is_announced(tmp_path, tok_dir):
    """Issue 36: a ``val_check_interval`` larger than the epoch, which Lightning finds only once the
    fit has its data, was a 20-line traceback that left an empty log folder; it is one line, exit
    2, and the folder the fit started is gone. The second ``--config`` replaces the pipeline: only
    its mix says its normalized weights (the first one's used to be announced as well)."""
    cfg = trainer_config(tmp_path, tok_dir)
    doc = json.loads(cfg.read_text())
    run_dir = tmp_path / "run"
    doc["trainer"].update(val_check_interval=100_000, check_val_every_n_epoch=1, default_root_dir=str(run_dir))
    del doc["trainer"]["logger"]  # the default CSV logger: it made run/lightning_logs/version_0 before Lightning refused
    for e, w in zip(doc["data"]["pipeline"]["mix"]["entries"], (2, 1)):
        e["weight"] = w
    doc["data"]["pipeline"]["mix"]["name"] = "first"
    cfg.write_text(json.dumps(doc))
    second = pipeline()
    second["mix"]["name"] = "second"
    for e, w in zip(second["mix"]["entries"], (3, 1)):
        e["weight"] = w
    more = tmp_path / "more.yaml"
    more.write_text(json.dumps({"data": {"pipeline": second}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("STACKLM_DEBUG", None)
    res = subprocess.run([sys.executable, "-m", "trainer", "fit", "--config", str(cfg), "--config", str(more)], cwd=tmp_path,
                         capture_output=True, text=True, env=env)
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(errors) == 1, res.stderr[-3000:]
    assert errors[0].startswith(f"stacklm-train fit: error: {cfg}, {more}: the trainer settings: `val_check_interval` (100000) "
                                "must be less than or equal to the number of the training batches"), errors[0]
    assert not run_dir.exists(), sorted(str(p) for p in run_dir.rglob("*"))  # nothing of the failed start is left
    assert "data mix 'second': the weights (web=3, code=1) sum to 4" in res.stderr and "'first'" not in res.stderr, res.stderr


def test_trainer_hf_data_files_matching_nothing(tmp_path, tok_dir):
    """Stream mode, a ``kind: hf`` source (json builder) whose data_files glob matches nothing:
    one line naming the source and the glob, exit 2 (was datasets' bare ``StopIteration``)."""
    pipe = pipeline(entries=hf_entry("json", "missing/*.jsonl"))
    cfg = trainer_config(tmp_path, tok_dir, pipeline=pipe)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("STACKLM_DEBUG", None)
    res = subprocess.run([sys.executable, "-m", "trainer", "fit", "--config", str(cfg)], cwd=tmp_path,
                         capture_output=True, text=True, env=env)
    errors = [line for line in res.stderr.splitlines() if "error:" in line]
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(errors) == 1, res.stderr[-3000:]
    assert "source 'web'" in errors[0] and "'missing/*.jsonl' matched no files" in errors[0], errors[0]
    assert "StopIteration" not in res.stderr


# --- summary and progress -------------------------------------------------------------------
def test_summary_is_printed_with_no_progress_and_equals_the_manifest(tmp_path, tok_dir, capsys):
    out = tmp_path / "out"
    # given as a file:// URL: written at the local path it names, not into a folder named 'file:'
    rc, stdout, stderr = run_cli(capsys, "prebuild", "--config", str(write_config(tmp_path, tok_dir)), "--out", out.as_uri(),
                                 "--tokens-per-shard", str(SEQ_LEN * 16), "--no-progress")
    assert rc == 0 and "tok/s" not in stderr and "prebuild summary" not in stderr
    assert not list(Path.cwd().glob("file:*")) and not list(tmp_path.glob("file:*"))
    for command in ("verify", "ledger"):  # and read back through the same URL
        assert run_cli(capsys, command, out.as_uri())[0] == 0
    top = json.loads((out / "manifest.json").read_text())
    rows: dict[str, list[str]] = {}
    for line in stdout.splitlines():  # the mix table's row of each source (the dedup histogram's rows come after it)
        if line.startswith("  ") and line.split():
            rows.setdefault(line.split()[0], line.split())
    for src in top["sources"]:
        row = rows[src["name"]]
        assert float(row[1]) == pytest.approx(src["target_weight"], abs=1e-3)
        assert int(row[3].replace(",", "")) == src["tokens"] and int(row[4].replace(",", "")) == src["docs"]
    for split, m in top["splits"].items():
        row = rows[split]
        on_disk = sum(p.stat().st_size for p in (out / split).glob("*.tokens.bin")) // np.dtype(top["dtype"]).itemsize
        assert int(row[2].replace(",", "")) == m["n_tokens"] == on_disk  # an independent count: the shard bytes
        assert int(row[1].replace(",", "")) == m["n_seq"] and int(row[3]) == m["shards"] == len(list((out / split).glob("*.tokens.bin")))
        assert int(row[4].replace(",", "")) == m["packing"]["pad_tokens"]
    drops = {}
    for per_split in top["drops"].values():
        for src, reasons in per_split.items():
            for reason, n in reasons.items():
                if n:
                    drops[f"{reason}={sum(top['drops'][s][src].get(reason, 0) for s in top['drops']):,}"] = src
    assert drops, "the toy corpus has duplicates and filtered documents"
    for text, src in drops.items():
        assert any(line.strip().startswith(f"{src}:") and text in line for line in stdout.splitlines()), (text, stdout)
    # a re-run of a finished build prints the same table
    rc, again, _ = run_cli(capsys, "prebuild", "--config", str(write_config(tmp_path, tok_dir)), "--out", str(out),
                           "--tokens-per-shard", str(SEQ_LEN * 16), "--no-progress")
    assert rc == 0 and again.splitlines()[1:] == stdout.splitlines()[1:] and "already complete" in again


def test_progress_moves_within_a_shard(tmp_path, tok_dir):
    """A job reports on its clock, not only per shard: with a fake clock ticking 1 s per call and
    a 3 s interval, there are many more reports than shards, and they only go up."""
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.prebuild import PrebuildPlan, run_job, state_dir_of
    from stacklm.tokenizer.bpe import StackTokenizer

    no_dedup = {**pipeline(), "dedup": {"exact": False, "near": False}}  # no global pass to run first
    plan = PrebuildPlan(PipelineConfig.from_dict(no_dedup), StackTokenizer.load(tok_dir), tmp_path / "o",
                        tokens_per_shard=SEQ_LEN * 64, splits=("train",))
    state_dir_of(plan.out).mkdir(parents=True)
    reports = []
    ticks = iter(range(10**9))
    summary = run_job(plan, "train", 0, lambda *msg: reports.append(msg), interval=3.0, clock=lambda: float(next(ticks)))
    shards = len(summary["shards"])
    assert shards >= 2
    assert len(reports) > 3 * shards  # start + one per shard would be shards + 1
    tokens = [sum(r[2].values()) for r in reports]
    docs = [r[3] for r in reports]
    assert tokens == sorted(tokens) and docs == sorted(docs) and docs[-1] > 0
    assert tokens[-1] == sum(r["tokens"] for r in summary["realized"].values())
    # run again (a resumed build): the finished job reports its final counts, so the build's lines count it
    again = []
    assert len(run_job(plan, "train", 0, lambda *msg: again.append(msg))["shards"]) == shards
    assert [(r[0], r[1], sum(r[2].values()), r[3]) for r in again] == [(reports[-1][0], shards, tokens[-1], docs[-1])]


def test_progress_bar_shows_docs_and_rate(tmp_path, tok_dir, capsys, monkeypatch):
    """The terminal's bar (pytest's captured stderr is not a terminal: asked for by name)."""
    from stacklm.prebuild import prebuild

    monkeypatch.setenv("STACKLM_PROGRESS", "bar")

    cfg = write_config(tmp_path, tok_dir)
    from stacklm.prebuild import load_config

    config, _ = load_config(cfg)
    prebuild(config, tok_dir, tmp_path / "o", tokens_per_shard=SEQ_LEN * 64, splits=("train",), progress=True, progress_interval=0)
    err = capsys.readouterr().err
    assert "docs=" in err and "MB/s" in err and "tok/s" in err and "web=0." in err


def test_summary_counts_records_every_split_reads_once():
    """Both splits read every record (the holdout split comes after the source stage), so an
    invalid line is in both split manifests; the summary counts it once, and splits' own
    drops (filter, dedup) add up."""
    from stacklm.prebuild.summary import drop_totals

    per_split = {"invalid_records": 3, "malformed_json": 2, "null_text": 1, "dropped_empty": 1, "exact_dup": 4}
    top = {"drops": {"train": {"web": per_split}, "val": {"web": {**per_split, "exact_dup": 1}}}}
    assert drop_totals(top) == {"web": {"malformed_json": 2, "null_text": 1, "dropped_empty": 1, "exact_dup": 5}}


@pytest.mark.parametrize("node", ["ConversationSource", "PreferenceSource"])
@pytest.mark.parametrize("kind, path, files", [
    ("hf", "json", "nope/*.jsonl"), ("hf", "parquet", "nope/*.parquet"), ("local", None, "nope/*.jsonl"),
])
def test_sft_and_preference_sources_name_the_glob_that_matches_nothing(node, kind, path, files, tmp_path, monkeypatch):
    """The chat sources' globs (``kind: hf`` builders and ``kind: local``): a SourceNotFoundError
    (a StackLMError: the CLIs print it as one line) naming the source and the pattern."""
    from stacklm.data.sources.schema import SourceConfig
    from stacklm.data.sft import preference_pipeline, reader
    from stacklm.errors import SourceNotFoundError, StackLMError

    monkeypatch.chdir(tmp_path)
    spec = SourceConfig("chats", kind=kind, path=path, data_files=(files,))
    src = getattr(preference_pipeline if node == "PreferenceSource" else reader, node)(spec)
    with pytest.raises(SourceNotFoundError) as info:
        src.reset()
    assert isinstance(info.value, StackLMError)
    assert "'chats'" in str(info.value) and "nope/*." in str(info.value) and "matched no files" in str(info.value)
    assert "StopIteration" not in str(info.value)


# --- class: configs (one schema for `data:`; the prebuild refuses what the trainer refuses) --
CONFIG_CASES = {
    "unknown data.mode": (lambda d: d["data"].update(mode="turbo"), ["data.mode", "turbo"]),
    "unknown data key": (lambda d: d["data"].update(bogus=1), ["bogus"]),
    "unknown top-level section": (lambda d: d.update(whatever={"x": 1}), ["whatever"]),
    "prebuild section typo": (lambda d: d.update(prebuild={"workerz": 2}), ["workerz", "did you mean 'workers'"]),
    "data.batch_size 0": (lambda d: d["data"].update(batch_size=0), ["data.batch_size", ">= 1", "got 0"]),
    "data.num_workers -1": (lambda d: d["data"].update(num_workers=-1), ["data.num_workers", ">= 0", "use 0"]),
    "data.snapshot_every_n_steps 0": (lambda d: d["data"].update(snapshot_every_n_steps=0), ["data.snapshot_every_n_steps"]),
    "negative shuffle_buffer": (lambda d: d["data"]["pipeline"].update(shuffle_buffer=-1), ["shuffle_buffer", ">= 1", "got -1"]),
    "zero pack_buffer_docs": (lambda d: d["data"]["pipeline"].update(pack_buffer_docs=0), ["pack_buffer_docs", ">= 1"]),
    "zero num_threads": (lambda d: d["data"]["pipeline"].update(num_threads=0), ["num_threads", ">= 1"]),
    "pipeline seq_len other than data.seq_len": (lambda d: d["data"]["pipeline"].update(seq_len=2 * d["data"]["seq_len"]),
                                                 ["seq_len", "set them in one place"]),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_prebuild_and_trainer_refuse_the_same_config(case, tmp_path, tok_dir, capsys):
    """One file in the shared layout, two entry points: the prebuild (was: accepted mode turbo,
    unknown data keys and sections; a traceback for a negative shuffle_buffer) and
    ``stacklm-train fit`` (was: torch's traceback for num_workers -1) both end in one line
    naming the file and the field."""
    edit, must = CONFIG_CASES[case]
    cfg = trainer_config(tmp_path, tok_dir)
    doc = json.loads(cfg.read_text())
    edit(doc)
    cfg.write_text(json.dumps(doc))
    rc, out, err = run_cli(capsys, "prebuild", "--config", str(cfg), "--out", str(tmp_path / "out"), "--no-progress")
    assert_clean(rc, err, str(cfg), *must)
    assert not (tmp_path / "out").exists()
    code, _, err = run_trainer(capsys, "fit", "--config", str(cfg))
    lines = [line for line in err.splitlines() if line.strip() and "error:" in line]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("stacklm-train fit: error: ") and str(cfg) in lines[0], err[-3000:]
    for text in must:
        assert text in lines[0], (text, lines[0])


def test_the_data_schema_is_the_datamodule_signature():
    """``DataConfig`` (what the datamodule and the prebuild parse) has exactly ``StackDataModule``'s arguments,
    defaults and modes, and the top-level sections are the trainer parser's plus ``prebuild``."""
    import dataclasses
    import inspect as pyinspect

    from stacklm.datamodule.modes import MODES
    from stacklm.datamodule.stack_datamodule import StackDataModule
    from stacklm.datamodule.section import MODE_NAMES, DataConfig

    params = {n: p.default for n, p in pyinspect.signature(StackDataModule.__init__).parameters.items() if n != "self"}
    fields = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    assert fields == params
    assert MODE_NAMES == MODES


def test_top_level_sections_are_the_trainers(capsys):
    import yaml

    from stacklm.datamodule.section import TOP_LEVEL_SECTIONS
    from stacklm.train.cli import main

    with pytest.raises(SystemExit) as info:  # the real parser's keys (defaults only)
        main(["fit", "--print_config"])
    assert info.value.code in (0, None)
    keys = set(yaml.safe_load(capsys.readouterr().out))
    assert keys == set(TOP_LEVEL_SECTIONS), keys ^ set(TOP_LEVEL_SECTIONS)


def _junk(tmp: Path) -> str:
    (tmp / "junk.ckpt").write_bytes(b"junk\n")
    return str(tmp / "junk.ckpt")


def _zip_not_torch(tmp: Path) -> str:
    import zipfile

    with zipfile.ZipFile(tmp / "z.ckpt", "w") as z:
        z.writestr("archive/data.pkl", b"garbage")
    return str(tmp / "z.ckpt")


TRAINER_RUN_CASES = {  # (extra arguments, what the one line says); each was a traceback
    "model vocab below the tokenizer's": (lambda tmp: ["--model.config.vocab_size", "100"],
                                          ["model.config.vocab_size >= 512"]),
    "junk --ckpt_path": (lambda tmp: ["--ckpt_path", _junk(tmp)], ["junk.ckpt", "not a PyTorch checkpoint", "'last'"]),
    "zip --ckpt_path torch cannot read": (lambda tmp: ["--ckpt_path", _zip_not_torch(tmp)], ["z.ckpt", "torch cannot read"]),
    "directory --ckpt_path": (lambda tmp: ["--ckpt_path", str(tmp)], ["is a directory", "last.ckpt"]),
    "missing --ckpt_path": (lambda tmp: ["--ckpt_path", str(tmp / "nope.ckpt")], ["nope.ckpt", "no such checkpoint"]),
}


@pytest.mark.parametrize("case", sorted(TRAINER_RUN_CASES))
def test_trainer_values_past_the_parser_are_one_line(case, tmp_path, tok_dir, capsys):
    make, must = TRAINER_RUN_CASES[case]
    cfg = trainer_config(tmp_path, tok_dir)
    code, _, err = run_trainer(capsys, "fit", "--config", str(cfg), *make(tmp_path))
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert lines[0].startswith("stacklm-train fit: error: "), lines
    for text in must:
        assert text in lines[0], (text, lines[0])


# --- class: files and formats (what a path holds is not what the command reads) ------------
def _tiktoken_junk(tmp: Path, tok) -> list[str]:
    (tmp / "in.txt").write_text("hello world\n")
    (tmp / "bad.tiktoken").write_text("not base64 at all\nxx yy\n")
    return ["tok-eval", "--tokenizer", str(tok), "--compare", str(tmp / "bad.tiktoken"), "--pattern", "cl100k",
            "--input", str(tmp / "in.txt")]


def _out_is_a_file(tmp: Path, tok) -> list[str]:
    (tmp / "afile").write_text("x")
    return ["train-tokenizer", "--vocab-size", "300", "--max-bytes", "5000", "--out", str(tmp / "afile"), "--no-progress"]


def _wordpiece_as_tokenizer(tmp: Path, tok) -> list[str]:
    wp = tmp / "tokenizer.json"
    wp.write_text(json.dumps({"version": "1.0", "model": {"type": "WordPiece", "vocab": {"[UNK]": 0}, "unk_token": "[UNK]"}}))
    return ["prebuild", "--config", str(write_config(tmp, tok)), "--tokenizer", str(wp), "--out", str(tmp / "o"), "--no-progress"]


def _binary_txt_source(tmp: Path, tok) -> list[str]:
    (tmp / "latin.txt").write_bytes(bytes(range(128, 256)) * 50)  # not UTF-8 at all
    cfg = write_config(tmp, tok, entries=local_entry(tmp / "latin.txt"))
    return ["prebuild", "--config", str(cfg), "--out", str(tmp / "o"), "--no-progress"]


def _binary_bin_to_inspect(tmp: Path, tok) -> list[str]:
    (tmp / "ids.bin").write_bytes(np.arange(500, dtype=np.uint16).tobytes())  # raw ids, not torch.save
    return ["inspect", str(tmp / "ids.bin"), "--tokenizer", str(tok)]


def _text_named_parquet(tmp: Path, tok) -> list[str]:
    (tmp / "a.parquet").write_text('{"text": "a JSON line, not parquet"}\n')  # was: ArrowInvalid traceback from the piece index
    return ["prebuild", "--config", str(write_config(tmp, tok, entries=local_entry(tmp / "a.parquet"))), "--out", str(tmp / "o"),
            "--no-progress"]


def _pickle_as_build_json(tmp: Path, tok) -> list[str]:
    import pickle

    (tmp / "o" / ".prebuild").mkdir(parents=True)  # was: UnicodeDecodeError traceback
    (tmp / "o" / ".prebuild" / "build.json").write_bytes(pickle.dumps({"tokenizer_hash": "x"}))
    return ["prebuild", "--config", str(write_config(tmp, tok)), "--out", str(tmp / "o"), "--no-progress"]


FILE_CASES = {  # was: a traceback, [Errno 17], "missing field 'format'", "empty text", torch's unpickler text
    "malformed .tiktoken with --pattern": (_tiktoken_junk, ["bad.tiktoken:1", "not a tiktoken ranks file"]),
    "--out names a file": (_out_is_a_file, ["afile", "is not a directory", "pass a directory"]),
    "WordPiece tokenizer.json as the tokenizer": (_wordpiece_as_tokenizer, ["Hugging Face tokenizer.json", "'WordPiece'",
                                                                           "train-tokenizer"]),
    "invalid-UTF-8 .txt source": (_binary_txt_source, ["latin.txt", "not UTF-8 text", "convert the files to UTF-8"]),
    "raw .bin given to inspect": (_binary_bin_to_inspect, ["ids.bin", "not a saved batch", "torch.save"]),
    "a text file named .parquet as a source": (_text_named_parquet, ["source 'mine'", "a.parquet", "cannot read", "as parquet"]),
    "a pickle as .prebuild/build.json": (_pickle_as_build_json, ["build.json", "pickled data, which stacklm never loads", "delete"]),
}


@pytest.mark.parametrize("case", sorted(FILE_CASES))
def test_files_of_the_wrong_kind_are_one_line(case, tmp_path, tok_dir, capsys):
    make, must = FILE_CASES[case]
    rc, _, err = run_cli(capsys, *make(tmp_path, tok_dir))
    assert_clean(rc, err, *must)
    assert "Errno" not in err and "Unpickl" not in err and "'format'" not in err


# --- class: types (the library's own arguments) ---------------------------------------------
@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory, tok_dir):
    from stacklm.prebuild import load_config, prebuild

    tmp = tmp_path_factory.mktemp("shards")
    config, _ = load_config(write_config(tmp, tok_dir))
    prebuild(config, tok_dir, tmp / "out", tokens_per_shard=SEQ_LEN * 32, splits=("train",), progress=False)
    return tmp / "out"


@pytest.mark.parametrize("index", [1.5, True, np.float32(2.0), "0", [[0, 1]], [0.5, 1.0], None])
def test_a_wrong_index_type_is_a_typed_error(index, shard_dir):
    """Was: ``ds[1.5]`` returned a 2-D batch (np.asarray(1.5) as a row index)."""
    from stacklm.data.storage.dataset import PackedMemmapDataset
    from stacklm.errors import ArgumentTypeError, StackLMError

    ds = PackedMemmapDataset(shard_dir, "train")
    with pytest.raises(ArgumentTypeError) as info:
        ds[index]
    assert isinstance(info.value, (StackLMError, TypeError)) and "an index is an int, a slice or a 1-D sequence of ints" in str(info.value)
    assert ds[1]["input_ids"].ndim == 1 and ds[np.int64(1)]["input_ids"].ndim == 1
    assert ds[[0, 1]]["input_ids"].shape[0] == 2 and ds[0:3]["input_ids"].shape[0] == 3


@pytest.mark.parametrize("call", ["encode", "encode_ordinary", "encode_batch"])
def test_encode_says_what_it_replaced(call, tokenizer_512):
    """A lone surrogate cannot round-trip (UTF-8 cannot hold it): a warning naming the count,
    or with strict=True a typed error; valid text never warns (was: replaced silently)."""
    import warnings

    from stacklm.errors import LoneSurrogateError, LoneSurrogateWarning

    fn = getattr(tokenizer_512, call)
    run = (lambda text, **kw: fn([text], **kw)[0]) if call == "encode_batch" else fn
    with pytest.warns(LoneSurrogateWarning, match=r"1 lone surrogate\(s\) \(first at character 3"):
        ids = run("ok \ud800 x")
    assert tokenizer_512.decode(ids) == "ok \ufffd x"
    with pytest.raises(LoneSurrogateError, match="strict=True"):
        run("ok \udc00", strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for text in ("plain", "café 😀 \ufffd", "\U0001F600" * 3):
            assert tokenizer_512.decode(run(text)) == text


# --- class: chat structure: tests/inspector/test_inspect_sft.py::test_inspect_and_sft_share_one_validity_rule ---------


def test_a_loader_workers_user_error_is_its_own_line():
    """torch re-raises a worker's error as "Caught X in DataLoader worker process N. Original
    Traceback ..."; the user sees the worker's own message, with the worker named."""
    from torch._utils import ExceptionWrapper

    from stacklm.errors import DataError, user_error_message

    try:
        raise DataError("shards/train/00001/tokens.bin: content hash 1 != manifest 2; run `stacklm verify shards`")
    except DataError:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 1")
    with pytest.raises(DataError) as info:
        wrapped.reraise()
    assert "Original Traceback" in str(info.value)
    assert user_error_message(info.value) == (
        "shards/train/00001/tokens.bin: content hash 1 != manifest 2; run `stacklm verify shards` (in DataLoader worker 1)")


def test_a_refused_argument_is_one_line_without_the_usage_block():
    """``--workers 0``: argparse printed its usage block ahead of the error line."""
    res = subprocess.run([sys.executable, "-m", "stacklm", "prebuild", "--config", "demo", "--workers", "0"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "usage:" not in res.stderr, res.stderr
    assert res.stderr.splitlines() == [
        "stacklm prebuild: error: argument --workers: must be an integer >= 1, got 0 (`stacklm prebuild --help` lists the options)"]


def test_verify_does_not_tell_its_user_to_run_verify(tmp_path):
    from stacklm.data.storage.shards import check_content_hash
    from stacklm.errors import DataError

    entry = {"name": "shard_00000", "xxh64": "garbled"}
    for advise in (True, False):
        try:
            check_content_hash(tmp_path, entry, tmp_path / "manifest.json", advise_verify=advise)
        except DataError as e:
            assert ("stacklm verify" in str(e)) is advise, str(e)
        else:
            raise AssertionError("a garbled hash passed")
