"""One line per event per run: an invalid record read by every split (and by the global dedup
pass), an offline fallback opened by every loader worker, a source that ran dry reported by the
loader and the callback -- each says so once, while the counts stay in the stats."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BAD_LINES = ("line 4: not valid JSON", "line 11: no field 'text'", "line 21: column 'text' is null")


@pytest.fixture(scope="module")
def tok_dir(tokenizer_512, saved_tokenizer_dir):
    return saved_tokenizer_dir(tokenizer_512)


def mixed_jsonl(path: Path) -> Path:
    lines = [json.dumps({"text": f"document number {i} says something different about topic {i * 7}"}) for i in range(300)]
    lines[3], lines[10], lines[20] = "not json", json.dumps({"body": "x"}), json.dumps({"text": None})
    path.write_text("\n".join(lines) + "\n")
    return path


def pipeline(tmp_path: Path, total: int, extra: list[dict] = ()) -> dict:
    return {
        "seq_len": 32, "batch_size": 2, "shuffle_buffer": 16, "pack_buffer_docs": 8, "holdout_fraction": 0.05,
        "tokenize_batch_docs": 8, "num_threads": 1,
        "mix": {"name": "t", "total_tokens": total, "entries": [
            {"name": "mixed", "kind": "local", "weight": 0.5, "domain": "prose", "path": str(mixed_jsonl(tmp_path / "mixed.jsonl"))},
            {"name": "syn", "kind": "synthetic", "weight": 0.5, "domain": "code", "seed": 1, "num_docs": 800}, *extra]},
    }


def run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    env.pop("STACKLM_DEBUG", None)
    return subprocess.run([sys.executable, "-m", *argv], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)


def fit(tmp_path: Path, data: dict, seq_len: int, max_steps: int) -> subprocess.CompletedProcess:
    """``python -m trainer fit`` on ``data`` with a one-layer model, two val batches, no logger;
    it must exit 0."""
    doc = {
        "data": data,
        "model": {"config": {"vocab_size": 512, "seq_len": seq_len, "n_layer": 1, "n_head": 2, "d_model": 32}},
        "trainer": {"accelerator": "cpu", "max_steps": max_steps, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "limit_val_batches": 2},
    }
    cfg = tmp_path / "train.yaml"
    cfg.write_text(json.dumps(doc))
    res = run(tmp_path, "trainer", "fit", "--config", str(cfg))
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_prebuild_logs_each_invalid_record_once(tmp_path, tok_dir):
    """The global dedup pass, the train job and the val job all read the bad lines: one line each
    on stderr (it was four), and the manifest still counts each of them."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"data": {"tokenizer": str(tok_dir), "pipeline": pipeline(tmp_path, 4000)}}))
    res = run(tmp_path, "stacklm.cli", "prebuild", "--config", str(cfg), "--out", str(tmp_path / "out"), "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    for text in BAD_LINES:
        assert res.stderr.count(text) == 1, (text, res.stderr[-4000:])
    counts = json.loads((tmp_path / "out" / "train" / "manifest.json").read_text())
    text = json.dumps(counts)
    for reason in ("malformed_json", "missing_text", "null_text"):
        assert f'"{reason}": 1' in text, (reason, text[:3000])


@pytest.mark.slow
def test_fit_says_each_event_once(tmp_path, tok_dir):
    """``python -m trainer fit`` with two loader workers, a train and a val loader: the bad lines,
    the offline fallback and the dry source each appear once on stderr."""
    hub = {"name": "hub", "kind": "hf", "weight": 0.2, "domain": "prose", "path": "nobody/nothing"}
    pipe = {**pipeline(tmp_path, 6000, [hub]), "fallback_offline": True}
    pipe["mix"]["entries"][0]["weight"] = 0.4
    pipe["mix"]["entries"][1]["weight"] = 0.4
    res = fit(tmp_path, {"mode": "stream", "tokenizer": str(tok_dir), "seq_len": 32, "batch_size": 2, "num_workers": 2,
                         "pipeline": pipe}, seq_len=32, max_steps=20)
    for text in (*BAD_LINES, "OFFLINE FALLBACK: source 'hub'"):
        assert res.stderr.count(text) == 1, (text, res.stderr[-4000:])
    for stream in ("train", "val"):  # each stream's loader says it for its own batches, once
        assert res.stderr.count(f"source 'mixed' ran dry in the {stream} stream") <= 1, res.stderr[-4000:]


def test_a_val_split_that_reads_its_holdout_to_the_end_says_so_once_as_information(tmp_path, tok_dir, capfd, recwarn):
    """Issue 36: every validation of a small holdout "ran dry" with a warning and advice meant
    for training (more data, a lower weight or budget), once per pass and source and logical
    stream. A val split reading its holdout to the end is expected: one line, information, for
    the whole fit; the train stream keeps its warnings. Two loader workers (their own processes:
    what they print reaches the captured stderr too), three validations (the sanity check's too)."""
    import lightning as L

    from stacklm.datamodule import StackDataModule
    from tests.helpers.lightning import TinyLM

    pipe = pipeline(tmp_path, 20_000)  # val budget 1,000 tokens; the holdout (5 % of 300 + 800 documents) holds less
    dm = StackDataModule(mode="stream", tokenizer=str(tok_dir), pipeline=pipe, seq_len=32, batch_size=2, num_workers=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=4, val_check_interval=2, check_val_every_n_epoch=None, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path / "run"))
    trainer.fit(TinyLM(512), datamodule=dm)
    err = capfd.readouterr().err
    assert err.count("stacklm: validation read the holdout of source") == 1, err
    assert "Information only" in err and "val stream" not in err, err  # no worker's "ran dry" padding warning either
    said = [str(w.message) for w in recwarn if "ran dry" in str(w.message)]
    assert not [w for w in said if "val" in w], said  # no warning with training advice for the val split


@pytest.mark.parametrize("mode", ["sft", "preference"])
def test_sft_and_preference_rejections_are_logged_once(mode, tmp_path, tokenizer_1024, caplog):
    """A train and a val pipeline over the same file (what a fit builds): each reader counts the
    malformed line, one log line says it."""
    from stacklm.data.sources.schema import SourceConfig
    from stacklm.data.sft import SFTConfig, build_sft_pipeline
    from stacklm.data.sft.preference_pipeline import build_preference_pipeline

    if mode == "sft":
        good = [{"messages": [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]}
                for i in range(40)]
        build = build_sft_pipeline
    else:
        good = [{"prompt": f"question {i}?", "chosen": f"good answer {i}.", "rejected": f"bad answer {i}."} for i in range(40)]
        build = build_preference_pipeline
    lines = [json.dumps(r) for r in good]
    lines[5] = "{not json"
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    cfg = SFTConfig(sources=(SourceConfig("chats", path=(str(path),)),), seq_len=64, batch_size=2, shuffle_buffer=1,
                    pack_buffer_docs=8, holdout_fraction=0.2)
    seen = {}
    with caplog.at_level("WARNING"):
        for split in ("val", "train"):  # a fit's sanity check reads val first
            pipe = build(cfg, tokenizer_1024, split)
            pipe.batches.reset()
            list(pipe.batches)
            seen[split] = pipe.stats()["source"]["chats"]["malformed_json"]
    assert seen == {"val": 1, "train": 1}  # counted by both readers
    said = [r.getMessage() for r in caplog.records if "malformed_json" in r.getMessage()]
    assert len([m for m in said if "dropping" in m]) == 1, said  # where the first one was, as soon as it is seen
    # and the count, once, when the train reader's pass ends (the val reader's is the same rows)
    assert [m for m in said if "dropped" in m] == [f"{mode} source 'chats': dropped 1 of 40 conversations in this "
                                                   "reader's pass (malformed_json 1)"], said



@pytest.mark.slow
def test_sft_fit_says_each_drop_once_across_loader_workers(tmp_path, tok_dir):
    """``trainer fit`` in SFT mode with two loader workers: the counting pass (main process) reads
    every record and says each drop reason once, with one count line for all it read; the
    data gate and the two workers read the same records quietly (each reason was said three times)."""
    good = [json.dumps({"messages": [{"role": "user", "content": f"question {i} about topic {i * 7}?"},
                                     {"role": "assistant", "content": f"answer {i}: it depends on {i * 3}."}]}) for i in range(120)]
    bad = ["{not json", json.dumps({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
           json.dumps({"messages": [{"role": "user", "content": "only a question"}]})]
    lines = list(good)
    for k in range(9):  # three of each reason, spread over the file (so over both workers' rows)
        lines.insert(7 + k * 14, bad[k % 3])
    (tmp_path / "chats.jsonl").write_text("\n".join(lines) + "\n")
    res = fit(tmp_path, {"mode": "sft", "tokenizer": str(tok_dir), "seq_len": 64, "batch_size": 2, "num_workers": 2,
                         "pipeline": {"shuffle_buffer": 8, "pack_buffer_docs": 8, "holdout_fraction": 0.1,
                                      "sources": [{"name": "chats", "kind": "local", "path": [str(tmp_path / "chats.jsonl")]}]}},
              seq_len=64, max_steps=6)
    for reason in ("malformed_json", "no_assistant", "unknown_role"):
        assert res.stderr.count(f"sft source 'chats': dropping conversations ({reason})") == 1, (reason, res.stderr[-4000:])
    counts = [line for line in res.stderr.splitlines() if "sft source 'chats': dropped" in line]
    # of every record read: a record is checked before the holdout gives it a split (10% val here)
    assert counts == ["sft source 'chats': dropped 9 of the 129 conversations read, before the train/val holdout "
                      "(malformed_json 3, no_assistant 3, unknown_role 3)"], res.stderr[-4000:]
