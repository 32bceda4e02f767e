"""The prebuild's YAML config file: the trainer's layout, read for the pipeline and the build settings."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from stacklm.config import PIPELINE_PATH, Config
from stacklm.errors import ConfigError, PrebuildError
from stacklm.prebuild.cluster import ClusterSettings
from stacklm.prebuild.plan import DEFAULT_TOKENS_PER_SHARD, SPLITS


@dataclass(frozen=True)
class PrebuildSettings(Config):
    """The optional top-level ``prebuild:`` section (command-line flags override it)."""

    out: str | None = None  # default: data.data_dir
    tokens_per_shard: int = DEFAULT_TOKENS_PER_SHARD
    workers: int = 1
    splits: tuple[str, ...] = SPLITS
    cluster: ClusterSettings = field(default_factory=ClusterSettings)  # prebuild-datatrove on Slurm/Ray

    def __post_init__(self) -> None:
        bad = [s for s in self.splits if s not in SPLITS]
        if bad or not self.splits:
            raise ConfigError(f"prebuild.splits must be a non-empty subset of {SPLITS}, got {list(self.splits)}")


class PrebuildSpec(dict):
    """The type of the trainer's ``--prebuild`` argument (the top-level ``prebuild:`` section):
    a plain dict that ``PrebuildSettings`` validates when ``stacklm-train`` reads the YAML
    (``prebuild_spec_type`` registers it with jsonargparse), so both commands read the shared
    file the same way."""


def _check_prebuild_spec(value: Any) -> dict[str, Any]:
    PrebuildSettings.coerce(value, "prebuild")
    return dict(value or {})


def prebuild_spec_type() -> type[PrebuildSpec]:
    """``PrebuildSpec``, registered with jsonargparse (the trainer's CLI parser). Registered
    here, when the trainer asks, not when this module is imported: every prebuild pool worker
    and datatrove task imports this package, and jsonargparse costs them ~0.3-0.8 CPU-s for
    nothing (bench/startup.py)."""
    from jsonargparse.typing import get_registered_type, register_type

    if get_registered_type(PrebuildSpec) is None:
        register_type(PrebuildSpec, serializer=dict, deserializer=_check_prebuild_spec)
    return PrebuildSpec


def load_config(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(PipelineConfig, settings)`` from a YAML config in the trainer's layout (the one
    ``python -m trainer fit --config`` reads): ``data:`` holds ``StackDataModule``'s arguments,
    the pipeline config under ``data.pipeline`` (``seq_len``/``batch_size``/``seed`` default to
    the module's), ``data.tokenizer`` and ``data.data_dir`` (the default ``--out``). An optional
    top-level ``prebuild:`` section (``PrebuildSettings``) may set ``tokens_per_shard``,
    ``workers``, ``splits``, ``out``, and ``cluster`` (``prebuild-datatrove``'s partition, QOS,
    env command, sbatch arguments and per-stage resources: ``stacklm.prebuild.cluster``, ``stacklm.scale.resources``); other top-level sections (model, trainer) are the trainer's.
    ``data:`` is parsed with the trainer's schema (``stacklm.datamodule.section.DataConfig``, which
    parses the pipeline once, with the module's defaults) and the top-level keys checked against
    the trainer's, so the prebuild refuses what the trainer refuses.
    ``settings`` has ``tokenizer``, ``out``, ``tokens_per_shard``, ``workers``, ``splits``, ``cluster``.
    ``path`` may also name a packaged config (``demo``, ``stack-100m``; ``stacklm.configs``).
    """
    import yaml

    from stacklm.configs import resolve_config
    from stacklm.datamodule.section import DATA_PATH, DataConfig, check_top_level

    path = resolve_config(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise PrebuildError(f"{path}: no such config file", path=path) from None
    except yaml.YAMLError as e:
        raise PrebuildError(f"{path}: not valid YAML ({e})", path=path) from None
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, dict) or not isinstance(data.get("pipeline"), dict) or not data["pipeline"]:
        raise PrebuildError(
            f"{path}: expected a 'data:' section with the pipeline config under '{PIPELINE_PATH}' (mix, seq_len, ...); "
            "see the packaged demo config (`stacklm prebuild --config demo`)",
            path=path,
        )
    try:  # the trainer's schema of the file: what `stacklm-train fit` refuses, the prebuild refuses
        check_top_level(doc, str(path))
        config = DataConfig.from_dict(data, path=DATA_PATH).pipeline
    except ConfigError as e:
        raise PrebuildError(f"{e}" if str(e).startswith(str(path)) else f"{path}: {e}", path=path) from None
    if data.get("mode") in ("sft", "preference"):
        raise PrebuildError(f"{path}: data.mode is {data['mode']!r}; prebuild writes pre-training shards (mode 'shards' or 'stream')", path=path)
    # The trainer refuses a pipeline seq_len/batch_size other than the module's (in stream mode,
    # ``section.parse_pipeline``, so DataConfig did above); shards built from such a file would not train.
    clash = [f"{k} {data['pipeline'][k]!r} vs data.{k} {data[k]!r}" for k in ("seq_len", "batch_size")
             if k in data and k in data["pipeline"] and data["pipeline"][k] != data[k]]
    if clash:
        raise PrebuildError(f"{path}: field '{PIPELINE_PATH}' sets {'; '.join(f'{PIPELINE_PATH}.{c}' for c in clash)}; "
                            "the trainer refuses a file where they differ: set them in one place (data.seq_len / data.batch_size)", path=path)
    try:
        section = PrebuildSettings.coerce(doc.get("prebuild"), "prebuild")
    except (ValueError, TypeError) as e:
        raise PrebuildError(f"{path}: {e}", path=path) from None
    settings = {
        "tokenizer": data.get("tokenizer"),
        "out": section.out or data.get("data_dir"),
        "tokens_per_shard": section.tokens_per_shard,
        "workers": section.workers,
        "splits": section.splits,
        "cluster": section.cluster,
    }
    return config, settings


def entry_column_error(err: Exception, config: str | os.PathLike, entries) -> Exception:
    """``err`` (a ``TextColumnError``: a mix entry's ``text_column`` is not in its file) said
    where the run config ``config`` sets that column: the file, the field
    ``data.pipeline.mix.entries[i].text_column``, the columns the file has and the fix, on one
    line. Why here: the source node that finds the column missing knows its file, not the
    config it came from; the commands that read a config (``prebuild``, ``train-tokenizer
    --config``) do. ``err`` itself when it names no entry of ``entries``."""
    names = [e.name for e in entries]
    if getattr(err, "source", None) not in names or not hasattr(err, "available"):
        return err
    i = names.index(err.source)
    hint = f" {err.hint}" if err.hint else ""
    return ConfigError(
        f"{config}: field '{PIPELINE_PATH}.mix.entries[{i}].text_column' (source {err.source!r}): column {err.column!r} "
        f"is not in {err.file}, whose columns are {err.available}.{hint} Set text_column to the column that holds the text"
    )
