"""Decontamination: documents that share an exact word n-gram with an evaluation set leave training.

The pipeline's ``decontaminate:`` section names the evaluation sets (local jsonl/parquet files or
``datasets`` ids, read through ``datasets`` as the hub sources are) and the text fields of
their records. ``DecontamNode`` sits after the quality filter and before dedup (docs/architecture.md,
"Decontamination"): a document with any n-gram (``n`` = 13 by default, on the normalized words of
``ngrams.py``) that a set holds is dropped, counted under the drop reason ``<set>`` of stage
``decontam`` (the first set in config order that it overlaps), or, with ``mode: cut``, the
overlapping spans are cut out and the rest goes on (dropped after all when no word is left). A
span runs from the first to the last character of its words, so the text between two kept
parts loses nothing else; a cut document not already in NFKC form comes out in NFKC form (the
form its word offsets refer to).

Matching is exact (``ngrams.NgramIndex``: a sorted uint64 hash array for the fast path, each hit
confirmed against the stored words, so a hash collision never drops a document). The index is
built once per content (``ensure_index``: the prebuild driver and the datamodule build it before
any worker starts; workers memory-map it) in ``$STACKLM_CACHE_DIR/decontam/<key>`` (or
``decontaminate.cache_dir``).

The stage's resume state is its counters, a few examples per set and the index's content hash
(a resume against other evaluation data is refused): small, whatever the index size.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torchdata.nodes import BaseNode

from stacklm.config import Config
from stacklm.constants import KEPT
from stacklm.data.quality.ngrams import NgramIndex, build_index, word_spans, words_of
from stacklm.data.stats import StageStats
from stacklm.errors import ConfigError
from stacklm.once import first_time

STAGE = "decontam"
EXCERPT_CHARS = 240
_LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class EvalSetConfig(Config):
    """One evaluation set: ``files`` (local jsonl/parquet globs) or ``path`` (a ``datasets`` id or
    builder, with ``config_name``/``split``/``data_files``/``revision`` as a hub source has)."""

    name: str
    fields: list[str] = field(default_factory=lambda: ["text"])
    files: list[str] = field(default_factory=list)
    path: str | None = None
    config_name: str | None = None
    split: str = "test"
    data_files: list[str] | None = None
    revision: str | None = None

    def __post_init__(self) -> None:
        where = f"decontaminate set {self.name!r}"
        if bool(self.files) == bool(self.path):
            raise ConfigError(f"{where}: give exactly one of 'files' (local jsonl/parquet) or 'path' (a datasets id)")
        if not self.fields:
            raise ConfigError(f"{where}: field 'fields' must name at least one text column")
        if self.name == KEPT or "/" in self.name:
            raise ConfigError(f"{where}: field 'name' may not be {KEPT!r} or contain '/' (it is a drop reason)")
        for f in self.files:
            if os.path.splitext(f)[1].lower() not in _LOCAL_BUILDERS:
                raise ConfigError(f"{where}: file {f!r} is not .jsonl/.json/.parquet; use 'path' for other builders")

    def load_args(self) -> tuple[str, dict[str, Any]]:
        """``load_dataset``'s path and keyword arguments (streamed, as the hub sources read)."""
        from stacklm.data.sources.hub import hub_load_kwargs

        if self.files:
            builders = {_LOCAL_BUILDERS[os.path.splitext(f)[1].lower()] for f in self.files}
            if len(builders) > 1:
                raise ConfigError(f"decontaminate set {self.name!r}: 'files' mixes json and parquet; use one set per format")
            return builders.pop(), hub_load_kwargs("train", data_files=list(self.files))
        return self.path, hub_load_kwargs(self.split, name=self.config_name, data_files=self.data_files, revision=self.revision)

    def fingerprint(self) -> dict[str, Any]:
        """What names this set's content: local files by their bytes' sha256, a hub dataset by id,
        config, split and revision (pin ``revision`` for a fixed index)."""
        from stacklm.data.sources.files import glob_files

        out: dict[str, Any] = {"name": self.name, "fields": list(self.fields)}
        patterns = list(self.files) or ([p for p in self.data_files or []] if self.path in _LOCAL_BUILDERS.values() else [])
        if patterns:
            files = glob_files(patterns)
            if not files:
                raise ConfigError(f"decontaminate set {self.name!r}: {patterns} matched no files (relative to {os.getcwd()})")
            out["files"] = [_file_sha(f) for f in files]
        if self.path:
            out["hub"] = [self.path, self.config_name, self.split, self.data_files, self.revision]
        return out

    def texts(self) -> Iterator[str]:
        """Each record's fields joined by newlines (a list field, e.g. choices, one item a line)."""
        from stacklm.data.sources.hub import check_data_files
        from stacklm.data.sources.readers import import_datasets

        path, kwargs = self.load_args()
        if self.path:
            check_data_files("decontaminate set", self.name, self.path, self.data_files)
        where = f"decontaminate set {self.name!r} ({', '.join(self.files) if self.files else self.path})"
        records = 0
        try:
            ds = import_datasets().load_dataset(path, **kwargs)
            for batch in ds.iter(batch_size=1000):
                missing = [f for f in self.fields if f not in batch]
                if missing:
                    raise ConfigError(f"decontaminate set {self.name!r}: no column {missing[0]!r} (columns: {sorted(batch)}); fix 'fields'")
                for row in zip(*(batch[f] for f in self.fields)):
                    records += 1
                    yield "\n".join(_field_text(self.name, f, v) for f, v in zip(self.fields, row))
        except ConfigError:
            raise
        except StopIteration:
            # ``datasets``' json builder says "empty file" as a bare StopIteration (which Python
            # turns into "generator raised StopIteration" here): name the set instead
            records = 0
        except Exception as e:  # a broken file surfaces as pyarrow's / datasets' own error
            first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else ""
            raise ConfigError(f"{where}: cannot be read: {type(e).__name__}: {first}; fix the file or 'files'") from e
        if records == 0:
            # an empty evaluation set would decontaminate nothing while looking configured
            raise ConfigError(f"{where}: holds no records; point 'files' (or 'path'/'split') at the evaluation data")


def _field_text(name: str, column: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise ConfigError(f"decontaminate set {name!r}: column {column!r} holds {type(value).__name__}, not text; name a text column in 'fields'")


def _file_sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class DecontamConfig(Config):
    """The ``decontaminate:`` section of a pipeline config."""

    sets: list[EvalSetConfig] = field(default_factory=list)
    n: int = 13
    mode: Literal["drop", "cut"] = "drop"
    examples: int = 3  # per set, kept in the report (and in the stage's resume state)
    cache_dir: str | None = None  # where indexes live; default $STACKLM_CACHE_DIR/decontam

    def __post_init__(self) -> None:
        if not self.sets:
            raise ConfigError("decontaminate: field 'sets' must name at least one evaluation set")
        if self.n < 1:
            raise ConfigError(f"decontaminate: field 'n' must be >= 1, got {self.n} (13 is the usual n-gram length)")
        if not 0 <= self.examples <= 100:
            raise ConfigError(f"decontaminate: field 'examples' must be in [0, 100], got {self.examples}")
        names = [s.name for s in self.sets]
        if len(set(names)) != len(names):
            raise ConfigError(f"decontaminate: set names must be unique, got {names}")

    def index_key(self) -> str:
        """The content hash that names the index folder (n, and each set's fields and content)."""
        spec = {"n": self.n, "sets": [s.fingerprint() for s in self.sets]}
        return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]

    def index_root(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir).expanduser()
        from stacklm.data.storage.remote import cache_root

        return cache_root() / "decontam"


_LOADED: dict[str, NgramIndex] = {}  # per process: folder -> index


def ensure_index(config: DecontamConfig, announce: bool = False) -> NgramIndex:
    """The index of ``config``'s sets: loaded (memory-mapped) when its folder exists, else built
    there once. Called by the prebuild driver and the datamodule before workers start, so
    workers and tasks only load it. ``announce`` (those two main-process callers): warn, once per
    process, about a set that holds no n-gram at all."""
    folder = config.index_root() / config.index_key()
    key = str(folder)
    if key not in _LOADED:
        if (folder / "meta.json").exists():
            _LOADED[key] = NgramIndex.load(folder)
        else:
            _LOADED[key] = build_index(folder, config.n, [(s.name, s.texts()) for s in config.sets], folder.name)
    if announce:
        _warn_unmatchable(_LOADED[key])
    return _LOADED[key]


def _warn_unmatchable(index: NgramIndex) -> None:
    """A set whose every record has fewer than ``n`` words (short questions, a short-text field)
    can match no document: the run would look decontaminated and be not. Said on every run, also
    when the index comes from the cache, since the build that saw it may be long gone."""
    import warnings

    import numpy as np

    per_set = np.bincount(np.asarray(index.set_of, dtype=np.int64), minlength=len(index.sets))
    records = index.meta.get("records", {})
    for s, name in enumerate(index.sets):
        if per_set[s] == 0 and first_time("decontam_unmatchable", index.content_hash, name):
            warnings.warn(
                f"decontaminate set {name!r}: none of its {records.get(name, 0):,} records has {index.n} words, so it "
                f"can match no document; lower 'n' or name the longer text columns in 'fields'",
                RuntimeWarning, stacklevel=3,
            )


def _merge_spans(hits: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for i in sorted({p for p, _ in hits}):
        if spans and i <= spans[-1][1]:
            spans[-1] = (spans[-1][0], max(spans[-1][1], i + n))
        else:
            spans.append((i, i + n))
    return spans


def _new_set_report() -> dict[str, Any]:
    return {"docs": 0, "tokens": 0, "cut_docs": 0, "cut_tokens": 0, "examples": []}


class DecontamNode(BaseNode[dict]):
    """Drop (or cut) the documents of ``source`` that share an n-gram with an evaluation set.

    ``count_tokens``: how the report counts tokens (the pipeline passes its tokenizer's encode;
    called only on dropped documents and cut spans). State: the source's state, the counters,
    the examples and the index's content hash.
    """

    def __init__(self, source: BaseNode, config: DecontamConfig, index: NgramIndex,
                 count_tokens: Callable[[str], int] | None = None) -> None:
        super().__init__()
        self.source, self.config, self.index = source, config, index
        self.count_tokens = count_tokens
        self.stats = StageStats(STAGE)
        self.sets: dict[str, dict[str, Any]] = {}

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            self.source.reset(None)
            self.stats.load_dict({})
            self.sets = {}
            return
        if initial_state.get("index") != self.index.content_hash:
            raise ValueError(
                f"DecontamNode: the checkpoint was decontaminated against index {initial_state.get('index')!r}, this "
                f"node uses {self.index.content_hash!r} (the evaluation sets or n changed); resume with the same decontaminate: sets"
            )
        self.source.reset(initial_state["source"])
        self.stats.load_dict(initial_state["stats"])
        self.sets = json.loads(json.dumps(initial_state["sets"]))  # a private copy

    def _tokens(self, text: str) -> int:
        return self.count_tokens(text) if self.count_tokens is not None else 0

    def _record(self, name: str, doc: dict, gram: str, cut: str | None) -> dict[str, Any]:
        rep = self.sets.setdefault(name, _new_set_report())
        if len(rep["examples"]) < self.config.examples:
            rep["examples"].append({"source": doc["source"], "file": doc.get("file"), "record": doc.get("record"),
                                    "ngram": gram, "text": (cut if cut is not None else doc["text"])[:EXCERPT_CHARS]})
        return rep

    def next(self) -> dict:
        n = self.index.n
        while True:
            doc = next(self.source)
            words = words_of(doc["text"])
            hits = self.index.lookup(words) if len(words) >= n else []
            if not hits:
                self.stats.add(doc["source"], KEPT)
                return doc
            first = min(s for _, s in hits)
            name = self.index.sets[first]
            at = min(p for p, s in hits if s == first)
            gram = " ".join(words[at : at + n])
            if self.config.mode == "cut":
                text, spans = word_spans(doc["text"])
                pieces, removed, prev = [], [], 0
                for a, b in _merge_spans(hits, n):
                    start, end = spans[a][0], spans[b - 1][1]
                    pieces.append(text[prev:start])
                    removed.append(text[start:end])
                    prev = end
                pieces.append(text[prev:])
                rest = "".join(pieces)
                if words_of(rest):
                    rep = self._record(name, doc, gram, "".join(removed))
                    rep["cut_docs"] += 1
                    rep["cut_tokens"] += sum(self._tokens(r) for r in removed)
                    self.stats.add(doc["source"], KEPT)
                    edited = {**doc, "text": rest}
                    edited.pop("seek", None)  # its position reads the uncut text: checkpointed by content (doc_refs)
                    return edited
            rep = self._record(name, doc, gram, None)
            rep["docs"] += 1
            rep["tokens"] += self._tokens(doc["text"])
            self.stats.add(doc["source"], name)

    def get_state(self) -> dict:
        return {"source": self.source.state_dict(), "stats": self.stats.to_dict(), "sets": json.loads(json.dumps(self.sets)),
                "index": self.index.content_hash}

    def report(self) -> dict[str, Any]:
        """For the manifest / logs: per evaluation set, documents and tokens dropped (and cut), examples."""
        return {"n": self.index.n, "mode": self.config.mode, "index": self.index.content_hash,
                "sets": {name: json.loads(json.dumps(self.sets.get(name, _new_set_report()))) for name in self.index.sets}}


def merge_reports(reports: list[dict[str, Any]], examples: int | None = None) -> dict[str, Any] | None:
    """Sum per-source or per-worker reports: counts add, examples are kept in a stable order
    (by source, file, record) up to ``examples`` per set (default: the most any report kept)."""
    reports = [r for r in reports if r]
    if not reports:
        return None
    limit = examples if examples is not None else max((len(s["examples"]) for r in reports for s in r["sets"].values()), default=0)
    out = {k: reports[0][k] for k in ("n", "mode", "index")}
    sets: dict[str, dict[str, Any]] = {}
    for r in reports:
        for name, rep in r["sets"].items():
            into = sets.setdefault(name, _new_set_report())
            for k in ("docs", "tokens", "cut_docs", "cut_tokens"):
                into[k] += int(rep.get(k, 0))
            into["examples"].extend(rep.get("examples", []))
    for rep in sets.values():
        rep["examples"] = sorted(rep["examples"], key=lambda e: (str(e["source"]), e.get("file") or 0, e.get("record") or 0))[:limit]
    out["sets"] = sets
    return out


def chain_report(chains: dict[str, dict[str, BaseNode]]) -> dict[str, Any] | None:
    """The decontamination report of a built pipeline (its ``decontam`` nodes, summed)."""
    return merge_reports([chain[STAGE].report() for chain in chains.values() if STAGE in chain])


def format_report(report: dict[str, Any]) -> str:
    """A few lines for ``stacklm ledger`` and the prebuild summary: per set, docs and tokens, examples."""
    lines = [f"decontamination ({report['n']}-grams, mode {report['mode']}, index {report['index']})"]
    for name, rep in report["sets"].items():
        line = f"  {name:24} dropped {rep['docs']:,} docs / {rep['tokens']:,} tokens"
        if report["mode"] == "cut":
            line += f"; cut spans from {rep['cut_docs']:,} docs / {rep['cut_tokens']:,} tokens"
        lines.append(line)
        for ex in rep["examples"]:
            lines.append(f"    e.g. {ex['source']} file {ex['file']} record {ex['record']}: \"{ex['ngram']}\"")
    return "\n".join(lines)
