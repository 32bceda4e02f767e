"""The whole streaming graph: batch contract, accounting, and bit-exact resume."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from stacklm.data.contract import BATCH_KEYS
from stacklm.data.pipeline import PipelineConfig, build_pipeline
from stacklm.data.packing.nodes import DELIVERY_KEY
from stacklm.data.registry import DataMix, SourceConfig
from tests.helpers.resume import check_save_load_state

SEQ_LEN = 128


@pytest.fixture(scope="module")
def tok(tokenizer_1024):
    return tokenizer_1024


def _config(**kw) -> PipelineConfig:
    mix = DataMix(
        "test",
        kw.pop("total_tokens", 60_000),
        (
            SourceConfig("web", "synthetic", 0.6, "prose", seed=1, num_docs=1500),
            SourceConfig("code", "synthetic", 0.3, "code", seed=2, num_docs=600),
            SourceConfig("math", "synthetic", 0.1, "math", seed=3, num_docs=600),
        ),
    )
    base = dict(seq_len=SEQ_LEN, batch_size=4, shuffle_buffer=64, pack_buffer_docs=32, holdout_fraction=0.05,
                tokenize_batch_docs=16, strategy="best_fit")
    base.update(kw)
    return PipelineConfig(mix, **base)


def _take(node, k):
    out = []
    for _ in range(k):
        out.append(next(node))
    return out


@pytest.mark.parametrize("strategy", ["best_fit", "greedy"])
def test_batches_count_what_they_deliver_per_source(tok, strategy):
    """Each batch's delivery counts against the batch itself (non-pad input tokens) and, over the
    drained stream, against the mixer's own per-source counts (documents, and their lengths:
    every document's <bos> ids <eos> counted once, in the batch where its <bos> is)."""
    p = build_pipeline(_config(total_tokens=40_000, strategy=strategy), tok)
    names = ["web", "code", "math"]
    tokens, docs, lengths = np.zeros(3, np.int64), np.zeros(3, np.int64), np.zeros(3, np.int64)
    for b in p.batches:
        d = {k: np.asarray(v, dtype=np.int64) for k, v in b[DELIVERY_KEY].items()}
        d["doc_lengths"] = d["doc_lengths"].reshape(-1, 2)
        assert int(d["tokens"].sum()) == int((b["input_ids"] != tok.pad_id).sum())
        assert int(d["docs"].sum()) == int((torch.cat([b["input_ids"], b["targets"][:, -1:]], 1) == tok.bos_id).sum())
        tokens += d["tokens"]
        docs += d["docs"]
        np.add.at(lengths, d["doc_lengths"][:, 0], d["doc_lengths"][:, 1])
    real = p.realized()
    assert docs.tolist() == [real[n]["docs"] for n in names]
    assert lengths.tolist() == [real[n]["tokens"] + 2 * real[n]["docs"] for n in names]
    assert all(tokens > 0) and tokens.sum() <= lengths.sum()


def test_batches_follow_the_contract(tok):
    p = build_pipeline(_config(total_tokens=150_000), tok)
    batches = list(p.batches)
    assert batches
    for b in batches:
        assert set(b) == set(BATCH_KEYS) | {DELIVERY_KEY}  # the loader takes the delivery counts off
        for key in BATCH_KEYS:
            assert b[key].dtype == torch.long and b[key].shape[1] == SEQ_LEN - 1
        assert int(b["position_ids"].min()) >= 0 and int(b["position_ids"].max()) < SEQ_LEN
        assert (b["targets"][:, :-1][b["targets"][:, :-1] != -100] == b["input_ids"][:, 1:][b["targets"][:, :-1] != -100]).all()
        assert (b["input_ids"] < tok.vocab_size).all()
        # bos starts a document at position 0; no target crosses into another document
        pos0 = b["input_ids"] == tok.bos_id
        assert (b["position_ids"][pos0] == 0).all()
        cross = b["seq_ids"][:, 1:] != b["seq_ids"][:, :-1]
        assert (b["targets"][:, :-1][cross] == -100).all()
    # budgets met exactly and every drop counted
    real = p.realized()
    assert sum(r["tokens"] for r in real.values()) == 150_000
    assert [real[n]["tokens"] for n in ("web", "code", "math")] == [90_000, 45_000, 15_000]
    stats = p.stats()
    assert sum(v.get("exact_dup", 0) for v in stats["dedup"].values()) > 0
    assert sum(v.get("near_dup", 0) for v in stats["dedup"].values()) > 0
    assert sum(v.get("holdout_other_split", 0) for v in stats["holdout"].values()) > 0


def test_train_and_val_never_share_a_document(tok):
    cfg = _config(holdout_fraction=0.2, total_tokens=20_000)
    ids = {}
    for split in ("train", "val"):
        p = build_pipeline(cfg, tok, split=split)
        seen = []
        orig = p.mix.mixer.admit

        def admit(i, doc, _seen=seen, _orig=orig):
            _seen.append(doc["doc_id"])
            return _orig(i, doc)

        p.mix.mixer.admit = admit
        list(p.batches)
        ids[split] = set(seen)
    assert ids["train"] and ids["val"]
    assert not ids["train"] & ids["val"]


@pytest.mark.parametrize("strategy", ["best_fit", "greedy"])
@pytest.mark.parametrize("k", [1, 7, 23])
def test_exact_resume_of_the_whole_graph(tok, strategy, k):
    cfg = _config(strategy=strategy)

    def counters_continue(r):  # from the checkpoint, not from zero
        assert sum(x["tokens"] for x in r.restored.realized().values()) == 60_000

    full = check_save_load_state(
        lambda: build_pipeline(cfg, tok), [k], node=lambda p: p.batches,
        state_round_trip="pickle",  # what a checkpoint stores
        check_resumed=counters_continue,
    )
    assert len(full) > k + 3


def test_state_is_compact(tok):
    p = build_pipeline(_config(), tok)
    _take(p.batches, 10)
    blob = pickle.dumps(p.batches.state_dict())
    assert len(blob) < 2_000_000


def test_bad_config_is_named():
    with pytest.raises(ValueError, match="strategy"):
        _config(strategy="first_fit")
    with pytest.raises(ValueError, match="unknown field"):
        PipelineConfig.from_dict({"mix": _config().mix.to_dict(), "seqlen": 5})
    cfg = _config()
    assert PipelineConfig.from_dict(cfg.to_dict()) == cfg
    assert PipelineConfig.from_dict(cfg.to_dict()).config_hash() == cfg.config_hash()
    assert _config(seed=1).config_hash() != cfg.config_hash()
