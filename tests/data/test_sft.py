"""SFT pipes: packing that isolates conversations, assistant-only targets, truncation and
drop rules with counts, jsonl / parquet / HF datasets sources, sharding, holdout, exact resume."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from stacklm.chat import IGNORE_INDEX, as_turns, render_conversation, sft_targets
from stacklm.errors import ChatFormatError, ConfigError
from stacklm.configs import CONFIG_DIR
from stacklm.data.contract import BATCH_KEYS
from stacklm.data.packing.masks import dense_mask
from stacklm.data.packing.nodes import DELIVERY_KEY
from stacklm.data.sources.schema import SourceConfig
from stacklm.chat.render import render_for_sft, tag_loss, truncation_point, untag_loss
from stacklm.data.sft import (
    ConversationPacker,
    ConversationSource,
    SFTConfig,
    build_sft_pipeline,
    collate_sft,
    sft_batch,
)
from stacklm.data.sources import ShardSpec
from stacklm.errors import SourceError
from stacklm.data.stats import StageStats
from tests.helpers.resume import check_save_load_state
from tests.helpers.sft import make_conversations, write_jsonl

SEQ = 256


@pytest.fixture(scope="module")
def tok(tokenizer_1024):
    return tokenizer_1024


@pytest.fixture(scope="module")
def convs():
    return make_conversations(90)


def sharegpt(msgs):
    names = {"user": "human", "assistant": "gpt"}
    return {"conversations": [{"from": names.get(m["role"], m["role"]), "value": m["content"]} for m in msgs]}


def write_parquet(path: Path, convs) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([sharegpt(c) for c in convs]), path)
    return path


def full_windows(batch):
    """The window tokens and loss flags back from a batch (every conversation here ends on a
    trained <|eos|>, so the last target of a row is known whenever it is not padding)."""
    x, y = batch["input_ids"].numpy(), batch["targets"].numpy()
    return np.concatenate([x, np.where(y[:, -1:] != IGNORE_INDEX, y[:, -1:], -1)], axis=1)


def rendered_pieces(tok, convs, seq_len=SEQ):
    out = {}
    for c in convs:
        piece, outcome, _ = render_for_sft(as_turns(c), tok, seq_len)
        if piece is not None:
            ids, loss = untag_loss(piece)
            out.setdefault(tuple(ids.tolist()), []).append(loss)
    return out


def split_row(window, bos, pad):
    starts = [j for j, t in enumerate(window) if t == bos]
    ends = starts[1:] + [next((j for j in range(starts[-1], len(window)) if window[j] in (pad, -1)), len(window))] if starts else []
    return list(zip(starts, ends))


def assert_isolated_and_correct(batch, tok, convs, seq_len=SEQ):
    bos, pad = tok.bos_id, tok.pad_id
    windows = full_windows(batch)
    pieces = rendered_pieces(tok, convs, seq_len)
    expected = sorted((k for k, v in pieces.items() for _ in v))
    seen = []
    seq, pos, targets = batch["seq_ids"].numpy(), batch["position_ids"].numpy(), batch["targets"].numpy()
    allowed = dense_mask(batch["seq_ids"]).numpy()
    for b, w in enumerate(windows):
        conv = np.cumsum(w == bos)[:-1]
        real = w[:-1] != pad
        # attention allowed only inside one conversation
        ii, jj = np.nonzero(allowed[b])
        both = real[ii] & real[jj]
        assert (conv[ii][both] == conv[jj][both]).all()
        for s, e in split_row(w.tolist(), bos, pad):
            piece = tuple(w[s:e].tolist())
            assert piece in pieces, "a packed conversation is not exactly one rendered conversation"
            seen.append(piece)
            T = min(e, len(w) - 1)
            assert pos[b, s:T].tolist() == list(range(T - s))  # positions restart per conversation
            assert len(set(seq[b, s:T].tolist())) == 1 and (s == 0 or seq[b, s] != seq[b, s - 1])
            exp = sft_targets(np.array(piece), pieces[piece][0].astype(np.int8))  # len(piece) - 1 targets
            last = min(e - 1, len(w) - 1)
            assert targets[b, s:last].tolist() == exp[: last - s].tolist()
            if e - 1 < len(w) - 1:  # the conversation's last token never predicts the next one
                assert targets[b, e - 1] == IGNORE_INDEX
        pad_from = next((j for j in range(len(w)) if w[j] in (pad, -1)), len(w))
        assert (targets[b, pad_from - 1 :] == IGNORE_INDEX).all() or pad_from >= len(w) - 1
    assert sorted(seen) == expected  # every kept conversation exactly once, none cut


def test_loss_tags_round_trip():
    ids = np.array([5, 0, 1023, 7, 32767], dtype=np.int32)
    mask = np.array([0, 1, 1, 0, 1], dtype=np.int8)
    tagged = tag_loss(ids, mask)
    assert tagged.dtype == np.int32 and ((tagged < 0) == mask.astype(bool)).all()
    back, loss = untag_loss(tagged)
    assert back.tolist() == ids.tolist() and loss.tolist() == mask.astype(bool).tolist()


def test_overlong_conversations_truncate_at_a_turn_boundary_or_drop(tok, convs):
    long_answer = " ".join(convs[i][-1]["content"] for i in range(12))
    conv = as_turns([
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "short answer"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": long_answer},
    ])
    piece, outcome, cut = render_for_sft(conv, tok, SEQ)
    assert outcome == "truncated" and cut == 2
    ids, loss = untag_loss(piece)
    ref_ids, ref_mask = render_conversation(conv[:2], tok)
    assert ids.tolist() == ref_ids.tolist() and loss.tolist() == ref_mask.astype(bool).tolist()
    assert ids[-2:].tolist() == [tok.token_id("<|end|>"), tok.eos_id] and loss[-2:].all()
    assert render_for_sft(conv, tok, SEQ, overlong="drop")[:2] == (None, "dropped_too_long")
    # nothing fits when the first assistant turn is already too long
    assert render_for_sft(conv[2:], tok, SEQ)[:2] == (None, "dropped_too_long")
    assert truncation_point(conv, [np.zeros(10)] * 4, 24) == 2  # 2 + 10 + 10 <= 24 < 2 + 30


def test_sft_batch_packs_whole_conversations_without_cross_attention(tok, convs):
    stats = StageStats("render")
    batch = sft_batch(convs, tok, SEQ, stats=stats)
    assert set(batch) == {"input_ids", "targets", "position_ids", "seq_ids"}
    assert all(v.dtype == torch.long and v.shape == batch["input_ids"].shape for v in batch.values())
    assert batch["input_ids"].shape[1] == SEQ - 1
    counts = stats.to_dict()["batch"]
    assert counts["kept"] + counts.get("truncated", 0) + counts.get("dropped_too_long", 0) == len(convs)
    assert counts.get("truncated", 0) > 0  # the generator makes some longer than SEQ
    # best fit: several conversations share a row
    assert batch["input_ids"].shape[0] < counts["kept"] + counts.get("truncated", 0)
    assert_isolated_and_correct(batch, tok, convs)
    # no loss anywhere but on assistant tokens: every trained target is inside an assistant span
    n_loss = int((batch["targets"] != IGNORE_INDEX).sum())
    want = sum(int(l.sum()) for v in rendered_pieces(tok, convs).values() for l in v)
    assert n_loss == want


def test_collate_rejects_nothing_and_pads_as_its_own_segment(tok):
    a = tag_loss(*render_conversation([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tok))
    packer = ConversationPacker(32, tok.bos_id, tok.eos_id, tok.pad_id, buffer_docs=4)
    windows = packer.push({"ids": a, "source": "t"}) + packer.push({"ids": a, "source": "t"}) + packer.finish()
    batch = collate_sft(windows, tok.bos_id, tok.eos_id, tok.pad_id)
    assert batch["seq_ids"][0].tolist()[: 2 * len(a)] == [0] * len(a) + [1] * len(a)
    assert batch["seq_ids"][0, 2 * len(a)] == 2  # padding
    # one buffer per batch, as in pre-training batches: one shared-memory block per worker batch
    assert len({t.untyped_storage().data_ptr() for t in batch.values()}) == 1
    assert all(t.is_contiguous() and t.dtype == torch.long for t in batch.values())
    with pytest.raises(ValueError, match="seq_len"):
        ConversationPacker(4, tok.bos_id, tok.eos_id, tok.pad_id).push({"ids": a, "doc_id": "x"})


def bad_rows(convs):
    good = [{"messages": c} for c in convs]
    return good[:10] + [
        "{this is not json",                                                          # line 11
        {"messages": [{"role": "wizard", "content": "abracadabra"}, {"role": "assistant", "content": "x"}]},  # 12
        {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}]},               # 13
        {"messages": [{"role": "user", "content": "only a question"}]},               # 14
        "",                                                                            # 15 blank
        {"text": "not a chat"},                                                        # 16
    ] + good[10:]


def test_pipeline_counts_every_rejection_with_its_location(tok, convs, tmp_path):
    path = write_jsonl(tmp_path / "chats.jsonl", bad_rows(convs))
    cfg = SFTConfig(sources=(SourceConfig("chats", path=(str(path),)),), seq_len=SEQ, batch_size=4,
                    shuffle_buffer=1, pack_buffer_docs=8, holdout_fraction=0.0)
    pipe = build_sft_pipeline(cfg, tok)
    pipe.batches.reset()
    batches = list(pipe.batches)
    stats = pipe.stats()
    src = stats["source"]["chats"]
    assert src["kept"] == len(convs)
    for reason in ("malformed_json", "unknown_role", "empty_content", "no_assistant", "no_messages_column", "blank_lines_skipped"):
        assert src[reason] == 1, reason
    ex = pipe.examples()["chats"]
    assert ex["malformed_json"].startswith(f"{path}:11:")
    assert f"{path}:12, message 0" in ex["unknown_role"] and "wizard" in ex["unknown_role"]
    assert f"{path}:13" in ex["empty_content"] and f"{path}:14" in ex["no_assistant"]
    render = stats["render"]["chats"]
    assert render["kept"] + render.get("truncated", 0) + render.get("dropped_too_long", 0) == len(convs)
    realized = pipe.realized()["chats"]
    assert realized["loss_tokens"] == sum(int((b["targets"] != IGNORE_INDEX).sum()) for b in batches)
    assert realized["docs"] == render["kept"] + render.get("truncated", 0) and realized["target_weight"] == 1.0
    assert pipe.packing()["docs"] == render["kept"] + render.get("truncated", 0)
    merged = {k: torch.cat([b[k] for b in batches]) for k in BATCH_KEYS}  # not the delivery counts riding along
    assert_isolated_and_correct(merged, tok, convs)
    delivered = sum(sum(b[DELIVERY_KEY]["tokens"]) for b in batches)
    assert int(delivered) == sum(int((b["input_ids"] != tok.pad_id).sum()) for b in batches)  # counted by the batch itself

    strict = SFTConfig(sources=cfg.sources, seq_len=SEQ, on_invalid="raise", holdout_fraction=0.0)
    pipe = build_sft_pipeline(strict, tok)
    pipe.batches.reset()
    with pytest.raises(ChatFormatError, match=rf"{path}:11: not valid JSON") as e:
        list(pipe.batches)
    assert e.value.reason == "malformed_json"


def test_all_rejected_source_is_an_error_naming_the_reasons(tok, tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": f"q{i}"}]} for i in range(5)])
    node = ConversationSource(SourceConfig("q", path=(str(path),)))
    node.reset()
    with pytest.raises(SourceError, match=r"all 5 conversations .* rejected .*no_assistant"):
        list(node)


def test_jsonl_parquet_and_hf_datasets_sources_agree(tok, convs, tmp_path):
    jsonl = write_jsonl(tmp_path / "a.jsonl", [{"messages": c} for c in convs])
    parquet = write_parquet(tmp_path / "a.parquet", convs)
    shj = write_jsonl(tmp_path / "s.jsonl", [sharegpt(c) for c in convs])
    specs = [
        SourceConfig("x", path=(str(jsonl),)),
        SourceConfig("x", path=(str(parquet),)),
        SourceConfig("x", kind="hf", path="json", data_files=(str(shj),)),  # the hub code path, on a local file
    ]
    results = []
    for spec in specs:
        cfg = SFTConfig(sources=(spec,), seq_len=SEQ, batch_size=8, shuffle_buffer=16, pack_buffer_docs=8, holdout_fraction=0.0)
        pipe = build_sft_pipeline(cfg, tok)
        pipe.batches.reset()
        results.append([b for b in pipe.batches])
    for other in results[1:]:
        assert len(other) == len(results[0])
        for a, b in zip(results[0], other):
            assert all(torch.equal(a[k], b[k]) for k in BATCH_KEYS)


def _resume_config(tmp_path, convs):
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": c} for c in convs[:50]])
    b = write_parquet(tmp_path / "b.parquet", convs[50:])
    return SFTConfig(
        sources=(SourceConfig("a", path=(str(a),), weight=2.0), SourceConfig("b", path=(str(b),))),
        seq_len=SEQ, batch_size=3, shuffle_buffer=12, pack_buffer_docs=6, holdout_fraction=0.1, seed=7,
    )


def test_exact_resume_mid_stream(tok, convs, tmp_path):
    cfg = _resume_config(tmp_path, convs)

    def small(r):
        assert len(pickle.dumps(r.state)) < 200_000  # small: arrays and counters, not the data

    def counters_continue(r):
        assert r.restored.stats() == r.uninterrupted.stats() and r.restored.realized() == r.uninterrupted.realized()

    full = check_save_load_state(
        lambda: build_sft_pipeline(cfg, tok), (1, 4), node=lambda pipe: pipe.batches,
        check_state=small, check_resumed=counters_continue,
    )
    assert len(full) >= 6


def test_train_and_val_splits_are_disjoint_and_complete(tok, convs, tmp_path):
    cfg = _resume_config(tmp_path, convs)
    ids = {}
    for split in ("train", "val"):
        pipe = build_sft_pipeline(cfg, tok, split=split)
        got = []
        for name in ("a", "b"):
            node = pipe.chains[name]["holdout"]
            node.reset()
            got += [d["doc_id"] for d in node]
        ids[split] = got
    assert not set(ids["train"]) & set(ids["val"])
    assert len(ids["train"]) + len(ids["val"]) == len(convs) and ids["val"]


@pytest.mark.parametrize("n_files", [1, 5])
def test_shards_read_each_conversation_once(convs, tmp_path, n_files):
    files = []
    for i in range(n_files):
        files.append(str(write_jsonl(tmp_path / f"p{i}.jsonl", [{"messages": c} for c in convs[i::n_files]])))
    seen = []
    for rank in range(2):
        for worker in range(2):
            node = ConversationSource(SourceConfig("s", path=tuple(files)), shard=ShardSpec(rank, 2, worker, 2))
            node.reset()
            seen += [d["doc_id"] for d in node]
    assert len(seen) == len(set(seen)) == len(convs)


def test_config_file_and_bad_config(tmp_path):
    import yaml

    data = yaml.safe_load((CONFIG_DIR / "sft.yaml").read_text())["data"]["pipeline"]
    cfg = SFTConfig.from_run_config(CONFIG_DIR / "sft.yaml")  # seq_len and batch_size from data:, as the trainer reads them
    assert cfg.sources[0].kind == "hf" and (cfg.seq_len, cfg.batch_size) == (2048, 16) and cfg.overlong == "truncate"
    with pytest.raises(ConfigError, match=r"no 'seq_len' or 'batch_size' in this mapping .* SFTConfig.from_run_config"):
        SFTConfig.from_dict(data)  # the pipeline mapping alone: batch_size 16 is in data:, not here
    data = {**data, "seq_len": 2048, "batch_size": 16}
    assert SFTConfig.from_dict(cfg.to_dict()).config_hash() == cfg.config_hash()
    with pytest.raises(ValueError, match="unknown field"):
        SFTConfig.from_dict({**data, "seqlen": 5})
    with pytest.raises(ValueError, match="overlong"):
        SFTConfig.from_dict({**data, "overlong": "wrap"})
    with pytest.raises(ValueError, match="path"):
        SourceConfig("x", kind="local")
