"""Preference (DPO) data: TRL's pair formats read into one shared-prompt pair, prompt masked and
stop token trained, overlong rules counted, pair batches, exact resume, disjoint rank shares,
a real Lightning Trainer in ``mode="preference"``, and TRL's DPOTrainer tokenizing like us."""

from __future__ import annotations

import json
import pickle

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from stacklm.chat import render_conversation
from stacklm.errors import ChatFormatError
from stacklm.chat.policy import LossPolicy
from stacklm.data.sources.schema import SourceConfig
from stacklm.data.sft import SFTConfig
from stacklm.data.sft.preference import (
    PREFERENCE_KEYS,
    collate_preference,
    dpo_dataset,
    preference_batch,
    preference_sides,
    read_pair,
    render_pair,
    render_preference_record,
)
from stacklm.data.sft.preference_pipeline import build_preference_pipeline
from stacklm.data.sources import ShardSpec
from stacklm.data.stats import StageStats
from tests.helpers.lightning import BatchRecorder, TinyDPO
from tests.helpers.resume import check_save_load_state
from tests.helpers.sft import make_pairs, write_jsonl

SEQ = 256


@pytest.fixture(scope="module")
def tok(tokenizer_1024):
    return tokenizer_1024


@pytest.fixture(scope="module")
def pairs():
    return make_pairs(60)


# ---------------------------------------------------------------------------------------
# Formats and rendering
# ---------------------------------------------------------------------------------------
def test_the_three_formats_render_the_same_pair(tok):
    sys_q = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sky colour?"}]
    a, b = {"role": "assistant", "content": "Blue."}, {"role": "assistant", "content": "Green, <|end|> surely."}
    explicit = {"prompt": sys_q, "chosen": [a], "rejected": [b]}
    implicit = {"chosen": sys_q + [a], "rejected": sys_q + [b]}
    implicit_with_text_prompt = {**implicit, "prompt": "Sky colour?"}  # TRL ignores a string prompt next to conversations
    plain = {"system": "Be brief.", "prompt": "Sky colour?", "chosen": "Blue.", "rejected": "Green, <|end|> surely."}
    sharegpt_roles = {"prompt": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Sky colour?"}],
                      "chosen": [{"from": "gpt", "value": "Blue."}], "rejected": [{"from": "gpt", "value": "Green, <|end|> surely."}]}
    want = render_preference_record(explicit, tok)
    for rec in (implicit, implicit_with_text_prompt, plain, sharegpt_roles):
        got = render_preference_record(rec, tok)
        for side in ("chosen", "rejected"):
            assert [x.tolist() for x in getattr(got, side)] == [x.tolist() for x in getattr(want, side)]
        assert got.n_prompt == want.n_prompt
    # each side is exactly the whole conversation as SFT renders it; the prompt is the generation prompt
    p_ids, _ = render_conversation(sys_q, tok, add_generation_prompt=True)
    for side, last in (("chosen", a), ("rejected", b)):
        ids, mask = getattr(want, side)
        full_ids, full_mask = render_conversation(sys_q + [last], tok)
        assert ids.tolist() == full_ids.tolist() and mask.tolist() == full_mask.tolist()
        assert ids[: want.n_prompt].tolist() == p_ids.tolist() and not mask[: want.n_prompt].any()
    assert read_pair(explicit).format == "conversational" and read_pair(implicit).format == "implicit"
    assert read_pair(plain).format == "plain"
    # lists stored as JSON text (parquet / hub) are messages; a reply that only looks like JSON is text
    as_json = {k: json.dumps(v) for k, v in explicit.items()}
    assert read_pair(as_json).chosen == read_pair(explicit).chosen
    jsonish = read_pair({"prompt": "List?", "chosen": '[{"a": 1}]', "rejected": "[1, 2]"})
    assert jsonish.format == "plain" and jsonish.chosen == [{"role": "assistant", "content": '[{"a": 1}]'}]


def test_a_multi_turn_prompt_is_never_trained_and_the_stop_token_is(tok):
    prompt = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "earlier reply"}, {"role": "user", "content": "b"}]
    rec = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "yes"}], "rejected": [{"role": "assistant", "content": "no"}]}
    for policy in (LossPolicy(), LossPolicy(mode="last_assistant_turn"), LossPolicy(mode="completion_only")):
        out = render_preference_record(rec, tok, policy=policy)
        for ids, mask in (out.chosen, out.rejected):
            assert not mask[: out.n_prompt].any()  # the earlier assistant turn is context here
            trained = ids[mask.astype(bool)].tolist()
            assert trained[-2:] == [tok.special_ids["<|end|>"], tok.eos_id]
            assert np.flatnonzero(mask).tolist() == list(range(out.n_prompt, len(ids)))
    no_stop = render_preference_record(rec, tok, policy=LossPolicy(train_stop_token=False))
    assert tok.eos_id not in no_stop.chosen[0][no_stop.chosen[1].astype(bool)].tolist()


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"prompt": "q", "chosen": "a"}, "no_messages_column"),
        ({"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}, "bad_message"),
        ({"chosen": "a", "rejected": "b"}, "bad_message"),
        ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
          "rejected": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "a"}]}, "no_shared_prompt"),
        ({"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}]},
         "empty_completion"),
        ({"prompt": "q", "chosen": "same", "rejected": "same"}, "identical_pair"),
        ({"prompt": [{"role": "wizard", "content": "q"}], "chosen": [], "rejected": []}, "unknown_role"),
    ],
)
def test_records_that_cannot_be_pairs_raise_with_their_reason(record, reason):
    with pytest.raises(ChatFormatError) as e:
        read_pair(record, where="f.jsonl:3")
    assert e.value.reason == reason and "f.jsonl:3" in str(e.value)


def test_overlong_rules_cut_at_turn_boundaries_and_count(tok):
    """Lengths from render_conversation (an independent renderer path) decide what each rule
    must do; the outcome, the turns cut and the result are checked against them."""
    long_user = "word " * 60
    prompt = [{"role": "system", "content": "sys"}, {"role": "user", "content": long_user},
              {"role": "assistant", "content": "ok"}, {"role": "user", "content": "short question?"}]
    chosen = [{"role": "assistant", "content": "short"}, {"role": "user", "content": "more?"}, {"role": "assistant", "content": "x " * 40}]
    rejected = [{"role": "assistant", "content": "tiny"}]
    rec = {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    full_c = len(render_conversation(prompt + chosen, tok)[0])
    full_r = len(render_conversation(prompt + rejected, tok)[0])
    cut_c = len(render_conversation(prompt + chosen[:1], tok)[0])
    kept_end_c = len(render_conversation(prompt[:1] + prompt[3:] + chosen, tok)[0])
    assert cut_c < full_c and full_r < full_c and kept_end_c < full_c
    seq = max(cut_c, full_r, kept_end_c)  # too short for the whole chosen side only
    assert seq < full_c
    p, c, r = read_pair(rec).turns()

    out, outcome, cut = render_pair(p, c, r, tok, seq, "truncate")
    assert (outcome, cut) == ("truncated", 2)
    assert len(out.chosen[0]) == cut_c and len(out.rejected[0]) == full_r
    assert out.chosen[0][-1] == tok.eos_id and out.chosen[1][-1] == 1  # the stop token stays, trained

    out, outcome, cut = render_pair(p, c, r, tok, seq, "keep_end")
    assert (outcome, cut) == ("truncated_start", 2)
    assert len(out.chosen[0]) == kept_end_c
    assert tok.decode(out.chosen[0].tolist()).startswith("<|bos|><|system|>sys<|end|><|user|>short question?")

    assert render_pair(p, c, r, tok, seq, "drop")[:2] == (None, "dropped_too_long")
    assert render_pair(p, c, r, tok, full_c, "drop")[1] == "kept"
    # what cannot be fit is dropped, and preference_batch counts every outcome
    stats = StageStats("render")
    tiny = {"prompt": "q", "chosen": "a " * 200, "rejected": "b"}
    batch = preference_batch([rec, rec, tiny], tok, seq, overlong="truncate", stats=stats)
    assert stats.to_dict() == {"batch": {"truncated": 2, "turns_cut": 4, "dropped_too_long": 1}}
    assert batch["pair_ids"].tolist() == [0, 1]


def test_collate_keeps_each_pair_on_its_row_index(tok, pairs):
    seq = 512
    batch = preference_batch(pairs[:6], tok, seq)
    assert tuple(batch) == PREFERENCE_KEYS
    assert all(batch[k].shape == (6, seq - 1) and batch[k].dtype == torch.long for k in PREFERENCE_KEYS[:-1])
    chosen, rejected = preference_sides(batch)
    for row, rec in enumerate(pairs[:6]):
        out = render_preference_record(rec, tok)
        for side, (ids, mask) in ((chosen, out.chosen), (rejected, out.rejected)):
            n = len(ids)  # the whole side is input (it is shorter than the row), then padding
            assert side["input_ids"][row, :n].tolist() == ids.tolist()
            want_t = np.where(mask[1:].astype(bool), ids[1:], -100)
            assert side["targets"][row, : n - 1].tolist() == want_t.tolist()
            assert (side["targets"][row, n - 1 :] == -100).all() and (side["input_ids"][row, n:] == tok.pad_id).all()
            assert side["position_ids"][row, :n].tolist() == list(range(n))
            assert side["seq_ids"][row, :n].eq(0).all() and side["seq_ids"][row, n:].eq(1).all()
            assert (side["targets"][row] != -100).sum() == int(mask.sum())
    # a side of exactly seq_len tokens fills the row: its <|eos|> is only a target, as in collate_sft
    out = render_preference_record(pairs[0], tok)
    longer = max((out.chosen, out.rejected), key=lambda s: len(s[0]))
    full = preference_batch([pairs[0]], tok, len(longer[0]))
    side = preference_sides(full)[0 if longer is out.chosen else 1]
    assert side["input_ids"][0].tolist() == longer[0][:-1].tolist() and side["seq_ids"][0].eq(0).all()
    assert side["targets"][0, -1] == tok.eos_id
    assert count_batches([full], tok.eos_id)["tokens"] == len(out.chosen[0]) + len(out.rejected[0])
    fill = collate_preference([], 16, tok.pad_id, batch_size=3)
    assert fill["pair_ids"].tolist() == [-1, -1, -1] and (fill["chosen_targets"] == -100).all()


# ---------------------------------------------------------------------------------------
# The graph: counts, resume, shares
# ---------------------------------------------------------------------------------------
def _config(tmp_path, pairs, **kw) -> SFTConfig:
    a = write_jsonl(tmp_path / "a.jsonl", pairs[: len(pairs) // 2] + ["{not json", {"prompt": "q", "chosen": "s", "rejected": "s"}])
    b = write_jsonl(tmp_path / "b.jsonl", pairs[len(pairs) // 2 :])
    args = {"sources": (SourceConfig("a", path=(str(a),), weight=2.0), SourceConfig("b", path=(str(b),))), "seq_len": SEQ,
            "batch_size": 3, "shuffle_buffer": 8, "holdout_fraction": 0.1, "seed": 3}
    args.update(kw)
    return SFTConfig(**args)


def _pair_ids(pipe) -> list[int]:
    return [i for b in pipe.batches for i in b["pair_ids"].tolist() if i >= 0]


def count_batches(batches, eos_id: int) -> dict[str, int]:
    """Pairs, tokens and loss tokens in preference batches, counted from the tensors alone: a
    side's tokens are its non-padding inputs, plus its final <|eos|> when it filled the row (then
    that token is only a target)."""
    out = {"docs": 0, "tokens": 0, "loss_tokens": 0}
    for b in batches:
        real = b["pair_ids"] >= 0
        out["docs"] += int(real.sum())
        for side in ("chosen", "rejected"):
            seq, inp = b[f"{side}_seq_ids"][real], b[f"{side}_input_ids"][real]
            out["tokens"] += int((seq == 0).sum() + ((seq[:, -1] == 0) & (inp[:, -1] != eos_id)).sum())
            out["loss_tokens"] += int((b[f"{side}_targets"] != -100).sum())
    return out


def test_pipeline_counts_every_pair(tok, pairs, tmp_path):
    cfg = _config(tmp_path, pairs)
    delivered, lost = {}, 0
    for split in ("train", "val"):
        pipe = build_preference_pipeline(cfg, tok, split)
        batches = list(pipe.batches)
        delivered[split] = [i for b in batches for i in b["pair_ids"].tolist() if i >= 0]
        realized = pipe.realized()
        assert {k: sum(r[k] for r in realized.values()) for k in ("docs", "tokens", "loss_tokens")} == count_batches(batches, tok.eos_id)
        st = pipe.stats()
        assert st["source"]["a"]["malformed_json"] == 1 and st["source"]["a"]["identical_pair"] == 1
        assert sum(per["kept"] for per in st["source"].values()) == len(pairs)  # every valid record read, on both splits
        render = st["render"]
        emitted = sum(per.get(k, 0) for per in render.values() for k in ("kept", "truncated", "truncated_start"))
        assert emitted == len(delivered[split])
        lost += sum(per.get(k, 0) for per in render.values() for k in ("dropped_too_long", "nothing_to_train"))
        summary = pipe.packing()
        assert summary["pairs"] == len(delivered[split])
        assert summary["pad_rows"] == summary["batches"] * 3 - summary["pairs"]
    assert not set(delivered["train"]) & set(delivered["val"]) and delivered["val"]
    assert len(delivered["train"]) + len(delivered["val"]) + lost == len(pairs)  # each pair in one split, or counted lost


def test_exact_resume_mid_epoch(tok, pairs, tmp_path):
    cfg = _config(tmp_path, pairs)

    def small(r):
        assert len(pickle.dumps(r.state)) < 200_000

    def counters_continue(r):
        assert r.restored.stats() == r.uninterrupted.stats() and r.restored.realized() == r.uninterrupted.realized()
        assert r.restored.packing() == r.uninterrupted.packing()

    full = check_save_load_state(lambda: build_preference_pipeline(cfg, tok), lambda n: (0, 1, n // 2, n - 1, n),
                                 node=lambda pipe: pipe.batches, state_round_trip="pickle",
                                 check_state=small, check_resumed=counters_continue)
    assert len(full) >= 10


@pytest.mark.parametrize("world, workers", [(2, 1), (2, 2)])
def test_rank_and_worker_shares_are_disjoint_and_complete(tok, pairs, tmp_path, world, workers):
    cfg = _config(tmp_path, pairs, holdout_fraction=0.0, overlong="drop")
    whole = _pair_ids(build_preference_pipeline(cfg, tok))
    shares = [_pair_ids(build_preference_pipeline(cfg, tok, shard=ShardSpec(r, world, w, workers)))
              for r in range(world) for w in range(workers)]
    flat = [i for s in shares for i in s]
    assert len(flat) == len(set(flat)) and sorted(flat) == sorted(whole)


# ---------------------------------------------------------------------------------------
# StackDataModule(mode="preference") under a real Trainer
# ---------------------------------------------------------------------------------------
def _trainer(root, callbacks, steps):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=1, callbacks=callbacks, logger=False,
                     enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, default_root_dir=root,
                     num_sanity_val_steps=0)


def test_preference_mode_trains_and_resumes_exactly_with_a_worker(tokenizer_512, saved_tokenizer_dir, tmp_path):
    from stacklm.datamodule import StackDataModule

    path = write_jsonl(tmp_path / "pairs.jsonl", make_pairs(40))
    pipeline = {"sources": [{"name": "p", "kind": "local", "path": [str(path)]}], "shuffle_buffer": 8, "holdout_fraction": 0.1}

    def dm(rank=0, world=1, **kw):
        m = StackDataModule(mode="preference", tokenizer=str(saved_tokenizer_dir(tokenizer_512)), pipeline=pipeline, seq_len=SEQ,
                            batch_size=2, num_workers=1, val_batches=0, **kw)
        m.rank, m.world_size = rank, world
        return m

    # DDP shares: both ranks take the same number of steps over disjoint pairs
    per_rank = []
    for rank in (0, 1):
        m = dm(rank, 2)
        batches = list(m.train_dataloader())
        per_rank.append(batches)
        assert all(tuple(b) == PREFERENCE_KEYS for b in batches)
        # what the module logs is what the batches hold
        stats = m.data_stats()
        counted = count_batches(batches, m.tokenizer.eos_id)
        assert stats["realized"]["p"]["docs"] == counted["docs"]
        pad = m.tokenizer.pad_id  # delivered tokens: the non-pad input ids of both sides, as for every batch
        non_pad = sum(int((b[f"{side}_input_ids"] != pad).sum()) for b in batches for side in ("chosen", "rejected"))
        assert stats["realized"]["p"]["tokens"] == non_pad == stats["delivered"]["tokens"]
    assert len(per_rank[0]) == len(per_rank[1])
    ids = [[i for b in bs for i in b["pair_ids"].tolist() if i >= 0] for bs in per_rank]
    assert ids[0] and ids[1] and not set(ids[0]) & set(ids[1])
    # a stream that runs dry is padded with filler batches of the same keys and shape, no loss
    # (the worker warns, in its own process, and counts them in its summary)
    n = len(list(dm().train_dataloader()))
    m = dm(train_batches=n + 3)
    long = list(m.train_dataloader())
    assert next(iter(m._train_loader.worker_summaries.values()))["padding_batches"] == 3
    fillers = [b for b in long if (b["pair_ids"] < 0).all()]
    assert len(long) == n + 3 and len(fillers) == 3
    assert all(tuple(b) == PREFERENCE_KEYS and b["chosen_input_ids"].shape == (2, SEQ - 1) for b in fillers)
    assert all((b["chosen_targets"] == -100).all() and (b["rejected_targets"] == -100).all() for b in fillers)

    steps, k = 8, 3
    full = BatchRecorder()
    _trainer(tmp_path / "full", [full], steps).fit(TinyDPO(512), datamodule=dm())
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=k, save_top_k=-1)
    crashed = BatchRecorder(crash_after_step=k + 2)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        _trainer(tmp_path / "run1", [ckpt, crashed], steps).fit(TinyDPO(512), datamodule=dm())
    resumed = BatchRecorder()
    _trainer(tmp_path / "run2", [resumed], steps).fit(TinyDPO(512), datamodule=dm(), ckpt_path=tmp_path / "ckpt" / f"epoch=0-step={k}.ckpt")
    assert len(full.seen) == steps and resumed.seen == full.seen[k:]


# ---------------------------------------------------------------------------------------
# TRL
# ---------------------------------------------------------------------------------------
def test_trl_dpo_trainer_tokenizes_like_us(tok, pairs, tmp_path):
    """TRL's DPOTrainer, given ``dpo_dataset`` and the exported tokenizer, splits every pair into
    the prompt ids and completion ids we render, and the completion is what our targets train."""
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from stacklm.chat.template_export import export_hf
    from tests.helpers.lightning import tiny_llama

    hf_tok = AutoTokenizer.from_pretrained(export_hf(tok, tmp_path / "hf"))
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    records = pairs[:30] + [{**pairs[0], "tools": tools}, {"prompt": "Plain <|end|> q", "chosen": "A", "rejected": "B"}]
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), report_to=[], max_length=None, dataset_num_proc=None, use_cpu=True,
                     bf16=False, gradient_checkpointing=False)
    trainer = DPOTrainer(model=tiny_llama(len(hf_tok)), ref_model=tiny_llama(len(hf_tok)), args=args, train_dataset=dpo_dataset(records), processing_class=hf_tok)
    rows = list(trainer.train_dataset)
    assert len(rows) == len(records)
    for rec, row in zip(records, rows, strict=True):
        out = render_preference_record(rec, tok)
        for side in ("chosen", "rejected"):
            ids, mask = getattr(out, side)
            assert row["prompt_ids"] == ids[: out.n_prompt].tolist(), rec
            assert row[f"{side}_ids"] == ids[out.n_prompt :].tolist(), rec
            assert np.flatnonzero(mask).tolist() == list(range(out.n_prompt, len(ids)))  # TRL's loss tokens are ours
    assert json.loads(dpo_dataset(records[-2:])[0]["tools"]) == tools
    # TRL's own reading of the raw conversational records, implicit prompts included (its
    # extract_prompt), agrees with ours too
    from datasets import Dataset

    for kind in (0, 1):
        raw = [r for i, r in enumerate(pairs[:30]) if i % 3 == kind]
        trainer = DPOTrainer(model=tiny_llama(len(hf_tok)), ref_model=tiny_llama(len(hf_tok)), args=args,
                             train_dataset=Dataset.from_list(raw), processing_class=hf_tok)
        for rec, row in zip(raw, trainer.train_dataset, strict=True):
            out = render_preference_record(rec, tok)
            assert row["prompt_ids"] == out.chosen[0][: out.n_prompt].tolist()
            assert row["chosen_ids"] == out.chosen[0][out.n_prompt :].tolist()
            assert row["rejected_ids"] == out.rejected[0][out.n_prompt :].tolist()


@pytest.mark.slow
def test_preference_mode_under_real_ddp_is_disjoint_complete_and_resumes(tokenizer_512, saved_tokenizer_dir, tmp_path):
    """Two gloo processes (``tests/runners/ddp_fit.py``): equal step counts, disjoint pairs that together
    are the whole train split, and a crash resumed from a checkpoint on both ranks exactly."""
    from tests.helpers.ddp import run_ddp, seen

    path = write_jsonl(tmp_path / "pairs.jsonl", make_pairs(36))
    pipeline = {"sources": [{"name": "p", "kind": "local", "path": [str(path)]}], "shuffle_buffer": 4, "holdout_fraction": 0.1}
    tok_dir = str(saved_tokenizer_dir(tokenizer_512))
    common = ["--mode", "preference", "--tokenizer", tok_dir, "--pipeline", json.dumps(pipeline), "--seq-len", str(SEQ),
              "--workers", "1"]
    run_ddp(*common, "--out", str(tmp_path / "full"))
    full = seen(tmp_path / "full")
    assert len(full[0]) == len(full[1]) >= 4
    ids = [[int(i) for s in rank for i in s[2] if int(i) >= 0] for rank in full]
    assert not set(ids[0]) & set(ids[1]) and len(ids[0]) == len(set(ids[0]))
    from stacklm.tokenizer.bpe import StackTokenizer

    whole = _pair_ids(build_preference_pipeline(SFTConfig.from_dict({**pipeline, "seq_len": SEQ, "batch_size": 2}),
                                                StackTokenizer.load(tok_dir)))
    assert sorted(ids[0] + ids[1]) == sorted(whole)

    k = 2
    run_ddp(*common, "--out", str(tmp_path / "run1"), "--ckpt-every", str(k), "--crash-after", str(k + 1), expect_crash=True)
    ckpt = tmp_path / "run1" / "ckpt" / f"epoch=0-step={k}.ckpt"
    assert ckpt.exists()
    run_ddp(*common, "--out", str(tmp_path / "run2"), "--resume", str(ckpt))
    resumed = seen(tmp_path / "run2")
    for r in (0, 1):
        assert [s[1] for s in resumed[r]] == [s[1] for s in full[r][k:]]


def test_inspect_reads_a_saved_preference_batch(tok, saved_tokenizer_dir, pairs, tmp_path):
    """``stacklm inspect`` checks both sides of every pair: all clean with the default policy
    (stop tokens counted: each side's <|end|> and <|eos|>), errors without trained stop tokens."""
    from stacklm.inspector import inspect_input

    tok_dir = saved_tokenizer_dir(tok)
    records = [p for p in pairs if isinstance(p.get("prompt"), str)][:5]  # plain pairs: one assistant turn a side
    torch.save(preference_batch(records, tok, 512), tmp_path / "ok.pt")
    ok = inspect_input(tmp_path / "ok.pt", tok_dir)
    assert not ok.errors and ok.sequences == 2 * len(records) and ok.trained_stop_tokens == 4 * len(records)
    batch = preference_batch(records, tok, 512, policy=LossPolicy(train_stop_token=False))
    torch.save(batch, tmp_path / "bad.pt")
    bad = inspect_input(tmp_path / "bad.pt", tok_dir)
    # no <|end|> trained either: the turn-closer check (issue 26) says so too, as for SFT batches
    assert {f.check for f in bad.errors} == {"stop_token_never_trained", "turn_closer_not_trained"}


def test_the_packaged_preference_config_builds_a_datamodule(tokenizer_512, saved_tokenizer_dir, tmp_path):
    """``--config preference``'s data section, pointed at local pairs, is a working datamodule."""
    import yaml

    from stacklm.configs import resolve_config
    from stacklm.datamodule import StackDataModule

    data = yaml.safe_load(resolve_config("preference").read_text())["data"]
    assert data["mode"] == "preference"
    path = write_jsonl(tmp_path / "pairs.jsonl", make_pairs(12))
    data["pipeline"]["sources"] = [{"name": "local", "kind": "local", "path": [str(path)]}]
    data.update(tokenizer=str(saved_tokenizer_dir(tokenizer_512)), seq_len=SEQ, batch_size=2)
    dm = StackDataModule(**data)
    batches = list(dm.train_dataloader())
    assert batches and all(tuple(b) == PREFERENCE_KEYS and b["chosen_input_ids"].shape == (2, SEQ - 1) for b in batches)



def test_the_built_in_gpt_refuses_preference_batches_up_front():
    """`python -m trainer fit` with mode: preference is a config mistake (the built-in model trains
    the batch contract only): one StackLMError at setup, not a KeyError at the first step."""
    from types import SimpleNamespace

    from stacklm.errors import ConfigError
    from stacklm.train.model import GPTConfig
    from stacklm.train.gpt_module import check_datamodule

    with pytest.raises(ConfigError, match=r"mode='preference'.*own LightningModule"):
        check_datamodule(SimpleNamespace(mode="preference"), GPTConfig())
    check_datamodule(SimpleNamespace(mode="sft"), GPTConfig())  # the other modes pass this check
