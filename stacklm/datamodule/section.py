"""The one schema of the ``data:`` section, read the same way by the trainer and the prebuild,
and the typed object it is parsed into once: ``DataConfig``.

``data:`` holds ``StackDataModule``'s arguments. The trainer (``stacklm-train fit``) passes them
through jsonargparse to ``StackDataModule.__init__``; ``stacklm prebuild`` / ``dedup-index`` /
``prebuild-datatrove`` read the same YAML with ``yaml.safe_load``. Both parse it with
``DataConfig`` (keys, types, ``mode``, ranges, and ``pipeline`` as its mode's config), so a
value one command refuses is refused by the other, with the same message (issue 23: prebuild
used to accept ``mode: turbo``, unknown ``data.*`` keys and ``batch_size: 0`` that the trainer
refused, or crashed on later). The parsed ``DataConfig`` is frozen and picklable: it is what
the datamodule keeps and hands its mode, and its ``pipeline`` (a ``PipelineConfig`` or
``SFTConfig``, not a dict) is what reaches the loader workers (issue 31).

``TOP_LEVEL_SECTIONS`` are the top-level keys of a config in the trainer's layout: the
trainer's (LightningCLI's ``fit`` keys) plus ``prebuild:``; anything else is a typo both refuse.

This module imports the pipeline configs (``stacklm.data``), not Lightning.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from stacklm.config import MODULE_FIELDS, PIPELINE_PATH, Config, with_module_fields
from stacklm.data.pipeline import PipelineConfig
from stacklm.data.sft import SFTConfig
from stacklm.errors import ConfigError, DataConfigError
from stacklm.once import unsaid

DATA_PATH = "data"
MODE_NAMES = ("shards", "stream", "sft", "preference")  # == stacklm.datamodule.modes.MODES (a test checks)
SFT_MODES = ("sft", "preference")  # their pipeline is an ``SFTConfig``; the others' a ``PipelineConfig``
# The top-level keys of ``stacklm-train fit`` (LightningCLI with auto_configure_optimizers=False;
# a test checks them against the real parser) plus the prebuild's own section.
TRAINER_SECTIONS = ("ckpt_path", "data", "model", "seed_everything", "trainer", "weights_only")
TOP_LEVEL_SECTIONS = (*TRAINER_SECTIONS, "prebuild")


def _as_mapping(value: Any) -> Mapping[str, Any]:
    """``data.pipeline`` as written must be one mapping; a ``--data.pipeline.KEY`` flag or a
    scalar is one line saying so."""
    key = getattr(value, "key", None)  # jsonargparse's NestedArg: a `--data.pipeline.KEY VALUE` flag
    if key is not None and hasattr(value, "val"):
        raise ConfigError(f"--{PIPELINE_PATH}.{key}: the pipeline's keys are not command-line flags (it is one mapping, checked "
                          f"as a whole); set {key}: {value.val} in a second config file given after the first "
                          "(--config my.yaml --config more.yaml)")
    if not isinstance(value, Mapping):
        raise ConfigError(f"{PIPELINE_PATH}: expected a mapping (the pipeline config), got {value!r}")
    return value


_last_checked: list[str] = []  # the canonical JSON of the mapping check_pipeline last accepted


def check_pipeline(value: Any) -> dict[str, Any]:
    """``value`` as a plain dict, after parsing it as the config it is (``SFTConfig`` when it
    lists ``sources``, else ``PipelineConfig``): unknown keys and wrong types raise here. The
    trainer's command line checks ``data.pipeline`` with it as it reads the YAML (before it
    knows the mode); ``DataConfig`` then parses it as its mode's config. jsonargparse
    deserializes one value several times while it parses a command line: the mapping accepted
    last is not parsed again."""
    d = dict(_as_mapping(value))
    if not d:
        return d
    try:
        key = json.dumps(d, sort_keys=True)
    except (TypeError, ValueError):  # not plain JSON (not from a YAML file): checked every time
        key = None
    if key is None or key not in _last_checked:
        # unsaid: a later --config may replace this pipeline; the one the run builds (DataConfig) speaks
        kind = SFTConfig if "sources" in d else PipelineConfig
        # before the mode and data.seq_len / batch_size are known: their defaults stand in (parse_pipeline takes the real ones)
        stand_in = {f.name: f.default for f in dataclasses.fields(kind) if f.name in MODULE_FIELDS}
        with unsaid():
            kind.from_dict(with_module_fields(d, stand_in), path=PIPELINE_PATH)
        _last_checked[:] = [key] if key is not None else []
    return d


def parse_pipeline(value: Any, mode: str, seq_len: int, batch_size: int, seed: int) -> PipelineConfig | SFTConfig | None:
    """``data.pipeline`` as the config of ``mode`` (``SFTConfig`` in sft and preference modes,
    else ``PipelineConfig``), its ``seq_len``, ``batch_size`` and ``seed`` defaulting to the
    module's. Called once, by ``DataConfig``; what it returns is what the modes, the datasets
    and the loader workers are handed. In stream mode the pipeline's seq_len and batch size must
    be the module's."""
    if value is None:
        return None
    kind = SFTConfig if mode in SFT_MODES else PipelineConfig
    if isinstance(value, (PipelineConfig, SFTConfig)):  # parsed already (``dataclasses.replace``)
        if not isinstance(value, kind):
            raise DataConfigError(f"field '{PIPELINE_PATH}': mode {mode!r} reads a {kind.__name__}, got a {type(value).__name__}")
        cfg = value
    else:
        d = dict(_as_mapping(value))
        if not d:
            return None
        cfg = kind.from_dict(with_module_fields(d, {"seq_len": seq_len, "batch_size": batch_size, "seed": seed}), path=PIPELINE_PATH)
    if mode == "stream" and (cfg.seq_len, cfg.batch_size) != (seq_len, batch_size):
        raise DataConfigError(
            f"field '{PIPELINE_PATH}': its seq_len/batch_size ({cfg.seq_len}/{cfg.batch_size}) differ from the module's "
            f"{DATA_PATH}.seq_len/{DATA_PATH}.batch_size ({seq_len}/{batch_size}); set them in one place"
        )
    return cfg


def check_skip_steps(value: Any, mode: str) -> tuple[tuple[int, int], ...]:
    """``skip_steps`` as sorted, disjoint ``(a, b)`` ranges with ``0 <= a <= b``; shards mode only."""
    if not value:
        return ()
    if mode != "shards":
        raise DataConfigError(f"field '{DATA_PATH}.skip_steps': only shards mode can skip a step range (this module is in "
                              f"{mode!r} mode); prebuild the data (`stacklm prebuild`) to skip steps")
    out = []
    for r in value:
        if not isinstance(r, (list, tuple)) or len(r) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in r) \
                or not 0 <= r[0] <= r[1]:
            raise DataConfigError(f"field '{DATA_PATH}.skip_steps': each range is [first_step, last_step] with 0 <= first <= last, "
                                  f"got {r!r}")
        out.append((int(r[0]), int(r[1])))
    out.sort()
    for (a0, b0), (a1, b1) in zip(out, out[1:]):
        if a1 <= b0:
            raise DataConfigError(f"field '{DATA_PATH}.skip_steps': ranges ({a0}, {b0}) and ({a1}, {b1}) overlap; merge them into one")
    return tuple(out)


def _at_least(name: str, value: int | None, low: int, fix: str) -> None:
    if value is not None and value < low:
        raise DataConfigError(f"field '{DATA_PATH}.{name}' must be >= {low}, got {value}; {fix}")


@dataclass(frozen=True)
class DataConfig(Config):
    """``data:``, typed: ``StackDataModule``'s arguments (same names and defaults; a test checks
    them against its signature, which jsonargparse and type checkers read), checked once, with
    ``pipeline`` parsed once into its mode's config (``parse_pipeline``). Frozen and picklable:
    ``StackDataModule.config`` holds it and hands it to its mode, whose loaders hand the parsed
    ``pipeline`` (never a dict) to the datasets and the loader workers' graph builders. See
    ``StackDataModule`` for what each field means."""

    config_error = DataConfigError

    mode: Literal["shards", "stream", "sft", "preference"] = "shards"
    tokenizer: str | None = None
    data_dir: str | None = None
    # given as the YAML's mapping; parsed in __post_init__, where ``mode`` and the module's defaults are known
    pipeline: PipelineConfig | SFTConfig | None = field(default=None, metadata={"coerce": False})
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
    skip_steps: tuple[tuple[int, int], ...] | None = None  # sorted and disjoint after __post_init__ (``()``: none)
    shard_window: int | None = None
    cache_max_bytes: int | None = None
    planes: Literal["lean", "full"] = "lean"

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
        object.__setattr__(self, "skip_steps", check_skip_steps(self.skip_steps, self.mode))
        if isinstance(self.data_dir, str):  # file:///x is the local /x everywhere the path is used
            from stacklm.data.storage.remote import file_url_path

            object.__setattr__(self, "data_dir", file_url_path(self.data_dir))
        pipeline = parse_pipeline(self.pipeline, self.mode, self.seq_len, self.batch_size, self.seed)
        if self.mode == "stream" and pipeline is not None:  # one knob: the module's planes are the stream's
            pipeline = dataclasses.replace(pipeline, planes=self.planes)
        object.__setattr__(self, "pipeline", pipeline)

    @classmethod
    def label(cls, data: Mapping[str, Any] | None) -> str:
        return "data section"

    @classmethod
    def parse(cls, arguments: Mapping[str, Any]) -> "DataConfig":
        """From ``StackDataModule``'s keyword arguments (its ``locals()``: names that are no field
        are left out; paths may be ``os.PathLike``)."""
        plain = {f.name: arguments[f.name] for f in dataclasses.fields(cls)}
        plain = {k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in plain.items()}
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
