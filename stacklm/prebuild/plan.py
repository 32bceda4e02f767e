"""What a prebuild is (``PrebuildPlan``), its identity (what a re-run must match to resume),
each worker's share of it, and where its state lives in the output directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data.storage import manifest as mf
from stacklm.data.storage.shards import token_dtype
from stacklm.data.splits import SPLITS
from stacklm.errors import ConfigError, PrebuildError
from stacklm.prebuild.signing import SIGN_MARGIN

STATE_DIR = ".prebuild"
BUILD_FILE = "build.json"
REVISIONS_FILE = "revisions.json"
DEFAULT_TOKENS_PER_SHARD = 100_000_000  # ~200 MB of uint16 per shard, as nanochat's shards
# Fields of the config that do not change the written tokens (left out of the identity).
_NON_CONTENT_FIELDS = ("num_threads", "batch_size", "drop_last")


@dataclasses.dataclass(frozen=True)
class PrebuildPlan:
    config: Any  # PipelineConfig
    tokenizer: Any  # StackTokenizer
    out: Path
    workers: int = 1
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD
    splits: tuple[str, ...] = SPLITS
    provenance: bool = True  # per-shard side files naming each row's document pieces (stacklm.data.storage.provenance)
    sign_margin: float = SIGN_MARGIN  # a small build signs each source's budget share x this (``signing``); 0: all of it

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.tokens_per_shard < self.config.seq_len:
            raise ConfigError(f"tokens_per_shard ({self.tokens_per_shard}) must hold at least one sequence of seq_len {self.config.seq_len}")
        bad = [s for s in self.splits if s not in SPLITS]
        if bad or not self.splits:
            raise ConfigError(f"splits must be a non-empty subset of {SPLITS}, got {self.splits}")

    @property
    def seqs_per_shard(self) -> int:
        return self.tokens_per_shard // self.config.seq_len

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.tokenizer.vocab_size)

    def content_config(self) -> dict[str, Any]:
        """The config as JSON types (tuples become lists), minus fields that do not change the tokens."""
        d = {k: v for k, v in self.config.to_dict().items() if k not in _NON_CONTENT_FIELDS}
        return json.loads(json.dumps(d))

    def identity(self) -> dict[str, Any]:
        """Everything that decides the bytes written; a resume must match it exactly."""
        return {
            "config": self.content_config(),
            "config_hash": self.config.config_hash(exclude=_NON_CONTENT_FIELDS),
            "tokenizer_hash": mf.tokenizer_hash(self.tokenizer),
            "vocab_size": self.tokenizer.vocab_size,
            "workers": self.workers,
            "tokens_per_shard": self.tokens_per_shard,
            "splits": list(self.splits),
            "provenance": self.provenance,
        }


def worker_config(config, worker: int, workers: int):
    """The config of worker ``worker``: the same, with its share of the token budget
    (largest remainder, so the shares add up to the budget exactly)."""
    if workers == 1:
        return config
    from stacklm.data.mix.mix import split_budget

    share = int(split_budget(config.mix.total_tokens, np.ones(workers))[worker])
    if share <= 0:
        raise PrebuildError(f"--workers {workers} leaves worker {worker} no tokens of the budget {config.mix.total_tokens}; use fewer workers")
    return dataclasses.replace(config, mix=dataclasses.replace(config.mix, total_tokens=share))


def job_name(split: str, worker: int) -> str:
    """A job's name in the build's state (checkpoints, summaries, removed-id shards): the same
    for the pool's job and the datatrove task of that (split, worker)."""
    return f"{split}-w{worker:03d}"


def state_dir_of(out: Path) -> Path:
    """Where a build in ``out`` keeps its claim, checkpoints and job summaries until it is done."""
    return out / STATE_DIR
