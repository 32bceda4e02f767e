"""The data-mix registry: which sources a run reads, with what weight, from where.

A ``DataMix`` is the entries -- each a ``SourceConfig``, the one source schema
(``stacklm.data.sources.schema``) -- plus a token budget; its weights are relative (normalized
to sum 1, with one line saying so when they did not).

Both are ``stacklm.config.Config``s: they round-trip through plain dicts (``to_dict`` /
``from_dict``) and every validation error names the entry and the field, so a bad YAML line
is found without reading this file. ``SourceConfig`` is imported here from the
schema, so ``from stacklm.data.registry import SourceConfig`` keeps working.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from stacklm.config import Config, did_you_mean
from stacklm.data.mix.schedule import MixScheduleConfig
from stacklm.data.sources.parts import DEFAULT_TEXT_COLUMN
from stacklm.data.sources.schema import DOMAINS, SourceConfig
from stacklm.errors import ConfigError
from stacklm.once import first_time

# Weights are floats typed by humans in YAML; allow rounding slack, nothing more.
WEIGHT_SUM_TOLERANCE = 1e-6


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
        normalized = self._normalize_weights()
        if isinstance(self.schedule, Mapping):
            object.__setattr__(self, "schedule", MixScheduleConfig.from_dict(self.schedule, "schedule"))
        self.validate()
        # said once the mix is accepted: before, the line came ahead of an unrelated refusal
        if normalized and first_time("normalized_weights", self.name, normalized[0]):
            logging.getLogger(__name__).warning(
                "data mix %r: the weights (%s) sum to %g; taken as relative and normalized to %s", self.name, *normalized)

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

    def _normalize_weights(self) -> tuple[str, float, str] | None:
        """Weights are relative (as in Mosaic streaming's ``proportion`` and litdata's
        ``weights``): entries summing to anything but 1 are divided by their sum, and one line
        per process says so (``__post_init__``, after the mix is validated; this returns what
        to say: the given weights, their sum, the normalized ones). The normalized weights are what the config (and its hash, the
        manifest and the logs) then hold, so 2/1/1 and 0.5/0.25/0.25 are the same mix."""
        ok = [e for e in self.entries if isinstance(e, SourceConfig) and not isinstance(e.weight, bool)
              and isinstance(e.weight, (int, float)) and math.isfinite(e.weight) and e.weight > 0]
        if len(ok) != len(self.entries) or not ok:
            return None  # validate() names the bad entry
        total = math.fsum(e.weight for e in ok)
        if abs(total - 1.0) <= WEIGHT_SUM_TOLERANCE:
            return None
        entries = tuple(dataclasses.replace(e, weight=e.weight / total) for e in ok)
        object.__setattr__(self, "entries", entries)
        given = ", ".join(f"{e.name}={e.weight:g}" for e in ok)
        now = ", ".join(f"{e.name}={e.weight:.4f}" for e in entries)
        return given, total, now

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
