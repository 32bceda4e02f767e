"""The one schema of the ``data:`` section, read the same way by the trainer and the prebuild.

``data:`` holds ``StackDataModule``'s arguments. The trainer (``stacklm-train fit``) passes them
through jsonargparse to ``StackDataModule.__init__``; ``stacklm prebuild`` / ``dedup-index`` /
``prebuild-datatrove`` read the same YAML with ``yaml.safe_load``. Both validate it with
``DataSection`` (keys, types, ``mode``, ranges), so a value one command refuses is refused by
the other, with the same message (issue 23: prebuild used to accept ``mode: turbo``, unknown
``data.*`` keys and ``batch_size: 0`` that the trainer refused, or crashed on later).

``TOP_LEVEL_SECTIONS`` are the top-level keys of a config in the trainer's layout: the
trainer's (LightningCLI's ``fit`` keys) plus ``prebuild:``; anything else is a typo both refuse.

This module imports neither torch nor Lightning: the prebuild checks a config without them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from stacklm.config import PIPELINE_PATH, Config
from stacklm.errors import ConfigError, DataConfigError

DATA_PATH = "data"
MODE_NAMES = ("shards", "stream", "sft", "preference")  # == stacklm.datamodule.modes.MODES (a test checks)
# The top-level keys of ``stacklm-train fit`` (LightningCLI with auto_configure_optimizers=False;
# a test checks them against the real parser) plus the prebuild's own section.
TRAINER_SECTIONS = ("ckpt_path", "data", "model", "seed_everything", "trainer", "weights_only")
TOP_LEVEL_SECTIONS = (*TRAINER_SECTIONS, "prebuild")


def check_pipeline(value: Any) -> dict[str, Any]:
    """``value`` as a plain dict, after parsing it as the config it is (``SFTConfig`` when it
    lists ``sources``, else ``PipelineConfig``): unknown keys and wrong types raise here."""
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.data.sft import SFTConfig

    key = getattr(value, "key", None)  # jsonargparse's NestedArg: a `--data.pipeline.KEY VALUE` flag
    if key is not None and hasattr(value, "val"):
        raise ConfigError(f"--{PIPELINE_PATH}.{key}: the pipeline's keys are not command-line flags (it is one mapping, checked "
                          f"as a whole); set {key}: {value.val} in a second config file given after the first "
                          "(--config my.yaml --config more.yaml)")
    if not isinstance(value, Mapping):
        raise ConfigError(f"{PIPELINE_PATH}: expected a mapping (the pipeline config), got {value!r}")
    d = dict(value)
    if d:
        (SFTConfig if "sources" in d else PipelineConfig).from_dict(d, path=PIPELINE_PATH)
    return d


def _at_least(name: str, value: int | None, low: int, fix: str) -> None:
    if value is not None and value < low:
        raise DataConfigError(f"field '{DATA_PATH}.{name}' must be >= {low}, got {value}; {fix}")


@dataclass(frozen=True)
class DataSection(Config):
    """``data:``: ``StackDataModule``'s arguments (same names, types and defaults; a test checks
    them against its signature). See ``StackDataModule`` for what each one means."""

    config_error = DataConfigError

    mode: Literal["shards", "stream", "sft", "preference"] = "shards"
    tokenizer: str | None = None
    data_dir: str | None = None
    pipeline: dict[str, Any] | None = None
    seq_len: int = 2048
    batch_size: int = 8
    num_workers: int = 0
    seed: int = 0
    val_batches: int | None = None
    train_batches: int | None = None
    snapshot_every_n_steps: int | None = None
    logical_streams: int | None = None
    step_log: bool | str = True
    verify_shards: bool = True
    gate: bool = True
    skip_steps: list[tuple[int, int]] | None = None
    shard_window: int | None = None
    cache_max_bytes: int | None = None

    def __post_init__(self) -> None:
        _at_least("seq_len", self.seq_len, 2, "a window needs at least 2 tokens (one input, one target)")
        _at_least("batch_size", self.batch_size, 1, "set the number of sequences per batch")
        _at_least("num_workers", self.num_workers, 0, "use 0 to load in the main process")
        _at_least("val_batches", self.val_batches, 0, "use 0 to disable validation, or null for the holdout budget")
        _at_least("train_batches", self.train_batches, 1, "or null for a counting pass")
        _at_least("snapshot_every_n_steps", self.snapshot_every_n_steps, 1, "or null to follow the checkpoint interval")
        _at_least("logical_streams", self.logical_streams, 1, "or null for ranks x workers")
        _at_least("shard_window", self.shard_window, 1, "or null for the global permutation")
        _at_least("cache_max_bytes", self.cache_max_bytes, 1, "or null for STACKLM_CACHE_MAX_BYTES (unset: unbounded)")
        if self.shard_window is not None and self.mode != "shards":
            raise DataConfigError(f"field '{DATA_PATH}.shard_window' is for mode 'shards' (got mode {self.mode!r}); remove it")
        if self.pipeline:
            check_pipeline(self.pipeline)

    @classmethod
    def label(cls, data: Mapping[str, Any] | None) -> str:
        return "data section"

    @classmethod
    def parse(cls, **arguments: Any) -> "DataSection":
        """From ``StackDataModule``'s keyword arguments (paths may be ``os.PathLike``)."""
        plain = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in arguments.items()}
        return cls.from_dict(plain, path=DATA_PATH)


def check_top_level(doc: Mapping[str, Any], source: str) -> None:
    """Refuse a top-level key neither the trainer nor the prebuild reads (both refuse it)."""
    from stacklm.config import did_you_mean

    for key in doc:
        if key not in TOP_LEVEL_SECTIONS:
            raise ConfigError(
                f"{source}: unknown top-level section {str(key)!r}{did_you_mean(str(key), TOP_LEVEL_SECTIONS)} "
                f"(sections: {', '.join(TOP_LEVEL_SECTIONS)})"
            )
