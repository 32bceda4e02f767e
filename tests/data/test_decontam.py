"""Decontamination (stacklm.data.quality.decontam, .ngrams): on planted overlaps -- exact 13-gram
copies under other case, punctuation and line breaks, 12-word near misses, one-word changes,
n-grams across two evaluation records -- the stage agrees with a brute-force reference that
shares none of its code (no miss, no false hit), and a forced hash collision never counts.
Drop and cut modes, the ledger, the per-set report (manifest, ``stacklm ledger``, the data
logs), the prebuild with two workers and an exact stream resume."""

from __future__ import annotations

import json
import random
import re
import unicodedata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stacklm.cli import main as stacklm_main
from stacklm.data import ledger
from stacklm.data.pipeline import PipelineConfig, build_pipeline
from stacklm.data.quality import decontam as dc
from stacklm.data.quality.ngrams import NgramIndex, build_index, ngram_hashes, word_hashes, words_of
from stacklm.errors import ConfigError

N = 13
SEQ_LEN = 64
BIG = 10**7


@pytest.fixture(autouse=True)
def strict_ledger(monkeypatch, tmp_path):
    monkeypatch.setenv(ledger.STRICT_ENV, "1")
    monkeypatch.setenv("STACKLM_CACHE_DIR", str(tmp_path / "cache"))
    dc._LOADED.clear()


# ----------------------------------------------------------------------------- the reference
def ref_words(text: str) -> list[str]:
    """The documented normalization, written out independently: NFKC, \\w runs, casefold each."""
    return [w.casefold() for w in re.findall(r"\w+", unicodedata.normalize("NFKC", text))]


def ref_grams(records: list[str], n: int = N) -> set[tuple[str, ...]]:
    out = set()
    for r in records:
        w = ref_words(r)
        out |= {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}
    return out


def ref_hits(text: str, grams_by_set: dict[str, set], n: int = N) -> set[tuple[int, str]]:
    w = ref_words(text)
    return {(i, name) for i in range(len(w) - n + 1) for name, grams in grams_by_set.items() if tuple(w[i : i + n]) in grams}


# ----------------------------------------------------------------------------- planted corpus
def _vocab(rng: random.Random) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyzé"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(3, 8))) for _ in range(300)]


def _noisy(words: list[str], rng: random.Random) -> str:
    """The same words as another surface: case, punctuation, line breaks between them."""
    out = []
    for w in words:
        w = w.upper() if rng.random() < 0.3 else (w.capitalize() if rng.random() < 0.3 else w)
        out.append(w + rng.choice(["", "", ",", ".", "!", " --", ";"]))
    seps = [rng.choice([" ", " ", "\n", "  ", "\n\n", "\t"]) for _ in out]
    return "".join(a + b for a, b in zip(out, seps))


def make_data(root: Path, seed: int = 3):
    """Two evaluation sets (jsonl with two fields, parquet with a list field) and one training
    source whose documents carry planted overlaps. Returns (eval records per set, train texts)."""
    rng = random.Random(seed)
    vocab = _vocab(rng)
    sentence = lambda k: [rng.choice(vocab) for _ in range(k)]  # noqa: E731
    qa = [{"question": " ".join(sentence(20)) + "?", "answer": " ".join(sentence(15)) + "."} for _ in range(25)]
    code = [{"prompt": [" ".join(sentence(10)), " ".join(sentence(12))]} for _ in range(15)]
    (root / "eval").mkdir(parents=True)
    (root / "eval" / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in qa))
    pq.write_table(pa.table({"prompt": [r["prompt"] for r in code]}), root / "eval" / "code.parquet")
    records = {"qa": [r["question"] + "\n" + r["answer"] for r in qa], "code": ["\n".join(r["prompt"]) for r in code]}
    texts = []
    for i in range(160):
        body = sentence(rng.randint(50, 90))
        kind = i % 8
        src = records["qa" if (i // 8) % 2 else "code"][rng.randrange(15)]
        ew = ref_words(src)
        at = rng.randrange(len(ew) - N + 1)
        cut = rng.randint(5, len(body) - 5)
        if kind == 0:  # an exact 13-gram copy, noisy surface
            texts.append(_noisy(body[:cut], rng) + " " + _noisy(ew[at : at + N], rng) + " " + _noisy(body[cut:], rng))
            continue
        if kind == 1:  # a 12-word near miss
            texts.append(" ".join(body[:cut]) + " " + _noisy(ew[at : at + N - 1], rng) + " " + " ".join(body[cut:]))
            continue
        if kind == 2:  # one word of the 13 changed
            gram = list(ew[at : at + N])
            gram[6] = gram[6] + "x"
            texts.append(" ".join(body[:cut]) + " " + " ".join(gram) + " " + " ".join(body[cut:]))
            continue
        if kind == 3:  # 13 words across two records of a set: not an n-gram of the set
            a, b = ref_words(records["qa"][0]), ref_words(records["qa"][1])
            texts.append(" ".join(body[:cut]) + " " + " ".join(a[-7:] + b[:6]) + " " + " ".join(body[cut:]))
            continue
        if kind == 4:  # a long copy (several overlapping n-grams) at the very start
            texts.append(" ".join(ew[: N + 6]) + " " + " ".join(body))
            continue
        texts.append(" ".join(body))  # clean
    return records, texts


def write_train(root: Path, texts: list[str]) -> None:
    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "train" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def decontam_section(root: Path, **kw) -> dict:
    return {"sets": [{"name": "qa", "files": [str(root / "eval" / "qa.jsonl")], "fields": ["question", "answer"]},
                     {"name": "code", "files": [str(root / "eval" / "code.parquet")], "fields": ["prompt"]}], **kw}


def data_section(root: Path, total: int = BIG, holdout: float = 0.0, **decon) -> dict:
    return {
        "seq_len": SEQ_LEN, "batch_size": 4, "strategy": "best_fit", "seed": 0, "shuffle_buffer": 16,
        "pack_buffer_docs": 8, "holdout_fraction": holdout, "tokenize_batch_docs": 8, "num_threads": 1,
        "mix": {"name": "t", "total_tokens": total, "entries": [
            {"name": "web", "kind": "local", "path": str(root / "train" / "*.jsonl"), "weight": 1.0, "domain": "prose",
             "filters": "none"}]},
        "decontaminate": decontam_section(root, **decon),
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("decon")
    records, texts = make_data(root)
    write_train(root, texts)
    grams = {name: ref_grams(recs) for name, recs in records.items()}
    return root, records, texts, grams


@pytest.fixture(scope="module")
def tok(tokenizer_512):
    return tokenizer_512


def _first_set(hits: set[tuple[int, str]]) -> str:
    return min(hits, key=lambda h: ["qa", "code"].index(h[1]))[1]


# ----------------------------------------------------------------------------- tests
def test_index_agrees_with_brute_force_on_planted_overlaps(data, tmp_path):
    root, records, texts, grams = data
    cfg = dc.DecontamConfig.from_dict(decontam_section(root))
    index = dc.ensure_index(cfg)
    assert index.sets == ["qa", "code"] and index.n == N
    planted = 0
    for text in texts:
        want = ref_hits(text, grams)
        got = {(i, index.sets[s]) for i, s in index.lookup(words_of(text))}
        assert got == want, text  # no miss, no false hit, right set, right position
        planted += bool(want)
    assert planted == sum(1 for i in range(160) if i % 8 in (0, 4))  # exactly the planted copies hit
    # the normalization the docs state: case, punctuation and line breaks do not hide a copy
    assert words_of("The ANSWER,\nis -- 42!") == ["the", "answer", "is", "42"] == ref_words("The ANSWER,\nis -- 42!")
    # the ASCII fast path finds the words the regex finds, over every ASCII character
    rng = random.Random(1)
    for _ in range(200):
        text = "".join(chr(rng.randrange(128)) for _ in range(rng.randint(0, 80)))
        assert words_of(text) == ref_words(text), repr(text)
    # built once: a second ensure in this process, and a fresh load, read the same folder
    assert dc.ensure_index(cfg) is index
    again = NgramIndex.load(index.folder)
    assert again.content_hash == index.content_hash and len(list((Path(tmp_path) / "cache" / "decontam").iterdir())) == 1


def test_a_hash_collision_never_counts(data, tmp_path):
    """Every entry of an index rewritten to the hash of a clean document's n-gram: the hash fast
    path hits, the word confirmation refuses, nothing is reported."""
    root, records, texts, grams = data
    index = build_index(tmp_path / "idx", N, [("qa", records["qa"])], "k")
    clean = next(t for t in texts if not ref_hits(t, grams))
    g = ngram_hashes(word_hashes(words_of(clean)), N)[5]
    forged = NgramIndex(index.folder, {"hashes": np.full(len(index), g, dtype=np.uint64), "sets": index.set_of,
                                       "pos": index.pos, "starts": index.starts, "ends": index.ends, "text": index.text}, index.meta)
    assert forged.lookup(words_of(clean)) == []
    assert np.searchsorted(forged.hashes, g) < len(forged.hashes)  # the fast path did hit


def _stage_output(cfg: PipelineConfig, tok):
    pipe = build_pipeline(cfg, tok, "train")
    node = pipe.chains["web"]["decontam"]
    node.reset(None)
    # in file order (the source reads its pieces in a spread order: docs/architecture.md)
    return sorted(node, key=lambda d: (d["file"], d["record"])), node


def test_drop_mode_drops_exactly_the_contaminated_and_reports_them(data, tok):
    root, records, texts, grams = data
    out, node = _stage_output(PipelineConfig.from_dict(data_section(root)), tok)
    dirty = {t: ref_hits(t, grams) for t in texts}
    assert [d["text"] for d in out] == [t for t in texts if not dirty[t]]
    rep = node.report()
    for name in ("qa", "code"):
        dropped = [t for t in texts if dirty[t] and _first_set(dirty[t]) == name]
        assert rep["sets"][name]["docs"] == len(dropped) > 0
        assert rep["sets"][name]["tokens"] == sum(len(tok.encode(t)) for t in dropped)
        assert 0 < len(rep["sets"][name]["examples"]) <= 3
        for ex in rep["sets"][name]["examples"]:
            assert tuple(ex["ngram"].split()) in grams[name] and ex["source"] == "web"
    assert node.stats.to_dict()["web"] == {"kept": len(out), **{n: rep["sets"][n]["docs"] for n in ("qa", "code")}}


def test_cut_mode_removes_only_the_overlapping_spans(data, tok):
    root, records, texts, grams = data
    out, node = _stage_output(PipelineConfig.from_dict(data_section(root, mode="cut")), tok)
    assert len(out) == len(texts)  # every planted document keeps text around its copy
    all_grams = grams["qa"] | grams["code"]
    cut = 0
    for src, doc in zip(texts, out):
        hits = ref_hits(src, grams)
        if not hits:
            assert doc["text"] == src
            continue
        cut += 1
        w = ref_words(src)
        covered = {i + k for i, _ in hits for k in range(N)}
        assert ref_words(doc["text"]) == [x for j, x in enumerate(w) if j not in covered]
        left = ref_words(doc["text"])
        assert not any(tuple(left[i : i + N]) in all_grams for i in range(len(left) - N + 1))
    rep = node.report()["sets"]
    assert rep["qa"]["cut_docs"] + rep["code"]["cut_docs"] == cut and rep["qa"]["docs"] + rep["code"]["docs"] == 0
    assert rep["qa"]["cut_tokens"] > 0


def test_the_ledger_adds_up_with_decontam_drops(data, tok):
    root, records, texts, grams = data
    pipe = build_pipeline(PipelineConfig.from_dict(data_section(root)), tok, "train")
    pipe.windows.reset()
    list(pipe.windows)
    led = ledger.pipeline_ledger(pipe)
    assert ledger.check(led) == []
    dirty = [t for t in texts if ref_hits(t, grams)]
    drops = {k: v for k, v in led["web"]["docs"]["dropped"].items() if k.startswith("decontam/")}
    assert sum(drops.values()) == len(dirty) and set(drops) == {"decontam/qa", "decontam/code"}
    assert "decontam/qa" in ledger.format_ledger(led)


def test_stream_resume_is_exact_and_the_state_small(data, tok):
    root, records, texts, grams = data
    cfg = PipelineConfig.from_dict(data_section(root))
    pipe = build_pipeline(cfg, tok, "train")
    pipe.batches.reset()
    for _ in range(3):
        next(pipe.batches)
    state = pipe.batches.state_dict()
    rest = [b["input_ids"].tolist() for b in pipe.batches]
    again = build_pipeline(cfg, tok, "train")
    again.batches.reset(state)
    assert [b["input_ids"].tolist() for b in again.batches] == rest
    assert again.chains["web"]["decontam"].report() == pipe.chains["web"]["decontam"].report()
    own = dict(pipe.chains["web"]["decontam"].get_state())
    own.pop("source")
    assert len(json.dumps(own)) < 4000  # counters, <= 3 examples per set, the index hash: not the index
    # other evaluation data under the same config: the resume is refused, not silently different
    other = root / "eval2"
    other.mkdir(exist_ok=True)
    (other / "qa.jsonl").write_text(json.dumps({"question": "a b c", "answer": "d"}) + "\n")
    changed = data_section(root)
    changed["decontaminate"]["sets"][0]["files"] = [str(other / "qa.jsonl")]
    with pytest.raises(ValueError, match="resume with the same decontaminate"):
        build_pipeline(PipelineConfig.from_dict(changed), tok, "train").batches.reset(state)


def test_worker_summaries_carry_the_report_to_the_data_logs(data, tok, tmp_path):
    from stacklm.callbacks import data_scalars, merge_data_stats
    from stacklm.data.sources import ShardSpec
    from stacklm.datamodule.stream import PipelineBuilder, StreamDataset, _StreamIterator, merge_worker_summaries

    root, records, texts, grams = data
    tok_path = tmp_path / "tok.stacklm.json"
    tok.save(tok_path)
    builder = PipelineBuilder(data_section(root, total=BIG), str(tok_path), "train")
    summaries = []
    for worker in range(2):
        ds = StreamDataset(builder, split="train", rank=0, world_size=1, n_batches_total=400, batch_size=4, seq_len=SEQ_LEN,
                           pad_id=tok.pad_id, sources=["web"])
        it = _StreamIterator(ds, ShardSpec(0, 1, worker, 2))
        with pytest.warns(UserWarning, match="ran dry"):  # every document read: the budget is bigger than the corpus
            for _ in it:
                pass
        summaries.append(it.summary())
    stats = merge_data_stats([merge_worker_summaries(summaries)])  # as the callback merges ranks
    dirty = {t: ref_hits(t, grams) for t in texts}
    scalars = data_scalars(stats)
    for name in ("qa", "code"):
        want = sum(1 for h in dirty.values() if h and _first_set(h) == name)
        assert scalars[f"data/decontam/{name}/docs"] == want
        assert scalars[f"data/dropped_docs/decontam/web/{name}"] == want
        assert stats["decontamination"]["sets"][name]["examples"]
    assert stats["ledger"]["ok"]


@pytest.mark.slow
def test_prebuild_with_two_workers_reports_the_same_per_set(data, tok, tmp_path, capsys):
    from stacklm.prebuild import prebuild
    from stacklm.data.quality.holdout import holdout_split

    root, records, texts, grams = data
    cfg = PipelineConfig.from_dict(data_section(root, holdout=0.2))
    reports = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        with pytest.warns(RuntimeWarning, match="ran dry"):
            top = prebuild(cfg, tok, out, workers=workers, tokens_per_shard=SEQ_LEN * 16, progress=False)
        assert all(v["ok"] for v in top["ledger"].values())
        reports[workers] = {split: {n: {k: r[k] for k in ("docs", "tokens")} for n, r in rep["sets"].items()}
                            for split, rep in top["decontamination"].items()}
        split_manifest = json.loads((out / "train" / "manifest.json").read_text())
        assert split_manifest["decontamination"]["sets"]["qa"]["examples"]
        assert stacklm_main(["ledger", str(out)]) == 0
        printed = capsys.readouterr().out
        assert "dropped decontam/qa" in printed and "decontamination (13-grams, mode drop" in printed
    assert reports[1] == reports[2]
    for split in ("train", "val"):
        dirty = [t for t in texts if holdout_split(t, 0.2, 0) == split and ref_hits(t, grams)]
        assert sum(r["docs"] for r in reports[1][split].values()) == len(dirty)
    assert len(list((tmp_path / "cache" / "decontam").iterdir())) == 1  # one index for both builds and all jobs


def test_config_errors_name_the_field(data):
    root = data[0]
    with pytest.raises(ConfigError, match="'n' must be >= 1"):
        dc.DecontamConfig.from_dict(decontam_section(root, n=0))
    with pytest.raises(ConfigError, match="exactly one of 'files'"):
        dc.DecontamConfig.from_dict({"sets": [{"name": "x"}]})
    bad = decontam_section(root)
    bad["sets"][0]["fields"] = ["question", "nope"]
    with pytest.raises(ConfigError, match="no column 'nope'"):
        dc.ensure_index(dc.DecontamConfig.from_dict(bad))
    with pytest.raises(ConfigError, match="must be one of"):
        dc.DecontamConfig.from_dict(decontam_section(root, mode="mask"))


def test_an_empty_or_broken_set_file_is_one_error_naming_the_set(tmp_path):
    # datasets says "empty file" as a bare StopIteration and "broken file" as pyarrow's error;
    # either must reach the user as a ConfigError naming the set and its file, and an empty
    # set must not pass as configured (it would decontaminate nothing)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "broken.jsonl").write_text('{"question": "a"\n')
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    cases = {"empty.jsonl": "holds no records", "broken.jsonl": "cannot be read: ArrowInvalid", "broken.parquet": "cannot be read: ArrowInvalid"}
    for name, message in cases.items():
        cfg = dc.DecontamConfig.from_dict({"cache_dir": str(tmp_path / "cache"), "sets": [
            {"name": "ev", "files": [str(tmp_path / name)], "fields": ["question"]}]})
        with pytest.raises(ConfigError, match=f"decontaminate set 'ev' \\(.*{re.escape(name)}\\): {message}") as e:
            dc.ensure_index(cfg)
        assert "\n" not in str(e.value)


def test_a_set_too_short_to_match_anything_is_warned_once(tmp_path):
    # records of fewer than n words hold no n-gram: such a set silently decontaminates nothing
    (tmp_path / "short.jsonl").write_text('{"q": "what is two plus two"}\n{"q": "name a prime"}\n')
    (tmp_path / "long.jsonl").write_text('{"q": "' + " ".join(f"w{i}" for i in range(20)) + '"}\n')
    cfg = dc.DecontamConfig.from_dict({"cache_dir": str(tmp_path / "cache"), "sets": [
        {"name": "shorty", "files": [str(tmp_path / "short.jsonl")], "fields": ["q"]},
        {"name": "longer", "files": [str(tmp_path / "long.jsonl")], "fields": ["q"]}]})
    with pytest.warns(RuntimeWarning, match="set 'shorty': none of its 2 records has 13 words") as caught:
        dc.ensure_index(cfg, announce=True)
        dc.ensure_index(cfg, announce=True)  # the datamodule asks once per split: said once
    assert len([w for w in caught if "none of its" in str(w.message)]) == 1
    assert not any("'longer'" in str(w.message) for w in caught)


def test_without_the_section_the_config_hash_is_unchanged(data):
    root = data[0]
    plain = data_section(root)
    del plain["decontaminate"]
    cfg = PipelineConfig.from_dict(plain)
    import dataclasses

    from stacklm.config import Config

    assert cfg.config_hash() == Config.config_hash(cfg, exclude=("num_threads", "planes", "decontaminate", "stages"))
    assert PipelineConfig.from_dict(data_section(root)).config_hash() != cfg.config_hash()
    assert dataclasses.replace(cfg).config_hash() == cfg.config_hash()


@pytest.mark.slow
def test_stream_datamodule_with_two_workers_shares_one_index(data, tokenizer_512, saved_tokenizer_dir, tmp_path):
    """``StackDataModule(mode="stream")`` builds the index in the main process before its
    forkserver workers start; they memory-map it (one folder), and their reports reach
    ``data_stats()`` as the callback reads it, adding up with the ledger."""
    from stacklm.callbacks import data_scalars
    from stacklm.datamodule import StackDataModule

    root, records, texts, grams = data
    pipeline = data_section(root, total=20_000, holdout=0.1)
    dm = StackDataModule(mode="stream", tokenizer=str(saved_tokenizer_dir(tokenizer_512)), pipeline=pipeline,
                         seq_len=SEQ_LEN, batch_size=4, num_workers=2)
    dm.setup("fit")
    for _ in dm.train_dataloader():
        pass
    stats = dm.data_stats()
    assert len(list((tmp_path / "cache" / "decontam").iterdir())) == 1
    report = stats["decontamination"]["sets"]
    dropped = stats["ledger"]["sources"]["web"]["docs"]["dropped"]
    assert stats["ledger"]["ok"] and sum(r["docs"] for r in report.values()) > 0
    for name in ("qa", "code"):
        assert dropped.get(f"decontam/{name}", 0) == report[name]["docs"] == data_scalars(stats)[f"data/decontam/{name}/docs"]
        assert all(tuple(ex["ngram"].split()) in grams[name] for ex in report[name]["examples"])


def test_a_build_that_leaves_a_split_with_no_tokens_is_refused(data, tok, tmp_path):
    """Issue 32.6: ``decontaminate`` with ``n: 1`` removes every document; the build wrote a
    shard set with 0 training tokens and exited 0. Now it ends in one line saying where the
    documents went, and no manifest is written (no loader opens an empty set)."""
    from stacklm.errors import PrebuildError
    from stacklm.prebuild import prebuild

    root, _, texts, _ = data
    cfg = PipelineConfig.from_dict(data_section(root, n=1))
    out = tmp_path / "empty"
    with pytest.raises(PrebuildError) as e:
        prebuild(cfg, tok, out, tokens_per_shard=SEQ_LEN * 16, progress=False, splits=("train",))
    line = str(e.value)
    assert "\n" not in line and "split 'train' has no tokens" in line and f"of {len(texts):,} documents read" in line, line
    assert re.search(r"\d[\d,]* decontaminated", line) and str(out) in line, line
    assert not (out / "train" / "manifest.json").exists() and not (out / "manifest.json").exists()
