"""The one source schema and the data-mix registry: which sources a run reads, with what
weight, from where.

A ``SourceConfig`` (pre-training and SFT alike) names one source completely (hub path,
config, ``data_dir``, split, text column, pinnable ``revision``), so a run's inputs can be written into a YAML config and into
the shard manifest, and re-read later. A ``DataMix`` is the entries plus a token budget; its
weights are relative (normalized to sum 1, with one line saying so when they did not).

Both are ``stacklm.config.Config``s: they round-trip through plain dicts (``to_dict`` /
``from_dict``) and every validation error names the entry and the field, so a bad YAML line
is found without reading this file.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from stacklm.config import Config, did_you_mean
from stacklm.data.audit import ON_INVALID
from stacklm.data.mix.schedule import MixScheduleConfig
from stacklm.data.quality.filters import rules_for
from stacklm.errors import ConfigError
from stacklm.once import first_time

KINDS = ("hf", "local", "synthetic")
DOMAINS = ("prose", "code", "math")  # the synthetic corpus's domains (and the filter rule sets)
# Weights are floats typed by humans in YAML; allow rounding slack, nothing more.
WEIGHT_SUM_TOLERANCE = 1e-6
DEFAULT_TEXT_COLUMN = "text"  # a pre-training source's text column when none is given


@dataclass(frozen=True)
class SourceConfig(Config):
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

    SFT only, per source (so a mix can train each dataset its own way): ``format``
    (``chat.formats.FORMATS``; ``auto`` detects messages / ShareGPT / prompt-completion / Alpaca
    by the fields), the loss policy (``loss``: ``assistant_only`` | ``last_assistant_turn`` |
    ``roles_to_train`` | ``completion_only``; ``roles_to_train``; ``train_stop_token``;
    ``reasoning_loss``: ``train`` | ``mask`` | ``drop``, see ``stacklm.chat.policy``) and
    ``overlong`` (``None``: the SFT config's rule).
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
    format: str = "auto"
    loss: str = "assistant_only"
    roles_to_train: tuple[str, ...] = ("assistant",)
    train_stop_token: bool = True
    reasoning_loss: str = "train"
    overlong: str | None = None
    # A row with no document (bad JSON, no/null/non-string text): skip and count | raise.
    # None: skip for a pre-training source; the stream's ``on_invalid`` for an SFT source.
    on_invalid: str | None = None
    filters: str | None = None  # pre-training: the quality rule set (prose|code|math|none); None: by domain

    # Fields added after configs were hashed: left out of to_dict() at their default, so an
    # existing config keeps its config_hash (a resume is not refused by an upgrade).
    _OMIT_AT_DEFAULT: ClassVar[dict[str, Any]] = {
        "format": "auto", "loss": "assistant_only", "roles_to_train": ["assistant"], "train_stop_token": True,
        "reasoning_loss": "train", "overlong": None, "on_invalid": None, "filters": None,
    }

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
        if self.on_invalid is not None and self.on_invalid not in (*ON_INVALID, "drop"):
            raise self._fail("on_invalid", f"must be one of {ON_INVALID} (skip: count and go on; raise: stop) or null, got {self.on_invalid!r}")
        self._validate_sft_fields()

    def _validate_sft_fields(self) -> None:
        from stacklm.chat.formats import FORMATS
        from stacklm.chat.policy import OVERLONG_RULES

        if self.format not in FORMATS:
            raise self._fail("format", f"must be one of {FORMATS}, got {self.format!r}")
        if self.overlong is not None and self.overlong not in OVERLONG_RULES:
            raise self._fail("overlong", f"must be one of {OVERLONG_RULES} (or null), got {self.overlong!r}")
        try:
            self.loss_policy()
        except ValueError as e:
            raise ConfigError(f"source {self.name!r}: {e} (fields 'loss', 'roles_to_train', 'train_stop_token', 'reasoning_loss')") from None

    def invalid_policy(self, default: str = "skip") -> str:
        """``skip`` or ``raise`` for rows that hold no document (``default`` when unset; ``drop``
        is the earlier SFT spelling of ``skip``)."""
        policy = self.on_invalid or default
        return "skip" if policy == "drop" else policy

    def filter_rules(self) -> str | None:
        """The quality rule set of this pre-training source (``filters.rules_for``; None: no filter)."""
        try:
            return rules_for(self.domain, self.filters)
        except ValueError as e:
            raise ConfigError(f"source {self.name!r}: {e}") from None

    def loss_policy(self):
        """The ``stacklm.chat.policy.LossPolicy`` of an SFT source's fields."""
        from stacklm.chat.policy import LossPolicy

        return LossPolicy(self.loss, self.roles_to_train, self.train_stop_token, self.reasoning_loss)

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        for key, default in self._OMIT_AT_DEFAULT.items():
            if d[key] == default:
                del d[key]
        return d

    def build(self, *, shard=None, fallback_offline: bool = False):
        """The pre-training document source node (``sources.open_source``)."""
        from stacklm.data.sources import open_source

        return open_source(self, shard=shard, fallback_offline=fallback_offline)


@dataclass(frozen=True)
class DataMix(Config):
    """Pre-training sources with relative weights (normalized to sum 1), plus the run's total token budget, and
    optionally a mixture ``schedule`` (``stacklm.data.mix.schedule``: phases, temperature, caps)
    that makes the target mix a function of the tokens consumed; the entries' weights are its
    default.

    A pre-training source needs a ``domain`` label that picks a quality rule set, or a
    ``filters:`` of its own (``SourceConfig``), and reads ``text_column`` ``"text"`` unless told otherwise (filled in here,
    so the config and its hash say which column was read).
    """

    name: str
    total_tokens: int
    entries: tuple[SourceConfig, ...] = field(default_factory=tuple)
    schedule: MixScheduleConfig | None = None

    @classmethod
    def label(cls, data: Mapping[str, Any] | None) -> str:
        name = data.get("name", "<unnamed>") if isinstance(data, Mapping) else "<unnamed>"
        return f"data mix {name!r}"

    @classmethod
    def _from_value(cls, value: Any, path: str) -> DataMix:
        if isinstance(value, str):
            if value not in MIXES:
                raise ConfigError(
                    f"field {path or 'mix'!r}: unknown data mix {value!r}{did_you_mean(value, sorted(MIXES))} "
                    f"(registered: {sorted(MIXES)}; or give a mapping with name, total_tokens, entries)"
                )
            return MIXES[value]
        return super()._from_value(value, path)

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(
            dataclasses.replace(e, text_column=DEFAULT_TEXT_COLUMN) if isinstance(e, SourceConfig) and e.text_column is None else e
            for e in self.entries
        ))
        self._normalize_weights()
        if isinstance(self.schedule, Mapping):
            object.__setattr__(self, "schedule", MixScheduleConfig.from_dict(self.schedule, "schedule"))
        self.validate()

    def validate(self) -> None:
        if isinstance(self.total_tokens, bool) or not isinstance(self.total_tokens, int) or self.total_tokens <= 0:
            raise ConfigError(f"data mix {self.name!r}: field 'total_tokens' must be an int > 0, got {self.total_tokens!r}")
        if not self.entries:
            raise ConfigError(f"data mix {self.name!r}: field 'entries' is empty; list at least one source")
        seen: set[str] = set()
        for entry in self.entries:
            if not isinstance(entry, SourceConfig):
                raise ConfigError(f"data mix {self.name!r}: entries must be SourceConfig, got {type(entry).__name__}")
            if entry.name in seen:
                raise ConfigError(f"data mix {self.name!r}: entry name {entry.name!r} appears twice; names must be unique")
            if entry.domain is None:
                raise entry._fail("domain", f"is required for pre-training: a label such as {DOMAINS} (it picks the quality filter) "
                                            "or your own with filters: prose|code|math|none")
            entry.filter_rules()
            seen.add(entry.name)
        total = math.fsum(e.weight for e in self.entries)
        if abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
            listed = ", ".join(f"{e.name}={e.weight}" for e in self.entries)
            raise ConfigError(f"data mix {self.name!r}: field 'weight' of the entries must sum to 1, got {total!r} ({listed})")
        if self.schedule is not None:
            self.schedule.check_sources([e.name for e in self.entries])

    def _normalize_weights(self) -> None:
        """Weights are relative (as in Mosaic streaming's ``proportion`` and litdata's
        ``weights``): entries summing to anything but 1 are divided by their sum, and one line
        per process says so. The normalized weights are what the config (and its hash, the
        manifest and the logs) then hold, so 2/1/1 and 0.5/0.25/0.25 are the same mix."""
        ok = [e for e in self.entries if isinstance(e, SourceConfig) and not isinstance(e.weight, bool)
              and isinstance(e.weight, (int, float)) and math.isfinite(e.weight) and e.weight > 0]
        if len(ok) != len(self.entries) or not ok:
            return  # validate() names the bad entry
        total = math.fsum(e.weight for e in ok)
        if abs(total - 1.0) <= WEIGHT_SUM_TOLERANCE:
            return
        entries = tuple(dataclasses.replace(e, weight=e.weight / total) for e in ok)
        object.__setattr__(self, "entries", entries)
        given = ", ".join(f"{e.name}={e.weight:g}" for e in ok)
        now = ", ".join(f"{e.name}={e.weight:.4f}" for e in entries)
        if first_time("normalized_weights", self.name, given):
            logging.getLogger(__name__).warning(
                "data mix %r: the weights (%s) sum to %g; taken as relative and normalized to %s", self.name, given, total, now)

    def __getitem__(self, name: str) -> SourceConfig:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(f"data mix {self.name!r} has no entry {name!r}; entries: {[e.name for e in self.entries]}")

    @property
    def weights(self) -> dict[str, float]:
        return {e.name: e.weight for e in self.entries}

    def token_budgets(self) -> dict[str, int]:
        """Integer tokens per source (largest remainder), summing to ``total_tokens`` exactly."""
        import numpy as np

        from stacklm.data.mix.mix import split_budget

        shares = split_budget(self.total_tokens, np.array([e.weight for e in self.entries]))
        return {e.name: int(s) for e, s in zip(self.entries, shares)}

    def target_weights(self) -> dict[str, float]:
        """The run's planned token share per source: the entries' weights, or with a schedule
        its average over the whole budget (phases, temperature and caps applied)."""
        if self.schedule is None:
            return self.weights
        import numpy as np

        from stacklm.data.mix.schedule import compile_schedule

        names = [e.name for e in self.entries]
        final = compile_schedule(self.schedule, names, np.array([e.weight for e in self.entries]), self.total_tokens).budgets[-1]
        return {n: float(x) / float(final.sum()) for n, x in zip(names, final)}

    def pinned(self, revisions: Mapping[str, str]) -> DataMix:
        """A copy with hub revisions pinned (e.g. commit shas recorded by a previous run)."""
        unknown = sorted(set(revisions) - {e.name for e in self.entries})
        if unknown:
            raise ConfigError(f"data mix {self.name!r}: cannot pin unknown entries {unknown}")
        entries = tuple(
            dataclasses.replace(e, revision=revisions[e.name]) if e.name in revisions else e for e in self.entries
        )
        return dataclasses.replace(self, entries=entries)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.schedule is None:  # absent, not null: configs without a schedule hash as before
            del out["schedule"]
        return out


STACK_100M = DataMix(
    name="stack-100m",
    total_tokens=20_000_000_000,
    entries=(
        SourceConfig(
            name="fineweb-edu", kind="hf", path="HuggingFaceFW/fineweb-edu", config_name="sample-100BT",
            weight=0.70, domain="prose",
        ),
        SourceConfig(
            name="cosmopedia-v2", kind="hf", path="HuggingFaceTB/smollm-corpus", config_name="cosmopedia-v2",
            weight=0.15, domain="prose",
        ),
        SourceConfig(
            name="starcoderdata-python", kind="hf", path="bigcode/starcoderdata", data_dir="python",
            text_column="content", weight=0.10, domain="code",
        ),
        SourceConfig(
            name="finemath", kind="hf", path="HuggingFaceTB/finemath", config_name="finemath-4plus",
            weight=0.05, domain="math",
        ),
    ),
)

MIXES: dict[str, DataMix] = {STACK_100M.name: STACK_100M}


def get_mix(name: str) -> DataMix:
    try:
        return MIXES[name]
    except KeyError:
        raise KeyError(f"unknown data mix {name!r}{did_you_mean(name, sorted(MIXES))}; registered: {sorted(MIXES)}") from None
