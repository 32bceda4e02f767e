"""Every common SFT format: parsed into the canonical form, rendered by ``render_conversation``,
and rendered by the exported chat template under real ``transformers`` and TRL's SFTTrainer to
the same ids and loss tokens -- on a few hundred generated conversations covering all formats."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from stacklm.chat import render_conversation
from stacklm.errors import ChatFormatError
from stacklm.chat.formats import (
    conversation_from_record,
    detect_format,
    read_record,
    record_turns,
    render_messages,
    render_record,
    tool_call_text,
)
from stacklm.chat.policy import LossPolicy
from stacklm.chat.template_export import export_hf
from tests.helpers.lightning import tiny_llama

WORDS = ["hello", "world", " the", "Oslo", "<|end|>", "<|im_start|>x", "naïve", "数学", "\n", "  ", "x=1;", "é", "{", "}"]
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Weather <|now|>", "parameters": {"type": "object",
     "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}},
]


def _text(rng: random.Random, n: int = 6) -> str:
    s = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))
    return s if s.strip() else s + "ok"


def _call(rng: random.Random, string_args: bool) -> dict:
    args = {"city": _text(rng, 2), "n": rng.randint(0, 9)}
    return {"id": f"call_{rng.randint(0, 999)}", "type": "function",
            "function": {"name": rng.choice(["weather", "add"]), "arguments": json.dumps(args) if string_args else args}}


def gen_messages(rng: random.Random, string_args: bool = True) -> dict:
    msgs: list[dict] = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": _text(rng)})
    for _ in range(rng.randint(1, 3)):
        msgs.append({"role": "user", "content": _text(rng)})
        if rng.random() < 0.4:
            calls = [_call(rng, string_args) for _ in range(rng.randint(1, 2))]
            msgs.append({"role": "assistant", "content": rng.choice([None, "", _text(rng)]), "tool_calls": calls})
            msgs += [{"role": "tool", "tool_call_id": c["id"], "content": _text(rng)} for c in calls]
        a: dict = {"role": "assistant", "content": _text(rng)}
        if rng.random() < 0.3:
            a["reasoning_content"] = _text(rng, 8)
        if rng.random() < 0.25:
            a["weight"] = rng.choice([0, 1])
        msgs.append(a)
    rec: dict = {"messages": msgs}
    if rng.random() < 0.4:
        rec["tools"] = TOOLS[: rng.randint(1, 2)]
    return rec


def gen_record(rng: random.Random, fmt: str) -> dict:
    if fmt == "messages":
        return gen_messages(rng, string_args=rng.random() < 0.7)
    if fmt == "sharegpt":
        conv = []
        for _ in range(rng.randint(1, 3)):
            conv.append({"from": "human", "value": _text(rng)})
            g = {"from": "gpt", "value": _text(rng)}
            if rng.random() < 0.4:
                g["weight"] = rng.choice([0, 1])
            conv.append(g)
        rec = {"conversations": conv}
        if rng.random() < 0.4:
            rec["system"] = _text(rng)
        return rec
    if fmt == "prompt_completion":
        if rng.random() < 0.5:
            return {"prompt": _text(rng), "completion": _text(rng)}
        prompt = gen_messages(rng)["messages"]
        return {"prompt": [*prompt, {"role": "user", "content": _text(rng)}], "completion": [{"role": "assistant", "content": _text(rng)}]}
    rec = {"instruction": _text(rng), "output": _text(rng)}
    if rng.random() < 0.5:
        rec["input"] = _text(rng)
    if rng.random() < 0.3:
        rec["system"] = _text(rng)
    return rec


FORMATS = ("messages", "sharegpt", "prompt_completion", "alpaca")


@pytest.fixture(scope="module")
def tok(tokenizer_1024):
    return tokenizer_1024


@pytest.fixture(scope="module")
def hf_tok(tok, tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(export_hf(tok, tmp_path_factory.mktemp("hf_formats")))


@pytest.fixture(scope="module")
def records():
    rng = random.Random(15)
    return [(fmt, gen_record(rng, fmt)) for _ in range(75) for fmt in FORMATS]  # 300 conversations


def test_formats_detected_and_parsed():
    assert detect_format({"messages": []}) == "messages"
    assert detect_format({"conversations": []}) == "sharegpt"
    assert detect_format({"prompt": "a", "completion": "b"}) == "prompt_completion"
    assert detect_format({"instruction": "a", "input": "", "output": "b"}) == "alpaca"
    turns = conversation_from_record({"instruction": "Sum", "input": "1 2", "output": "3", "system": "S"})
    assert [(t.role, t.content, t.completion) for t in turns] == [("system", "S", False), ("user", "Sum\n\n1 2", False), ("assistant", "3", True)]
    turns = conversation_from_record({"prompt": "The sky is", "completion": " blue."})
    assert [(t.role, t.completion) for t in turns] == [("user", False), ("assistant", True)]
    rec = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "w?"},
                        {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [
                            {"function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": "-3"},
                        {"role": "assistant", "content": "cold", "weight": 0}], "tools": TOOLS[:1]}
    turns = conversation_from_record(rec)
    assert [t.role for t in turns] == ["system", "user", "assistant", "tool_call", "tool_result", "assistant"]
    assert turns[0].content == "S\n\n# Tools\n" + json.dumps(TOOLS[0], ensure_ascii=False)
    assert turns[2].content == "" and turns[2].reasoning == "think" and turns[2].text() == "<think>\nthink\n</think>\n\n"
    assert turns[3].content == '{"name": "weather", "arguments": {"city": "Oslo"}}'
    assert turns[5].weight == 0
    sg = conversation_from_record({"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b", "weight": 0}]})
    assert sg[1].weight == 0


def test_bad_records_are_located_errors():
    for rec, reason in [
        ({"text": "x"}, "no_messages_column"),
        ({"messages": [{"role": "user", "content": None}]}, "bad_message"),
        ({"messages": [{"role": "user", "content": "a", "tool_calls": [{"function": {"name": "f"}}]}]}, "bad_message"),
        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "bad_message"),
        ({"conversations": [{"from": "gpt", "value": "a", "weight": -1}]}, "bad_message"),
        ({"instruction": 3, "output": "b"}, "bad_message"),
        ({"messages": [], "tools": "{not json"}, "bad_message"),
        ({"prompt": "q", "completion": [{"role": "assistant", "content": "a"}]}, "bad_message"),
    ]:
        with pytest.raises(ChatFormatError) as e:
            conversation_from_record(rec, where="f.jsonl:9")
        assert e.value.reason == reason and "f.jsonl:9" in str(e.value), rec
    assert tool_call_text({"name": "f", "arguments": {"a": 1}}) == '{"name": "f", "arguments": {"a": 1}}'


def test_weight_zero_and_reasoning_policies(tok):
    rec = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a1", "weight": 0},
                        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2", "reasoning_content": "hmm"}]}
    ids, mask = render_record(rec, tok)
    turns = conversation_from_record(rec)
    assert [ids.tolist(), mask.tolist()] == [a.tolist() for a in render_conversation(turns, tok)]
    a1 = tok.encode("a1")
    start = 1 + 2 + len(tok.encode("q")) + 1  # bos, <|user|> q <|end|>, <|assistant|>
    assert ids[start : start + len(a1)].tolist() == a1 and not mask[start : start + len(a1) + 1].any()
    think = tok.encode("<think>\nhmm\n</think>\n\n")
    ids_m, mask_m = render_conversation(turns, tok, policy=LossPolicy(reasoning="mask"))
    assert ids_m.tolist() == ids.tolist() and mask.sum() - mask_m.sum() == len(think)
    ids_d, mask_d = render_conversation(turns, tok, policy=LossPolicy(reasoning="drop"))
    assert len(ids) - len(ids_d) == len(think) and mask_d.sum() == mask_m.sum()


def test_hf_template_matches_render_on_every_format(tok, hf_tok, records):
    """apply_chat_template on the canonical messages (and, for the messages format, on the raw
    OpenAI messages: role tool, content null, tools=) gives render_conversation's ids and mask."""
    seen = {f: 0 for f in FORMATS}
    features = {"tool_calls": 0, "reasoning": 0, "weight0": 0, "tools": 0, "null_content": 0}
    for i, (fmt, raw) in enumerate(records):
        rec = read_record(raw)
        turns = record_turns(rec)
        ids, mask = render_conversation(turns, tok)
        variants = [rec.messages] + ([raw["messages"]] if fmt == "messages" else [])
        for msgs in variants:
            out = hf_tok.apply_chat_template(msgs, tools=rec.tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            assert out["input_ids"] == ids.tolist(), (i, fmt, raw)
            assert out["assistant_masks"] == mask.tolist(), (i, fmt, raw)
            m_ids, m_mask = render_messages(msgs, tok, tools=rec.tools)
            assert m_ids.tolist() == ids.tolist() and m_mask.tolist() == mask.tolist()
        # the generation prompt after the last user turn
        last_user = max(k for k, m in enumerate(rec.messages) if m["role"] == "user")
        prompt = rec.messages[: last_user + 1]
        p_ids, _ = render_conversation(record_turns(type(rec)(prompt, rec.tools)), tok, add_generation_prompt=True)
        assert hf_tok.apply_chat_template(prompt, tools=rec.tools, tokenize=True, add_generation_prompt=True, return_dict=False) == p_ids.tolist()
        seen[fmt] += 1
        msgs = rec.messages
        features["tool_calls"] += any(m.get("tool_calls") for m in msgs)
        features["null_content"] += any(m.get("tool_calls") and m["content"] is None for m in msgs)
        features["reasoning"] += any(m.get("reasoning_content") for m in msgs)
        features["weight0"] += any(m.get("weight") == 0 for m in msgs)
        features["tools"] += bool(rec.tools)
    assert all(n == 75 for n in seen.values()), seen
    assert all(n >= 10 for n in features.values()), features  # every feature exercised, not just generated


def _trl_rows(hf_tok, rows, tmp_path, **cfg):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), report_to=[], max_length=None, packing=False, dataset_num_proc=None, use_cpu=True,
                     bf16=False, gradient_checkpointing=False, **cfg)
    trainer = SFTTrainer(model=tiny_llama(len(hf_tok)), args=args, train_dataset=Dataset.from_list(rows), processing_class=hf_tok)
    return list(trainer.train_dataset)


def test_trl_sft_trainer_tokenizes_like_us(tok, hf_tok, records, tmp_path):
    """TRL's SFTTrainer (conversational messages with assistant_only_loss; conversational
    prompt/completion with completion_only_loss) gives our ids and loss tokens."""
    conv, pc = [], []
    for _fmt, raw in records:
        rec = read_record(raw)
        if any(isinstance((c.get("function") or c).get("arguments"), dict) for m in rec.messages for c in m.get("tool_calls") or []):
            continue  # Arrow cannot hold string and object arguments in one column; the template test covers them
        if not render_conversation(record_turns(rec), tok)[1].any():
            continue  # every assistant turn weight 0: nothing to train (the SFT pipes drop and count it; TRL raises)
        (pc if rec.n_prompt is not None else conv).append(rec)
    assert len(conv) >= 100 and len(pc) >= 100
    got = _trl_rows(hf_tok, [r.to_trl() for r in conv], tmp_path / "m", assistant_only_loss=True)
    for rec, row in zip(conv, got, strict=True):
        ids, mask = render_conversation(record_turns(rec), tok)
        assert row["input_ids"] == ids.tolist()
        assert [j for j, lab in enumerate(row["labels"]) if lab != -100] == np.flatnonzero(mask).tolist()
    got = _trl_rows(hf_tok, [r.to_trl() for r in pc], tmp_path / "pc", completion_only_loss=True)
    for rec, row in zip(pc, got, strict=True):
        ids, mask = render_conversation(record_turns(rec), tok, policy=LossPolicy(mode="completion_only"))
        assert row["input_ids"] == ids.tolist()
        assert [j for j, lab in enumerate(row["labels"]) if lab != -100] == np.flatnonzero(mask).tolist()


def test_trl_plain_text_path_has_one_eos(tok, hf_tok, tmp_path):
    """TRL's language-modeling path appends the <|eos|> string and tokenizes with HF defaults:
    one <|eos|>, never two (the export has no post-processor)."""
    texts = ["Hello world.", "Already ended.<|eos|>", "<|bos|>Starts with bos."]
    got = _trl_rows(hf_tok, [{"text": t} for t in texts], tmp_path / "t")
    for t, row in zip(texts, got):
        ids = row["input_ids"]
        assert ids.count(tok.eos_id) == 1 and ids[-1] == tok.eos_id, t
        assert ids.count(tok.bos_id) == int(t.startswith("<|bos|>")), t
