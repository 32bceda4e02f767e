"""StackDataModule with a real Lightning Trainer on CPU: contract, exact resume, bad input."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from stacklm.configs import CONFIG_DIR
from stacklm.data.contract import BATCH_KEYS, LEAN_KEYS, full_batch
from stacklm.datamodule import DEFAULT_SNAPSHOT_STEPS, StackDataModule
from stacklm.errors import DataConfigError
from tests.helpers.lightning import TinyLM
from tests.helpers.worker_probe import ThenProbe
from tests.helpers.resume import check_save_load_state
from tests.helpers.datamodule import SEQ_LEN, BATCH, stream_pipeline, stream_dm, crash_and_resume, cpu_trainer


def test_stream_batches_follow_the_contract(tokenizer_dir):
    dm = stream_dm(tokenizer_dir)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 12_000 // (BATCH * SEQ_LEN)
    for b in batches:  # the lean planes (data.planes' default); the module derives the four on the device
        assert set(b) == set(LEAN_KEYS) and b["input_ids"].dtype == b["cu_seqlens"].dtype == torch.int32
        full = dm.on_after_batch_transfer(b, 0)
        assert all(full[k].shape == (BATCH, SEQ_LEN - 1) and full[k].dtype == torch.long for k in BATCH_KEYS)
    assert len(list(dm.val_dataloader())) == 2
    full_dm = stream_dm(tokenizer_dir, planes="full")
    full_dm.setup("fit")
    for lean, full in zip(batches, full_dm.train_dataloader()):  # the same stream in the four planes
        assert set(full) == set(BATCH_KEYS)
        derived = dm.on_after_batch_transfer(lean, 0)
        assert all(torch.equal(derived[k], full[k]) for k in BATCH_KEYS)


def test_stream_workers_start_clean_and_fast(tokenizer_dir, tmp_path, monkeypatch):
    """Loader workers start from the forkserver: they never import Lightning or wandb (whose
    threads and import hooks break a forked worker) even though this process has both."""
    import json

    import lightning  # noqa: F401  (in this process, as under a real fit)
    import wandb  # noqa: F401

    warm = stream_dm(tokenizer_dir, num_workers=2)
    warm.setup("fit")
    next(iter(warm.train_dataloader()))  # the forkserver runs before the variable below exists
    monkeypatch.setenv("STACKLM_TEST_PROBE", str(tmp_path / "probe"))
    dm = stream_dm(tokenizer_dir, num_workers=2)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.multiprocessing_context.get_start_method() == "forkserver"
    loader.worker_init_fn = ThenProbe(loader.worker_init_fn)  # the variable set above reaches a warm forkserver's workers
    next(iter(loader))
    seen = [json.loads((tmp_path / f"probe{w}").read_text()) for w in range(2)]
    assert all(s == {"lightning": False, "wandb": False, "lightning.pytorch": False} for s in seen), seen


@pytest.mark.parametrize("num_workers", [0, 2])
def test_exact_resume_with_a_real_trainer(tokenizer_dir, tmp_path, num_workers):
    steps, k = 10, 4
    full, resumed = crash_and_resume(tokenizer_dir, tmp_path, steps, k, num_workers=num_workers)
    assert len(full) == steps
    assert resumed == full[k:]


def test_worker_snapshots_follow_the_checkpoint_interval(tokenizer_dir, tmp_path):
    """Snapshots copy the shuffle buffer and dedup indexes, so they are rare by default: at the
    trainer's step checkpoint interval, where a resume then replays no batch at all."""
    assert stream_dm(tokenizer_dir).snapshot_interval() == DEFAULT_SNAPSHOT_STEPS  # no trainer to follow
    assert stream_dm(tokenizer_dir, snapshot_every_n_steps=5).snapshot_interval() == 5
    with pytest.raises(DataConfigError, match="snapshot_every_n_steps"):
        stream_dm(tokenizer_dir, snapshot_every_n_steps=0)
    dm = stream_dm(tokenizer_dir, num_workers=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    cpu_trainer(tmp_path, [ckpt], 6).fit(TinyLM(512), datamodule=dm)
    assert dm.snapshot_interval() == 3
    for step in (3, 6):
        state = torch.load(tmp_path / "ckpt" / f"epoch=0-step={step}.ckpt", weights_only=True)
        (loader,) = state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        own = loader["per_rank"][0]["loader"]  # each worker role: its last snapshot, at the batches it had delivered
        assert own["handed"] == step and [r["delivered"] - r["at"] for r in own["roles"]] == [0, 0]


def test_resume_refuses_other_data(tokenizer_dir, tmp_path):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    cpu_trainer(tmp_path, [ckpt], 2).fit(TinyLM(512), datamodule=stream_dm(tokenizer_dir))
    other = stream_dm(tokenizer_dir, pipeline={**stream_pipeline(), "seed": 7})
    with pytest.raises(DataConfigError, match="different data"):
        cpu_trainer(tmp_path / "b", [], 4).fit(TinyLM(512), datamodule=other, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=2.ckpt")


def test_bad_set_ups_fail_before_training(tokenizer_dir):
    with pytest.raises(DataConfigError, match="mode"):
        StackDataModule(mode="magic", tokenizer=str(tokenizer_dir))
    with pytest.raises(DataConfigError, match="data_dir"):
        StackDataModule(mode="shards", tokenizer=str(tokenizer_dir))
    dm = stream_dm(tokenizer_dir, pipeline=stream_pipeline(total_tokens=50))
    dm.setup("fit")
    with pytest.raises(DataConfigError, match="zero batches"):
        dm.train_dataloader()


@pytest.mark.parametrize("num_workers, prefetch", [(0, None), (2, 2), (2, 6)])
def test_data_stats_count_what_the_batches_delivered(tokenizer_dir, num_workers, prefetch):
    """Counted from the batches themselves at every step: per-source tokens sum to the non-pad
    input tokens handed out so far, exactly, however far the workers read and prefetch ahead."""
    dm = stream_dm(tokenizer_dir, num_workers=num_workers)
    dm.setup("fit")
    loader = dm.train_dataloader()
    if prefetch is not None:
        loader.prefetch_factor = prefetch
    pad, bos = dm.tokenizer.pad_id, dm.tokenizer.bos_id
    tokens = positions = docs_at_least = 0
    for n, batch in enumerate(loader, 1):
        assert set(batch) == set(LEAN_KEYS)  # counts and summaries taken off
        tokens += int((batch["input_ids"] != pad).sum())
        positions += batch["input_ids"].numel()
        docs_at_least += int((batch["input_ids"] == bos).sum())
        stats = dm.data_stats()
        real = stats["realized"]
        assert sum(r["tokens"] for r in real.values()) == tokens, n
        assert stats["delivered"] == {"batches": n, "positions": positions, "tokens": tokens, "padding_rows": 0}
        assert abs(stats["padding_fraction"] - (1 - tokens / positions)) < 1e-12
        assert sum(r["docs"] for r in real.values()) >= docs_at_least  # + those whose <bos> is a row's last token
        if n == 1:  # the first numbers are there with the first batch, drops included
            assert "dropped_docs" in stats and "holdout_docs" in stats
    assert n == len(loader) >= 12_000 // (BATCH * SEQ_LEN) - 1
    assert tokens <= 12_000 + 2 * sum(r["docs"] for r in real.values())  # never more than the budget delivered
    assert real["web"]["tokens"] > real["code"]["tokens"] > 0 and real["web"]["target_weight"] == pytest.approx(0.7)
    assert abs(sum(r["realized_weight"] for r in real.values()) - 1) < 1e-9
    assert sum(stats["holdout_docs"].values()) > 0  # the other split's documents: holdout, not drops
    assert "holdout" not in stats["dropped_docs"] and stats["offline_fallback"] == []
    # the budget met: each source that lost tokens to it had a document cut short, kept (cut_docs), not dropped
    cut_tokens = {s: r["cut_by_budget"] for s, r in stats["dropped_tokens"].items() if r.get("cut_by_budget")}
    assert cut_tokens and set(cut_tokens) == set(stats["cut_docs"]) and all(r["cut_by_budget"] >= 1 for r in stats["cut_docs"].values())
    hist = stats["doc_length_hist"]
    assert sum(sum(c) for c in hist["counts"].values()) == sum(r["docs"] for r in real.values())
    assert set(stats["hashes"]) == {"tokenizer", "manifest", "data_config"}


def test_sft_mode_trains_on_assistant_tokens_and_resumes_exactly(tokenizer_dir, tmp_path):
    from tests.helpers.sft import make_conversations, write_jsonl

    path = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in make_conversations(120)])
    pipeline = {"sources": [{"name": "chats", "kind": "local", "path": [str(path)]}], "shuffle_buffer": 16,
                "pack_buffer_docs": 8, "holdout_fraction": 0.1}
    kw = dict(mode="sft", pipeline=pipeline, seq_len=128, batch_size=2)
    dm = stream_dm(tokenizer_dir, **kw)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) >= 8
    tok = dm.tokenizer
    roles = torch.tensor([tok.special_ids[r] for r in ("<|system|>", "<|user|>", "<|assistant|>", "<|tool_call|>", "<|tool_result|>")])
    assistant = tok.special_ids["<|assistant|>"]
    for b in batches:
        trained = b["targets"] != -100
        assert trained.any()
        # the token each trained position predicts lies in an assistant turn: the last role
        # marker at or before it (within its conversation) is <|assistant|>
        for row in range(b["input_ids"].shape[0]):
            ids, seg = b["input_ids"][row], b["seq_ids"][row]
            for i in torch.nonzero(trained[row]).flatten().tolist():
                window = ids[: i + 1][seg[: i + 1] == seg[i]]
                marks = window[torch.isin(window, roles)]
                assert len(marks) and int(marks[-1]) == assistant
    full, resumed = crash_and_resume(tokenizer_dir, tmp_path, 8, 3, **kw)
    assert resumed == full[3:]


def test_sft_mode_data_stats_count_what_the_batches_delivered(tokenizer_dir, tmp_path):
    """SFT batches carry their per-source counts too: with 2 workers, two weighted sources and
    padding batches of a reader that ran dry, the delivered tokens are the batches' own."""
    from tests.helpers.sft import make_conversations, write_jsonl

    convs = make_conversations(90)
    a = write_jsonl(tmp_path / "a.jsonl", [{"messages": m} for m in convs[:60]])
    b = write_jsonl(tmp_path / "b.jsonl", [{"messages": m} for m in convs[60:]])
    pipeline = {"sources": [{"name": "a", "kind": "local", "path": [str(a)], "weight": 2.0},
                            {"name": "b", "kind": "local", "path": [str(b)], "weight": 1.0}],
                "shuffle_buffer": 8, "pack_buffer_docs": 4, "holdout_fraction": 0.0}
    dm = stream_dm(tokenizer_dir, mode="sft", pipeline=pipeline, seq_len=128, batch_size=2, num_workers=2)
    dm.setup("fit")
    pad = dm.tokenizer.pad_id
    tokens = positions = 0
    for n, batch in enumerate(dm.train_dataloader(), 1):
        assert set(batch) == {"input_ids", "position_ids", "seq_ids", "targets"}
        tokens += int((batch["input_ids"] != pad).sum())
        positions += batch["input_ids"].numel()
        stats = dm.data_stats()
        assert sum(r["tokens"] for r in stats["realized"].values()) == tokens, n
        assert {k: stats["delivered"][k] for k in ("batches", "positions", "tokens")} == {"batches": n, "positions": positions, "tokens": tokens}
    real = stats["realized"]
    assert set(real) == {"a", "b"} and real["a"]["tokens"] > real["b"]["tokens"] > 0
    assert real["a"]["target_weight"] == pytest.approx(2 / 3)
    # every conversation is delivered once or counted as dropped (most of these are too long for 128)
    dropped = sum(n for by_src in stats["dropped_docs"].values() for by_reason in by_src.values() for n in by_reason.values())
    assert stats["dropped_docs"]["render"]["a"]["dropped_too_long"] > 0
    assert sum(r["docs"] for r in real.values()) + dropped == 90
    assert sum(stats["cut_docs"]["a"].get(k, 0) for k in ("truncated", "truncated_start")) > 0


def test_stack_100m_config_data_section_builds():
    import yaml

    cfg = yaml.safe_load((CONFIG_DIR / "stack-100m.yaml").read_text())
    dm = StackDataModule(**cfg["data"])
    pc = dm.pipeline_config()
    assert pc.mix.name == "stack-100m" and pc.mix.total_tokens == 20_000_000_000
    assert pc.mix.weights == {"fineweb-edu": 0.70, "cosmopedia-v2": 0.15, "starcoderdata-python": 0.10, "finemath": 0.05}
    assert pc.seq_len == cfg["model"]["config"]["seq_len"] == 2048


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shards_mode_exact_resume_with_a_real_trainer(tokenizer_dir, shards_dir, tmp_path, num_workers):
    kw = dict(mode="shards", data_dir=str(shards_dir), pipeline=None, num_workers=num_workers)
    full, resumed = crash_and_resume(tokenizer_dir, tmp_path, 12, 5, **kw)
    assert resumed == full[5:]


def test_shards_mode_refuses_a_model_seq_len_mismatch(tokenizer_dir, shards_dir):
    dm = stream_dm(tokenizer_dir, mode="shards", data_dir=str(shards_dir), pipeline=None, seq_len=128)
    dm.setup("fit")
    with pytest.raises(DataConfigError, match="seq_len 64"):
        dm.train_dataloader()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_shards_mode_data_stats_count_the_rows_taken(tokenizer_dir, shards_dir, num_workers):
    """Per-source delivery from each taken row's provenance: the tokens sum to the non-pad input
    ids of the batches at every step, and over a whole epoch (every row once) each source's
    documents are the manifest's. The counts live in the module's state: a resume continues them."""
    import json

    dm = stream_dm(tokenizer_dir, mode="shards", data_dir=str(shards_dir), pipeline=None, num_workers=num_workers)
    dm.setup("fit")
    pad = dm.tokenizer.pad_id
    tokens = positions = 0
    rows: dict[str, int] = {}
    for n, batch in enumerate(dm.train_dataloader(), 1):
        tokens += int((batch["input_ids"] != pad).sum())
        positions += batch["input_ids"].numel()
        # the rows holding each source's input tokens, by the per-source loss's own lookup (RowSources)
        names, where = dm.batch_sources()
        for i, name in enumerate(names):
            rows[name] = rows.get(name, 0) + int((where[:, :-1] == i).any(axis=1).sum())
        stats = dm.data_stats()
        assert sum(r["tokens"] for r in stats["realized"].values()) == tokens, n
        assert {s: r["rows"] for s, r in stats["realized"].items()} == rows, n
        assert {k: stats["delivered"][k] for k in ("batches", "positions", "tokens")} == {"batches": n, "positions": positions, "tokens": tokens}
        if n == 3:
            saved = dm.state_dict()
    assert "realized_estimated" not in stats and abs(stats["padding_fraction"] - (1 - tokens / positions)) < 1e-12
    padding_rows = sum(int((full_batch(b)["targets"] == -100).all(dim=1).sum()) for b in [batch])  # only the last step pads
    assert stats["delivered"]["padding_rows"] == padding_rows
    manifest = json.loads((shards_dir / "manifest.json").read_text())
    assert {s: r["docs"] for s, r in stats["realized"].items()} == {s["name"]: s["docs"] for s in manifest["sources"]}
    again = stream_dm(tokenizer_dir, mode="shards", data_dir=str(shards_dir), pipeline=None)
    again.setup("fit")
    again.load_state_dict(saved)
    rest = list(again.train_dataloader())
    assert len(rest) == n - 3
    assert again.data_stats()["realized"] == stats["realized"]  # totals continue from the checkpoint


def test_shards_mode_refuses_a_rotten_shard_unless_told_not_to_check(tokenizer_dir, shards_dir, tmp_path):
    """One flipped bit inside the vocabulary: the loader workers refuse the shard at its first
    read, naming it and `stacklm verify`; ``verify_shards=False`` trains on it."""
    import shutil

    from stacklm.data.storage.shards import tokens_path
    from stacklm.errors import DataError

    data = tmp_path / "shards"
    shutil.copytree(shards_dir, data)
    path = tokens_path(data / "train", "shard_00000")
    raw = bytearray(path.read_bytes())
    raw[2 * 70] ^= 1  # the low byte of token 70: the id changes by one, staying inside the (even) vocab
    path.write_bytes(bytes(raw))
    dm = stream_dm(tokenizer_dir, mode="shards", data_dir=str(data), pipeline=None, num_workers=2)
    dm.setup("fit")
    with pytest.raises(DataError, match=r"shard_00000.tokens.bin: content hash .* `stacklm verify"):
        list(dm.train_dataloader())
    quiet = stream_dm(tokenizer_dir, mode="shards", data_dir=str(data), pipeline=None, num_workers=2, verify_shards=False)
    quiet.setup("fit")
    assert len(list(quiet.train_dataloader())) == len(quiet.train_dataloader())
    with pytest.raises(DataConfigError, match=r"'data.verify_shards' must be true or false, got 'off'"):
        stream_dm(tokenizer_dir, mode="shards", data_dir=str(data), pipeline=None, verify_shards="off")


@pytest.mark.parametrize("mode, num_workers", [("stream", 0), ("stream", 2), ("shards", 2)])
def test_loader_state_survives_a_weights_only_checkpoint(tokenizer_dir, shards_dir, mode, num_workers):
    """The train loader alone, no Trainer: its state saved mid-epoch goes through ``torch.save`` +
    ``torch.load(weights_only=True)`` (a checkpoint must load without pickle trust) and a fresh
    module's loader continues exactly."""
    kw = dict(num_workers=num_workers)
    if mode == "shards":
        kw.update(mode="shards", data_dir=str(shards_dir), pipeline=None)

    def build():
        dm = stream_dm(tokenizer_dir, **kw)
        dm.setup("fit")
        return dm.train_dataloader()

    full = check_save_load_state(build, lambda n: (1, n // 2), state_round_trip="torch")
    assert len(full) >= 6


def test_a_source_that_runs_dry_is_named_with_its_batch_and_share(tokenizer_dir):
    pipeline = stream_pipeline()
    pipeline["mix"]["entries"][1]["num_docs"] = 3  # code: far too little for its 30%
    dm = stream_dm(tokenizer_dir, pipeline=pipeline)
    dm.setup("fit")
    with pytest.warns(RuntimeWarning, match=r"source 'code' ran dry in the train stream, rank 0 worker 0, at batch \d+ .*target 0\.3000"):
        for _ in dm.train_dataloader():
            pass
    dry = dm.data_stats()["ran_dry"]
    assert list(dry) == ["code"] and dry["code"]["target_share"] == pytest.approx(0.3)
    assert 0 < dry["code"]["batch"] and dry["code"]["delivered_share"] < 0.3


def test_every_stream_batch_is_checked_against_the_vocabulary(tokenizer_dir):
    from stacklm.errors import DataError

    dm = stream_dm(tokenizer_dir)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert loader.vocab_size == dm.vocab_size == 512
    next(iter(loader))
    loader.vocab_size = 300  # as if the data came from a bigger tokenizer than the model's
    with pytest.raises(DataError, match=r"train stream: a batch holds token id \d+ outside the vocabulary \[0, 300\)"):
        for _ in loader:
            pass


def test_an_opted_in_offline_fallback_is_recorded_in_data_stats(tokenizer_dir, monkeypatch):
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    pipeline = stream_pipeline()
    pipeline["mix"]["entries"][1] = {"name": "code", "kind": "hf", "path": "HuggingFaceTB/finemath", "config_name": "finemath-4plus",
                                     "weight": 0.3, "domain": "math", "num_docs": 400}
    dm = stream_dm(tokenizer_dir, pipeline=pipeline)  # fallback_offline not set: a broken hub source is an error
    dm.setup("fit")
    with pytest.raises(Exception, match="HuggingFaceTB/finemath") as err:
        next(iter(dm.train_dataloader()))
    assert "fallback" not in str(err.value)
    dm = stream_dm(tokenizer_dir, pipeline={**pipeline, "fallback_offline": True})
    dm.setup("fit")
    with pytest.warns(RuntimeWarning, match="OFFLINE FALLBACK: source 'code'"):
        next(iter(dm.train_dataloader()))
    assert dm.data_stats()["offline_fallback"] == ["code"]


def test_rows_are_not_reported_for_a_run_resumed_from_a_state_without_them():
    """A checkpoint written before packed rows were counted: a count from the resume on would read
    as the whole run's ("N tokens in R rows" with R too small), so the run reports no rows."""
    from stacklm.datamodule.delivery import DeliveryCounter

    batch = {"tokens": [8], "docs": [1], "rows": [1], "doc_lengths": [[0, 8]]}
    first = DeliveryCounter(["web"])
    first.add(8, batch)
    old = {k: v for k, v in first.state_dict().items() if k != "rows"}
    for state, rows in ((first.state_dict(), 2), (old, None)):
        resumed = DeliveryCounter(["web"])
        resumed.load_state_dict(state)
        resumed.add(8, batch)
        assert resumed.stats()["realized"]["web"].get("rows") == rows and resumed.stats()["realized"]["web"]["tokens"] == 16
        assert ("rows" in resumed.state_dict()) == (rows is not None)
