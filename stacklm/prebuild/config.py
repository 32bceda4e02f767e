"""The prebuild's YAML config file: the pipeline config and the build settings."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stacklm.prebuild.plan import DEFAULT_TOKENS_PER_SHARD, SPLITS, PrebuildError


def load_config(path: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(PipelineConfig, settings)`` from a YAML config.

    Two layouts are read. The trainer's: ``data:`` holds ``StackDataModule``'s arguments, the
    pipeline config under ``data.pipeline`` (``seq_len``/``batch_size``/``seed`` default to the
    module's), ``data.tokenizer`` and ``data.data_dir`` (the default ``--out``). Or a plain one:
    ``data:`` is the pipeline config itself, ``tokenizer:`` at the top. An optional top-level
    ``prebuild:`` section may set ``tokens_per_shard``, ``workers``, ``splits``, ``out``.
    ``settings`` has ``tokenizer``, ``out``, ``tokens_per_shard``, ``workers``, ``splits``.
    """
    import yaml

    from stacklm.data.nodes import PipelineConfig

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise PrebuildError(f"{path}: no such config file", path=path) from None
    except yaml.YAMLError as e:
        raise PrebuildError(f"{path}: not valid YAML ({e})", path=path) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise PrebuildError(f"{path}: expected a mapping with a 'data:' section (the pipeline config: seq_len, mix, ...)", path=path)
    data = doc["data"]
    section = doc.get("prebuild") or {}
    if "pipeline" in data:  # StackDataModule arguments
        if not isinstance(data["pipeline"], dict):
            raise PrebuildError(f"{path}: 'data.pipeline' must be the pipeline config (a mapping with mix, ...)", path=path)
        fields = dict(data["pipeline"])
        for key in ("seq_len", "batch_size", "seed"):
            if key in data:
                fields.setdefault(key, data[key])
        where, tokenizer, out = "data.pipeline", data.get("tokenizer", doc.get("tokenizer")), data.get("data_dir")
    else:
        fields, where, tokenizer, out = data, "data", doc.get("tokenizer"), None
    try:
        config = PipelineConfig.from_dict(fields)
    except (ValueError, TypeError) as e:
        raise PrebuildError(f"{path}: section {where!r}: {e}", path=path) from None
    settings = {
        "tokenizer": tokenizer,
        "out": section.get("out", out),
        "tokens_per_shard": int(section.get("tokens_per_shard", DEFAULT_TOKENS_PER_SHARD)),
        "workers": int(section.get("workers", 1)),
        "splits": tuple(section.get("splits", SPLITS)),
    }
    return config, settings
