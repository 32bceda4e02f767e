"""The Stack-100M GPT, its attention kernels, the LightningModule and the CLI, on CPU.

Batches are real: standard-library prose encoded as raw UTF-8 bytes (ids 0-255 are the byte
tokens of the id layout), packed by ``stacklm.data.packing.pack`` into the batch contract.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import lightning.pytorch as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from stacklm.configs import CONFIG_DIR
from stacklm.data.contract import BATCH_KEYS, lean_batch
from stacklm.data.packing.pack import collate
from stacklm.train.attention import attend, build_attention_mask, reference_attention
from stacklm.train.model import GPT, GPTConfig, RotaryEmbedding, apply_rotary, check_batch, lm_loss
from stacklm.train.gpt_module import GPTModule, OptimConfig, check_datamodule, warmup_cosine
from tests.helpers.model import BOS, EOS, PAD, VOCAB, ContractDataModule, byte_docs, packed_windows, tiny_config

ROOT = Path(__file__).resolve().parents[2]
# ---------------------------------------------------------------------------------------
# attention kernels
# ---------------------------------------------------------------------------------------
def test_sdpa_and_flex_match_naive_reference_on_packed_rows():
    torch.manual_seed(0)
    batch = collate(packed_windows(12, seq_len=97, max_len=70), BOS, EOS, PAD)  # several docs + a padded tail
    seq_ids = batch["seq_ids"]
    assert int(seq_ids.max()) >= 2, "rows must hold several documents for this test to mean anything"
    B, T = seq_ids.shape
    q, k, v = (torch.randn(B, 4, T, 16) for _ in range(3))
    expected = reference_attention(q, k, v, seq_ids)

    out_sdpa = attend(q, k, v, build_attention_mask(seq_ids, "sdpa"))
    torch.testing.assert_close(out_sdpa, expected, atol=1e-5, rtol=1e-5)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        out_flex = attend(q, k, v, build_attention_mask(seq_ids, "flex"))
    torch.testing.assert_close(out_flex, expected, atol=1e-5, rtol=1e-5)

    # And the mask does something: plain causal attention over the same row differs.
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (causal - expected).abs().max() > 1e-2


def test_model_on_a_lean_batch_equals_the_full_planes():
    """A lean batch (``stacklm.data.contract``) through the module's transfer hook gives the four
    planes exactly, and the model's flex mask built from its ``cu_seqlens`` (no host sync) gives
    the logits the sdpa mask from ``seq_ids`` gives."""
    torch.manual_seed(0)
    windows = packed_windows(12, seq_len=65, max_len=40)  # several docs per row, a padded tail
    full = collate(windows, BOS, EOS, PAD)
    lean = lean_batch(windows, BOS, EOS, PAD)
    module = GPTModule(tiny_config())
    derived = module.with_planes(lean)
    for key in BATCH_KEYS:
        assert derived[key].dtype == torch.long and torch.equal(derived[key], full[key]), key
    assert module.with_planes(full) is full
    check_batch(derived, module.config)
    flex = GPT(tiny_config(attention="flex"))
    flex.load_state_dict(module.model.state_dict())
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        want = module.model(full["input_ids"], full["position_ids"], full["seq_ids"])
        got = module.model(derived["input_ids"], derived["position_ids"], derived["seq_ids"], lean["cu_seqlens"], lean["max_seqlen"])
        got_flex = flex(derived["input_ids"], derived["position_ids"], derived["seq_ids"], lean["cu_seqlens"], lean["max_seqlen"])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_flex, want, atol=1e-4, rtol=1e-4)


def test_cuda_only_backends_fail_clearly_on_cpu():
    assert build_attention_mask(torch.zeros(1, 4, dtype=torch.long)).backend == "sdpa"  # 'auto' on CPU
    with pytest.raises(ValueError, match="needs a CUDA device"):
        GPT(tiny_config(attention="flash_varlen"))(*(torch.zeros(1, 4, dtype=torch.long),) * 3)
    with pytest.raises(ValueError, match="attention must be one of"):
        tiny_config(attention="xformers")


# ---------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------
def two_doc_row(doc_a: np.ndarray, doc_b: np.ndarray, seq_len: int) -> dict[str, torch.Tensor]:
    window = np.concatenate([[BOS], doc_a, [EOS, BOS], doc_b, [EOS]])
    window = np.concatenate([window, np.full(seq_len - len(window), PAD)])
    return collate(window[None], BOS, EOS, PAD)


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_documents_in_one_row_do_not_see_each_other(backend):
    torch.manual_seed(0)
    model = GPT(tiny_config(attention=backend)).eval()
    docs = byte_docs(3, max_len=25)
    doc_a, doc_a2, doc_b = docs[0]["ids"][:25], docs[1]["ids"][:25], docs[2]["ids"][:25]
    assert not np.array_equal(doc_a, doc_a2)
    row1, row2 = two_doc_row(doc_a, doc_b, 64), two_doc_row(doc_a2, doc_b, 64)
    b_positions = row1["seq_ids"][0] == 1
    assert b_positions.sum() == len(doc_b) + 2 and torch.equal(row1["seq_ids"], row2["seq_ids"])

    def logits(row, seq_ids=None):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            return model(row["input_ids"], row["position_ids"], row["seq_ids"] if seq_ids is None else seq_ids)[0]

    l1, l2 = logits(row1), logits(row2)
    assert (l1[~b_positions] - l2[~b_positions]).abs().max() > 1e-3  # doc A's own logits did change
    torch.testing.assert_close(l1[b_positions], l2[b_positions], atol=1e-5, rtol=0)
    # Control: with one segment for the whole row, doc A's tokens leak into doc B's logits.
    one_segment = torch.zeros_like(row1["seq_ids"])
    leak = (logits(row1, one_segment)[b_positions] - logits(row2, one_segment)[b_positions]).abs().max()
    assert leak > 1e-3


def test_doc_packed_at_offset_matches_doc_alone():
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    docs = byte_docs(2, max_len=30)
    first, doc = docs[0]["ids"][:30], docs[1]["ids"][:20]
    packed = two_doc_row(first, doc, 64)
    alone = collate(np.concatenate([[BOS], doc, [EOS], np.full(64 - len(doc) - 2, PAD)])[None], BOS, EOS, PAD)
    offset = len(first) + 2
    n = len(doc) + 1
    assert torch.equal(packed["position_ids"][0, offset:offset + n], alone["position_ids"][0, :n])
    with torch.no_grad():
        lp = model(packed["input_ids"], packed["position_ids"], packed["seq_ids"])[0, offset:offset + n]
        la = model(alone["input_ids"], alone["position_ids"], alone["seq_ids"])[0, :n]
    torch.testing.assert_close(lp, la, atol=1e-5, rtol=1e-5)


def test_rope_is_driven_by_position_ids():
    # The tables are exactly rotation by position * theta^(-2i/d), looked up per token.
    head_dim, theta = 16, 10000.0
    rope = RotaryEmbedding(head_dim, seq_len=64, theta=theta)
    pos = torch.tensor([[0, 5, 63, 1], [2, 2, 0, 7]])
    x = torch.randn(2, 3, 4, head_dim, dtype=torch.float64)
    cos, sin = rope(pos)
    got = apply_rotary(x.float(), cos, sin).double()
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = pos[:, None, :, None].double() * inv_freq  # (B, 1, T, D/2)
    z = torch.complex(x[..., : head_dim // 2], x[..., head_dim // 2 :]) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], dim=-1), atol=1e-5, rtol=1e-5)

    # In the model: same tokens and mask, positions 2 and 3 swapped -> different logits.
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    row = two_doc_row(byte_docs(1, 20)[0]["ids"][:20], byte_docs(2, 20)[1]["ids"][:20], 64)
    swapped = row["position_ids"].clone()
    swapped[0, [2, 3]] = swapped[0, [3, 2]]
    with torch.no_grad():
        base = model(row["input_ids"], row["position_ids"], row["seq_ids"])
        moved = model(row["input_ids"], swapped, row["seq_ids"])
    assert (base[0, 3:22] - moved[0, 3:22]).abs().max() > 1e-3


def test_loss_ignores_minus_100_targets():
    torch.manual_seed(0)
    logits = torch.randn(2, 10, VOCAB, requires_grad=True)
    targets = torch.randint(0, VOCAB, (2, 10))
    targets[0, 3:7] = -100
    targets[1, 0] = -100
    loss, n = lm_loss(logits, targets)
    keep = targets != -100
    assert int(n) == int(keep.sum()) == 15
    torch.testing.assert_close(loss, F.cross_entropy(logits[keep], targets[keep]))
    loss.backward()
    assert logits.grad[~keep].abs().max() == 0 and logits.grad[keep].abs().max() > 0
    # Ignored positions can hold anything without changing the loss.
    scrambled = logits.detach().clone()
    scrambled[~keep] = torch.randn_like(scrambled[~keep]) * 100
    torch.testing.assert_close(lm_loss(scrambled, targets)[0], loss.detach())
    # A batch with nothing to learn is 0, not NaN.
    empty_loss, empty_n = lm_loss(logits.detach(), torch.full_like(targets, -100))
    assert float(empty_loss) == 0.0 and int(empty_n) == 0


def test_stack_100m_parameter_count_and_tied_embedding():
    config = GPTConfig.stack_100m()
    assert (config.vocab_size, config.d_model, config.seq_len, config.rope_theta) == (32768, 512, 2048, 10000.0)
    with torch.device("meta"):
        model = GPT(config)
    assert model.lm_head.weight is model.embed.weight
    assert model.num_params() == config.num_params() == 98_593_280
    assert abs(model.num_params() - 100e6) / 100e6 < 0.02
    tiny = GPT(tiny_config())
    assert tiny.num_params() == tiny_config().num_params() < 1_000_000


def test_check_batch_names_the_problem():
    config = tiny_config()
    batch = collate(packed_windows(4, 64, 50)[:2], BOS, EOS, PAD)
    check_batch(batch, config)
    with pytest.raises(ValueError, match="embedding has 300 rows"):
        check_batch(batch, tiny_config(vocab_size=300))
    long_rows = collate(packed_windows(4, 80, 100)[:2], BOS, EOS, PAD)
    with pytest.raises(ValueError, match="seq_len is 64"):
        check_batch(long_rows, config)
    with pytest.raises(ValueError, match=r"missing key\(s\) \['seq_ids'\]"):
        check_batch({k: v for k, v in batch.items() if k != "seq_ids"}, config)


# ---------------------------------------------------------------------------------------
# LightningModule and CLI
# ---------------------------------------------------------------------------------------
def test_warmup_cosine_schedule():
    lrs = [warmup_cosine(s, warmup_steps=10, total_steps=110, min_lr_ratio=0.1) for s in range(130)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(lrs[:10], lrs[1:10]))
    assert lrs[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(lrs[10:110], lrs[11:111]))
    assert lrs[110] == lrs[129] == pytest.approx(0.1)


class _Recorder(L.Callback):
    def __init__(self):
        self.tokens, self.metrics = 0, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.tokens += int((batch["targets"] != -100).sum())
        self.metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def test_module_fits_tiny_model_and_counts_tokens(tmp_path):
    torch.manual_seed(0)
    dm = ContractDataModule(seq_len=64, batch_size=8, n_docs=120)
    module = GPTModule(tiny_config(), OptimConfig(lr=3e-3, warmup_steps=5))
    recorder = _Recorder()
    trainer = L.Trainer(
        accelerator="cpu", max_steps=40, log_every_n_steps=5, limit_val_batches=2, val_check_interval=20,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[recorder], default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 40
    losses = [m["train/loss"] for m in recorder.metrics]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5  # it learns
    assert int(module.tokens_seen) == recorder.tokens
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}
    assert logged["train/tokens"] == recorder.tokens  # logged by the module at step 40
    assert recorder.metrics[-1]["train/tokens"] < recorder.tokens  # (an earlier log point)
    assert logged["train/tokens_per_s"] > 0
    assert math.isfinite(logged["val/loss"])
    assert 0 < logged["train/lr"] < 3e-3  # cosine has started decaying


def test_token_count_survives_checkpoint_resume(tmp_path):
    def run(max_steps, ckpt_path=None):
        recorder = _Recorder()
        module = GPTModule(tiny_config(n_layer=1), OptimConfig(warmup_steps=1))
        trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder], default_root_dir=tmp_path)
        trainer.fit(module, datamodule=ContractDataModule(seq_len=64, batch_size=4, n_docs=40), ckpt_path=ckpt_path)
        return trainer, module, recorder

    first_trainer, first, rec1 = run(3)
    first_trainer.save_checkpoint(tmp_path / "step3.ckpt")
    _, resumed, rec2 = run(6, ckpt_path=tmp_path / "step3.ckpt")
    assert int(first.tokens_seen) == rec1.tokens > 0
    assert int(resumed.tokens_seen) == rec1.tokens + rec2.tokens  # continued, not restarted


class _FirstWeights(L.Callback):
    """The model's weights at the first training batch (after init_from / a resume restored them)."""

    def __init__(self):
        self.weights = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.weights is None:
            self.weights = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


def test_init_from_starts_a_new_run_from_another_runs_weights(tmp_path, capsys):
    """Pre-training -> SFT: init_from loads the weights and nothing else (step, optimizer and data
    start fresh); a resume keeps its own weights; another shape or tokenizer is one clear line."""
    from stacklm.errors import ConfigError

    def run(max_steps, module, ckpt_path=None):
        first = _FirstWeights()
        trainer = L.Trainer(accelerator="cpu", max_steps=max_steps, limit_val_batches=0, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[first], default_root_dir=tmp_path)
        trainer.fit(module, datamodule=ContractDataModule(seq_len=64, batch_size=4, n_docs=40), ckpt_path=ckpt_path)
        return trainer, first.weights

    torch.manual_seed(0)
    pre, _ = run(3, GPTModule(tiny_config(n_layer=1), OptimConfig(warmup_steps=1)))
    pre.save_checkpoint(tmp_path / "pre.ckpt")
    saved = {k.removeprefix("model."): v for k, v in torch.load(tmp_path / "pre.ckpt", weights_only=True)["state_dict"].items()
             if k.startswith("model.")}
    torch.manual_seed(1)  # another random init, so equality below means the weights were loaded
    sft, at_start = run(2, GPTModule(tiny_config(n_layer=1), OptimConfig(warmup_steps=1), init_from=str(tmp_path / "pre.ckpt")))
    assert sft.global_step == 2  # a fresh run: its own steps from 0, not 3 -> 5
    assert at_start.keys() == saved.keys() and all(torch.equal(at_start[k], saved[k]) for k in saved)
    assert "model.init_from: " in capsys.readouterr().out
    sft.save_checkpoint(tmp_path / "sft.ckpt")
    sft_saved = torch.load(tmp_path / "sft.ckpt", weights_only=True)
    assert sft_saved["hyper_parameters"]["init_from"] == str(tmp_path / "pre.ckpt")

    # a resume of the SFT run restores the SFT run's weights, not init_from's
    _, resumed_start = run(3, GPTModule(tiny_config(n_layer=1), OptimConfig(warmup_steps=1), init_from=str(tmp_path / "pre.ckpt")),
                           ckpt_path=tmp_path / "sft.ckpt")
    sft_weights = {k.removeprefix("model."): v for k, v in sft_saved["state_dict"].items() if k.startswith("model.")}
    assert all(torch.equal(resumed_start[k], sft_weights[k]) for k in sft_weights)
    assert not all(torch.equal(resumed_start[k], saved[k]) for k in saved)

    # refusals: another shape, a tokenizer that is not the data's, not a checkpoint
    with pytest.raises(ConfigError, match=r"another shape .*d_model 128 vs 64"):
        run(1, GPTModule(tiny_config(n_layer=1, d_model=64), init_from=str(tmp_path / "pre.ckpt")))
    bad = torch.load(tmp_path / "pre.ckpt", weights_only=True)
    bad["StackDataModule"] = {"identity": {"tokenizer": "f" * 64}}
    torch.save(bad, tmp_path / "other_tok.ckpt")

    class WithTokenizer(ContractDataModule):
        def tokenizer_hash(self):
            return "0" * 64

    module = GPTModule(tiny_config(n_layer=1), init_from=str(tmp_path / "other_tok.ckpt"))
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"trained with tokenizer ffff.*this run's data.tokenizer is 0000"):
        trainer.fit(module, datamodule=WithTokenizer(seq_len=64, batch_size=4, n_docs=40))
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="junk.ckpt: not a readable checkpoint"):
        run(1, GPTModule(tiny_config(n_layer=1), init_from=str(tmp_path / "junk.ckpt")))
    with pytest.raises(ConfigError, match="no such file"):
        run(1, GPTModule(tiny_config(n_layer=1), init_from=str(tmp_path / "absent.ckpt")))


@pytest.mark.parametrize(
    "dm_kwargs, message",
    [({"vocab_size": 1000}, "vocab_size = 1000 but the model embedding has 512 rows"), ({"seq_len": 32}, "seq_len = 32 but the model's seq_len = 64")],
)
def test_mismatched_datamodule_fails_before_any_step(tmp_path, dm_kwargs, message):
    dm = ContractDataModule(**{"seq_len": 64, "n_docs": 30, **dm_kwargs})
    module = GPTModule(tiny_config())
    steps = []
    module.training_step = lambda *a, **k: steps.append(1)  # must never run
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, datamodule=dm)
    assert steps == []
    check_datamodule(object(), tiny_config())  # attributes absent: nothing to check


def test_cli_fit_from_yaml(tmp_path, monkeypatch):
    from stacklm.train.cli import cli_main

    monkeypatch.setattr("sys.argv", ["trainer"])  # args come from the list below only
    config = {
        "seed_everything": 0,
        "model": {"config": tiny_config().to_dict(), "optim": {"lr": 1e-3, "warmup_steps": 2}},
        "trainer": {"accelerator": "cpu", "max_steps": 3, "logger": False, "enable_checkpointing": False,
                    "enable_progress_bar": False, "limit_val_batches": 1, "default_root_dir": str(tmp_path)},
        "data": {"seq_len": 64, "batch_size": 2, "n_docs": 30},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = cli_main(["fit", "--config", str(path), "--model.config.n_layer", "1"], datamodule_class=ContractDataModule)
    assert cli.trainer.global_step == 3
    assert cli.model.config.n_layer == 1 and cli.model.config.vocab_size == VOCAB
    assert cli.model.optim.lr == 1e-3


def test_stack_100m_config_file():
    import jsonargparse

    cfg = yaml.safe_load((CONFIG_DIR / "stack-100m.yaml").read_text())
    # The model and trainer sections parse against the real signatures (names, types, class paths).
    parser = jsonargparse.ArgumentParser()
    parser.add_class_arguments(GPTModule, "model")
    parser.add_class_arguments(L.Trainer, "trainer")
    parsed = parser.parse_object({"model": cfg["model"], "trainer": cfg["trainer"]})
    assert parsed.trainer.callbacks[0].class_path == "stacklm.callbacks.DataStatsCallback"
    model = GPTConfig.coerce(cfg["model"]["config"])
    assert model.num_params() == 98_593_280 and model.seq_len == 2048 and model.vocab_size == 32768
    assert cfg["data"]["mode"] == "stream"
    t = cfg["trainer"]
    rows_per_step = cfg["data"]["batch_size"] * t["devices"] * t["num_nodes"] * t["accumulate_grad_batches"]
    tokens = t["max_steps"] * rows_per_step * (model.seq_len - 1)
    assert abs(tokens - 20e9) / 20e9 < 0.001, tokens
    assert OptimConfig.coerce(cfg["model"]["optim"]).warmup_steps < t["max_steps"]
