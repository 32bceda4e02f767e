"""``manifest.json``: what a shard set is, where it came from, and what was dropped on the way.

Prebuild writes one manifest per split directory (``train/``, ``val/``) and one at the top,
always last, so a directory with a readable manifest is a finished build. Everything in it is
deterministic (no timestamps, no paths of the machine that built it): two builds from the same
config, tokenizer and worker count produce byte-identical manifests, which is what lets a
resumed build be compared with an uninterrupted one file by file.

Per-task results (one per prebuild worker or datatrove task) are merged here: counts add up,
weights and fractions are recomputed from the summed counts, never averaged.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.data.audit import INVALID_RECORDS
from stacklm.data.stats import drops_by_reason
from stacklm.data.storage.datafiles import check_data_dir, check_data_file, read_data_bytes
from stacklm.data.storage.shards import atomic_write_shard_file
from stacklm.errors import DataError

MANIFEST_NAME = "manifest.json"
FORMAT = "stacklm-shards"
VERSION = 1
REQUIRED = ("format", "version", "seq_len", "dtype", "vocab_size", "bos_id", "eos_id", "pad_id", "tokenizer_hash")
SPLIT_REQUIRED = REQUIRED + ("split", "shards", "n_seq")


# ---------------------------------------------------------------------------------------
# Hashes
# ---------------------------------------------------------------------------------------
def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def tokenizer_hash(tokenizer) -> str:
    """sha256 of the tokenizer artifact's content: vocab size, pattern, merges, specials.

    ``tokenizer`` is a loaded tokenizer (a ``StackTokenizer``): the data layer takes it as an
    argument and never loads one, so data/ does not depend on the tokenizer's code. The
    artifact's ``metadata`` (training time, sample audit) is left out, so re-saving or
    re-training the same tokenizer gives the same hash, and any change to the ids does not.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        raise TypeError(
            f"tokenizer_hash: got the path {os.fspath(tokenizer)!r}; pass the loaded tokenizer "
            "(stacklm.tokenizer.bpe.StackTokenizer.load(path))"
        )
    content = {k: v for k, v in tokenizer.to_dict().items() if k != "metadata"}
    return hashlib.sha256(_canonical(content)).hexdigest()


# ---------------------------------------------------------------------------------------
# Reading / writing
# ---------------------------------------------------------------------------------------
def manifest_path(directory: str | os.PathLike) -> Path:
    return Path(directory) / MANIFEST_NAME


def dumps(manifest: Mapping[str, Any]) -> bytes:
    """The manifest's bytes: sorted keys and fixed spacing, so equal content is equal bytes."""
    return (json.dumps(manifest, sort_keys=True, indent=1, ensure_ascii=True) + "\n").encode("ascii")


def write_manifest(directory: str | os.PathLike, manifest: Mapping[str, Any]) -> Path:
    """Atomically write ``directory/manifest.json`` (temp name, fsync, rename, fsync dir)."""
    path = manifest_path(directory)
    atomic_write_shard_file(path, dumps(manifest))
    return path


def read_manifest(directory: str | os.PathLike, *, required: Iterable[str] = REQUIRED) -> dict[str, Any]:
    """Read and sanity-check ``directory/manifest.json``; every failure names the file and the fix."""
    directory = Path(directory)
    path = manifest_path(directory)
    if not directory.is_dir():
        raise DataError(f"{directory} does not exist or is not a directory; build shards with `stacklm prebuild --config CONFIG --out {directory}`", path=directory)
    if check_data_file(path, directory) is None:  # a FIFO or a link out of the directory: refused here, never opened
        if not any(directory.iterdir()):
            why = f"{directory} is empty: it is not a prebuilt shard directory"
        elif (directory / ".prebuild").exists() or (directory.parent / ".prebuild").exists():
            why = f"{path} is missing: the prebuild into {directory} has not finished (the manifest is written last); re-run the same `stacklm prebuild` command to resume it"
        else:
            why = f"{path} is missing: {directory} is not a finished shard set"
        raise DataError(f"{why}. Build one with `stacklm prebuild --config CONFIG --out DIR`.", path=path)
    try:
        data = json.loads(read_data_bytes(path, directory))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path} is not readable JSON ({e}); the file is damaged — rebuild with `stacklm prebuild` (or restore it from a copy)", path=path) from None
    if not isinstance(data, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(data).__name__}; rebuild with `stacklm prebuild`", path=path)
    if data.get("format") != FORMAT:
        raise DataError(f"{path}: field 'format' is {data.get('format')!r}, expected {FORMAT!r}: not a stacklm shard manifest", path=path)
    if data.get("version") != VERSION:
        raise DataError(f"{path}: field 'version' is {data.get('version')!r}; this stacklm reads version {VERSION} — rebuild the shards with this version", path=path)
    missing = [k for k in required if k not in data]
    if missing:
        raise DataError(f"{path}: missing field(s) {missing}; the manifest is incomplete — rebuild with `stacklm prebuild`", path=path)
    check_names(data, path)
    return data


def is_plain_name(value: Any) -> bool:
    """A file name that stays inside the directory it is joined to: a non-empty string with no
    path separator, not ``.`` or ``..``, not absolute, no NUL."""
    return (isinstance(value, str) and value not in ("", ".", "..") and "/" not in value and "\\" not in value
            and "\0" not in value and not os.path.isabs(value) and (os.altsep is None or os.altsep not in value))


def check_names(data: Mapping[str, Any], path: str | os.PathLike) -> None:
    """Refuse a manifest whose names would leave its directory: every shard ``name`` (a split
    manifest) and every split key and ``path`` (the top manifest) is joined to the manifest's
    directory by every reader, so ``../../elsewhere/x`` or ``/abs/x`` would make the loader and
    ``verify`` read (and vouch for) files of someone else's choosing. Called by ``read_manifest``,
    so every reader gets it; one line naming the file, the field and the value."""
    path = Path(path)

    def bad(field: str, value: Any, what: str) -> DataError:
        return DataError(
            f"{path}: field '{field}' is {value!r}, not {what} inside {path.parent} (no '/', no '..', not absolute, not "
            "empty): the manifest is damaged or was not written by stacklm; rebuild with `stacklm prebuild`", path=path)

    if "shards" in data:
        shards = data["shards"]
        if not isinstance(shards, list):
            raise bad("shards", type(shards).__name__, "a list of shards")
        for i, entry in enumerate(shards):
            name = entry.get("name") if isinstance(entry, Mapping) else entry
            if not is_plain_name(name):
                raise bad(f"shards[{i}].name", name, "a plain shard file name")
    splits = data.get("splits")
    if splits is not None:
        if not isinstance(splits, Mapping):
            raise bad("splits", type(splits).__name__, "a table of splits")
        for key, entry in splits.items():
            if not is_plain_name(key):
                raise bad("splits", key, "a plain split directory name")
            if isinstance(entry, Mapping) and "path" in entry and not is_plain_name(entry["path"]):
                raise bad(f"splits.{key}.path", entry["path"], "a plain split directory name")


# ---------------------------------------------------------------------------------------
# One split: its manifest against its files
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SplitLayout:
    """What ``check_split`` found a split to be: its manifest, layout and shards' row counts."""

    path: Path
    manifest: dict[str, Any]
    seq_len: int
    vocab_size: int
    dtype: np.dtype
    shard_names: list[str]
    shard_rows: list[int]

    @property
    def num_rows(self) -> int:
        return sum(self.shard_rows)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_split(directory: str | os.PathLike, *, files: bool = True) -> SplitLayout:
    """The checks a split's manifest passes before anything reads it as a shard set, in one
    place so every reader makes the same ones (the loader, ``stacklm verify``, ``stacklm
    inspect`` on a split and with ``--row``/``--step``, ``stacklm ledger``): ``read_manifest``
    (format, version, required fields, names), every field the readers compute with of the
    right type and range, no shard listed twice; with ``files``, each listed shard's files
    (tokens, meta, side files) regular files inside the directory (``datafiles``), its meta
    agreeing with the manifest and its size what the meta says (``shards.check_shard_files``),
    and no unlisted shard files beside them; then the rows summing to ``n_seq`` and
    ``n_tokens`` = ``n_seq`` x ``seq_len``. ``files=False`` (a mirror of the manifests only, a
    streamed cache): the row counts are the manifest's and no file beside it is looked at.
    Content hashes are checked where rows are read (``shards.check_content_hash``): hashing a
    whole set is ``stacklm verify``'s work, not an opening's. One ``DataError`` line naming
    the file, the field and the fix."""
    from stacklm.data.storage.shards import check_shard_files, list_shard_files, parse_dtype

    directory = Path(directory)
    m = read_manifest(directory, required=SPLIT_REQUIRED)
    where = manifest_path(directory)

    def bad(field: str, value: Any, what: str) -> DataError:
        return DataError(f"{where}: field {field!r} is {value!r}, not {what}: the manifest is damaged; restore it from a copy "
                         "or rebuild with `stacklm prebuild`", path=where)

    for key, low in (("seq_len", 2), ("vocab_size", 1), ("n_seq", 0)):
        if not _is_int(m[key]) or m[key] < low:
            raise bad(key, m[key], f"an integer >= {low}")
    seq_len, vocab_size = m["seq_len"], m["vocab_size"]
    dtype = parse_dtype(m["dtype"], where=str(where))
    if np.iinfo(dtype).max + 1 < vocab_size:
        raise DataError(f"{where}: dtype {m['dtype']} cannot hold vocab_size {vocab_size}; the manifest is corrupt — rebuild", path=where)
    for key in ("bos_id", "eos_id", "pad_id"):
        if not _is_int(m[key]) or not 0 <= m[key] < vocab_size:
            raise DataError(f"{where}: field {key!r} = {m[key]!r} is outside the vocab (size {vocab_size}); the manifest is corrupt — rebuild", path=where)
    for key in ("tokenizer_hash", "split"):
        if not isinstance(m[key], str):
            raise bad(key, m[key], "a string")
    names: list[str] = []
    for i, entry in enumerate(m["shards"]):  # a list of plain names: read_manifest checked it
        if not isinstance(entry, dict):
            raise bad(f"shards[{i}]", entry, "a table {name, n_seq, xxh64}")
        if not _is_int(entry.get("n_seq")) or entry["n_seq"] < 0:
            raise bad(f"shards[{i}].n_seq", entry.get("n_seq"), "an integer >= 0")
        if entry["name"] in names:
            raise bad(f"shards[{i}].name", entry["name"], f"a shard not listed before (shards[{names.index(entry['name'])}] is it)")
        names.append(entry["name"])
    if files:
        rows = [check_shard_files(directory, e["name"], dtype, seq_len, e["n_seq"]) for e in m["shards"]]
        listed = set(names)
        for entry in os.scandir(directory):  # every other file of a listed shard (its provenance side file, ...) too
            if entry.name.split(".", 1)[0] in listed:
                check_data_file(entry.path, directory)
    else:
        rows = [e["n_seq"] for e in m["shards"]]
    if sum(rows) != m["n_seq"]:
        raise DataError(f"{where}: field 'n_seq' = {m['n_seq']} but its shards hold {sum(rows)} rows; rebuild with `stacklm prebuild`", path=where)
    if "n_tokens" in m and m["n_tokens"] != m["n_seq"] * seq_len:
        raise DataError(f"{where}: field 'n_tokens' = {m['n_tokens']!r} but n_seq {m['n_seq']} x seq_len {seq_len} = "
                        f"{m['n_seq'] * seq_len}: the manifest is damaged; rebuild with `stacklm prebuild`", path=where)
    stray = sorted(set(list_shard_files(directory)) - set(names)) if files else []
    if stray:
        raise DataError(
            f"{directory} holds shard files the manifest does not list ({', '.join(stray[:3])}{'...' if len(stray) > 3 else ''}): "
            "shards from another build were copied in; remove them or rebuild into a fresh directory",
            path=directory,
        )
    return SplitLayout(directory, m, seq_len, vocab_size, dtype, names, rows)


def split_directory(top: str | os.PathLike, name: str) -> Path:
    """Split ``name`` of the build at ``top``: a directory inside it (a link that leaves the
    build, or a file under its name, is refused: ``datafiles.check_data_dir``). Missing is a
    ``DataError`` too: a top manifest lists only splits it wrote."""
    path = Path(top) / name
    if check_data_dir(path, top) is None:
        raise DataError(f"{path} is missing: {manifest_path(top)} lists split {name!r}; restore the directory or rebuild "
                        "with `stacklm prebuild`", path=path)
    return path


# ---------------------------------------------------------------------------------------
# Merging per-task results
# ---------------------------------------------------------------------------------------
def sum_counts(items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Nested sum of int leaves; other leaves are kept when every task agrees, else listed."""
    out: dict[str, Any] = {}
    for item in items:
        for key, value in item.items():
            if isinstance(value, Mapping):
                out[key] = sum_counts([out.get(key, {}), value])
            elif isinstance(value, int) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
            elif key not in out:
                out[key] = value
            elif out[key] != value:
                prev = out[key] if isinstance(out[key], list) else [out[key]]
                out[key] = prev if value in prev else prev + [value]
    return out


def merge_realized(per_task: Iterable[Mapping[str, Mapping[str, Any]]], target: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """Sum the mixer's per-source counts over tasks; target/realized weights from the sums."""
    merged = sum_counts(per_task)
    total = sum(int(r.get("tokens", 0)) for r in merged.values()) or 1
    for name, r in merged.items():
        r["target_weight"] = float(target[name])
        r["realized_weight"] = int(r.get("tokens", 0)) / total
    return merged


def merge_packing(per_task: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum the packer's counters over tasks; the pad fraction from the sums."""
    per_task = list(per_task)
    seq_len = int(per_task[0]["seq_len"]) if per_task else 0
    merged = sum_counts({k: v for k, v in p.items() if k not in ("seq_len", "pad_fraction")} for p in per_task)
    merged["seq_len"] = seq_len
    total = int(merged.get("windows", 0)) * seq_len
    merged["pad_fraction"] = int(merged.get("pad_tokens", 0)) / total if total else 0.0
    return merged


# Stage/reason names of ``Pipeline.stats()`` folded into the manifest's drop summary.
_BYTE_REPAIRS = ("invalid_utf8_replaced", "surrogates_replaced")


def drop_summary(stats: Mapping[str, Mapping[str, Mapping[str, int]]], realized: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, int]]:
    """Per source: documents dropped by the filters, by each user stage (``stage/reason``), by decontamination (when configured), exact and near duplicates, copies of a
    document kept in another split (``cross_split_dup``, the global dedup pass), empty/binary
    records, invalid records skipped (``invalid_records`` and one count per reason), bytes
    replaced by the audit, and what the mix budget cut."""
    sources = set(realized)
    for per in stats.values():
        sources |= set(per)
    out: dict[str, dict[str, int]] = {}
    for src in sorted(sources):
        audit = stats.get("source", {}).get(src, {})
        filt = stats.get("filter", {}).get(src, {})
        decon = stats.get("decontam", {}).get(src, {})
        dedup = stats.get("dedup", {}).get(src, {})
        mix = realized.get(src, {})
        out[src] = {
            "filtered": sum(n for r, n in filt.items() if r != "kept"),
            **({"decontaminated": sum(n for r, n in decon.items() if r != "kept")} if decon else {}),
            "exact_dup": int(dedup.get("exact_dup", 0)),
            "near_dup": int(dedup.get("near_dup", 0)),
            "cross_split_dup": int(dedup.get("cross_split_dup", 0)),
            "bytes_replaced": sum(int(audit.get(r, 0)) for r in _BYTE_REPAIRS),
            "nul_removed": int(audit.get("nul_removed", 0)),
            "dropped_empty": int(audit.get("dropped_empty", 0)),
            "dropped_binary": int(audit.get("dropped_binary", 0)),
            "invalid_records": sum(int(audit.get(r, 0)) for r in INVALID_RECORDS),
            **{r: int(audit.get(r, 0)) for r in INVALID_RECORDS},
            "empty_after_tokenize": int(mix.get("empty_docs", 0)),
            "truncated_to_budget": int(mix.get("truncated_docs", 0)),
            "tokens_cut_by_budget": int(mix.get("truncated_tokens", 0)),
            # each user stage's drops by reason (``pipeline.stages``), keyed as the ledger keys them
            **{f"{stage}/{r}": int(n) for stage, per in stats.items() if stage not in ("filter", "decontam") and drops_by_reason(stage)
               for r, n in per.get(src, {}).items() if r != "kept"},
        }
    return out


def source_list(
    mix_dict: Mapping[str, Any],
    realized: Mapping[str, Mapping[str, Any]],
    stats: Mapping[str, Any],
    resolved: Mapping[str, str | None] | None = None,
) -> list[dict[str, Any]]:
    """Every source with its full hub/file coordinates (and the commit it resolved to), target
    and realized weight and counts."""
    resolved = resolved or {}
    out = []
    fallback = stats.get("source", {})
    for entry in mix_dict["entries"]:
        r = realized.get(entry["name"], {})
        out.append(
            {
                **entry,
                **({"resolved_revision": resolved[entry["name"]]} if entry["name"] in resolved else {}),
                "target_weight": r.get("target_weight", entry["weight"]),
                "realized_weight": r.get("realized_weight", 0.0),
                "tokens": int(r.get("tokens", 0)),
                "docs": int(r.get("docs", 0)),
                "offline_fallback": bool(fallback.get(entry["name"], {}).get("fallback_offline", 0)),
            }
        )
    return out


def resolve_revisions(mix_dict: Mapping[str, Any], timeout: float = 10.0) -> dict[str, str | None]:
    """Commit sha of every hub (``kind: hf``) source at build time, so a later run can pin
    exactly this data (``DataMix.pinned``). ``None`` where the hub cannot be asked (offline,
    a packaged builder such as ``json``); the manifest then records only the configured revision."""
    out: dict[str, str | None] = {}
    for entry in mix_dict["entries"]:
        if entry.get("kind") != "hf" or not entry.get("path") or "/" not in str(entry["path"]):
            continue
        try:
            from huggingface_hub import HfApi

            out[entry["name"]] = HfApi().dataset_info(entry["path"], revision=entry.get("revision"), timeout=timeout).sha
        except Exception:  # offline or unknown: recorded as unresolved, never fatal
            out[entry["name"]] = None
    return out


def config_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two config dicts differ, with both values (for refusal messages)."""
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        diffs = []
        for key in sorted(set(old) | set(new), key=str):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in old:
                diffs.append(f"{path} (absent -> {new[key]!r})")
            elif key not in new:
                diffs.append(f"{path} ({old[key]!r} -> absent)")
            else:
                diffs += config_differences(old[key], new[key], path)
        return diffs
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in config_differences(a, b, f"{prefix}[{i}]")]
    return [] if old == new else [f"{prefix} ({old!r} -> {new!r})"]
