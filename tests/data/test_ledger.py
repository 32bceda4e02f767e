"""The token ledger (stacklm.data.ledger): on a real prebuild of a corpus with planted drops
(duplicates, too-short documents, malformed JSON lines, null and empty texts, blank lines),
every term is checked against numbers this test counts from the input files itself; a budget
that cuts the corpus still adds up exactly; in stream mode the ledger holds mid-stream (with
documents in the buffers), and a stage that silently loses a document breaks it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stacklm.cli import main as stacklm_main
from stacklm.data import ledger
from stacklm.data.storage import manifest as mf
from stacklm.data.storage import shards as sh
from stacklm.data.quality.holdout import holdout_split
from stacklm.data.pipeline import PipelineConfig, build_pipeline
from stacklm.errors import LedgerError
from stacklm.prebuild import prebuild
from tests.helpers.ledger import SEQ_LEN, HOLDOUT, SEED, BIG, write_corpus, data_section


@pytest.fixture(autouse=True)
def strict_ledger(monkeypatch):
    monkeypatch.setenv(ledger.STRICT_ENV, "1")


def expected_ledger(records, tok, split: str) -> dict[str, dict]:
    """The ledger of ``split`` counted from the input records alone (no pipeline code but the
    holdout's hash, which *defines* the split)."""
    out = {}
    for source, rows in records.items():
        docs = {"read": 0, "dropped": {}, "holdout": 0, "kept": 0}
        tokens = 0
        seen: set[str] = set()

        def drop(reason: str) -> None:
            docs["dropped"][reason] = docs["dropped"].get(reason, 0) + 1

        for _, _, value in rows:
            docs["read"] += 1
            if isinstance(value, bytes):
                drop("source/malformed_json")
            elif value is None:
                drop("source/null_text")
            elif value == "":
                drop("source/dropped_empty")
            elif holdout_split(value, HOLDOUT, SEED) != split:
                docs["holdout"] += 1
            elif len(value) < 200:
                drop("filter/too_short")
            elif value in seen:
                drop("dedup/exact_dup")
            else:
                seen.add(value)
                docs["kept"] += 1
                tokens += len(tok.encode(value))
        out[source] = {"docs": docs, "tokens": tokens}
    return out


@pytest.fixture(scope="module")
def tok(tokenizer_512):
    return tokenizer_512


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    return root, write_corpus(root)


@pytest.fixture(scope="module")
def built(corpus, tok, tmp_path_factory):
    root, _ = corpus
    out = tmp_path_factory.mktemp("ledger") / "shards"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ledger.STRICT_ENV, "1")
        with pytest.warns(RuntimeWarning, match="ran dry"):  # the budget is bigger than the corpus on purpose
            prebuild(PipelineConfig.from_dict(data_section(root)), tok, out, tokens_per_shard=SEQ_LEN * 16, progress=False)
    return out


def _content(split_dir: Path, m: dict, tok) -> tuple[int, int]:
    """(documents, document tokens) in the shard files themselves: <bos> count and the tokens
    that are neither <bos>, <eos> nor padding."""
    docs = tokens = 0
    for s in m["shards"]:
        rows = sh.open_tokens(split_dir, s["name"], np.dtype("<u2"), int(s["n_seq"]), SEQ_LEN)
        docs += int((rows == tok.bos_id).sum())
        tokens += int(((rows != tok.bos_id) & (rows != tok.eos_id) & (rows != tok.pad_id)).sum())
    return docs, tokens


@pytest.mark.parametrize("split", ["train", "val"])
def test_prebuild_ledger_matches_the_input_files(built, corpus, tok, split):
    _, records = corpus
    top = mf.read_manifest(built)
    entry = top["ledger"][split]
    assert entry["ok"] and entry["problems"] == []
    want = expected_ledger(records, tok, split)
    for source, w in want.items():
        d, t = entry["sources"][source]["docs"], entry["sources"][source]["tokens"]
        assert d["read"] == w["docs"]["read"]
        assert d["dropped"] == w["docs"]["dropped"], source
        assert d["holdout"] == w["docs"]["holdout"]
        assert d["buffered"] == {} and d["remainder"] == {}  # everything was read and flushed
        assert d["kept"] == d["delivered"] == w["docs"]["kept"]
        assert t["read"] == t["kept"] == t["delivered"] == w["tokens"]
        assert t["dropped"] == {} and t["remainder"] == {}
    # the planted drops are all there (the corpus is not accidentally clean)
    web = want["web"]["docs"]["dropped"]
    assert {"source/malformed_json", "source/null_text", "source/dropped_empty", "filter/too_short"} <= set(web)
    assert "source/null_text" in want["books"]["docs"]["dropped"]
    assert want["web"]["docs"]["dropped"].get("dedup/exact_dup", 0) + want["books"]["docs"]["dropped"].get("dedup/exact_dup", 0) > 0
    # delivered = what the shard files hold
    split_dir = built / split
    docs, tokens = _content(split_dir, mf.read_manifest(split_dir), tok)
    assert docs == sum(w["docs"]["kept"] for w in want.values())
    assert tokens == sum(w["tokens"] for w in want.values())


def test_ledger_cli_prints_and_fails_on_a_broken_identity(built, capsys, tmp_path):
    assert stacklm_main(["ledger", str(built)]) == 0
    text = capsys.readouterr().out
    assert "source web" in text and "source books" in text and "dropped filter/too_short" in text
    assert text.count("identities: OK") == 4  # 2 splits x 2 sources
    assert stacklm_main(["ledger", str(built / "train"), "--json"]) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["train"]["ok"]
    # a ledger whose delivered count was altered no longer adds up: exit 1, naming the identity
    broken = tmp_path / "broken"
    broken.mkdir()
    m = json.loads((built / "manifest.json").read_text())
    m["ledger"]["train"]["sources"]["web"]["tokens"]["delivered"] -= 1
    (broken / "manifest.json").write_text(json.dumps(m))
    assert stacklm_main(["ledger", str(broken)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "source 'web' tokens: kept" in out and "off by +1" in out


def test_budget_cut_still_adds_up(corpus, tok, tmp_path):
    root, records = corpus
    total = 3000  # well under the corpus: the mix cuts the last documents and leaves read-ahead unused
    out = tmp_path / "cut"
    prebuild(PipelineConfig.from_dict(data_section(root, total=total)), tok, out, tokens_per_shard=SEQ_LEN * 16,
             splits=("train",), progress=False)
    entry = mf.read_manifest(out)["ledger"]["train"]
    assert entry["ok"], entry["problems"]
    srcs = entry["sources"]
    assert sum(s["tokens"]["delivered"] for s in srcs.values()) == total  # budgets are met exactly
    assert sum(s["tokens"]["dropped"].get("mix/cut_by_budget", 0) for s in srcs.values()) > 0
    # read ahead but never mixed: documents left in the dedup/tokenize buffers when the budget was met
    assert sum(sum(s["docs"]["buffered"].values()) for s in srcs.values()) > 0
    docs, tokens = _content(out / "train", mf.read_manifest(out / "train"), tok)
    assert tokens == total and docs == sum(s["docs"]["delivered"] for s in srcs.values())


def _content_of(window: np.ndarray, tok) -> int:
    return int(((window != tok.bos_id) & (window != tok.eos_id) & (window != tok.pad_id)).sum())


def test_stream_ledger_holds_mid_stream_and_catches_a_silent_loss(corpus, tok, monkeypatch):
    root, records = corpus
    cfg = PipelineConfig.from_dict(data_section(root, total=BIG, shuffle_buffer=8))
    pipe = build_pipeline(cfg, tok, "train")
    pipe.windows.reset()
    emitted = 0
    for _ in range(6):
        emitted += _content_of(next(pipe.windows), tok)
    mid = ledger.pipeline_ledger(pipe)
    assert ledger.check(mid) == []
    assert sum(s["tokens"]["delivered"] for s in mid.values()) == emitted
    # mid-stream the remainder is real: documents wait in the shuffle and pack buffers
    assert sum(sum(s["docs"]["remainder"].values()) for s in mid.values()) > 0
    for w in pipe.windows:
        emitted += _content_of(w, tok)
    end = ledger.pipeline_ledger(pipe)
    assert ledger.check(end) == []
    want = expected_ledger(records, tok, "train")
    assert {k: v["tokens"]["delivered"] for k, v in end.items()} == {k: v["tokens"] for k, v in want.items()}
    assert sum(v["tokens"]["delivered"] for v in end.values()) == emitted

    # a filter that loses one document without counting it: the ledger no longer adds up
    from stacklm.data.quality.filters import FilterNode

    original = FilterNode.next
    lost = []

    def lossy(self):
        doc = original(self)
        if not lost and doc["source"] == "web":
            lost.append(doc)
            return original(self)
        return doc

    monkeypatch.setattr(FilterNode, "next", lossy)
    pipe = build_pipeline(cfg, tok, "train")
    pipe.windows.reset()
    list(pipe.windows)
    problems = ledger.check(ledger.pipeline_ledger(pipe))
    assert len(problems) == 1 and "source 'web' docs: read" in problems[0] and "off by +1" in problems[0]
    with pytest.raises(LedgerError, match="does not add up"):
        ledger.enforce(ledger.pipeline_ledger(pipe), "test")
    monkeypatch.setenv(ledger.STRICT_ENV, "0")
    with pytest.warns(RuntimeWarning, match="does not add up"):
        ledger.enforce(ledger.pipeline_ledger(pipe), "a run")


def test_stream_worker_summaries_carry_a_checked_ledger(corpus, tok, tmp_path):
    """The stream loader's path: each worker's summary carries its ledger (delivered = what
    left its packer), the main process sums and checks them at every log step."""
    from stacklm.datamodule.stream import PipelineBuilder, StreamDataset, merge_worker_summaries

    root, _ = corpus
    tok_path = tmp_path / "tok.stacklm.json"
    tok.save(tok_path)
    builder = PipelineBuilder(data_section(root, total=20_000), str(tok_path), "train")
    summaries = []
    for worker in range(2):
        ds = StreamDataset(builder, split="train", rank=0, world_size=1, n_batches_total=10, batch_size=4, seq_len=SEQ_LEN,
                           pad_id=tok.pad_id, sources=["web", "books"])
        from stacklm.data.sources import ShardSpec
        from stacklm.datamodule.stream import _StreamIterator

        it = _StreamIterator(ds, ShardSpec(0, 1, worker, 2))
        for _ in range(3):
            next(it)
        summaries.append(it.summary())
    merged = merge_worker_summaries(summaries)
    assert merged["ledger"]["ok"], merged["ledger"]["problems"]
    total = ledger.merge(s["ledger"] for s in summaries)
    assert merged["ledger"]["sources"] == total
    assert sum(s["docs"]["read"] for s in total.values()) > 0


def test_drop_last_windows_are_counted_as_undelivered(corpus, tok):
    """``drop_last``: the windows of an incomplete last batch were kept by the mix but never
    delivered; the ledger names them instead of losing them."""
    root, _ = corpus
    # file order: this corpus then ends on windows where documents start (spread reads end on
    # the middle of a long one, whose tokens alone are then undelivered)
    cfg = PipelineConfig.from_dict(data_section(root, total=BIG, drop_last=True, batch_size=64, read_order="sequential"))
    pipe = build_pipeline(cfg, tok, "train")
    pipe.batches.reset()
    delivered = sum(int((b["input_ids"] != tok.pad_id).sum()) for b in pipe.batches)  # drains the stream
    windows = pipe.windows.packer.windows
    assert windows % 64, "the corpus must leave an incomplete last batch for this test"
    end = ledger.pipeline_ledger(pipe)
    assert ledger.check(end) == []
    undelivered = sum(s["docs"]["undelivered"].get("drop_last", 0) for s in end.values())
    assert undelivered > 0 and delivered > 0 or windows < 64
    assert sum(s["tokens"]["undelivered"].get("drop_last", 0) for s in end.values()) > 0
    text = ledger.format_ledger(end)
    assert "undelivered: drop_last" in text and "FAIL" not in text
