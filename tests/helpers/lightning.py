"""Small real Lightning pieces shared by the datamodule tests: tiny models that train on the
batch contract and on preference batches, a callback that fingerprints every batch it sees, and
``run_program`` for the tests that run a fit as its own program."""

from __future__ import annotations

import hashlib
import subprocess
import tempfile

import lightning as L
import torch

from stacklm.data.contract import IGNORE_INDEX, full_batch


class TinyLM(L.LightningModule):
    """Embedding + linear head; enough to make real optimizer steps on contract batches."""

    def __init__(self, vocab_size: int, dim: int = 16) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab_size, dim)
        self.head = torch.nn.Linear(dim, vocab_size)

    def training_step(self, batch, batch_idx):
        logits = self.head(self.emb(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)

    def validation_step(self, batch, batch_idx):
        logits = self.head(self.emb(batch["input_ids"]))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)
        self.log("val_loss", loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TinyDPO(L.LightningModule):
    """Embedding + head for preference batches (``mode="preference"``) with the reference-free
    DPO loss -log sigmoid(logp(chosen) - logp(rejected)) over each side's trained tokens, so a
    batch's pairing and targets drive real steps (filler rows, ``pair_ids`` -1, take no loss)."""

    def __init__(self, vocab_size: int, dim: int = 16) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(vocab_size, dim), torch.nn.Linear(dim, vocab_size)

    def _logp(self, side):
        logits = self.head(self.emb(side["input_ids"])).log_softmax(-1)
        t = side["targets"]
        lp = logits.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (lp * (t != -100)).sum(-1)

    def training_step(self, batch, batch_idx):
        from stacklm.data.sft.preference import preference_sides

        chosen, rejected = preference_sides(batch)
        real = batch["pair_ids"] >= 0
        return -torch.nn.functional.logsigmoid(self._logp(chosen) - self._logp(rejected))[real].sum() / real.sum().clamp(min=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def batch_hash(batch: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    batch = full_batch(batch)  # a lean batch from the loader hashes as the planes the model saw
    for key in sorted(batch):
        h.update(key.encode())
        value = batch[key]  # a lean batch also holds host ints (max_seqlen, pad_id)
        h.update(value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()[:16]


class BatchRecorder(L.Callback):
    """Records (global_step, hash) of every training batch; can crash after a given step."""

    def __init__(self, crash_after_step: int | None = None) -> None:
        self.seen: list[tuple[int, str]] = []
        self.crash_after_step = crash_after_step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((trainer.global_step, batch_hash(batch)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.crash_after_step is not None and trainer.global_step >= self.crash_after_step:
            raise KeyboardInterrupt("simulated crash")


class DeliveredTokenTally(L.Callback):
    """Counts, from the batches themselves, the non-pad input tokens and the ``<bos>`` tokens
    the training step received, after every step: the independent count the data layer's
    logged numbers are checked against. Its totals are in the checkpoint (callback state), so a
    resumed run continues them; ``out`` gets ``{step: [tokens, bos]}`` as JSON after each step
    (``{rank}`` in it is replaced by the rank, for DDP)."""

    def __init__(self, out: str, pad_id: int, bos_id: int) -> None:
        self.out, self.pad_id, self.bos_id = out, pad_id, bos_id
        self.tokens = self.bos = 0
        self.per_step: dict[int, list[int]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.tokens += int((batch["input_ids"] != self.pad_id).sum())
        self.bos += int((batch["input_ids"] == self.bos_id).sum())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import json

        self.per_step[int(trainer.global_step)] = [self.tokens, self.bos]
        with open(self.out.replace("{rank}", str(trainer.global_rank)), "w") as f:
            json.dump(self.per_step, f)

    def state_dict(self) -> dict:
        return {"tokens": self.tokens, "bos": self.bos}

    def load_state_dict(self, state: dict) -> None:
        self.tokens, self.bos = int(state["tokens"]), int(state["bos"])


def run_program(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` that waits for ``cmd`` itself, not
    for every process that inherited its output. A fit's DDP ranks, loader workers or a
    forkserver that outlive the program would hold a pipe open and ``communicate()`` would wait
    for them until the timeout (CI hung 900 s twice in a resumed DDP fit); with files there is
    no pipe to wait on, and ``timeout`` still bounds the program.

    A runner script (``tests/runners/*.py``) runs as a fork of a process that has imported
    Lightning already (``tests.helpers.program_server``), unless it asks for the re-executed DDP
    launch; ``STACKLM_TEST_FRESH_PROGRAMS=1`` runs every one as a fresh interpreter."""
    from tests.helpers.program_server import can_serve, run_served

    if can_serve(cmd, kwargs.get("env")) and set(kwargs) <= {"cwd", "env"}:
        return run_served(cmd, timeout=timeout, **kwargs)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, **kwargs)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            out.seek(0), err.seek(0)
            raise subprocess.TimeoutExpired(cmd, timeout, output=out.read(), stderr=err.read()) from None
        out.seek(0), err.seek(0)
        return subprocess.CompletedProcess(cmd, rc, out.read(), err.read())


def tiny_llama(vocab: int):
    """A one-layer transformers Llama: enough for TRL's trainers to tokenize and step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg)


def row_ids(batch) -> list[str | None]:
    """A short content hash per row, ``None`` for a padding row (its targets all ignored); a lean
    batch's planes derived first (``contract.full_batch``), so a row hashes the same either way."""
    batch = full_batch(batch)
    return [None if bool((t == IGNORE_INDEX).all()) else hashlib.sha256(r.numpy().tobytes()).hexdigest()[:16]
            for r, t in zip(batch["input_ids"], batch["targets"])]


def global_rows(run: dict, *, before: int | None = None, after: int | None = None) -> dict[int, list]:
    """Data epoch -> the rows of every step in order (rank-major inside a step), padding kept
    as ``None``; only steps ``< before`` / ``>= after`` (global step at the batch's start)."""
    steps: dict[tuple[int, int], dict[int, list]] = {}
    for rank, records in enumerate(run["ranks"]):
        for data_epoch, lightning_epoch, step, rows in records:
            assert data_epoch == lightning_epoch, f"data epoch {data_epoch} trained as Lightning epoch {lightning_epoch}"
            assert len(rows) == run["batch"]
            if (before is None or step < before) and (after is None or step >= after):
                steps.setdefault((data_epoch, step), {})[rank] = rows
    out: dict[int, list] = {}
    for (epoch, _), per_rank in sorted(steps.items()):
        assert sorted(per_rank) == list(range(run["devices"])), "every rank trains every step"
        out.setdefault(epoch, []).append([r for rank in sorted(per_rank) for r in per_rank[rank]])
    return out


class KillAt(L.Callback):
    """SIGKILLs its own process after optimizer step ``step`` (a crash no handler sees: nothing
    is flushed or closed that was not already)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import os
        import signal

        if trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)
