"""The step log of a training run (stacklm.data.storage.steplog) and ``stacklm inspect RUN --step S``
(stacklm.inspector.steps): for every global step, the rows it answers are the rows the model
trained on at that step — checked against fingerprints a callback takes of every batch the
model saw — in stream mode (rebuilt from local jsonl and a parquet file read through
``datasets``, each row's CRC verified) and shards mode, through real Lightning Trainers with
loader workers, and across a checkpoint resume on another world size (real DDP over gloo), where
the newer run's records of the re-trained steps supersede the first run's."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest

from stacklm.cli import main as stacklm_main
from stacklm.datamodule import StackDataModule
from stacklm.data.storage.steplog import MAGIC, StepLogWriter, find_step, frame_records, read_frames
from stacklm.errors import DataError
from stacklm.inspector.steps import step_provenance
from tests.helpers.lightning import row_ids
from tests.helpers.lightning import TinyLM, run_program
from tests.helpers.ledger import SEQ_LEN, data_section, write_corpus

ROOT = Path(__file__).resolve().parents[2]


def window_id(input_ids: list[int]) -> str:
    """``row_ids`` of a logged window: the model sees ``input_ids = window[:-1]`` as int64."""
    return hashlib.sha256(np.asarray(input_ids[:-1], dtype=np.int64).tobytes()).hexdigest()[:16]


def answered(root: Path, step: int) -> dict[int, list[str | None]]:
    """Per rank, the row ids ``inspect --step`` gives for ``step`` (None: padding), in batch order."""
    out: dict[int, list[str | None]] = {}
    for row in step_provenance(root, step)["rows"]:
        out.setdefault(row["rank"], []).append(None if row.get("padding") else window_id(row["input_ids"]))
    return out


# ------------------------------------------------------------------ the format itself
def test_frames_round_trip_and_a_torn_last_frame_is_skipped(tmp_path):
    w = StepLogWriter(tmp_path / "g", 0, meta={"mode": "shards", "world_size": 1}, frame_batches=2)
    w.add_rows(0, 0, np.array([5, 9]), 0)
    w.add_rows(0, 1, np.array([2]), 1)  # a frame of two batches is written here
    w.add_rows(0, 2, np.array([7, 1]), 0)
    w.close()
    frames = list(read_frames(w.path))
    assert [f["step"].tolist() for f in frames] == [[0, 1], [2]]  # no trainer: the writer counts its batches
    assert frames[0]["rows"].tolist() == [5, 9, 2] and frames[0]["n_pad"].tolist() == [0, 1]
    data = w.path.read_bytes()
    assert data.count(MAGIC) == 2 and w.bytes == len(data)
    w.path.write_bytes(data[:-5])  # a run killed while writing its last frame
    assert [f["step"].tolist() for f in read_frames(w.path)] == [[0, 1]]
    # stream mode: a frame of padding batches only (a dry stream) has rows of no pieces
    p = StepLogWriter(tmp_path / "p", 0, frame_batches=1)  # the first frame: padding only
    p.add_pieces(0, 0, [], [], 2)
    p.add_pieces(0, 1, [[(0, 3, 7, 0, 5, 0)], None], [11, 12], 0)
    p.close()
    recs = [r for f in read_frames(p.path) for r in frame_records(f)]
    assert [(r["pieces"], r["crc"], r["n_pad"]) for r in recs] == [([], [], 2), ([[[0, 3, 7, 0, 5, 0]], None], [11, 12], 0)]


def test_the_newest_run_that_logged_a_step_answers(tmp_path):
    """A run logged steps 0..5 and crashed; a resume from step 3 logged 3..4 and crashed; the
    next resume from 3 logged 3..8. Steps 3..8 come from the last run, 0..2 from the first."""
    root = tmp_path / "steplog"
    for gen, steps, row in (("20260101T000000.000000Z-1", range(6), 100), ("20260101T000100.000000Z-2", range(3, 5), 200),
                            ("20260101T000200.000000Z-3", range(3, 9), 300)):
        now = {"step": 0}
        w = StepLogWriter(root / gen, 0, meta={"mode": "shards", "world_size": 1, "start_step": steps[0]},
                          step_of=lambda: now["step"])
        for s in steps:
            now["step"] = s
            w.add_rows(0, s, np.array([row + s]), 0)
        w.close()
    for s in range(9):
        gen, _, records = find_step(tmp_path, s)  # the run directory holding steplog/ is accepted too
        assert [r["rows"] for r in records] == [[(100 if s < 3 else 300) + s]], s
    with pytest.raises(DataError, match=r"step 9 belongs to run 20260101T000200.000000Z-3 .* logged steps 3\.\.8"):
        find_step(root, 9)
    # one run's folder answers from that run alone, even where a later run superseded it
    assert [r["rows"] for r in find_step(root / "20260101T000000.000000Z-1", 4)[2]] == [[104]]
    with pytest.raises(DataError, match=r"this run did not log global step 7 \(it logged steps 0\.\.5\)"):
        find_step(root / "20260101T000000.000000Z-1", 7)
    # the run resumed at step 3 stopped at 4 and nothing resumed it: step 5 was trained by the
    # first run only, which that resume superseded
    (root / "20260101T000200.000000Z-3" / "meta.json").unlink()
    with pytest.raises(DataError, match=r"step 5 belongs to run 20260101T000100.000000Z-2 .* 3\.\.4 .*"
                                           r"20260101T000000.000000Z-1 trained it before being superseded"):
        find_step(root, 5)


def test_a_damaged_log_is_an_error_that_names_the_file(tmp_path):
    root = tmp_path / "steplog"
    w = StepLogWriter(root / "g1", 0, meta={"mode": "shards", "world_size": 1, "start_step": 0})
    w.add_rows(0, 0, np.array([3]), 0)
    w.close()
    w.path.write_bytes(b"\x00garbage" * 40)
    with pytest.raises(DataError, match=r"rank-00000.frames: not a step-log frame at byte 0"):
        find_step(root, 0)
    w.path.unlink()
    (root / "g1" / "meta.json").write_text("junk")
    with pytest.raises(DataError, match=r"g1/meta.json: unreadable"):
        find_step(root, 0)


# ------------------------------------------------------------------ sft and preference modes (issue 36)
class SeenMarkers(L.Callback):
    """Per global step, the markers (``[[c17]]``: conversation / pair 17 of the file) each row of
    the batches the model trained on holds, read off the batch's own tokens: the independent
    record ``inspect --step`` is checked against."""

    def __init__(self, tokenizer, key: str) -> None:
        self.tok, self.key, self.steps = tokenizer, key, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        import re

        rows = self.steps.setdefault(trainer.global_step, [])
        for row in batch[self.key]:
            ids = [int(t) for t in row if int(t) != self.tok.pad_id]
            rows.append(sorted(int(m) for m in re.findall(r"\[\[c(\d+)\]\]", self.tok.decode(ids))))


def _conversation_fit(tok, tok_dir, root: Path, mode: str):
    """A tiny fit of ``mode`` (one loader worker) over one jsonl whose record ``i`` (line ``i``)
    carries the marker ``[[c<i>]]``; returns the markers seen per step."""
    from tests.helpers.lightning import TinyDPO
    from tests.helpers.sft import make_conversations, write_jsonl

    convs = make_conversations(48, seed=3)
    if mode == "sft":
        rows = [{"messages": [{"role": "user", "content": f"[[c{i}]] " + c[-2]["content"][:80]},
                              {"role": "assistant", "content": c[-1]["content"][:80]}]} for i, c in enumerate(convs)]
    else:
        rows = [{"prompt": f"[[c{i}]] " + c[-2]["content"][:60], "chosen": c[-1]["content"][:60],
                 "rejected": convs[(i + 1) % len(convs)][-1]["content"][:60]} for i, c in enumerate(convs)]
    path = write_jsonl(root / "chats.jsonl", rows)
    seen = SeenMarkers(tok, "input_ids" if mode == "sft" else "chosen_input_ids")
    dm = StackDataModule(mode=mode, tokenizer=str(tok_dir), seq_len=128, batch_size=3, num_workers=1, val_batches=0,
                         pipeline={"sources": [{"name": "chats", "kind": "local", "path": [str(path)]}], "shuffle_buffer": 8,
                                   "pack_buffer_docs": 4, "holdout_fraction": 0.0})
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=6, max_epochs=1, callbacks=[seen], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=str(root / "run"))
    trainer.fit((TinyLM if mode == "sft" else TinyDPO)(dm.vocab_size), datamodule=dm)
    return seen.steps


@pytest.mark.parametrize("mode", ["sft", "preference"])
def test_sft_and_preference_steps_name_the_conversations_they_trained_on(mode, tokenizer_512, saved_tokenizer_dir, tmp_path,
                                                                          capsys):
    seen = _conversation_fit(tokenizer_512, saved_tokenizer_dir(tokenizer_512), tmp_path, mode)
    assert sorted(seen) == list(range(6))
    for step, markers in seen.items():
        out = step_provenance(tmp_path / "run", step)
        assert out["mode"] == mode and len(out["rows"]) == len(markers) == 3
        for row, marked in zip(out["rows"], markers):
            assert row["verified"], (step, row)  # each named record read back and rendered: the logged CRC
            named = sorted(seg["record"] for seg in row["segments"])  # record i of chats.jsonl holds [[c<i>]]
            assert named == marked and all(seg["source"] == "chats" and seg["file"].endswith("chats.jsonl")
                                           for seg in row["segments"]), (step, row["segments"], marked)
            if mode == "preference":
                assert len(named) == 1  # one pair a row
    named_total = sum(len(r) for m in seen.values() for r in m)
    assert named_total == 18 if mode == "preference" else named_total > 18  # sft rows pack several conversations
    step = max(seen)
    assert stacklm_main(["inspect", str(tmp_path / "run"), "--step", str(step)]) == 0
    text = capsys.readouterr().out
    assert f"step {step} ({mode} mode" in text and "3 of 3 rebuilt from the source files and verified" in text
    for m in seen[step][0]:
        assert f"chats.jsonl  record {m} " in text and f"[[c{m}]]" in text  # named, and its text decoded


# ------------------------------------------------------------------ stream mode, in-process Trainer
class SeenBatches(L.Callback):
    """Per global step, the row ids of every batch the model trained on (this rank)."""

    def __init__(self) -> None:
        self.steps: dict[int, list[str | None]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.steps.setdefault(trainer.global_step, []).extend(row_ids(batch))


def file_pipeline(root: Path, total: int = 20_000) -> dict:
    """The ledger corpus (planted duplicates, malformed and null lines, too-short documents):
    ``web`` two local jsonl files, ``books`` its parquet file read through ``datasets``."""
    section = data_section(root, total=total)
    section["mix"]["entries"][1] = {"name": "books", "kind": "hf", "path": "parquet", "weight": 0.4, "domain": "prose",
                                    "data_files": [str(root / "books" / "c.parquet")]}
    return {k: v for k, v in section.items() if k not in ("seq_len", "batch_size")}


@pytest.fixture(scope="module")
def stream_run(tokenizer_dir, tmp_path_factory):  # noqa: F811
    """A stream-mode fit with one loader worker and gradient accumulation 2."""
    base = tmp_path_factory.mktemp("stream_run")
    write_corpus(base / "corpus")
    seen = SeenBatches()
    dm = StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=file_pipeline(base / "corpus"), seq_len=SEQ_LEN,
                         batch_size=4, num_workers=1, val_batches=0)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2, callbacks=[seen], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        num_sanity_val_steps=0, default_root_dir=str(base / "run"))
    trainer.fit(TinyLM(dm.vocab_size), datamodule=dm)
    return base, seen.steps


def test_stream_steps_are_the_rows_the_model_saw_rebuilt_from_the_files(stream_run, tokenizer_512):
    base, seen = stream_run
    root = base / "run" / "steplog"
    assert len(seen) >= 10 and all(len(ids) == 8 for ids in seen.values())  # 2 batches of 4 per step (accumulation)
    corpus = write_corpus(base / "again")  # the records, as the test wrote them
    text_of = {(src, f, r): v for src, rows in corpus.items() for f, r, v in rows}
    for step, ids in seen.items():
        out = step_provenance(base / "run", step)
        assert out["mode"] == "stream" and out["accumulate_grad_batches"] == 2
        assert [window_id(r["input_ids"]) for r in out["rows"]] == ids, step
        assert [r["batch"] for r in out["rows"]] == [2 * step] * 4 + [2 * step + 1] * 4
        for row in out["rows"]:
            assert row["verified"], (step, row)
            end = 0
            for seg in row["segments"]:  # each piece is its record's tokens at its offset
                assert seg["row_start"] == end
                end = seg["row_end"]
                if seg["source"] == "books":  # read through datasets: the stream's shard, named with its file
                    assert seg["file"] == "shard00000 (c.parquet)"
                label = seg["file"] if seg["source"] == "web" else "c.parquet"
                wrapped = [tokenizer_512.bos_id, *tokenizer_512.encode(text_of[(seg["source"], label, seg["record"])]),
                           tokenizer_512.eos_id]
                piece = row["input_ids"][seg["row_start"] : seg["row_end"]]
                n = seg["row_end"] - seg["row_start"]
                assert piece[:-1] == wrapped[seg["doc_offset"] : seg["doc_offset"] + n - 1]
            assert all(t == tokenizer_512.pad_id for t in row["input_ids"][end:])
    assert len(list(root.iterdir())) == 1  # one generation: one fit


def test_inspect_step_cli(stream_run, capsys, tmp_path):
    base, seen = stream_run
    step = sorted(seen)[3]
    assert stacklm_main(["inspect", str(base / "run"), "--step", str(step), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == json.loads(json.dumps(step_provenance(base / "run", step)))
    assert stacklm_main(["inspect", str(base / "run" / "steplog"), "--step", str(step)]) == 0
    text = capsys.readouterr().out
    assert f"step {step} (stream mode" in text and "8 rows, 0 padding rows; 8 of 8 rebuilt from the source files" in text
    assert "record" in text and "\n      '" in text  # each piece's text, decoded with the run's own tokenizer
    assert stacklm_main(["inspect", str(base / "run"), "--step", "99999"]) == 2
    assert "global step 99999 belongs to run" in capsys.readouterr().err
    assert stacklm_main(["inspect", str(tmp_path), "--step", "0"]) == 2
    assert "no step log here" in capsys.readouterr().err


def test_a_source_changed_since_the_run_is_not_verified(stream_run, tmp_path, capsys):
    import shutil

    base, seen = stream_run
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    meta_path = next((copy / "run" / "steplog").glob("*/meta.json"))
    meta = json.loads(meta_path.read_text())
    text = json.dumps(meta).replace(str(base / "corpus"), str(copy / "corpus"))
    meta_path.write_text(text)
    a = copy / "corpus" / "web" / "a.jsonl"
    lines = []
    for line in a.read_bytes().split(b"\n"):  # every text of a.jsonl reversed; malformed and blank lines kept
        try:
            rec = json.loads(line)
        except ValueError:
            lines.append(line)
            continue
        if isinstance(rec.get("text"), str):
            rec["text"] = rec["text"][::-1]
        lines.append(json.dumps(rec).encode())
    a.write_bytes(b"\n".join(lines))
    outs = [step_provenance(copy / "run", s) for s in sorted(seen)]
    rows = [r for o in outs for r in o["rows"]]
    # a piece of 3 tokens or more holds text (a shorter one may be only its document's <bos>/<eos>)
    touched = [r for r in rows if any(s["file"] == "a.jsonl" and s["row_end"] - s["row_start"] >= 3 for s in r["segments"])]
    assert touched and not any(r["verified"] for r in touched)
    assert all(r["verified"] for r in rows if not any(s["file"] == "a.jsonl" for s in r["segments"]))
    step = next(o["step"] for o in outs if any(r in touched for r in o["rows"]))
    assert stacklm_main(["inspect", str(copy / "run"), "--step", str(step)]) == 1
    assert "NOT VERIFIED" in capsys.readouterr().out
    assert stacklm_main(["inspect", str(copy / "run"), "--step", str(step), "--json"]) == 1  # scripts see it too
    assert json.loads(capsys.readouterr().out)["step"] == step


# ------------------------------------------------------------------ resume on another world size, real gloo DDP
def _fit(script: str, args: list[str], out: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    res = run_program([sys.executable, str(ROOT / "tests" / "runners" / script), *args, "--out", str(out)], cwd=ROOT, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


def _seen(out: Path, ranks: int, shards: bool) -> dict[int, dict[int, list]]:
    """step -> rank -> row ids the model saw (every batch of that step on that rank)."""
    steps: dict[int, dict[int, list]] = {}
    for rank in range(ranks):
        for rec in json.loads((out / f"rank{rank}.json").read_text()):
            step, ids = (rec[2], rec[3]) if shards else (rec[1], rec[2])
            steps.setdefault(step, {}).setdefault(rank, []).extend(ids)
    return steps


@pytest.mark.slow
def test_shards_steps_across_a_resume_from_two_ranks_to_three(tokenizer_dir, small_shards_dir, tmp_path):  # noqa: F811
    log = tmp_path / "steplog"
    common = ["--tokenizer", str(tokenizer_dir), "--data-dir", str(small_shards_dir), "--step-log", str(log), "--epochs", "1"]
    _fit("elastic_fit.py", [*common, "--devices", "2", "--workers", "2", "--save-at", "5"], tmp_path / "a")
    _fit("elastic_fit.py", [*common, "--devices", "3", "--workers", "1", "--resume", str(tmp_path / "a" / "step5.ckpt")],
         tmp_path / "b")
    first, second = _seen(tmp_path / "a", 2, True), _seen(tmp_path / "b", 3, True)
    assert min(second) == 5 and max(first) > 5  # the first run went on past its checkpoint: superseded there
    checked = 0
    for step in sorted(set(first) | set(second)):
        if step > max(second):  # trained by the first run only, after the checkpoint the resume continued from
            with pytest.raises(DataError, match="superseded"):
                step_provenance(log, step)
            continue
        want = second[step] if step >= 5 else first[step]
        assert answered(log, step) == want, step
        checked += sum(len(v) for v in want.values())
    out = step_provenance(log, 7)
    assert out["world_size"] == 3 and {r["rank"] for r in out["rows"]} == {0, 1, 2}
    assert all("row" in r and r["segments"] for r in out["rows"] if not r.get("padding"))
    assert checked >= 2 * 4 * 5 + 3 * 4 * 3


@pytest.mark.slow
def test_stream_steps_across_a_resume_from_two_ranks_to_one(tokenizer_dir, tmp_path):  # noqa: F811
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    (tmp_path / "pipeline.json").write_text(json.dumps(file_pipeline(corpus, total=6_000)))
    log = tmp_path / "steplog"
    common = ["--tokenizer", str(tokenizer_dir), "--pipeline", str(tmp_path / "pipeline.json"), "--step-log", str(log),
              "--epochs", "1", "--logical-streams", "4"]
    _fit("elastic_stream_fit.py", [*common, "--devices", "2", "--workers", "1", "--save-at", "4"], tmp_path / "a")
    _fit("elastic_stream_fit.py", [*common, "--devices", "1", "--workers", "2", "--batch-size", "4", "--resume",
                                   str(tmp_path / "a" / "step4.ckpt")], tmp_path / "b")
    first, second = _seen(tmp_path / "a", 2, False), _seen(tmp_path / "b", 1, False)
    assert max(first) == 3 and min(second) == 4  # the first run stopped at its checkpoint (after step 3)
    for step in sorted(set(first) | set(second)):
        want = second.get(step) or first[step]
        got = answered(log, step)
        assert got == want, step
        assert all(r["verified"] for r in step_provenance(log, step)["rows"] if not r.get("padding"))


@pytest.mark.parametrize("strategy", ["best_fit", "greedy"])
def test_a_stream_state_saved_without_pieces_resumes_with_them_marked_unknown(strategy, tmp_path):
    """A checkpoint written before stream packers kept pieces still resumes (the same windows);
    the pieces it did not keep are logged as unknown, never as wrong numbers, and every window
    packed after the resume has its pieces again."""
    from torchdata.nodes import IterableWrapper

    from stacklm.data.packing.nodes import PackBatchNode, PackNode

    bos, eos, pad = 1024, 1025, 1026
    rng = np.random.default_rng(5)
    docs = [{"ids": rng.integers(0, 1024, size=int(rng.integers(5, 70))).astype(np.int32), "source": "a", "file": 0,
             "record": i} for i in range(80)]

    def batches(provenance: bool):
        return PackBatchNode(PackNode(IterableWrapper(docs), 48, strategy, bos, eos, pad, 6, sources=["a"],
                                      provenance=provenance), 2)

    old = batches(False)
    old.reset()
    for _ in range(3):
        next(old)
    state = old.state_dict()
    reference = [b["input_ids"] for b in old]
    new = batches(True)
    new.reset(state)
    w = StepLogWriter(tmp_path / "g", 0)
    got = []
    for i, batch in enumerate(new):
        got.append(batch["input_ids"])
        d = batch["stacklm_delivery"]
        w.add_pieces(0, i, d["pieces"], d["crc"], 0)
    w.close()
    assert len(got) == len(reference) and all(bool((a == b).all()) for a, b in zip(got, reference))  # the same windows
    rows = [p for f in read_frames(w.path) for rec in frame_records(f)
            for p in rec["pieces"]]
    unknown = [r for r in rows if r is None or any(None in p[1:3] for p in r)]
    assert unknown and rows[-1] is not None and None not in rows[-1][0]  # later windows are known again
    for r in rows:
        if r is not None and all(None not in p for p in r):
            assert all(p[0] == 0 and 0 <= p[2] < len(docs) for p in r)
