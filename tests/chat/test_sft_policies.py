"""Masking and truncation policies of the SFT pipes: each loss mode, per-turn weight 0, the
stop token, reasoning, per source in a mix, and drop / truncate / keep_end -- every mask checked
against an independent per-turn rendering, every count against an independent count."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stacklm.chat import Turn, render_conversation
from stacklm.chat.formats import conversation_from_record
from stacklm.chat.policy import LossPolicy
from stacklm.data.sources.schema import SourceConfig
from stacklm.chat.render import render_for_sft, untag_loss
from stacklm.data.sft import SFTConfig, build_sft_pipeline, sft_batch
from stacklm.data.stats import StageStats
from tests.helpers.sft import make_conversations, write_jsonl


@pytest.fixture(scope="module")
def tok(tokenizer_1024):
    return tokenizer_1024


CONV = [Turn("system", "Be brief."), Turn("user", "Weather?"), Turn("assistant", "Let me look."),
        Turn("tool_call", '{"name": "w", "arguments": {}}'), Turn("tool_result", "-3C"),
        Turn("assistant", "Cold: -3C.", reasoning="It is below zero."), Turn("user", "Thanks"), Turn("assistant", "Welcome!")]


def expected_mask(tok, turns, trained, stop=True, reasoning="train"):
    """Independent of ``assemble``: walk the layout turn by turn."""
    mask = [0]
    for t, tr in zip(turns, trained):
        think = tok.encode("<think>\n" + t.reasoning + "\n</think>\n\n") if t.reasoning and reasoning != "drop" else []
        body = tok.encode(t.text(reasoning))
        n_think = len(think) if reasoning == "mask" and body[: len(think)] == think else 0
        mask += [0] + [int(tr and j >= n_think) for j in range(len(body))] + [int(tr and stop)]
    return mask + [int(trained[-1] and stop)]


@pytest.mark.parametrize("policy,trained", [
    (LossPolicy(), [0, 0, 1, 0, 0, 1, 0, 1]),
    (LossPolicy("last_assistant_turn"), [0, 0, 0, 0, 0, 0, 0, 1]),
    (LossPolicy("roles_to_train", roles_to_train=("assistant", "tool_call")), [0, 0, 1, 1, 0, 1, 0, 1]),
    (LossPolicy("roles_to_train", roles_to_train=("user",)), [0, 1, 0, 0, 0, 0, 1, 0]),
    (LossPolicy(train_stop_token=False), [0, 0, 1, 0, 0, 1, 0, 1]),
    (LossPolicy(reasoning="mask"), [0, 0, 1, 0, 0, 1, 0, 1]),
    (LossPolicy(reasoning="drop"), [0, 0, 1, 0, 0, 1, 0, 1]),
])
def test_loss_modes_exact(tok, policy, trained):
    ids, mask = render_conversation(CONV, tok, policy=policy)
    assert mask.tolist() == expected_mask(tok, CONV, trained, policy.train_stop_token, policy.reasoning)
    end, eos = tok.token_id("<|end|>"), tok.eos_id
    assert bool(mask[(ids == end) | (ids == eos)].any()) == policy.train_stop_token


def test_weight_zero_and_completion_only(tok):
    rec = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b", "weight": 0},
                             {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]}
    turns = conversation_from_record(rec)
    assert render_conversation(turns, tok)[1].tolist() == expected_mask(tok, turns, [0, 0, 0, 1])
    pc = {"prompt": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}],
          "completion": [{"role": "assistant", "content": "a2"}]}
    turns = conversation_from_record(pc)
    assert render_conversation(turns, tok)[1].tolist() == expected_mask(tok, turns, [0, 1, 0, 1])
    only = LossPolicy("completion_only")
    assert render_conversation(turns, tok, policy=only)[1].tolist() == expected_mask(tok, turns, [0, 0, 0, 1])
    alpaca = conversation_from_record({"instruction": "Add", "input": "1 2", "output": "3"})
    assert render_conversation(alpaca, tok, policy=only)[1].tolist() == expected_mask(tok, alpaca, [0, 1])
    # nothing to train under the policy: counted, not rendered
    stats = StageStats("render")
    with pytest.raises(ValueError, match="no conversation fits"):
        sft_batch([{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b", "weight": 0}]}], tok, 64, stats=stats)
    assert stats.to_dict() == {"batch": {"nothing_to_train": 1}}


def test_overlong_rules(tok):
    turns = [Turn("system", "S " * 5)] + [Turn(r, f"{r} {i} " * 12) for i in range(4) for r in ("user", "assistant")]
    full = len(render_conversation(turns, tok)[0])
    seq_len = full - 20
    piece, outcome, cut = render_for_sft(turns, tok, seq_len, "truncate")
    ids, loss = untag_loss(piece)
    assert outcome == "truncated" and cut == 2 and ids.tolist() == render_conversation(turns[:-2], tok)[0].tolist()
    piece, outcome, cut = render_for_sft(turns, tok, seq_len, "keep_end")
    ids, loss = untag_loss(piece)
    kept = [turns[0], *turns[3:]]  # the system turn, then the tail from the second user turn
    assert outcome == "truncated_start" and cut == 2 and len(ids) <= seq_len
    want_ids, want_mask = render_conversation(kept, tok)
    assert ids.tolist() == want_ids.tolist() and loss.astype(int).tolist() == want_mask.tolist()
    assert render_for_sft(turns, tok, seq_len, "drop")[1:] == ("dropped_too_long", len(turns))
    assert render_for_sft(turns, tok, 10, "keep_end")[1] == "dropped_too_long"


def test_per_source_policies_and_truncation_counted_in_a_mix(tok, tmp_path):
    convs = make_conversations(40, seed=11)
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": c} for c in convs[:20]])
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": c[:-1], "completion": c[-1:]} for c in convs[20:]])
    alp = write_jsonl(tmp_path / "c.jsonl", [{"instruction": c[-2]["content"], "output": c[-1]["content"]} for c in convs[20:30]])
    seq_len = 200
    sources = (
        SourceConfig("chat", path=str(a), loss="last_assistant_turn", overlong="keep_end"),
        SourceConfig("pc", path=str(b), loss="completion_only", train_stop_token=False),
        SourceConfig("alpaca", path=str(alp), format="alpaca", overlong="drop"),
    )
    cfg = SFTConfig(sources=sources, seq_len=seq_len, batch_size=4, shuffle_buffer=8, pack_buffer_docs=8, holdout_fraction=0.0)
    pipe = build_sft_pipeline(cfg, tok)
    pipe.batches.reset()
    eos, end = tok.eos_id, tok.token_id("<|end|>")
    n_loss = n_stop = 0
    for batch in pipe.batches:
        t = batch["targets"]
        n_loss += int((t != -100).sum())
        n_stop += int(((t == eos) | (t == end)).sum())
    # independent: render each source's records with its own policy and rule
    want_stats: dict[str, dict[str, int]] = {}
    want_loss: dict[str, int] = {}
    want_stop: dict[str, int] = {}
    for spec, path in zip(sources, (a, b, alp)):
        counts: dict[str, int] = {}
        loss = stop = 0
        for line in path.read_text(encoding="utf-8").splitlines():
            turns = conversation_from_record(json.loads(line), format=spec.format)
            piece, outcome, cut = render_for_sft(turns, tok, seq_len, spec.overlong or cfg.overlong, spec.loss_policy())
            counts[outcome] = counts.get(outcome, 0) + 1
            if cut and piece is not None:
                counts["turns_cut"] = counts.get("turns_cut", 0) + cut
            if piece is not None:
                loss += int((piece < 0).sum())
                stop += int(np.isin(~piece[piece < 0], [eos, end]).sum())
        want_stats[spec.name], want_loss[spec.name], want_stop[spec.name] = counts, loss, stop
    assert pipe.stats()["render"] == want_stats
    assert {n: r["loss_tokens"] for n, r in pipe.realized().items()} == want_loss
    assert n_loss == sum(want_loss.values())  # every loss token delivered (the first token of a row is never a target)
    assert want_stats["chat"].get("truncated_start", 0) >= 1 and want_stats["alpaca"].get("kept", 0) >= 1
    # the prompt/completion source trains no stop token; the others do, and all arrive
    assert want_stop["pc"] == 0 and want_loss["pc"] > 0 and n_stop == want_stop["chat"] + want_stop["alpaca"] > 0


def test_source_config_fields(tmp_path):
    base = {"name": "s", "path": ["x.jsonl"]}
    s = SourceConfig.from_dict({**base, "loss": "roles_to_train", "roles_to_train": ["assistant", "tool_call"],
                                   "reasoning_loss": "mask", "overlong": "keep_end", "format": "sharegpt"})
    assert s.loss_policy() == LossPolicy("roles_to_train", ("assistant", "tool_call"), True, "mask")
    assert SourceConfig.from_dict(s.to_dict()) == s
    assert "loss" not in SourceConfig.from_dict(base).to_dict()  # defaults keep old config hashes
    for bad, field in [({"loss": "all"}, "loss"), ({"roles_to_train": ["wizard"]}, "roles_to_train"),
                       ({"overlong": "wrap"}, "overlong"), ({"format": "csv"}, "format"), ({"reasoning_loss": "x"}, "reasoning")]:
        with pytest.raises(ValueError, match=field):
            SourceConfig.from_dict({**base, **bad})
