"""The SFT configuration: one conversation dataset (``SFTSourceConfig``) and the stream (``SFTConfig``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stacklm.chat import DEFAULT_ROLE_ALIASES

OVERLONG_RULES = ("truncate", "drop")
ON_INVALID = ("skip", "raise", "drop")  # "drop": the earlier spelling of "skip"


def _unknown_keys(what: str, data: Mapping[str, Any], cls) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {unknown}; known: {sorted(known)}")


@dataclass(frozen=True)
class SFTSourceConfig:
    """One conversation dataset.

    ``kind="local"``: ``files`` are globs of ``.jsonl``/``.ndjson``/``.json`` (JSON lines,
    optionally ``.gz``/``.zst``) or ``.parquet`` files. ``kind="hf"``:
    ``datasets.load_dataset(path, config_name, split=..., streaming=True, ...)`` -- a hub id, or
    a builder such as ``"json"``/``"parquet"`` with ``data_files``. ``column``: the list of
    messages; ``None`` picks ``messages``, else ``conversations`` (ShareGPT ``from``/``value``).
    """

    name: str
    kind: str = "local"
    files: tuple[str, ...] = ()
    path: str | None = None
    config_name: str | None = None
    split: str = "train"
    data_files: tuple[str, ...] | None = None
    data_dir: str | None = None
    revision: str | None = None
    column: str | None = None
    domain: str = "chat"
    weight: float = 1.0
    on_invalid: str | None = None  # skip | raise for this dataset; None: the stream's ``on_invalid``

    def __post_init__(self) -> None:
        where = f"sft source {self.name!r}"
        if self.kind not in ("local", "hf"):
            raise ValueError(f"{where}: field 'kind' must be 'local' or 'hf', got {self.kind!r}")
        if self.kind == "local" and not self.files:
            raise ValueError(f"{where}: field 'files' (globs of .jsonl/.parquet files) is required for kind 'local'")
        if self.kind == "hf" and not self.path:
            raise ValueError(f"{where}: field 'path' (hub id or builder like 'json') is required for kind 'hf'")
        if not self.weight > 0:
            raise ValueError(f"{where}: field 'weight' must be > 0, got {self.weight}")
        if self.on_invalid is not None and self.on_invalid not in ON_INVALID:
            raise ValueError(f"{where}: field 'on_invalid' must be one of {ON_INVALID} or null, got {self.on_invalid!r}")
        for f in ("files", "data_files"):
            v = getattr(self, f)
            if isinstance(v, str):
                object.__setattr__(self, f, (v,))
            elif v is not None:
                object.__setattr__(self, f, tuple(v))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SFTSourceConfig":
        if "name" not in data:
            raise ValueError(f"sft source {dict(data)}: missing field 'name'")
        _unknown_keys(f"sft source {data['name']!r}", data, cls)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["files"] = list(self.files)
        d["data_files"] = list(self.data_files) if self.data_files is not None else None
        return d


@dataclass(frozen=True)
class SFTConfig:
    """Everything that decides the SFT stream. ``config_hash`` guards resumes.

    ``pack_buffer``: conversations held by the best-fit packer (1 = one conversation per row,
    padded). ``overlong``: a conversation longer than ``seq_len`` is cut after the last
    assistant turn that fits (``truncate``) or dropped (``drop``); both counted.
    ``on_invalid``: ``skip`` counts a malformed line / unknown role / empty message / no
    assistant turn and goes on (the first location of each reason is logged and kept);
    ``raise`` stops at the first one (``drop`` is the earlier spelling of ``skip``). A source's
    own ``on_invalid`` overrides it.
    """

    sources: tuple[SFTSourceConfig, ...]
    seq_len: int = 2048
    batch_size: int = 8
    seed: int = 0
    shuffle_buffer: int = 1000
    pack_buffer: int = 128
    overlong: str = "truncate"
    on_invalid: str = "skip"
    holdout_fraction: float = 0.01
    role_aliases: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_ROLE_ALIASES))
    drop_last: bool = False

    def __post_init__(self) -> None:
        w = "sft config"
        if not self.sources:
            raise ValueError(f"{w}: field 'sources' is empty; list at least one conversation dataset")
        object.__setattr__(self, "sources", tuple(self.sources))
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"{w}: source names must be unique, got {names}")
        if self.seq_len < 8:
            raise ValueError(f"{w}: field 'seq_len' must be >= 8, got {self.seq_len}")
        if self.batch_size < 1:
            raise ValueError(f"{w}: field 'batch_size' must be >= 1, got {self.batch_size}")
        if self.pack_buffer < 1 or self.shuffle_buffer < 1:
            raise ValueError(f"{w}: fields 'pack_buffer' and 'shuffle_buffer' must be >= 1")
        if self.overlong not in OVERLONG_RULES:
            raise ValueError(f"{w}: field 'overlong' must be one of {OVERLONG_RULES}, got {self.overlong!r}")
        if self.on_invalid not in ON_INVALID:
            raise ValueError(f"{w}: field 'on_invalid' must be one of {ON_INVALID}, got {self.on_invalid!r}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ValueError(f"{w}: field 'holdout_fraction' must be in [0, 1), got {self.holdout_fraction}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SFTConfig":
        """From the ``data.sft`` section of a YAML config (see ``configs/sft.yaml``)."""
        _unknown_keys("sft config", data, cls)
        if "sources" not in data:
            raise ValueError("sft config: missing field 'sources' (a list of {name, kind, files|path, ...})")
        kw = dict(data)
        kw["sources"] = tuple(s if isinstance(s, SFTSourceConfig) else SFTSourceConfig.from_dict(s) for s in data["sources"])
        if kw.get("role_aliases") is not None:
            kw["role_aliases"] = dict(kw["role_aliases"])
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["sources"] = [s.to_dict() for s in self.sources]
        d["role_aliases"] = dict(self.role_aliases)
        return d

    def config_hash(self) -> str:
        """sha256 of the canonical config: a resume with another stream is refused on this."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()).hexdigest()
