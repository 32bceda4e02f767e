"""User stages (``pipeline.stages``, ``stacklm.data.quality.user_stages``): a filter function of
one's own, a map, and two of datatrove's filters as they are (``GopherRepetitionFilter`` on one
source, ``FineWebQualityFilter`` on both), run on ~200 documents of real text in each surface
-- a stream fit with a loader worker (logs, ``stacklm report``), ``stacklm prebuild`` (its
global dedup pass reads the stages too) and datatrove's local executor (tasks in their own
processes) -- with every drop count checked against a count this test makes by calling the
same functions and datatrove filters on the input files itself, and the ledger adding up.
Then: what a stage returns; a stateful stage resumes exactly through a weights-only
checkpoint; a stage that raises ends the run in one line naming the document; a stage that
cannot reach a worker (or fails to import, or takes other arguments) is refused before any work
in one line, by the commands that run the stages only; the stage set is part of the config hash,
and a stream resume's refusal names the changed field."""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from pathlib import Path

import lightning as L
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from lightning.pytorch.loggers import CSVLogger

from stacklm.callbacks import DATA_STATS_FILE, DataStatsCallback
from stacklm.cli import main as stacklm_main
from stacklm.data import ledger
from stacklm.data.pipeline import PipelineConfig
from stacklm.data.quality.filters import FilterConfig, filter_reason
from stacklm.datamodule import StackDataModule
from stacklm.errors import ConfigError
from tests.helpers import user_stages as us
from tests.helpers.lightning import TinyLM

SEQ_LEN, BATCH = 64, 4
STAGES = [
    {"fn": "tests.helpers.user_stages:drop_marked", "kwargs": {"marker": us.MARKER}},
    {"fn": "datatrove.pipeline.filters:GopherRepetitionFilter", "sources": ["web"]},
    {"fn": "datatrove.pipeline.filters.fineweb_quality_filter.FineWebQualityFilter", "name": "fineweb",
     "kwargs": {"line_punct_thr": 0.12}},
    {"fn": "tests.helpers.user_stages:redact_digits"},
]


@pytest.fixture(autouse=True)
def strict_ledger(monkeypatch):
    monkeypatch.setenv(ledger.STRICT_ENV, "1")


@pytest.fixture(scope="module")
def corpus(real_docs, tmp_path_factory) -> tuple[Path, dict[str, list[str]]]:
    """``web``: two JSON-lines files; ``notes``: a parquet file; real text in pieces of 1,000
    characters, a few of them marked for ``drop_marked``. Returns the folder and each source's texts."""
    chunks = [p for d in real_docs for p in (d[i:i + 1000] for i in range(0, len(d), 1000)) if len(p.strip()) >= 200][:200]
    chunks = [c + f"\n{us.MARKER}" if i % 23 == 4 else c for i, c in enumerate(chunks)]
    root = tmp_path_factory.mktemp("stages")
    (root / "web").mkdir()
    for name, part in (("a.jsonl", chunks[:70]), ("b.jsonl", chunks[70:130])):
        (root / "web" / name).write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    (root / "notes").mkdir()
    pq.write_table(pa.table({"text": chunks[130:]}), root / "notes" / "c.parquet", row_group_size=32)
    return root, {"web": chunks[:130], "notes": chunks[130:]}


def pipeline(root: Path, total: int = 10**6, stages=STAGES, **kw) -> dict:
    return {"seq_len": SEQ_LEN, "batch_size": BATCH, "shuffle_buffer": 16, "pack_buffer_docs": 8, "holdout_fraction": 0.0,
            "tokenize_batch_docs": 16, "num_threads": 1, "stages": stages,
            "mix": {"name": "s", "total_tokens": total, "entries": [
                {"name": "web", "kind": "local", "path": str(root / "web" / "*.jsonl"), "weight": 0.6, "domain": "prose"},
                {"name": "notes", "kind": "local", "path": str(root / "notes" / "*.parquet"), "weight": 0.4, "domain": "prose"}]},
            **kw}


@pytest.fixture(scope="module")
def expected(corpus) -> dict:
    """The drops by stage -> source -> reason, counted here: the built-in filter's rule
    function, then the user's functions and datatrove's filters called on each text in order."""
    from datatrove.data import Document
    from datatrove.pipeline.filters import FineWebQualityFilter, GopherRepetitionFilter

    _, texts = corpus
    gopher, fineweb = GopherRepetitionFilter(), FineWebQualityFilter(line_punct_thr=0.12)
    out: dict[str, dict[str, Counter]] = {}
    kept: dict[str, list[str]] = {}

    def drop(stage: str, src: str, reason) -> None:
        out.setdefault(stage, {}).setdefault(src, Counter())[reason] += 1

    for src, docs in texts.items():
        for t in docs:
            if (r := filter_reason({"text": t}, FilterConfig(), "prose")) is not None:
                drop("filter", src, r)
            elif (r := us.drop_marked({"text": t}, us.MARKER)) is not True:
                drop("drop_marked", src, r)
            elif src == "web" and (r := gopher.filter(Document(text=t, id="x"))) is not True:
                drop("gopher_repetition_filter", src, r[1])
            elif (r := fineweb.filter(Document(text=t, id="x"))) is not True:
                drop("fineweb", src, r[1])
            else:
                kept.setdefault(src, []).append(us.redact_digits({"text": t})["text"])
    counts = {stage: {src: dict(c) for src, c in per.items()} for stage, per in out.items()}
    for stage in ("drop_marked", "gopher_repetition_filter", "fineweb"):  # every stage drops something here
        assert sum(sum(c.values()) for c in counts[stage].values()) > 0, stage
    assert set(counts["gopher_repetition_filter"]) == {"web"}  # its sources: [web]
    return {"drops": counts, "kept": kept}


def user_drops(by_stage: dict) -> dict:
    return {stage: {src: dict(c) for src, c in per.items()} for stage, per in by_stage.items()
            if stage in ("filter", "drop_marked", "gopher_repetition_filter", "fineweb")}


def ledger_drops(sources: dict) -> dict:
    """stage -> source -> reason of a ledger's dropped documents (filter and user stages)."""
    return user_drops(ledger.data_log_drops(sources)["dropped_docs"])


# ---------------------------------------------------------------------------------------
# Surface 1: a stream fit (a loader worker), its logs and its report


@pytest.fixture(scope="module")
def stream_run(corpus, expected, tokenizer_dir, tmp_path_factory):
    root, _ = corpus
    tok_total = 24_000  # above what the kept documents hold: every document is read, then padding rows
    run = tmp_path_factory.mktemp("stream_run")
    dm = StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=pipeline(root, total=tok_total),
                         seq_len=SEQ_LEN, batch_size=BATCH, num_workers=1, val_batches=0, step_log=False)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=CSVLogger(run, name="csv"), log_every_n_steps=20,
                        callbacks=[DataStatsCallback(log_every_n_steps=20)], enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, default_root_dir=run, num_sanity_val_steps=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # both sources run dry before the budget: on purpose
        trainer.fit(TinyLM(dm.vocab_size), datamodule=dm)
    kept_tokens = sum(len(dm.tokenizer.encode(t)) for texts in expected["kept"].values() for t in texts)
    assert kept_tokens < tok_total
    return run, dm.data_stats(), json.loads(sorted(run.rglob(DATA_STATS_FILE))[-1].read_text())


def test_stream_fit_counts_each_stage_as_the_test_does(stream_run, expected):
    run, stats, snapshot = stream_run
    assert user_drops(stats["dropped_docs"]) == expected["drops"]
    assert user_drops(snapshot["dropped_docs"]) == expected["drops"]  # what the logs hold
    assert stats["ledger"]["ok"], stats["ledger"]["problems"]
    assert ledger_drops(stats["ledger"]["sources"]) == expected["drops"]
    # dedup read what the stages kept: the documents delivered + its removals = the documents they kept
    dedup = stats["dropped_docs"].get("dedup", {})
    assert {s: r["docs"] + sum(dedup.get(s, {}).values()) for s, r in stats["realized"].items()} == \
        {s: len(t) for s, t in expected["kept"].items()}
    rows = [r for p in run.rglob("metrics.csv") for r in p.read_text().splitlines()[:1]]
    assert any("data/dropped_docs/fineweb/notes/" in r for r in rows) and any("data/dropped_docs/drop_marked/web/marked" in r for r in rows)
    assert stacklm_main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    for stage, per in expected["drops"].items():
        for src, reasons in per.items():
            for reason in reasons:
                assert f"data/dropped_docs/{stage}/{src}/{reason}" in page, (stage, src, reason)


# ---------------------------------------------------------------------------------------
# Surface 2: `stacklm prebuild` (its jobs and its global dedup pass)


@pytest.fixture(scope="module")
def prebuilt(corpus, tokenizer_dir, tmp_path_factory):
    root, _ = corpus
    work = tmp_path_factory.mktemp("prebuilt")
    (work / "c.yaml").write_text(json.dumps({"data": {"tokenizer": str(tokenizer_dir), "pipeline": pipeline(root)}}))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the budget is bigger than the corpus on purpose
        assert stacklm_main(["prebuild", "--config", str(work / "c.yaml"), "--out", str(work / "out"), "--workers", "1", "--sign-margin", "0",
                             "--no-progress"]) == 0
    return work


def test_stacklm_prebuild_counts_each_stage_as_the_test_does(prebuilt, expected, capsys):
    top = json.loads((prebuilt / "out" / "manifest.json").read_text())
    train = top["ledger"]["train"]
    assert train["ok"], train["problems"]
    assert ledger_drops(train["sources"]) == expected["drops"]
    for src, reasons in expected["drops"]["fineweb"].items():  # the drop summary, keyed as the ledger keys them
        assert {k: n for k, n in top["drops"]["train"][src].items() if k.startswith("fineweb/")} == \
            {f"fineweb/{r}": n for r, n in reasons.items()}
    # dedup (the global pass here) read what the stages kept: delivered + its removals = the documents they kept
    dedup = {s: sum(n for k, n in row["docs"]["dropped"].items() if k.startswith("dedup/")) for s, row in train["sources"].items()}
    assert {s["name"]: s["docs"] + dedup[s["name"]] for s in top["sources"]} == {s: len(t) for s, t in expected["kept"].items()}
    capsys.readouterr()
    assert stacklm_main(["ledger", str(prebuilt / "out")]) == 0
    printed = capsys.readouterr().out
    assert "dropped gopher_repetition_filter/" in printed and "dropped drop_marked/marked" in printed


def test_a_changed_stage_set_is_another_config(prebuilt, corpus, tokenizer_dir, capsys):
    """The stage set is in ``config_hash``: a prebuild with another stage's arguments refuses the
    output folder, in one line; without stages the hash is what it was before ``stages`` existed."""
    root, _ = corpus
    base = PipelineConfig.from_dict(pipeline(root))
    other = [dict(s) for s in STAGES]
    other[2] = {**other[2], "kwargs": {"line_punct_thr": 0.2}}
    assert PipelineConfig.from_dict(pipeline(root, stages=other)).config_hash() != base.config_hash()
    plain = pipeline(root, stages=[])
    assert PipelineConfig.from_dict(plain).config_hash() == PipelineConfig.from_dict(
        {k: v for k, v in plain.items() if k != "stages"}).config_hash()
    (prebuilt / "d.yaml").write_text(json.dumps({"data": {"tokenizer": str(tokenizer_dir), "pipeline": pipeline(root, stages=other)}}))
    capsys.readouterr()
    assert stacklm_main(["prebuild", "--config", str(prebuilt / "d.yaml"), "--out", str(prebuilt / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) <= 2 and "config" in err, err


# ---------------------------------------------------------------------------------------
# Surface 3: datatrove's local executor


def test_datatrove_executor_counts_each_stage_as_the_test_does(corpus, expected, tokenizer_dir, tmp_path):
    from stacklm.scale.datatrove_executors import describe_task, prebuild_executors
    from stacklm.scale.supervise import run_chain

    root, _ = corpus
    out = tmp_path / "dt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        # dedup off: the global pass's tasks read the same chain as the prebuild's (checked above), at 20 tasks' cost
        config = PipelineConfig.from_dict(pipeline(root, dedup={"exact": False, "near": False}))
        main, merge = prebuild_executors(config, tokenizer_dir, out, tasks=1,
                                         tokens_per_shard=SEQ_LEN * 16, workers=2)
        run_chain(main, describe=describe_task)
        run_chain(merge, describe=describe_task)
    top = json.loads((out / "manifest.json").read_text())
    assert top["ledger"]["train"]["ok"], top["ledger"]["train"]["problems"]
    assert ledger_drops(top["ledger"]["train"]["sources"]) == expected["drops"]
    assert {s["name"]: s["docs"] for s in top["sources"]} == {s: len(t) for s, t in expected["kept"].items()}  # no dedup


# ---------------------------------------------------------------------------------------
# State, errors, refusals


def test_a_stateful_stage_resumes_exactly_through_a_weights_only_checkpoint(corpus, tokenizer_dir):
    from tests.helpers.resume import check_save_load_state

    root, _ = corpus
    stages = [{"fn": "tests.helpers.user_stages:EveryNth", "kwargs": {"n": 3}, "sources": ["notes"]}]
    states = []

    def build():
        dm = StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=pipeline(root, total=6_000, stages=stages),
                             seq_len=SEQ_LEN, batch_size=BATCH, num_workers=0, val_batches=0, step_log=False,
                             snapshot_every_n_steps=2)  # the graph's state (the stage's with it) at every second step
        dm.setup("fit")
        return dm.train_dataloader()

    def saved(record):
        states.append(record.state)

    full = check_save_load_state(build, lambda n: [n // 2], state_round_trip="torch", check_state=saved)
    assert len(full) > 4
    found = []

    def walk(x):
        if isinstance(x, dict):
            if "identity" in x and "stage" in x:
                found.append(x["stage"])
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(states[0])
    assert found and all(s["seen"] > 0 for s in found)  # the stage's own count rode in the checkpoint


def test_a_stage_that_raises_ends_the_run_in_one_line_naming_the_document(corpus, tokenizer_dir, tmp_path, capsys):
    root, texts = corpus
    (tmp_path / "c.yaml").write_text(json.dumps({"data": {"tokenizer": str(tokenizer_dir), "pipeline": pipeline(
        root, stages=[{"fn": "tests.helpers.user_stages:explode", "sources": ["web"]}], filters=False)}}))
    assert stacklm_main(["prebuild", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # one line (the budget note aside)
    first = next(i for i, t in enumerate(texts["web"]) if us.MARKER in t)  # the holdout is off: train reads every record
    assert err.startswith("stacklm prebuild: error: pipeline stage 'explode' (tests.helpers.user_stages:explode, "
                          "pipeline.stages[0]) raised KeyError: \"cannot handle 'FORBIDDEN'\"")
    assert err.endswith(f"on source 'web', file 'a.jsonl', record {first}; fix the stage or take it out of pipeline.stages[0]")
    # the same from a stream loader worker: the worker's error, one line, the worker named
    from stacklm.errors import UserError, user_error_message

    dm = StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), seq_len=SEQ_LEN, batch_size=BATCH, num_workers=1,
                         val_batches=0, step_log=False, pipeline=pipeline(
                             root, total=20_000, stages=[{"fn": "tests.helpers.user_stages:explode"}], filters=False))
    dm.setup("fit")
    with pytest.raises(UserError) as e:
        for _ in dm.train_dataloader():
            pass
    line = user_error_message(e.value)
    assert "\n" not in line and line.startswith("pipeline stage 'explode' (") and line.endswith("(in DataLoader worker 0)")
    assert " on source 'web', file 'a.jsonl', record " in line or " on source 'notes', file 'c.parquet', record " in line


def test_what_a_stage_returns_decides_and_an_edited_text_loses_its_position():
    """True keeps, a dict keeps it changed (the input's other fields kept), an edit in place
    counts as a new text; either way the read position goes (the buffers then checkpoint the
    content); a return value of another type stops the run naming the stage and the document."""
    from torchdata.nodes import IterableWrapper

    from stacklm.data.quality.user_stages import StageConfig, UserStageNode
    from stacklm.errors import UserError

    docs = [{"text": t, "source": "web", "doc_id": f"web/a.jsonl/{i}", "file": 0, "record": i, "seek": 10 * i}
            for i, t in enumerate(["abc 1", "def", f"x {us.MARKER}"])]

    def run(fn: str) -> list[dict]:
        node = UserStageNode(IterableWrapper([dict(d) for d in docs]), StageConfig(fn=fn), "pipeline.stages[0]")
        node.reset(None)
        out = list(node)
        assert sum(node.stats.to_dict()["web"].values()) == len(docs)
        return out

    assert run("tests.helpers.user_stages:drop_marked") == docs[:2]  # untouched, positions kept
    mapped = run("tests.helpers.user_stages:redact_digits")
    assert mapped[0] == {**{k: v for k, v in docs[0].items() if k != "seek"}, "text": "abc #"} and mapped[1] == docs[1]
    assert [d["text"] for d in run("tests.helpers.user_stages:shout_in_place")] == ["ABC 1", "DEF", f"X {us.MARKER}"]
    assert not any("seek" in d for d in run("tests.helpers.user_stages:shout_in_place"))
    with pytest.raises(UserError, match=r"stage 'count_words' .* returned int; a stage returns True .* on source 'web', "
                                        r"file 'a.jsonl', record 0"):
        run("tests.helpers.user_stages:count_words")


BROKEN = {  # stage modules that are found but fail to import (written per test: not importable from the repo)
    "stacklm_broken_syntax": "def keep(doc):\n    return True +\n",
    "stacklm_raises_at_import": "import os\nROOT = os.environ['STACKLM_NO_SUCH_VARIABLE']\n\ndef keep(doc):\n    return True\n",
}


@pytest.fixture
def broken_modules(tmp_path, monkeypatch):
    folder = tmp_path / "mods"
    folder.mkdir()
    for name, source in BROKEN.items():
        (folder / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))


# "parse": refused when the config is read (no import); "run": the spec is fine, so the config
# parses, but where the stages are going to run (a stream datamodule, a prebuild) it is refused
# before any work, in one line naming the field
@pytest.mark.parametrize("stage, at, field, words", [
    ({"fn": "tests.helpers.user_stages:keep_all"}, "run", "pipeline.stages[0].fn", "cannot be pickled"),
    ({"fn": "tests.helpers.no_such_module:keep"}, "run", "pipeline.stages[0].fn", "cannot import"),
    ({"fn": "tests.helpers.user_stages:nothing"}, "run", "pipeline.stages[0].fn", "has no 'nothing'"),
    ({"fn": "stacklm_broken_syntax:keep"}, "run", "pipeline.stages[0].fn",
     r"importing 'stacklm_broken_syntax' raised SyntaxError: invalid syntax \(.*stacklm_broken_syntax.py, line 2\); "
     r"fix the module so that `import stacklm_broken_syntax` works"),
    ({"fn": "stacklm_raises_at_import:keep"}, "run", "pipeline.stages[0].fn",
     r"importing 'stacklm_raises_at_import' raised KeyError: 'STACKLM_NO_SUCH_VARIABLE'; fix the module"),
    ({"fn": "tests.helpers.user_stages:drop_marked", "kwargs": {"makrer": "XX"}}, "run", "pipeline.stages[0].kwargs",
     r"drop_marked\(doc, marker='FORBIDDEN'\) does not take \['makrer'\] .*; give keyword arguments"),
    ({"fn": "tests.helpers.user_stages:Threshold", "kwargs": {"treshold": 0.4}}, "run", "pipeline.stages[0].kwargs",
     r"Threshold\(threshold=0.5\) does not take \['treshold'\] .*; give the constructor's arguments"),
    ({"fn": "tests.helpers.user_stages:Threshold", "kwargs": {"threshold": 2}}, "run", "pipeline.stages[0].kwargs",
     r"Threshold\(threshold=2\) raised ValueError: threshold must be in \[0, 1\], got 2; fix the constructor's arguments"),
    ({"fn": "tests.helpers.user_stages:Threshold", "kwargs": {"threshold": "high"}}, "run", "pipeline.stages[0].kwargs",
     r"Threshold\(threshold='high'\) raised TypeError: '<=' not supported .*; fix the constructor's arguments"),
    ({"fn": "__main__:keep"}, "parse", "pipeline.stages[0].fn", "move the stage into a module"),
    ({"fn": "keep"}, "parse", "pipeline.stages[0].fn", "as 'package.module:name'"),
    ({"fn": "tests.helpers.user_stages:drop_marked", "sources": ["wbe"]}, "parse", "pipeline.stages[0].sources", "not sources of the mix"),
    ({"fn": "tests.helpers.user_stages:drop_marked", "name": "dedup"}, "parse", "pipeline.stages[0].name", "built-in stage"),
])
def test_a_stage_no_worker_could_run_is_refused_before_work(corpus, tokenizer_dir, tmp_path, capsys, broken_modules,
                                                            stage, at, field, words):
    root, _ = corpus
    field_re = field.replace("[", r"\[").replace("]", r"\]")
    if at == "parse":
        with pytest.raises(ConfigError, match=rf"field '{field_re}'.*{words}"):
            PipelineConfig.from_dict(pipeline(root, stages=[stage]))
    else:  # nothing imported at parse: a command that never runs the stages does not need their module
        config = PipelineConfig.from_dict(pipeline(root, stages=[stage]))
        with pytest.raises(ConfigError, match=rf"field '{field_re}'.*{words}") as e:
            config.check_stages_run()
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=words):  # a stream datamodule refuses at construction
        StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=pipeline(root, stages=[stage]),
                        seq_len=SEQ_LEN, batch_size=BATCH, num_workers=1)
    (tmp_path / "c.yaml").write_text(json.dumps({"data": {"tokenizer": str(tokenizer_dir), "pipeline": pipeline(root, stages=[stage])}}))
    assert stacklm_main(["prebuild", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and not (tmp_path / "out").exists(), err
    assert re.search(words, err), err


def test_commands_that_never_run_the_stages_do_not_import_them(corpus, tokenizer_dir, tmp_path, capsys):
    """A shards-mode datamodule (it reads built shards) and ``train-tokenizer --config`` (it reads
    the sources raw) take a config whose stage module is not importable here."""
    root, texts = corpus
    stages = [{"fn": "stacklm_not_installed_here:keep", "kwargs": {"anything": 1}}]
    dm = StackDataModule(mode="shards", tokenizer=str(tokenizer_dir), data_dir=str(tmp_path / "shards"),
                         pipeline=pipeline(root, stages=stages), seq_len=SEQ_LEN, batch_size=BATCH)
    assert dm.config.pipeline.stages[0].fn == "stacklm_not_installed_here:keep"
    (tmp_path / "c.yaml").write_text(json.dumps({"data": {"mode": "stream", "tokenizer": str(tokenizer_dir), "seq_len": SEQ_LEN,
                                                          "batch_size": BATCH, "pipeline": pipeline(root, stages=stages)}}))
    assert stacklm_main(["train-tokenizer", "--config", str(tmp_path / "c.yaml"), "--vocab-size", "300",
                         "--max-bytes", "20000", "--out", str(tmp_path / "tok"), "--no-progress"]) == 0, capsys.readouterr().err
    assert any((tmp_path / "tok").iterdir())
    # the same config where the stages run: refused, naming the module, before anything is written
    from stacklm.scale.datatrove_executors import dedup_index_executors, prebuild_executors

    refused = r"field 'pipeline.stages\[0\].fn'.*cannot import 'stacklm_not_installed_here'"
    with pytest.raises(ConfigError, match=refused):
        StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=pipeline(root, stages=stages),
                        seq_len=SEQ_LEN, batch_size=BATCH)
    config = PipelineConfig.from_dict(pipeline(root, stages=stages))
    with pytest.raises(ConfigError, match=refused):
        prebuild_executors(config, tokenizer_dir, tmp_path / "dt", tasks=1)
    with pytest.raises(ConfigError, match=refused):
        dedup_index_executors(config, tmp_path / "dt-index" / "index.npz", tasks=1)
    capsys.readouterr()
    assert stacklm_main(["dedup-index", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "ix" / "index.npz")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot import 'stacklm_not_installed_here'" in err, err
    assert [p.name for p in tmp_path.iterdir() if p.name in ("dt", "dt-index", "ix")] == []


def test_a_resume_refused_for_a_changed_stage_names_the_field(corpus, tokenizer_dir, tmp_path):
    """A stream checkpoint's data identity carries the pipeline config it hashed (plain data, read
    back weights-only), so the refusal names what changed as a prebuild's does; the hash itself is
    what it was before the config rode along (earlier checkpoints resume)."""
    import hashlib

    import torch

    from stacklm.datamodule.resume.identity import check_identity, data_identity
    from stacklm.errors import ResumeRefused

    root, _ = corpus

    def module(stages):
        return StackDataModule(mode="stream", tokenizer=str(tokenizer_dir), pipeline=pipeline(root, stages=stages),
                               seq_len=SEQ_LEN, batch_size=BATCH)

    def identity(stages):
        return data_identity(module(stages))

    dm = module([{"fn": "tests.helpers.user_stages:drop_marked"}])
    before = data_identity(dm)
    torch.save({"identity": before}, tmp_path / "c.pt")
    saved = torch.load(tmp_path / "c.pt", weights_only=True)["identity"]
    check_identity(saved, before)  # the same run resumes
    hashed = {k: v for k, v in dm.config.pipeline.to_dict().items() if k not in ("num_threads", "batch_size")}
    old_hash = hashlib.sha256(json.dumps(hashed, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert saved["pipeline"] == old_hash
    with pytest.raises(ResumeRefused, match=r"pipeline: checkpoint [0-9a-f]+ vs now [0-9a-f]+; "
                                            r"changed: stages\[0\]\.kwargs\.marker \(absent -> 'XX'\)\)"):
        check_identity(saved, identity([{"fn": "tests.helpers.user_stages:drop_marked", "kwargs": {"marker": "XX"}}]))
    older = {k: v for k, v in saved.items() if k != "config"}  # a checkpoint from before: the hashes alone
    with pytest.raises(ResumeRefused, match=r"pipeline: checkpoint [0-9a-f]+ vs now [0-9a-f]+\)"):
        check_identity(older, identity([{"fn": "tests.helpers.user_stages:drop_marked", "kwargs": {"marker": "XX"}}]))
