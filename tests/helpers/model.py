"""Byte-level batches of real text on the batch contract, and the tiny GPT config, shared by the
model, logging, data-gate and stream-fit tests (ids 0-255 are the byte tokens of the id layout)."""

from __future__ import annotations

import lightning.pytorch as L
import numpy as np
from torch.utils.data import DataLoader

from stacklm.corpus import iter_prose
from stacklm.data.packing.pack import Collate, pack_greedy
from stacklm.tokenizer.specials import special_token_ids
from stacklm.train.model import GPTConfig

VOCAB = 512  # 256 byte tokens + room for merges + the 9 specials at the top
SPECIALS = special_token_ids(VOCAB)
BOS, EOS, PAD = SPECIALS["<|bos|>"], SPECIALS["<|eos|>"], SPECIALS["<|pad|>"]


def byte_docs(n_docs: int, max_len: int = 400) -> list[dict]:
    docs = []
    for i, text in enumerate(iter_prose()):
        ids = np.frombuffer(text.encode("utf-8")[:max_len], dtype=np.uint8).astype(np.int32)
        if len(ids) > 10:
            docs.append({"ids": ids, "source": "prose", "domain": "prose", "doc_id": str(i)})
        if len(docs) == n_docs:
            break
    return docs


def packed_windows(n_docs: int, seq_len: int, max_len: int = 400) -> np.ndarray:
    return np.stack(list(pack_greedy(byte_docs(n_docs, max_len), seq_len, BOS, EOS, PAD)))


def tiny_config(**overrides) -> GPTConfig:
    return GPTConfig.tiny(**{"vocab_size": VOCAB, "seq_len": 64, "attention": "sdpa", **overrides})


class ContractDataModule(L.LightningDataModule):
    """A tiny real-text datamodule yielding contract batches (stands in for StackDataModule)."""

    def __init__(self, seq_len: int = 64, batch_size: int = 4, n_docs: int = 60, vocab_size: int | None = VOCAB, seed: int = 0) -> None:
        super().__init__()
        self.seq_len, self.batch_size, self.vocab_size = seq_len, batch_size, vocab_size
        windows = packed_windows(n_docs, seq_len, max_len=3 * seq_len)
        rng = np.random.default_rng(seed)
        self.train_windows = windows[rng.permutation(len(windows))]
        self.val_windows = windows[:batch_size * 2]
        self.collate = Collate(BOS, EOS, PAD)

    def train_dataloader(self):
        return DataLoader(list(self.train_windows), batch_size=self.batch_size, shuffle=False, collate_fn=self.collate, drop_last=True)

    def val_dataloader(self):
        return DataLoader(list(self.val_windows), batch_size=self.batch_size, collate_fn=self.collate, drop_last=True)
