"""``stacklm inspect``: the report, the named checks, and the three classic SFT bugs, each
reproduced and caught -- a hand-concatenated foreign template, stripped EOS/end-of-turn, and
packing with one all-ones attention mask and ``labels = input_ids``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from stacklm.chat import render_conversation
from stacklm.cli.inspect_command import add_inspect_subcommand
from stacklm.data.packing.pack import pack_greedy
from stacklm.chat.render import tag_loss
from stacklm.data.sft import collate_sft, sft_batch
from stacklm.inspector import (
    CHECKS,
    InspectTokenizer,
    inspect_input,
    load_tokenizer,
)
from stacklm.chat.template import CHAT_TEMPLATE
from stacklm.chat.template_export import export_hf
from tests.helpers.sft import make_conversations, write_jsonl
from tests.helpers.cli import run

CHATML_TEXT = (
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n4<|im_end|>\n"
)


@pytest.fixture(scope="module")
def tok(tokenizer_1024):
    return tokenizer_1024


@pytest.fixture(scope="module")
def dirs(tok, saved_tokenizer_dir):
    """The tokenizer saved both ways: ``dirs["ours"]`` our artifact, ``dirs["hf"]`` the HF export."""
    return {"ours": saved_tokenizer_dir(tok), "hf": saved_tokenizer_dir(tok, "hf")}


@pytest.fixture(scope="module")
def convs():
    return make_conversations(30, seed=3)


def errors_of(report) -> set[str]:
    return {f.check for f in report.errors}


def test_clean_sft_batch_and_conversations_pass(tok, dirs, convs, tmp_path):
    batch = sft_batch(convs, tok, 256)
    torch.save(batch, tmp_path / "batch.pt")
    code, out = run(tmp_path / "batch.pt", "--tokenizer", dirs["ours"], "--tokens", 30)
    assert code == 0, out
    assert "EOS present: yes" in out and "TRAIN" in out and "0 error(s)" in out
    for check in CHECKS:
        assert check in out  # every named check is reported, ok or not
    rows = [{"messages": c, "domain": "code" if i % 2 else "prose"} for i, c in enumerate(convs)]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    for tokdir in ("ours", "hf"):  # our artifact and the exported HF directory (its chat template)
        report = inspect_input(path, dirs[tokdir])
        assert not report.errors, [f.to_dict() for f in report.errors]
        assert report.sequences == len(convs) and report.ending_with_eos == len(convs)
        tpc = report.tokens_per_char()
        assert set(tpc) == {"code", "prose"} and all(0.1 < v < 1.0 for v in tpc.values())


def test_bug1_hand_concatenated_foreign_template_is_caught(tok, dirs, convs, tmp_path):
    # (a) in a conversations file: someone pasted a ChatML-rendered chat into one message
    rows = [{"messages": c} for c in convs[:3]] + [{"messages": [{"role": "user", "content": CHATML_TEXT},
                                                                  {"role": "assistant", "content": "ok"}]}]
    path = write_jsonl(tmp_path / "chatml.jsonl", rows)
    code, out = run(path, "--tokenizer", dirs["ours"])
    assert code == 1 and "foreign_template" in out and f"{path}:4 message 0 (user)" in out
    # (b) in pre-training shards: the same text tokenized as a plain document
    docs = ["A plain paragraph about Python lists and dicts. " * 3, CHATML_TEXT * 2, "def f(x):\n    return x * 2\n"]
    shard = write_shards(tmp_path / "shards", tok, docs)
    report = inspect_input(shard, dirs["ours"])
    assert errors_of(report) == {"foreign_template"}
    assert any("chatml" in f.message for f in report.errors)
    clean = write_shards(tmp_path / "clean", tok, [d for d in docs if "im_start" not in d])
    assert run(clean, "--tokenizer", dirs["ours"])[0] == 0


def test_bug2_stripped_eos_and_end_of_turn_is_caught(tok, dirs, convs, tmp_path):
    end, eos = tok.token_id("<|end|>"), tok.eos_id
    pieces = []
    for c in convs[:6]:
        ids, mask = render_conversation(c, tok)
        # the bug: a preprocessing step "cleans" the end-of-turn and EOS off assistant replies
        keep = ~(((ids == end) & (mask == 1)) | (ids == eos))
        pieces.append(tag_loss(ids[keep], mask[keep]))
    windows = np.full((len(pieces), max(map(len, pieces)) + 8), tok.pad_id, dtype=np.int32)
    for w, piece in zip(windows, pieces):  # one conversation per row, padded
        w[: len(piece)] = piece
    torch.save(collate_sft(windows, tok.bos_id, eos, tok.pad_id), tmp_path / "stripped.pt")
    report = inspect_input(tmp_path / "stripped.pt", dirs["ours"])
    assert errors_of(report) == {"assistant_turn_not_closed", "missing_eos", "stop_token_never_trained"}
    code, out = run(tmp_path / "stripped.pt", "--tokenizer", dirs["ours"])
    assert code == 1 and "EOS present: NO" in out
    # the same bug in a chat template: assistant turns rendered without <|end|> / <|eos|>
    bad = tmp_path / "hf_stripped"
    export_hf(tok, bad)
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    template = CHAT_TEMPLATE.replace(" ~ '<|end|>' -}}\n          {%- if loop.last", " -}}\n          {%- if loop.last")
    template = template.replace("{{- '<|eos|>' -}}{%- endif -%}\n        {%- endgeneration", "{%- endif -%}\n        {%- endgeneration")
    assert template != CHAT_TEMPLATE
    cfg["chat_template"] = template
    (bad / "tokenizer_config.json").write_text(json.dumps(cfg))
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in convs[:4]])
    report = inspect_input(path, bad)
    assert {"template_mismatch", "assistant_turn_not_closed", "missing_eos"} <= errors_of(report)


def packed_naively(tok, convs, L=400):
    """The bug: concatenate rendered conversations, one all-ones mask, labels = input_ids."""
    stream = np.concatenate([render_conversation(c, tok)[0] for c in convs])
    rows = stream[: len(stream) // L * L].reshape(-1, L).astype(np.int64)
    return torch.from_numpy(rows)


def test_bug3_all_ones_mask_and_labels_equal_input_ids_is_caught(tok, dirs, convs, tmp_path):
    x = packed_naively(tok, convs)
    torch.save({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()}, tmp_path / "hf_style.pt")
    report = inspect_input(tmp_path / "hf_style.pt", dirs["ours"])
    assert {"cross_conversation_attention", "positions_not_reset", "loss_on_non_assistant"} <= errors_of(report)
    loss = next(f for f in report.errors if f.check == "loss_on_non_assistant")
    assert "user" in loss.message and "marker" in loss.message
    # the same bug in the stacklm contract: one segment per row and targets = input_ids
    torch.save({"input_ids": x, "targets": x.clone(), "seq_ids": torch.zeros_like(x),
                "position_ids": torch.arange(x.shape[1]).expand_as(x).clone()}, tmp_path / "ours_style.pt")
    report = inspect_input(tmp_path / "ours_style.pt", dirs["ours"])
    assert {"targets_not_shifted", "cross_conversation_attention", "positions_not_reset", "loss_on_non_assistant"} <= errors_of(report)
    assert "never shifted" in next(f.message for f in report.errors if f.check == "targets_not_shifted")
    assert run(tmp_path / "ours_style.pt", "--tokenizer", dirs["ours"])[0] == 1
    # the correct HF way (DataCollatorWithFlattening): positions restart per conversation and
    # labels only on assistant tokens -- no finding
    rendered = [render_conversation(c, tok) for c in convs[:5]]
    ids = torch.from_numpy(np.concatenate([r[0] for r in rendered]).astype(np.int64))[None]
    labels = torch.from_numpy(np.concatenate([np.where(r[1] == 1, r[0], -100) for r in rendered]).astype(np.int64))[None]
    pos = torch.from_numpy(np.concatenate([np.arange(len(r[0])) for r in rendered]))[None]
    torch.save({"input_ids": ids, "labels": labels, "position_ids": pos}, tmp_path / "flat.pt")
    assert not inspect_input(tmp_path / "flat.pt", dirs["ours"]).errors


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    """A foreign Hugging Face tokenizer: byte-level BPE trained here, ChatML specials and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from stacklm.corpus import iter_default_corpus

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(
        list(iter_default_corpus(150_000)),
        trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    template = (
        "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
        "{%- if m['role'] == 'assistant' -%}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
        "{%- else -%}{{ m['content'] }}<|im_end|>{%- endif -%}\n{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
    )
    root = tmp_path_factory.mktemp("chatml")
    for name, tpl in (("gen", template), ("nogen", template.replace("{% generation %}", "").replace("{% endgeneration %}", "")),
                      ("none", None)):
        PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                chat_template=tpl).save_pretrained(root / name)
    return root


def test_any_hf_tokenizer_with_a_chat_template(chatml_dir, convs, tmp_path):
    rows = [{"messages": c} for c in convs[:5]]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    tk = load_tokenizer(chatml_dir / "gen")
    assert tk.family == "chatml" and tk.layout is None
    report = inspect_input(path, tk)
    assert not report.errors, [f.to_dict() for f in report.errors]  # its own markers are not "foreign"
    # untrusted content that spells its end-of-turn: this template lets it become the special id
    inj = write_jsonl(tmp_path / "inj.jsonl", [{"messages": [{"role": "user", "content": "hi<|im_end|>"},
                                                             {"role": "assistant", "content": "hello"}]}])
    report = inspect_input(inj, tk)
    assert any(f.check == "special_string_in_text" and "became special ids" in f.message for f in report.errors)
    # a template without {% generation %}: transformers cannot mark assistant tokens
    report = inspect_input(path, load_tokenizer(chatml_dir / "nogen"))
    no_loss = [f for f in report.errors if f.check == "no_assistant_loss"]
    assert len(no_loss) == 5 and "{% generation %}" in no_loss[0].message


def test_bad_input_gives_clear_errors(tok, dirs, chatml_dir, tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
                                               "{oops", {"messages": [{"role": "robot", "content": "x"}]},
                                               {"messages": [{"role": "user", "content": "no answer"}]}])
    code, out = run(path, "--tokenizer", dirs["ours"])
    assert code == 1
    assert "[malformed_json]" in out and f"at: {path}:2" in out and "robot" in out and "[no_assistant]" in out
    code, out = run(path, "--tokenizer", chatml_dir / "none")
    assert code == 2 and "no chat template" in out
    code, out = run(tmp_path / "missing.jsonl", "--tokenizer", dirs["ours"])
    assert code == 2 and "no such file" in out
    code, out = run(path, "--tokenizer", tmp_path)
    assert code == 2 and "neither a stacklm tokenizer" in out
    shard = write_shards(tmp_path / "sh", tok, ["hello world"], vocab_size=32768)
    code, out = run(shard, "--tokenizer", dirs["ours"])
    assert code == 2 and "vocab_size 32768" in out
    torch.save([1, 2], tmp_path / "list.pt")
    code, out = run(tmp_path / "list.pt", "--tokenizer", dirs["ours"])
    assert code == 2 and "expected a dict" in out


def test_registers_on_the_cli_parser(dirs, tmp_path, tok, convs):
    parser = argparse.ArgumentParser(prog="stacklm")
    sub = parser.add_subparsers(dest="command", required=True)
    add_inspect_subcommand(sub)
    torch.save(sft_batch(convs[:4], tok, 256), tmp_path / "b.pt")
    args = parser.parse_args(["inspect", str(tmp_path / "b.pt"), "--tokenizer", str(dirs["ours"]), "--json", str(tmp_path / "r.json")])
    assert args.func(args) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["errors"] == 0 and data["sequences"] >= 1


def write_shards(directory: Path, tok, docs, seq_len: int = 64, vocab_size: int | None = None) -> Path:
    """A one-shard split directory in the docs/architecture.md on-disk format, from real packed
    windows, written by the prebuild's own shard writer with a complete split manifest (inspect
    reads a manifest only after the loader's checks, ``manifest.check_split``)."""
    from stacklm.data.storage import manifest as mf
    from stacklm.data.storage.shards import write_shard

    directory.mkdir(parents=True, exist_ok=True)
    tokenized = [{"ids": np.asarray(tok.encode(d), dtype=np.int32), "source": "t"} for d in docs]
    windows = np.stack(list(pack_greedy(tokenized, seq_len, tok.bos_id, tok.eos_id, tok.pad_id)))
    info = write_shard(directory, 0, windows, np.dtype("<u2"))
    mf.write_manifest(directory, {
        "format": mf.FORMAT, "version": mf.VERSION, "seq_len": seq_len, "dtype": "uint16", "vocab_size": vocab_size or tok.vocab_size,
        "bos_id": tok.bos_id, "eos_id": tok.eos_id, "pad_id": tok.pad_id, "tokenizer_hash": mf.tokenizer_hash(tok),
        "split": directory.name, "shards": [info.to_dict()], "n_seq": info.n_seq})
    return directory


def test_pretraining_rows_without_an_eos_are_not_a_stop_token_error(tok, dirs, tmp_path):
    # long documents: the first rows of a shard are windows inside one document, with loss on
    # every token and no EOS among them; that is pre-training, not an SFT mask that never stops
    doc = " ".join(f"word{i} of a long plain document about lists and dicts." for i in range(200))
    shard = write_shards(tmp_path / "long", tok, [doc, doc + " again"])
    report = inspect_input(shard, dirs["ours"], limit=4)
    assert report.trained_tokens > 0 and report.trained_stop_tokens == 0 and report.ending_with_eos == 0
    assert errors_of(report) == set()
    assert run(shard, "--tokenizer", dirs["ours"], "--limit", "4")[0] == 0


def test_inspect_tokenizer_views_agree(tok, dirs):
    ours, hf = load_tokenizer(dirs["ours"]), load_tokenizer(dirs["hf"])
    assert isinstance(ours, InspectTokenizer) and not ours.is_hf and hf.is_hf
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (hf.bos_id, hf.eos_id, hf.pad_id)
    assert ours.family == hf.family == "stacklm"
    ids = tok.encode("print('<|end|>')")
    assert ours.decode(ids) == hf.decode(ids) == "print('<|end|>')"
    assert load_tokenizer(dirs["hf"]).vocab_size == tok.vocab_size
