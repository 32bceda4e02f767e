"""The data-mix registry: which sources a run reads, with what weight, from where.

A ``DataMixEntry`` names one source completely (hub path, config, ``data_dir``, split, text
column, pinnable ``revision``), so a run's inputs can be written into a YAML config and into
the shard manifest, and re-read later. A ``DataMix`` is the entries plus a token budget; its
weights must sum to 1 so a config typo cannot silently reshape the mix.

Both round-trip through plain dicts (``to_dict`` / ``from_dict``) and every validation error
names the entry and the field, so a bad YAML line is found without reading this file.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stacklm.data.schedule import MixScheduleConfig
from stacklm.errors import ConfigError

KINDS = ("hf", "local", "synthetic")
DOMAINS = ("prose", "code", "math")
# Weights are floats typed by humans in YAML; allow rounding slack, nothing more.
WEIGHT_SUM_TOLERANCE = 1e-6


class DataMixError(ConfigError):
    """A data-mix config problem; the message names the entry and the field."""


@dataclass(frozen=True)
class DataMixEntry:
    """One source of a data mix.

    ``kind`` decides how ``path`` is read:
      - ``"hf"``: ``path`` is a hub id (or a packaged builder such as ``"json"`` together with
        ``data_files``), opened with ``datasets.load_dataset(..., streaming=True)``;
      - ``"local"``: ``path`` (or ``data_files``) are glob patterns of jsonl / jsonl.gz /
        jsonl.zst / parquet / txt files;
      - ``"synthetic"``: the deterministic offline corpus (``seed``, ``num_docs``).
    """

    name: str
    kind: str
    weight: float
    domain: str
    path: str | None = None
    config_name: str | None = None  # the ``name=`` of load_dataset (hub subset)
    data_dir: str | None = None
    data_files: tuple[str, ...] | None = None
    split: str = "train"
    text_column: str = "text"
    revision: str | None = None  # a commit sha pins the data; None follows the default branch
    seed: int = 0  # synthetic corpus (also the offline fallback of an hf entry)
    num_docs: int | None = None  # synthetic corpus length; None = its default

    def __post_init__(self) -> None:
        if isinstance(self.data_files, str):
            object.__setattr__(self, "data_files", (self.data_files,))
        elif self.data_files is not None:
            object.__setattr__(self, "data_files", tuple(self.data_files))
        self.validate()

    def _fail(self, field_name: str, problem: str) -> DataMixError:
        return DataMixError(f"data mix entry {self.name!r}: field {field_name!r} {problem}")

    def validate(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise DataMixError(f"data mix entry {self.name!r}: field 'name' must be a non-empty string without '/'")
        if self.kind not in KINDS:
            raise self._fail("kind", f"must be one of {KINDS}, got {self.kind!r}")
        if self.domain not in DOMAINS:
            raise self._fail("domain", f"must be one of {DOMAINS}, got {self.domain!r}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)):
            raise self._fail("weight", f"must be a number, got {self.weight!r}")
        if not math.isfinite(self.weight) or self.weight <= 0:
            raise self._fail("weight", f"must be a finite number > 0, got {self.weight!r}")
        if self.kind == "hf" and not self.path:
            raise self._fail("path", "is required for kind 'hf' (a hub id such as 'HuggingFaceFW/fineweb-edu')")
        if self.kind == "local" and not (self.path or self.data_files):
            raise self._fail("path", "is required for kind 'local' (a glob such as 'data/*.jsonl.zst')")
        if not isinstance(self.text_column, str) or not self.text_column:
            raise self._fail("text_column", f"must be a non-empty string, got {self.text_column!r}")
        if not isinstance(self.split, str) or not self.split:
            raise self._fail("split", f"must be a non-empty string, got {self.split!r}")
        if self.num_docs is not None and (not isinstance(self.num_docs, int) or self.num_docs < 0):
            raise self._fail("num_docs", f"must be an int >= 0 or null, got {self.num_docs!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise self._fail("seed", f"must be an int, got {self.seed!r}")

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if out["data_files"] is not None:
            out["data_files"] = list(out["data_files"])
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataMixEntry:
        name = data.get("name", "<unnamed>")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise DataMixError(f"data mix entry {name!r}: unknown field(s) {unknown}; known fields: {sorted(known)}")
        missing = [f for f in ("name", "kind", "weight", "domain") if f not in data]
        if missing:
            raise DataMixError(f"data mix entry {name!r}: missing required field(s) {missing}")
        return cls(**dict(data))


@dataclass(frozen=True)
class DataMix:
    """Entries whose weights sum to 1, plus the run's total token budget, and optionally a
    mixture ``schedule`` (``stacklm.data.schedule``: phases, temperature, caps) that makes the
    target mix a function of the tokens consumed; the entries' weights are its default."""

    name: str
    total_tokens: int
    entries: tuple[DataMixEntry, ...] = field(default_factory=tuple)
    schedule: MixScheduleConfig | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "entries", tuple(self.entries))
        if isinstance(self.schedule, Mapping):
            object.__setattr__(self, "schedule", MixScheduleConfig.from_dict(self.schedule))
        self.validate()

    def validate(self) -> None:
        if isinstance(self.total_tokens, bool) or not isinstance(self.total_tokens, int) or self.total_tokens <= 0:
            raise DataMixError(f"data mix {self.name!r}: field 'total_tokens' must be an int > 0, got {self.total_tokens!r}")
        if not self.entries:
            raise DataMixError(f"data mix {self.name!r}: field 'entries' is empty; list at least one source")
        seen: set[str] = set()
        for entry in self.entries:
            if not isinstance(entry, DataMixEntry):
                raise DataMixError(f"data mix {self.name!r}: entries must be DataMixEntry, got {type(entry).__name__}")
            if entry.name in seen:
                raise DataMixError(f"data mix {self.name!r}: entry name {entry.name!r} appears twice; names must be unique")
            seen.add(entry.name)
        total = math.fsum(e.weight for e in self.entries)
        if abs(total - 1.0) > WEIGHT_SUM_TOLERANCE:
            listed = ", ".join(f"{e.name}={e.weight}" for e in self.entries)
            raise DataMixError(f"data mix {self.name!r}: field 'weight' of the entries must sum to 1, got {total!r} ({listed})")
        if self.schedule is not None:
            self.schedule.check_sources([e.name for e in self.entries])

    def __getitem__(self, name: str) -> DataMixEntry:
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

        from stacklm.data.mix import split_budget

        shares = split_budget(self.total_tokens, np.array([e.weight for e in self.entries]))
        return {e.name: int(s) for e, s in zip(self.entries, shares)}

    def target_weights(self) -> dict[str, float]:
        """The run's planned token share per source: the entries' weights, or with a schedule
        its average over the whole budget (phases, temperature and caps applied)."""
        if self.schedule is None:
            return self.weights
        import numpy as np

        from stacklm.data.schedule import compile_schedule

        names = [e.name for e in self.entries]
        final = compile_schedule(self.schedule, names, np.array([e.weight for e in self.entries]), self.total_tokens).budgets[-1]
        return {n: float(x) / float(final.sum()) for n, x in zip(names, final)}

    def pinned(self, revisions: Mapping[str, str]) -> DataMix:
        """A copy with hub revisions pinned (e.g. commit shas recorded by a previous run)."""
        unknown = sorted(set(revisions) - {e.name for e in self.entries})
        if unknown:
            raise DataMixError(f"data mix {self.name!r}: cannot pin unknown entries {unknown}")
        entries = tuple(
            dataclasses.replace(e, revision=revisions[e.name]) if e.name in revisions else e for e in self.entries
        )
        return dataclasses.replace(self, entries=entries)

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "total_tokens": self.total_tokens, "entries": [e.to_dict() for e in self.entries]}
        if self.schedule is not None:  # absent, not null: configs without a schedule hash as before
            out["schedule"] = self.schedule.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DataMix:
        name = data.get("name", "<unnamed>")
        unknown = sorted(set(data) - {"name", "total_tokens", "entries", "schedule"})
        if unknown:
            raise DataMixError(f"data mix {name!r}: unknown field(s) {unknown}; known: ['entries', 'name', 'schedule', 'total_tokens']")
        entries = data.get("entries")
        if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)):
            raise DataMixError(f"data mix {name!r}: field 'entries' must be a list of entries, got {type(entries).__name__}")
        total = data.get("total_tokens")
        if isinstance(total, float) and total.is_integer():  # YAML "2.0e10" parses as float
            total = int(total)
        schedule = data.get("schedule")
        if schedule is not None and not isinstance(schedule, Mapping):
            raise DataMixError(f"data mix {name!r}: field 'schedule' must be a mapping (phases, temperature, sizes, max_epochs), got {schedule!r}")
        return cls(name=name, total_tokens=total, entries=tuple(DataMixEntry.from_dict(e) for e in entries),
                   schedule=MixScheduleConfig.from_dict(schedule) if schedule is not None else None)


STACK_100M = DataMix(
    name="stack-100m",
    total_tokens=20_000_000_000,
    entries=(
        DataMixEntry(
            name="fineweb-edu", kind="hf", path="HuggingFaceFW/fineweb-edu", config_name="sample-100BT",
            weight=0.70, domain="prose",
        ),
        DataMixEntry(
            name="cosmopedia-v2", kind="hf", path="HuggingFaceTB/smollm-corpus", config_name="cosmopedia-v2",
            weight=0.15, domain="prose",
        ),
        DataMixEntry(
            name="starcoderdata-python", kind="hf", path="bigcode/starcoderdata", data_dir="python",
            text_column="content", weight=0.10, domain="code",
        ),
        DataMixEntry(
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
        raise KeyError(f"unknown data mix {name!r}; registered: {sorted(MIXES)}") from None
