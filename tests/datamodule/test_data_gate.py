"""The data gate (``StackDataModule(gate=True)``, ``stacklm.datamodule.gate``) with a real
Lightning Trainer: a batch bug of each gated check class stops the fit before step 1 with the
finding, where and the fix; ``gate=False`` lets it run; good data passes without a finding; the
rules follow the sources' loss policies."""

from __future__ import annotations

import warnings

import lightning as L
import pytest
import torch

from stacklm.data.contract import full_batch
from stacklm.data.sft.sft_pack import CollateSFT
from stacklm.datamodule import StackDataModule
from stacklm.errors import DataGateError
from stacklm.datamodule.gate import GateRules, check_batches, inspect_tokenizer, sample_sft
from tests.helpers.lightning import BatchRecorder, TinyLM

SEQ_LEN, BATCH = 128, 2


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    from tests.helpers.sft import make_conversations, write_jsonl

    return write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", [{"messages": m} for m in make_conversations(60, seed=3)])


def sft_dm(tokenizer_dir, chats, gate=True, **source) -> StackDataModule:
    pipeline = {"sources": [{"name": "chats", "kind": "local", "path": [str(chats)], **source}], "shuffle_buffer": 8,
                "pack_buffer_docs": 8, "holdout_fraction": 0.0}
    return StackDataModule(mode="sft", tokenizer=str(tokenizer_dir), pipeline=pipeline, seq_len=SEQ_LEN, batch_size=BATCH,
                           train_batches=4, val_batches=0, gate=gate)


def fit(dm, tmp_path, steps=3, recorder=None) -> BatchRecorder:
    seen = recorder if recorder is not None else BatchRecorder()
    L.Trainer(accelerator="cpu", devices=1, max_steps=steps, max_epochs=1, callbacks=[seen], logger=False,
              enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
              default_root_dir=tmp_path, num_sanity_val_steps=0).fit(TinyLM(512), datamodule=dm)
    return seen


# Each bug a collate could have, applied to the real batches the SFT pipeline makes.
def untrained_end(b, tok):  # the known gap: <|eos|> trained, no <|end|> ever a target
    b["targets"][b["targets"] == tok.token_id("<|end|>")] = -100


def loss_on_user(b, tok):  # an all-ones mask: every next token a target
    real = b["input_ids"][:, 1:] != tok.pad_id
    b["targets"][:, :-1] = torch.where(real, b["input_ids"][:, 1:], b["targets"][:, :-1])


def cross_conversation(b, tok):  # packed conversations in one attention segment
    b["seq_ids"].zero_()


def out_of_range(b, tok):  # an id of a bigger vocabulary
    b["input_ids"][0, 3] = tok.vocab_size + 7


BUGS = {untrained_end: "turn_closer_not_trained", loss_on_user: "loss_on_non_assistant",
        cross_conversation: "cross_conversation_attention", out_of_range: "ids_out_of_range"}


def buggy_collate(monkeypatch, bug, tok):
    real = CollateSFT.__call__

    def call(self, windows):
        batch = real(self, windows)
        bug(batch, tok)
        return batch

    monkeypatch.setattr(CollateSFT, "__call__", call)


@pytest.mark.parametrize("bug", list(BUGS), ids=lambda f: f.__name__)
def test_a_broken_sft_batch_stops_the_fit_before_step_1(tokenizer_dir, chats, tmp_path, monkeypatch, bug):
    dm = sft_dm(tokenizer_dir, chats)
    buggy_collate(monkeypatch, bug, dm.tokenizer)
    seen = BatchRecorder()
    with pytest.raises(DataGateError) as err:
        fit(dm, tmp_path, recorder=seen)
    assert seen.seen == []  # not one batch reached a step
    checks = {f["check"] for f in err.value.findings}
    assert BUGS[bug] in checks, err.value.findings
    msg = str(err.value)
    assert f"{BUGS[bug]} (first at sft train batch " in msg and " of rank 0 worker 0" in msg
    assert msg.count(BUGS[bug]) == 1 and "Fix: " in msg and "data.gate: false" in msg  # once, however many batches had it


def test_gate_false_lets_a_broken_fit_run(tokenizer_dir, chats, tmp_path, monkeypatch):
    dm = sft_dm(tokenizer_dir, chats, gate=False)
    buggy_collate(monkeypatch, untrained_end, dm.tokenizer)
    assert len(fit(dm, tmp_path).seen) == 3


def test_good_sft_data_passes_with_no_finding(tokenizer_dir, chats, tmp_path):
    dm = sft_dm(tokenizer_dir, chats)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(fit(dm, tmp_path).seen) == 3
    assert not [w for w in caught if "data gate" in str(w.message)]
    found = check_batches(sample_sft(dm), inspect_tokenizer(dm), GateRules.of(dm))
    assert [f.check for f in found] == ["padding_fraction"] and found[0].severity == "info"  # the sample's padding, reported


def test_the_rules_follow_the_sources_loss_policy(tokenizer_dir, chats):
    """Loss on user turns is an error unless the source trains them (roles_to_train); an
    untrained stop token is the policy's choice with train_stop_token: false (warned, not fatal)."""
    dm = sft_dm(tokenizer_dir, chats, loss="roles_to_train", roles_to_train=["user", "assistant"])
    dm.setup("fit")
    sample, tok = sample_sft(dm), inspect_tokenizer(dm)
    assert not [f for f in check_batches(sample, tok, GateRules.of(dm)) if f.severity == "error"]
    assert "loss_on_non_assistant" in {f.check for f in check_batches(sample, tok, GateRules()) if f.severity == "error"}
    dm = sft_dm(tokenizer_dir, chats, train_stop_token=False)
    found = check_batches(sample_sft(dm), tok, GateRules.of(dm))
    assert {f.check for f in found if f.severity == "warning"} == {"turn_closer_not_trained", "stop_token_never_trained"}
    assert not [f for f in found if f.severity == "error"]
    assert all("train_stop_token: false in source(s) chats" in f.message for f in found if f.severity == "warning")


@pytest.fixture(scope="module")
def shards_dir(tokenizer_dir, tmp_path_factory):
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.prebuild import prebuild
    from tests.helpers.datamodule import stream_pipeline

    out = tmp_path_factory.mktemp("shards")
    cfg = PipelineConfig.from_dict({**stream_pipeline(total_tokens=6_000), "seq_len": 64, "batch_size": 2})
    prebuild(cfg, tokenizer_dir, out, tokens_per_shard=64 * 64, progress=False)
    return out


def test_pretraining_gate_checks_the_first_batches_in_flight(tokenizer_dir, shards_dir, tmp_path, monkeypatch):
    """Shards mode: the first batches are checked as the trainer takes them, each before its
    step. Unshifted targets (every batch) stop the fit before step 1; documents merged into one
    attention segment stop it before the step of the first batch whose window holds two."""
    from stacklm.datamodule.shards_loader import _BatchFetch

    def dm(**kw):
        return StackDataModule(mode="shards", tokenizer=str(tokenizer_dir), data_dir=str(shards_dir), seq_len=64, batch_size=2,
                               step_log=False, **kw)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert len(fit(dm(), tmp_path / "good", steps=6).seen) == 6
    assert not [w for w in caught if "data gate" in str(w.message)]
    probe = dm()
    probe.setup("fit")
    two_docs = next(i for i, b in enumerate(probe.train_dataloader()) if int(full_batch(b)["seq_ids"].max()) > 0)
    assert 0 < two_docs < 4, two_docs  # within the gate's first GATE_BATCHES batches
    real = _BatchFetch.__getitem__

    def bugged(bug):
        def get(self, item):
            batch = dict(full_batch(real(self, item)))  # the bug in the four planes, as a collate would make it
            if bug == "unshifted":  # labels = input_ids, as for a model that shifts inside
                batch["targets"] = batch["input_ids"].clone()
            else:  # the documents of a window share one segment
                batch["seq_ids"] = torch.zeros_like(batch["seq_ids"])
            return batch
        return get

    for bug, check, at in (("unshifted", "targets_not_shifted", 0), ("merged", "cross_conversation_attention", two_docs)):
        monkeypatch.setattr(_BatchFetch, "__getitem__", bugged(bug))
        seen = BatchRecorder()
        with pytest.raises(DataGateError, match=rf"{check} \(first at shards train batch {at} of rank 0\)"):
            fit(dm(), tmp_path / bug, steps=6, recorder=seen)
        assert len(seen.seen) == at  # the bad batch's step never ran
    assert len(fit(dm(gate=False), tmp_path / "off", steps=2).seen) == 2


def test_the_cli_turns_the_gate_off(tokenizer_dir, chats, tmp_path, monkeypatch):
    import yaml

    from stacklm.train.cli import cli_main
    from tests.helpers.model import tiny_config

    monkeypatch.setattr("sys.argv", ["trainer"])
    config = {"model": {"config": {**tiny_config().to_dict(), "vocab_size": 512}},
              "trainer": {"accelerator": "cpu", "max_steps": 1, "logger": False, "default_root_dir": str(tmp_path)},
              "data": {"mode": "sft", "tokenizer": str(tokenizer_dir), "seq_len": SEQ_LEN, "batch_size": BATCH,
                       "pipeline": {"sources": [{"name": "chats", "kind": "local", "path": [str(chats)]}]}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert cli_main(["--config", str(tmp_path / "c.yaml")], run=False).datamodule.gate is True
    assert cli_main(["--config", str(tmp_path / "c.yaml"), "--data.gate", "false"], run=False).datamodule.gate is False


def test_the_gate_leaves_saying_a_dropped_row_to_the_loader(tokenizer_dir, chats, tmp_path, caplog):
    """The gate reads the records in this process and the loader again in its worker process:
    the gate's readers say nothing, so a fit says a dropped row once (it said it twice)."""
    bad = tmp_path / "chats.jsonl"
    bad.write_text("{not json\n" + chats.read_text())
    from stacklm.once import forget

    forget()
    with caplog.at_level("WARNING"):
        sample_sft(sft_dm(tokenizer_dir, bad))
    assert not [r for r in caplog.records if "dropping conversations" in r.getMessage()]
