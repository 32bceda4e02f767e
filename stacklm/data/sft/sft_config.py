"""The SFT configuration: ``SFTConfig``, the stream over conversation datasets, each one a
``SourceConfig`` -- the same source schema as pre-training (``stacklm.data.sources.schema``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from stacklm.chat.policy import OVERLONG_RULES
from stacklm.chat.turns import DEFAULT_ROLE_ALIASES
from stacklm.config import PipelineSection
from stacklm.data.audit import ON_INVALID_SPELLINGS
from stacklm.data.sources.schema import SourceConfig
from stacklm.data.sft.reader import SFT_DOMAIN
from stacklm.errors import ConfigError

SFT_KINDS = ("local", "hf")


@dataclass(frozen=True)
class SFTConfig(PipelineSection):
    """Everything that decides the SFT stream. ``config_hash`` guards resumes.

    ``sources``: conversation datasets (``SourceConfig`` with ``kind`` ``local`` -- ``path``:
    globs of ``.jsonl``/``.ndjson``/``.json`` (JSON lines, optionally ``.gz``/``.zst``) or
    ``.parquet`` files -- or ``hf``: ``datasets.load_dataset(path, config_name, split=...,
    streaming=True, ...)``, a hub id or a builder such as ``"json"`` with ``data_files``);
    ``text_column`` is the list of messages (``None``: ``messages``, else ShareGPT
    ``conversations``); ``domain`` defaults to ``chat``. Per source (so a mix can train each
    dataset its own way): ``format``, the loss policy (``loss``, ``roles_to_train``,
    ``train_stop_token``, ``reasoning_loss``) and ``overlong`` (see ``SourceConfig``).
    ``pack_buffer_docs``: conversations held by the best-fit packer (1 = one conversation per
    row, padded). ``overlong``: a conversation longer than ``seq_len`` is cut after the last
    trained turn that fits (``truncate``), cut to its system turn(s) plus the longest tail that
    starts at a user turn and fits (``keep_end``), or dropped (``drop``); all counted. A
    source's own ``overlong`` overrides it.
    ``on_invalid``: ``skip`` counts a malformed line / unknown role / empty message / no
    assistant turn and goes on (the first location of each reason is logged and kept);
    ``raise`` stops at the first one (``drop`` is the earlier spelling of ``skip``). A source's
    own ``on_invalid`` overrides it.
    """

    modes = ("sft", "preference")  # the data.mode values whose pipeline this is (from_run_config)

    sources: tuple[SourceConfig, ...] = field(metadata={"help": "a list of {name, kind, path, ...}"})
    seq_len: int = 2048
    batch_size: int = 8
    seed: int = 0
    shuffle_buffer: int = 1000
    pack_buffer_docs: int = 128
    overlong: str = "truncate"
    on_invalid: str = "skip"
    holdout_fraction: float = 0.01
    role_aliases: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_ROLE_ALIASES))
    drop_last: bool = False

    def __post_init__(self) -> None:
        w = "sft config"
        if not self.sources:
            raise ConfigError(f"{w}: field 'sources' is empty; list at least one conversation dataset")
        sources = tuple(replace(s, domain=SFT_DOMAIN) if s.domain is None else s for s in self.sources)
        object.__setattr__(self, "sources", sources)
        object.__setattr__(self, "role_aliases", dict(self.role_aliases))
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ConfigError(f"{w}: source names must be unique, got {names}")
        for s in self.sources:
            if s.kind not in SFT_KINDS:
                raise ConfigError(f"{w}: source {s.name!r}: field 'kind' must be one of {SFT_KINDS}, got {s.kind!r}")
        if self.seq_len < 8:
            raise ConfigError(f"{w}: field 'seq_len' must be >= 8, got {self.seq_len}")
        if self.batch_size < 1:
            raise ConfigError(f"{w}: field 'batch_size' must be >= 1, got {self.batch_size}")
        if self.pack_buffer_docs < 1 or self.shuffle_buffer < 1:
            raise ConfigError(f"{w}: fields 'pack_buffer_docs' and 'shuffle_buffer' must be >= 1")
        if self.overlong not in OVERLONG_RULES:
            raise ConfigError(f"{w}: field 'overlong' must be one of {OVERLONG_RULES}, got {self.overlong!r}")
        if self.on_invalid not in ON_INVALID_SPELLINGS:
            raise ConfigError(f"{w}: field 'on_invalid' must be one of {ON_INVALID_SPELLINGS}, got {self.on_invalid!r}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise ConfigError(f"{w}: field 'holdout_fraction' must be in [0, 1), got {self.holdout_fraction}")

    def build(self, tokenizer, split: str = "train", shard=None):
        """The SFT node graph for one split and one (rank, worker) shard (``build_sft_pipeline``).
        The one arrow between this module and the graph (imported here, at call time); the
        graph module does not import this one, so the two make no circle."""
        from stacklm.data.sft.sft_pipeline import build_sft_pipeline

        return build_sft_pipeline(self, tokenizer, split, shard)
