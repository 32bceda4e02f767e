"""The one source schema, ``SourceConfig``: which data a source reads and how (pre-training and
SFT alike), validated with messages that name the source and the field.

A ``SourceConfig`` names one source completely (hub path, config, ``data_dir``, split, text
column, pinnable ``revision``), so a run's inputs can be written into a YAML config and into the
shard manifest, and re-read later. The pre-training fields are declared here; the SFT-only ones
(``format``, the loss policy, ``overlong``) in ``stacklm.chat.source_fields`` and inherited, so
the YAML schema stays one mapping per source. The data mix (weights and a token budget over
these) is ``stacklm.data.registry``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from stacklm.chat.source_fields import CHAT_FIELDS_AT_DEFAULT, ChatSourceFields
from stacklm.config import Config
from stacklm.data.audit import ON_INVALID, ON_INVALID_SPELLINGS, invalid_policy
from stacklm.data.quality.filters import rules_for
from stacklm.errors import ConfigError

KINDS = ("hf", "local", "synthetic")
DOMAINS = ("prose", "code", "math")  # the synthetic corpus's domains (and the filter rule sets)


@dataclass(frozen=True)
class SourceConfig(ChatSourceFields, Config):
    """One source, for pre-training and SFT alike.

    ``kind`` decides how ``path`` is read:
      - ``"hf"``: ``path`` is a hub id (or a packaged builder such as ``"json"`` together with
        ``data_files``), opened with ``datasets.load_dataset(..., streaming=True)``;
      - ``"local"``: ``path`` (one glob or a list of globs) or ``data_files`` are glob patterns
        of jsonl / jsonl.gz / jsonl.zst / parquet / txt files;
      - ``"synthetic"``: the deterministic offline corpus (``seed``, ``num_docs``); pre-training only.
    ``text_column``: the column holding the text (pre-training; ``None`` = ``"text"``) or the
    list of messages (SFT; ``None`` = ``messages``, else ShareGPT ``conversations``).
    ``domain``: a free label of what the source is (``web``, ``legal``, ...); for a pre-training
    source it also picks the quality filter's rule set when it is one of
    ``filters.DOMAIN_RULES`` (``prose``/``code``/``math`` and a few aliases). ``filters``:
    the rule set itself, ``prose``/``code``/``math``, or ``none`` for no quality filter on this
    source; needed when the domain label picks none. An SFT source is ``chat`` (its default).

    SFT only, per source: ``format``, the loss policy and ``overlong``, declared apart in
    ``stacklm.chat.source_fields.ChatSourceFields`` (keyword-only fields of this one YAML
    schema; a pre-training reader never looks at them).
    """

    # the SFT schema's names before the one source schema (closer in spelling to 'filters')
    renamed_fields: ClassVar[dict[str, str]] = {"files": "data_files", "column": "text_column"}

    name: str
    kind: str = "local"  # one of KINDS
    weight: float = 1.0
    domain: str | None = None
    path: str | tuple[str, ...] | None = None
    config_name: str | None = None  # the ``name=`` of load_dataset (hub subset)
    data_dir: str | None = None
    data_files: tuple[str, ...] | None = None
    split: str = "train"
    text_column: str | None = None
    revision: str | None = None  # a commit sha pins the data; None follows the default branch
    seed: int = 0  # synthetic corpus (also the offline fallback of an hf entry)
    num_docs: int | None = None  # synthetic corpus length; None = its default
    # A row with no document (bad JSON, no/null/non-string text): skip and count | raise.
    # None: skip for a pre-training source; the stream's ``on_invalid`` for an SFT source.
    on_invalid: str | None = None
    filters: str | None = None  # pre-training: the quality rule set (prose|code|math|none); None: by domain

    # Fields added after configs were hashed: left out of to_dict() at their default, so an
    # existing config keeps its config_hash (a resume is not refused by an upgrade).
    _OMIT_AT_DEFAULT: ClassVar[dict[str, Any]] = {**CHAT_FIELDS_AT_DEFAULT, "on_invalid": None, "filters": None}

    @classmethod
    def label(cls, data: Mapping[str, Any] | None) -> str:
        name = data.get("name", "<unnamed>") if isinstance(data, Mapping) else "<unnamed>"
        return f"source {name!r}"

    def __post_init__(self) -> None:
        for name in ("path", "data_files"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, tuple(value))
        if isinstance(self.data_files, str):
            object.__setattr__(self, "data_files", (self.data_files,))
        roles = self.roles_to_train
        object.__setattr__(self, "roles_to_train", (roles,) if isinstance(roles, str) else tuple(roles))
        self.validate()

    def _fail(self, field_name: str, problem: str) -> ConfigError:
        return ConfigError(f"source {self.name!r}: field {field_name!r} {problem}")

    @property
    def paths(self) -> list[str]:
        """The glob patterns of a local source (``data_files``, else ``path``)."""
        given = self.data_files or self.path or ()
        return [given] if isinstance(given, str) else list(given)

    def validate(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ConfigError(f"source {self.name!r}: field 'name' must be a non-empty string without '/'")
        if self.kind not in KINDS:
            raise self._fail("kind", f"must be one of {KINDS}, got {self.kind!r}")
        if self.domain is not None and (not isinstance(self.domain, str) or not self.domain):
            raise self._fail("domain", f"must be a non-empty label (e.g. 'prose', 'code', 'math', 'web') or null, got {self.domain!r}")
        if self.kind == "synthetic" and self.domain is not None and self.domain not in DOMAINS:
            raise self._fail("domain", f"of a synthetic source must be one of {DOMAINS} (the corpus it draws), got {self.domain!r}")
        if self.filters is not None:
            try:
                rules_for(self.domain, self.filters)
            except ValueError as e:
                raise self._fail("filters", str(e).removeprefix("field 'filters' ")) from None
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)):
            raise self._fail("weight", f"must be a number, got {self.weight!r}")
        if not math.isfinite(self.weight) or self.weight <= 0:
            raise self._fail("weight", f"must be a finite number > 0, got {self.weight!r}")
        if self.kind == "hf" and not (isinstance(self.path, str) and self.path):
            raise self._fail("path", "is required for kind 'hf' (a hub id such as 'HuggingFaceFW/fineweb-edu', or a builder like 'json')")
        if self.kind == "local" and not self.paths:
            raise self._fail("path", "is required for kind 'local' (a glob such as 'data/*.jsonl.zst', or a list of globs)")
        if self.text_column is not None and (not isinstance(self.text_column, str) or not self.text_column):
            raise self._fail("text_column", f"must be a non-empty string or null, got {self.text_column!r}")
        if not isinstance(self.split, str) or not self.split:
            raise self._fail("split", f"must be a non-empty string, got {self.split!r}")
        if self.num_docs is not None and (not isinstance(self.num_docs, int) or self.num_docs < 0):
            raise self._fail("num_docs", f"must be an int >= 0 or null, got {self.num_docs!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise self._fail("seed", f"must be an int, got {self.seed!r}")
        if self.on_invalid is not None and self.on_invalid not in ON_INVALID_SPELLINGS:
            raise self._fail("on_invalid", f"must be one of {ON_INVALID} (skip: count and go on; raise: stop) or null, got {self.on_invalid!r}")
        self._validate_sft_fields()

    def _validate_sft_fields(self) -> None:
        problem = self.chat_field_problem()
        if problem is not None:
            field_name, text = problem
            raise self._fail(field_name, text) if field_name else ConfigError(f"source {self.name!r}: {text}")

    def invalid_policy(self, default: str = "skip") -> str:
        """``skip`` or ``raise`` for rows that hold no document (``default`` when unset; ``drop``
        is the earlier SFT spelling of ``skip``)."""
        return invalid_policy(self.on_invalid or default)

    def filter_rules(self) -> str | None:
        """The quality rule set of this pre-training source (``filters.rules_for``; None: no filter)."""
        try:
            return rules_for(self.domain, self.filters)
        except ValueError as e:
            raise ConfigError(f"source {self.name!r}: {e}") from None

    def build(self, *, shard=None, fallback_offline: bool = False):
        """The pre-training document source node (``sources.open_source``). Imported at call
        time; ``entry`` and ``hub`` take the entry untyped and never import this module, so
        the two make no circle."""
        from stacklm.data.sources.entry import open_source

        return open_source(self, shard=shard, fallback_offline=fallback_offline)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for key, default in self._OMIT_AT_DEFAULT.items():
            if d[key] == default:
                del d[key]
        return d
