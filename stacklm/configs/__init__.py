"""The example configs, shipped in the package: ``demo`` (offline CPU demo), ``stack-100m``
(the 20B-token run), ``sft`` (chat fine-tuning data), ``preference`` (DPO pairs). One layout for all of them and for every
tool: ``python -m trainer fit --config demo`` and ``stacklm prebuild --config demo`` find them
by name; any other value is a path to a YAML file.
"""

from __future__ import annotations

import os
from pathlib import Path

from stacklm.config import did_you_mean
from stacklm.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent


def packaged_configs() -> list[str]:
    """Names of the shipped configs (``demo``, ``sft``, ``stack-100m``)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config(name_or_path: str | os.PathLike) -> Path:
    """An existing path as given, else the packaged config of that name (``demo`` or
    ``demo.yaml``); neither is a ``ConfigError`` naming the shipped configs."""
    path = Path(name_or_path)
    if path.exists():  # a directory too: reading it then says so
        return path
    text = str(name_or_path)
    name = text[: -len(".yaml")] if text.endswith(".yaml") else text
    if os.sep not in name and "/" not in name and name in packaged_configs():
        return CONFIG_DIR / f"{name}.yaml"
    raise ConfigError(
        f"{text}: no such config file, and no packaged config of that name{did_you_mean(name, packaged_configs())} "
        f"(packaged: {', '.join(packaged_configs())}; or give the path of a YAML file)"
    )
