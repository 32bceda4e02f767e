"""``stacklm inspect`` on the SFT bugs that pass silently: a stop token never trained, chat
markers typed into content, a reply cut at the row end, conversations without an assistant
turn, truncation -- each an error (or a counted report), each message once with its count."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from stacklm.chat import render_conversation
from stacklm.chat.formats import conversation_from_record
from stacklm.chat.policy import LossPolicy
from stacklm.chat.render import render_for_sft, tag_loss
from stacklm.data.sft import collate_sft
from stacklm.inspector import inspect_input
from tests.helpers.cli import run
from tests.helpers.sft import make_conversations, write_jsonl


@pytest.fixture(scope="module")
def tok(tokenizer_1024):
    return tokenizer_1024


@pytest.fixture(scope="module")
def dirs(tok, saved_tokenizer_dir):
    return {"ours": saved_tokenizer_dir(tok), "hf": saved_tokenizer_dir(tok, "hf")}


@pytest.fixture(scope="module")
def convs():
    return make_conversations(24, seed=5)


def checks(report, severity="error") -> set[str]:
    return {f.check for f in report.findings if f.severity == severity}


def padded_batch(tok, pieces):
    windows = np.full((len(pieces), max(map(len, pieces)) + 4), tok.pad_id, dtype=np.int32)
    for w, p in zip(windows, pieces):
        w[: len(p)] = p
    return collate_sft(windows, tok.bos_id, tok.eos_id, tok.pad_id)


def test_stop_token_never_trained_is_an_error(tok, dirs, convs, tmp_path):
    no_stop = LossPolicy(train_stop_token=False)
    torch.save(padded_batch(tok, [tag_loss(*render_conversation(c, tok, policy=no_stop)) for c in convs[:6]]), tmp_path / "b.pt")
    report = inspect_input(tmp_path / "b.pt", dirs["ours"])
    assert checks(report) == {"stop_token_never_trained", "turn_closer_not_trained"}
    f = report.by_check("stop_token_never_trained")[0]
    want = sum(int(render_conversation(c, tok, policy=no_stop)[1].sum()) for c in convs[:6])
    assert f"{want} tokens carry loss" in f.message and report.trained_stop_tokens == 0
    assert run(tmp_path / "b.pt", "--tokenizer", dirs["ours"])[0] == 1
    torch.save(padded_batch(tok, [tag_loss(*render_conversation(c, tok)) for c in convs[:6]]), tmp_path / "ok.pt")
    ok = inspect_input(tmp_path / "ok.pt", dirs["ours"])
    assert not ok.errors and ok.trained_stop_tokens == sum(
        sum(t["role"] == "assistant" for t in c) + 1 for c in convs[:6])  # each assistant <|end|> + the final <|eos|>


def test_end_never_trained_while_eos_is_is_an_error(tok, dirs, convs, tmp_path):
    """The known gap: every <|eos|> trained, no <|end|> -- the stop-token check passed it, yet a
    model trained on it never ends a turn. Each trained turn's closer must carry loss."""
    end = tok.token_id("<|end|>")
    pieces = []
    for c in convs[:6]:
        ids, mask = render_conversation(c, tok)
        pieces.append(tag_loss(ids, np.where(ids == end, 0, mask)))  # the bug: a mask that stops before <|end|>
    torch.save(padded_batch(tok, pieces), tmp_path / "b.pt")
    report = inspect_input(tmp_path / "b.pt", dirs["ours"])
    assert checks(report) == {"turn_closer_not_trained"}
    turns = sum(t["role"] == "assistant" for c in convs[:6] for t in c)
    assert f"{turns} of {turns} trained turns" in report.by_check("turn_closer_not_trained")[0].message
    assert report.trained_stop_tokens == 6  # the final <|eos|> of each conversation: why the old check passed it
    code, out = run(tmp_path / "b.pt", "--tokenizer", dirs["ours"])
    assert code == 1 and "ERROR    turn_closer_not_trained" in out
    # last_assistant_turn: earlier replies are untrained context, their closers need no loss
    last = LossPolicy(mode="last_assistant_turn")
    torch.save(padded_batch(tok, [tag_loss(*render_conversation(c, tok, policy=last)) for c in convs[:6]]), tmp_path / "last.pt")
    assert not inspect_input(tmp_path / "last.pt", dirs["ours"]).errors


@pytest.mark.parametrize("marker,check", [
    ("<|assistant|>", "special_string_in_text"),  # our own role token, typed as text
    ("<|im_start|>", "foreign_template"),  # ChatML
    ("[INST]", "foreign_template"),  # Llama 2 / Mistral
    ("<|start_header_id|>", "foreign_template"),  # Llama 3
    ("<|endoftext|>", "foreign_template"),
])
def test_any_chat_marker_in_content_is_an_error_unless_allowed(tok, dirs, tmp_path, marker, check):
    rows = [{"messages": [{"role": "user", "content": f"say {marker} please {i}"}, {"role": "assistant", "content": "ok"}]}
            for i in range(8)]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    for tokdir in ("ours", "hf"):
        report = inspect_input(path, dirs[tokdir])
        assert checks(report) == {check}, [f.to_dict() for f in report.errors]
        assert len(report.by_check(check, "error")) == 8
    code, out = run(path, "--tokenizer", dirs["ours"])
    assert code == 1 and "--allow-template-text" in out
    assert out.count("error [x8]") == 1 and "(+3 more)" in out and f"{path}:1 message 0 (user)" in out  # once, counted, located
    code, out = run(path, "--tokenizer", dirs["ours"], "--allow-template-text")
    assert code == 0 and "warning [x8]" in out
    # Phi-3 markers are our role tokens: also an error in an assistant reply
    phi = write_jsonl(tmp_path / "phi.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                               {"role": "assistant", "content": "<|user|>x<|end|>"}]}])
    assert checks(inspect_input(phi, dirs["ours"])) == {"special_string_in_text"}


def test_row_ending_inside_an_assistant_turn_is_an_error(tok, dirs, convs, tmp_path):
    """TRL-style truncation at max_length cuts replies: the row ends mid-assistant."""
    rendered = [render_conversation(c, tok) for c in convs[:8]]
    L = 64
    rows = np.full((8, L), tok.pad_id, dtype=np.int64)
    labels = np.full((8, L), -100, dtype=np.int64)
    mid_assistant = 0
    for b, (ids, mask) in enumerate(rendered):
        n = min(L, len(ids))
        rows[b, :n], labels[b, :n] = ids[:n], np.where(mask[:n] == 1, ids[:n], -100)
        mid_assistant += int(len(ids) > L and mask[L - 1] == 1 and ids[L - 1] != tok.token_id("<|end|>"))
    assert mid_assistant >= 1
    torch.save({"input_ids": torch.from_numpy(rows), "labels": torch.from_numpy(labels),
                "attention_mask": torch.from_numpy(rows != tok.pad_id).long()}, tmp_path / "trunc.pt")
    report = inspect_input(tmp_path / "trunc.pt", dirs["ours"])
    assert "row_ends_mid_assistant" in checks(report)
    assert len(report.by_check("row_ends_mid_assistant")) == mid_assistant
    info = report.by_check("truncation")[0]
    assert info.message.startswith(f"{sum(len(ids) > L for ids, _ in rendered)} of 8 rows end inside")


def test_no_assistant_turn_reported_and_truncation_counted(tok, dirs, convs, tmp_path):
    rows = [{"messages": c} for c in convs] + [{"messages": [{"role": "user", "content": "just a question"}]}] * 3
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    seq_len = 160
    code, out = run(path, "--tokenizer", dirs["ours"], "--seq-len", seq_len, "--json", "-")
    data = json.loads(out)
    assert code == 1 and data["errors"] == 3  # the SFT pipes drop them (test_inspect_and_sft_share_one_validity_rule)
    groups = {g["check"]: g for g in data["findings"]}
    assert groups["invalid_conversation"]["count"] == 3 and groups["invalid_conversation"]["message"].startswith("[no_assistant]")
    want: dict[str, int] = {}
    for c in convs:  # independent count: the SFT renderer's outcome per conversation
        _, outcome, n_cut = render_for_sft(conversation_from_record({"messages": c}), tok, seq_len, "truncate")
        want[outcome] = want.get(outcome, 0) + 1
        if n_cut and outcome != "dropped_too_long":
            want["turns_cut"] = want.get("turns_cut", 0) + n_cut
    assert data["counts"] == want and want.get("truncated", 0) >= 1
    assert data["trained_stop_tokens"] > 0


# One row per rule of chat.validate_conversation (and of the record reader before it): its
# verdict -- "drop" (inspect: error; SFT: dropped and counted) or "flag" (inspect: warning;
# SFT: trained and counted next to kept) -- and the reason both surfaces name.
U, A, S, TR = ("user", "q"), ("assistant", "a"), ("system", "s"), ("tool_result", "r")
VALIDITY_RULES = [
    ("valid", [S, U, A], "kept", None),
    ("malformed JSON", "{broken", "drop", "malformed_json"),
    ("no messages field", {"text": "x"}, "drop", "no_messages_column"),
    ("unknown role", [U, ("narrator", "x"), A], "drop", "unknown_role"),
    ("non-text content", [U, ("assistant", 3)], "drop", "bad_message"),
    ("no turns", [], "drop", "empty_conversation"),
    ("blank message", [U, ("assistant", "  ")], "drop", "empty_content"),
    ("no assistant turn", [S, U], "drop", "no_assistant"),
    ("assistant first (after the system turn)", [S, A, U, A], "drop", "first_turn_not_user"),
    ("system late", [U, S, A], "flag", "system_not_first"),
    ("ends on user", [U, A, U], "flag", "ends_without_reply"),
    ("two assistant turns", [U, A, A], "flag", "repeated_role"),
]


def _rule_row(case):
    if isinstance(case, (str, dict)):
        return case
    return {"messages": [{"role": r, "content": c} for r, c in case]}


def test_inspect_and_sft_share_one_validity_rule(tok, dirs, tmp_path, caplog):
    """Issue 32.7a: inspect called an assistant-first conversation an error, SFT trained it
    without a count. Now every rule has one verdict and one reason name on both surfaces."""
    from stacklm.chat import FLAG_REASONS, INVALID_REASONS
    from stacklm.data.sft import SFTConfig, build_sft_pipeline, say_split_drops
    from stacklm.data.sources.schema import SourceConfig
    from stacklm.datamodule.stream import merge_worker_summaries

    path = write_jsonl(tmp_path / "rules.jsonl", [_rule_row(case) for _, case, _, _ in VALIDITY_RULES])
    line = {i + 1: (name, verdict, reason) for i, (name, _, verdict, reason) in enumerate(VALIDITY_RULES)}
    # inspect: per line, severity and the [reason] its finding names
    report = inspect_input(path, dirs["ours"])
    seen = {}
    for f in report.findings:
        if f.check in ("invalid_conversation", "roles_out_of_order"):
            n = int(f.where.split(f"{path}:")[1].split(",")[0])
            seen[n] = ({"error": "drop", "warning": "flag"}[f.severity], f.message[1:].split("]")[0])
    assert seen == {n: (v, r) for n, (_, v, r) in line.items() if r}, seen
    assert report.sequences == sum(v != "drop" for _, v, _ in line.values())  # the flagged ones are rendered and checked
    code, out = run(path, "--tokenizer", dirs["ours"])
    assert code == 1 and "ERROR    invalid_conversation: 8 finding(s)" in out and "WARNING  roles_out_of_order: 3 finding(s)" in out
    assert "[first_turn_not_user] starts with an assistant message (message 1)" in out and f"at: {path}:9" in out, out
    # SFT: the same file through the whole pipeline
    with caplog.at_level("WARNING"):
        pipe = build_sft_pipeline(SFTConfig(sources=(SourceConfig("rules", path=(str(path),)),), seq_len=128, batch_size=2,
                                            holdout_fraction=0.0), tok)
        pipe.batches.reset()
        list(pipe.batches)
    counts = pipe.stats()["source"]["rules"]
    for n, (name, verdict, reason) in line.items():
        if reason:
            assert counts.get(reason) == 1, (name, counts)
            assert (reason in INVALID_REASONS) == (verdict == "drop") and (reason in FLAG_REASONS) == (verdict == "flag"), name
            assert pipe.examples()["rules"][reason].startswith(f"{path}:{n}"), (name, pipe.examples())
    kept = sum(v != "drop" for _, v, _ in line.values())
    assert counts["kept"] == kept and pipe.stats()["render"]["rules"] == {"kept": kept}  # flagged ones are trained
    # the drops (only they) reach data_stats' dropped_docs, the channel every invalid record takes
    drops = merge_worker_summaries([{"stats": pipe.stats()}])["dropped_docs"]["source"]["rules"]
    assert drops == {r: 1 for _, v, r in line.values() if v == "drop"}
    assert f"flagged ends_without_reply (counted, kept); first: {path}:11" in caplog.text
    say_split_drops(list(pipe.sources.values()), "train")  # what a fit's counting pass says for its quiet readers
    assert f"flagged and kept ends_without_reply 1, repeated_role 1, system_not_first 1 of the {len(line)} conversations read" \
        in caplog.text, caplog.text
