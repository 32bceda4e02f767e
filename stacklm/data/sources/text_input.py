"""Tokenizer input from any text a user has: text files, JSON lines, parquet, ``datasets``.

``open_text_input`` is what ``stacklm train-tokenizer`` and ``stacklm tok-eval`` read: plain
text files (``.txt``, source code, ..., optionally ``.gz``/``.zst``) streamed block by block
through ``text_sample.stream_sample``'s rules, and *records* -- JSON lines (``.jsonl``/``.json``/
``.ndjson``, optionally compressed), parquet, or a ``datasets`` dataset (hub id or local
builder such as ``json``/``parquet`` with ``data_files``) -- whose ``text_column`` is read by
the same source nodes the data pipes use (this folder: JSON errors naming the
line, the missing-column error with the nearest name, the byte-loss audit). Each record is a
document: chunks never span two.

Why refuse instead of read: a JSON-lines file read as raw text trains a tokenizer on JSON
quoting and ``\\n`` escapes, and a binary file trains it on noise, and both "succeed". So a
file read as text is sniffed first (its first 64 KiB): mostly NUL/control bytes or invalid
UTF-8 is refused as binary, and lines that are JSON objects are refused with the fix (name
it ``.jsonl``; ``fmt="txt"``, the CLI's ``--raw-text``, reads it as raw text on purpose).

A sample can be read again: ``sample_spec`` is how it was read (files resolved to absolute
paths, the reading options, the byte budget), ``SampleDigest`` its byte count and sha256;
``train-tokenizer`` stores both in the artifact (``metadata.training_sample``) and ``tok-eval``
trains its baselines on ``open_recorded_sample`` of it, checking the hash.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from stacklm.data.audit import BINARY_INVALID_FRACTION, INVALID_RECORDS
from stacklm.data.sources.text_sample import (
    DEFAULT_CHUNK_BYTES,
    RECORD_COUNTERS,
    SampleAudit,
    TextSample,
    _Budget,
    _check_sizes,
    _chunk_pieces,
    _file_pieces,
    _safe_split,
    resolve_inputs,
)
from stacklm.errors import TextInputError, TextInputNotFoundError
from stacklm.tokenizer.evaluate import DEFAULT_DOMAIN_BYTES

FORMATS = ("auto", "txt")  # txt: every file is plain text (JSON too, on purpose)
SNIFF_BYTES = 64 * 1024
# Source-node counters (stacklm.data.audit / sources) -> this sample's audit counters.
_NODE_COUNTERS = {
    "invalid_utf8_replaced": "invalid_utf8_replaced",
    "nul_removed": "nul_bytes_removed",
    "surrogates_replaced": "lone_surrogates_replaced",
    "dropped_empty": "records_empty",
    "dropped_binary": "records_binary",
    "blank_lines_skipped": "blank_lines",
    # records that hold no document (``on_invalid: skip``): malformed JSON, null / non-string text, ...
    **{reason: "records_invalid" for reason in INVALID_RECORDS},
}
# C0 controls that never occur in text (tab, newline, CR, form feed, vertical tab and escape do)
_CONTROL = frozenset(chr(c) for c in range(32)) - set("\t\n\r\f\v\x1b")


def input_format(path: str, fmt: str = "auto") -> str:
    """``txt`` / ``jsonl`` / ``parquet`` for ``path``: from the name when ``fmt`` is ``auto``
    (``stacklm.data.sources.file_format``; any other name, ``.py``, ``.c`` or none, is text);
    ``txt`` reads every file as plain text."""
    if fmt not in FORMATS:
        raise TextInputError(f"unknown input format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if fmt != "auto":
        return fmt
    from stacklm.data.sources.files import file_format

    try:
        return file_format(path)
    except ValueError:
        return "txt"


def check_text_head(path: str, head: bytes, *, complete: bool, json_ok: bool) -> None:
    """Refuse ``path`` (whose first bytes are ``head``; ``complete`` when that is the whole
    file) if it is binary or, unless ``json_ok``, JSON (see the module docstring)."""
    if not head:
        return
    body, _ = _safe_split(head) if not complete else (head, b"")
    text = (body or head).decode("utf-8", errors="replace")
    bad = text.count("\ufffd") + sum(1 for ch in text if ch in _CONTROL)
    if bad > BINARY_INVALID_FRACTION * len(text):
        raise TextInputError(
            f"{path}: does not look like text ({bad / len(text):.0%} of its first {len(head):,} bytes are NUL/control "
            f"bytes or invalid UTF-8). Pass text files (.txt, .md, code; .gz/.zst need their suffix), JSON lines "
            f"(.jsonl) or parquet with --text-column"
        )
    if json_ok:
        return
    lines = text.splitlines()
    if not complete and len(lines) > 1:
        lines = lines[:-1]  # the last line of a partial head may be cut
    lines = [ln.strip() for ln in lines if ln.strip()][:3]
    if not lines:
        return
    if lines[0] in ("{", "[", "[{"):
        kind = "JSON (a document starting with " + repr(lines[0]) + ")"
    else:
        try:
            objs = [json.loads(ln) for ln in lines]
        except (json.JSONDecodeError, RecursionError):
            return
        if not all(isinstance(o, dict) for o in objs):
            return
        keys = sorted({k for o in objs for k in o})[:8]
        kind = f"JSON lines (each line an object with keys {keys})"
    raise TextInputError(
        f"{path}: looks like {kind}; read as raw text it would teach the tokenizer JSON quoting and escapes. "
        f"Name it .jsonl and choose the field with --text-column (default 'text'); "
        f"--raw-text reads it as raw text on purpose"
    )


def _sniff(path: str, fmt: str) -> None:
    from stacklm.data.sources.readers import open_binary

    with open_binary(path) as f:
        head = f.read(SNIFF_BYTES + 1)
    check_text_head(path, head[:SNIFF_BYTES], complete=len(head) <= SNIFF_BYTES, json_ok=fmt == "txt")


def _record_node(name: str, path: str, text_column: str):
    """The data pipes' source node for one JSON-lines or parquet file of source ``name``."""
    from stacklm.data.sources.files import LocalFileSource

    return LocalFileSource(name, [path], "tokenizer", text_column=text_column)


def _check_column(path: str, fmt: str, group: "TextGroup") -> None:
    """Refuse a record file without ``group``'s text column up front (a parquet file by its
    schema, JSON lines by their first records, as the source node does at open), before any
    training starts: a ``TextColumnError`` naming the source, the file and its columns."""
    from stacklm.data.sources.parts import FIRST_ROWS_CHECK
    from stacklm.data.sources.readers import missing_column
    from stacklm.errors import column_error

    if fmt == "jsonl":
        keys = missing_column(path, group.text_column, FIRST_ROWS_CHECK)
    else:
        import pyarrow.parquet as pq

        try:
            names = pq.ParquetFile(path).schema_arrow.names
        except Exception:  # noqa: BLE001 -- not parquet after all: the reader says so, naming the file
            return
        keys = None if group.text_column in names else names
    if keys is not None:
        raise column_error(group.name, group.text_column, keys, path)


def _dataset_node(path: str, config: str | None, split: str, data_files: Sequence[str] | None, text_column: str):
    from stacklm.data.sources.hub import HFStreamSource

    return HFStreamSource(path, path, "tokenizer", config_name=config, split=split, data_files=data_files,
                          text_column=text_column)


def _records(node, name: str, audit: SampleAudit, budget: _Budget, chunk_bytes: int) -> Iterator[str]:
    """Chunks of every document of ``node``, counted in ``audit.per_file[name]``."""
    counts = audit._counts(name)
    for key in ("documents", *RECORD_COUNTERS):
        counts.setdefault(key, 0)
    node.reset()
    try:
        while not budget.done:
            try:
                doc = node.next()
            except StopIteration:
                break
            text = doc["text"]
            counts["documents"] += 1
            counts["bytes_read"] += len(text) if text.isascii() else len(text.encode("utf-8"))
            yield from _chunk_pieces((text,), budget, chunk_bytes, counts, audit)
    finally:
        for stats in node.stats.to_dict().values():
            for reason, n in stats.items():
                if reason in _NODE_COUNTERS:
                    key = _NODE_COUNTERS[reason]
                    counts[key] = counts.get(key, 0) + n
        close = getattr(node, "_close", None)  # a part source's open reader (the synthetic corpus has none)
        if close is not None:
            close()


def open_text_input(
    inputs: str | os.PathLike | Iterable[str | os.PathLike] | None = None,
    max_bytes: int | None = None,
    *,
    text_column: str = "text",
    fmt: str = "auto",
    dataset: str | None = None,
    dataset_config: str | None = None,
    split: str = "train",
    data_files: Sequence[str] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> TextSample:
    """Text chunks (each <= ``chunk_bytes``) from files/globs ``inputs`` or a ``datasets``
    ``dataset``, ``max_bytes`` UTF-8 bytes of them (``None``: all), with an audit.

    Under a budget every file gets a share in proportion to the text it holds (``open_text_mix``
    with ``weight_by="size"``; compressed files by their uncompressed size), taken from its
    start, so a sample of four inputs holds all four in proportion rather than the first ones
    whole; the audit records each file's ``quota`` and what it gave (``bytes_yielded``), and
    ``summary()`` prints it.

    Files are resolved and every text file sniffed up front, so a missing file, a binary file
    or JSON read as text fails here, naming the file, before any training starts.
    """
    _check_sizes(max_bytes, chunk_bytes)
    if (inputs is None) == (dataset is None):
        raise TextInputError("pass either input files/globs or a dataset (--input or --dataset), not both or neither")
    if dataset is not None:
        label = f"{dataset}" + (f" ({dataset_config})" if dataset_config else "") + f" [{split}]"
        audit = SampleAudit([label], max_bytes, chunk_bytes)
        node = _dataset_node(dataset, dataset_config, split, list(data_files) if data_files else None, text_column)

        def gen_dataset() -> Iterator[str]:
            yield from _records(node, label, audit, _Budget(max_bytes), chunk_bytes)

        return TextSample(gen_dataset(), audit)
    specs = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(p) for p in inputs]
    return open_text_mix([TextGroup("input", tuple(specs), text_column=text_column, fmt=fmt)], max_bytes,
                         weight_by="size", chunk_bytes=chunk_bytes)


WEIGHT_BY = ("mix", "size")


@dataclass(frozen=True)
class TextGroup:
    """One source of a tokenizer sample: ``inputs`` (files/globs) read as ``fmt`` with
    ``text_column``, or ``node()`` (a document node: a ``datasets`` stream, the synthetic
    corpus; its size is unknown before reading, ``label`` names it), with ``weight`` its share
    of the budget when shares follow the mix. Why a group and not a file list: the sources of
    a run config each have their own files, format, column and weight (issue 36)."""

    name: str
    inputs: tuple[str, ...] = ()
    text_column: str = "text"
    fmt: str = "auto"
    weight: float = 1.0
    node: Callable[[], Any] | None = None
    label: str | None = None


def _group_files(group: TextGroup, many: bool) -> list[str]:
    where = f"source {group.name!r}: " if many else ""
    try:
        return resolve_inputs(group.inputs)[0]
    except FileNotFoundError as e:
        raise TextInputNotFoundError(f"{where}{e}; check the path (cwd {os.getcwd()})") from None
    except (IsADirectoryError, ValueError) as e:
        raise TextInputError(f"{where}{e}") from None


def open_text_mix(groups: Sequence[TextGroup], max_bytes: int | None, *, weight_by: str = "mix",
                  chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> TextSample:
    """Text chunks from several sources, ``max_bytes`` UTF-8 bytes of them (``None``: all), with
    an audit. Every input (file, or a group's node) gets a share: with ``weight_by="mix"`` its
    group's ``weight`` (normalized) split between the group's files by the text each holds;
    with ``"size"`` the text it holds over all inputs' (``text_sizes.text_estimate``:
    compressed files by their uncompressed size). Inputs are read in ``text_sizes.plan``'s
    order, each taking ``quota`` of what is left from its start, and what one cannot fill
    passes to the rest. The audit records each input's source, estimate, ``quota``, what it
    gave (``bytes_yielded``) and whether it was read to its end (``complete``).

    Files are resolved and every text file sniffed up front, so a missing file, a binary file,
    JSON read as text or a record file without the text column (``_check_column``) fails here,
    naming the file (and the source, of several), before any training starts; so does a node group under ``weight_by="size"`` (its size is unknown)."""
    from stacklm.data.sources.text_sizes import plan, quota, text_estimate

    _check_sizes(max_bytes, chunk_bytes)
    if weight_by not in WEIGHT_BY:
        raise TextInputError(f"unknown weight_by {weight_by!r}; choose one of {', '.join(WEIGHT_BY)}")
    many = len(groups) > 1
    units: list[dict] = []  # per input: name, group, path/node, format, column, text estimate
    seen: set[str] = set()
    duplicates: list[str] = []
    for g in groups:
        if g.node is not None:
            if weight_by == "size":
                raise TextInputError(f"source {g.label or repr(g.name)} has no size known before reading; "
                                     "use --weight-by mix (the weights), or name its files as a local source")
            units.append({"name": g.label or g.name, "group": g, "est": None})
            continue
        for path in _group_files(g, many):
            key = os.path.realpath(path)
            if key in seen:
                duplicates.append(path)
                continue
            seen.add(key)
            f = input_format(path, g.fmt)
            if f == "txt":
                _sniff(path, g.fmt)
            else:
                _check_column(path, f, g)
            units.append({"name": path, "group": g, "path": path, "fmt": f,
                          "est": text_estimate(path, f, g.text_column)})
    if not units:
        raise TextInputError(f"no input files: every path was listed twice ({duplicates[:3]})")
    audit = SampleAudit([s for g in groups for s in (g.inputs or [g.label or g.name])], max_bytes, chunk_bytes)
    audit.duplicate_paths, audit.weight_by = duplicates, weight_by
    audit.file_sizes = {u["name"]: u["est"]["disk"] for u in units if u["est"] is not None}
    audit.estimates = {u["name"]: {**(u["est"] or {"text": None}), "source": u["group"].name} for u in units}
    total_weight = sum(g.weight for g in groups)
    for g in groups:
        members = [u for u in units if u["group"] is g]
        texts = [u["est"]["text"] if u["est"] is not None else None for u in members]
        known = None if None in texts else sum(texts)
        share = g.weight / total_weight if weight_by == "mix" else None
        for u, t in zip(members, texts):
            if weight_by == "size":
                u["weight"] = float(t)
            else:  # the group's weight, split between its files by their text (equally when none is known)
                u["weight"] = share * (t / known if known else 1 / len(members))
        audit.sources[g.name] = {"weight": g.weight, "text": known, "inputs": [u["name"] for u in members],
                                 "text_column": g.text_column, "share": share}
    if weight_by == "size":
        everything = sum(u["weight"] for u in units)
        for info in audit.sources.values():
            info["share"] = sum(u["weight"] for u in units if u["name"] in info["inputs"]) / everything if everything else 0.0
    order = plan([u["weight"] for u in units], [u["est"]["text"] if u["est"] is not None else None for u in units])
    block = max(chunk_bytes, 64 * 1024)

    def gen() -> Iterator[str]:
        budget = _Budget(max_bytes)
        for k, i in enumerate(order):
            if budget.done:
                break
            u = units[i]
            q = quota(budget.left, u["weight"], sum(units[j]["weight"] for j in order[k:]), k == len(order) - 1)
            counts = audit._counts(u["name"])
            counts["quota"] = q if q is not None else -1
            part = _Budget(q)
            before = audit.bytes_yielded
            if u["group"].node is not None:
                yield from _records(u["group"].node(), u["name"], audit, part, chunk_bytes)
            elif u["fmt"] == "txt":
                pieces = _file_pieces(u["path"], part, block, counts)
                try:
                    yield from _chunk_pieces(pieces, part, chunk_bytes, counts, audit)
                finally:
                    pieces.close()
            else:
                yield from _records(_record_node(u["group"].name, u["path"], u["group"].text_column), u["name"], audit, part, chunk_bytes)
            audit.complete[u["name"]] = not part.done or q is None
            if budget.left is not None:
                budget.left -= audit.bytes_yielded - before
        audit.budget_reached = budget.done

    return TextSample(gen(), audit)


def domain_texts_from_files(
    files_by_domain: Mapping[str, Any], max_bytes: int = DEFAULT_DOMAIN_BYTES, *, text_column: str = "text"
) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """Read user files per domain (paths or globs: text, JSON lines or parquet with
    ``text_column``) through ``open_text_input``, for ``stacklm.tokenizer.evaluate.compression_report``.

    Returns ``(texts, audits)``: the byte-budgeted chunks per domain and each domain's
    ``SampleAudit`` so the caller can print what was replaced or removed.
    """
    texts, audits = {}, {}
    for domain, spec in files_by_domain.items():
        sample = open_text_input(spec, max_bytes, text_column=text_column)
        texts[domain] = list(sample)
        audits[domain] = sample.audit
    return texts, audits




# ----------------------------------------------------------------------------- recorded samples
# A tokenizer artifact records the sample it was trained on (``metadata.training_sample``) so
# that ``tok-eval`` trains its baselines on that same text, never on the text it evaluates.
TRAINING_SAMPLE = "training_sample"
EMBEDDED_CORPUS = "<embedded default corpus>"


class SampleDigest:
    """The texts passing through, counted (UTF-8 bytes) and hashed: sha256 over each text's
    UTF-8 bytes and a NUL (the sampler removes NULs from text, so the NUL marks the chunk
    boundaries, which the trainers see too)."""

    def __init__(self, texts: Iterable[str]) -> None:
        import hashlib

        self.texts, self.bytes, self._hash = texts, 0, hashlib.sha256()

    def __iter__(self) -> Iterator[str]:
        for t in self.texts:
            b = t.encode("utf-8", "surrogatepass")
            self.bytes += len(b)
            self._hash.update(b + b"\0")
            yield t

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


def sample_spec(inputs: Sequence[str] | None, max_bytes: int | None, **read: Any) -> dict[str, Any]:
    """How to read a sample again: ``open_text_input``'s arguments (``read``: text_column, fmt,
    dataset, ...) with the input files resolved to absolute paths (``None``: the embedded
    corpus), and the byte budget. ``TRAINING_SAMPLE`` adds the ``bytes`` and ``sha256`` read."""
    if inputs is None and read.get("dataset") is None:
        return {"inputs": [EMBEDDED_CORPUS], "max_bytes": max_bytes}
    if inputs is not None:
        read["inputs"] = [os.path.abspath(p) for p in resolve_inputs(inputs)[0]]
    return {**{k: v for k, v in read.items() if v is not None}, "max_bytes": max_bytes}


def open_recorded_sample(record: Mapping[str, Any], source: str, max_bytes: int | None = None,
                         files: Sequence[str] | None = None, groups: Sequence[TextGroup] | None = None):
    """The sample a ``sample_spec`` record names, read again with its recorded options
    (``max_bytes``: another budget over the same input). ``files``: where the user says the
    sample's files are (``tok-eval --train-input``). Paths recorded in the artifact are never
    opened: a name read from a data file does not lead out of it; the caller checks that what
    ``files`` hold is the recorded text (``SampleDigest`` against the record's sha256). A record
    that is not one is a ``TokenizerArtifactError`` naming ``source`` and the field; a sample of
    files read without ``files`` is a ``TextInputError`` saying to give them. A sample of a mix
    (the record has ``groups``: ``train-tokenizer --config`` or ``--input PATH:COLUMN``) is read
    from ``groups``, which the caller rebuilds from what the user names (the run config, the inputs)."""
    from stacklm.errors import TokenizerArtifactError

    budget = record.get("max_bytes") if max_bytes is None else max_bytes
    if budget is not None and not (isinstance(budget, int) and budget > 0):
        raise TokenizerArtifactError(f"{source}: field 'metadata.{TRAINING_SAMPLE}.max_bytes': {budget!r} is not a byte count")
    if record.get("inputs") == [EMBEDDED_CORPUS]:
        from stacklm.corpus import iter_default_corpus
        from stacklm.data.sources.text_sample import sample_texts

        return sample_texts(iter_default_corpus(), budget, source="embedded default corpus (Python stdlib)")
    if "groups" in record:
        names = ", ".join(str(g.get("name")) for g in record["groups"] if isinstance(g, Mapping))[:200]
        if not groups:
            how = "its run config (the YAML given to --config)" if record.get("config") else "the same PATH:COLUMN inputs"
            raise TextInputError(f"the tokenizer was trained on a mix of sources ({names}); give {how} with --train-input "
                                 "(checked against the recorded sha256)")
        weight_by = record.get("weight_by", "mix")
        if weight_by not in WEIGHT_BY:
            raise TokenizerArtifactError(f"{source}: field 'metadata.{TRAINING_SAMPLE}.weight_by': {weight_by!r} is not one of {WEIGHT_BY}")
        return open_text_mix(groups, budget, weight_by=weight_by)
    known = ("inputs", "text_column", "fmt", "dataset", "dataset_config", "split", "data_files")
    read = {k: record[k] for k in known if k in record}
    bad = [k for k, v in read.items() if not (isinstance(v, str) or (k in ("inputs", "data_files") and isinstance(v, list)))]
    if bad or not ("inputs" in read or "dataset" in read):
        raise TokenizerArtifactError(f"{source}: field 'metadata.{TRAINING_SAMPLE}': names no input files or dataset "
                                     f"({', '.join(bad) or 'inputs/dataset missing'}); retrain the tokenizer to record its sample")
    field = "inputs" if "inputs" in read else "data_files" if "data_files" in read else None
    if field is not None:  # files: the user names them; the recorded names are only shown
        if not files:
            shown = ", ".join(map(str, read[field][:3])) + (", ..." if len(read[field]) > 3 else "")
            raise TextInputError(f"the tokenizer was trained on files ({shown}); give them with --train-input (they are "
                                 "checked against the recorded sha256)")
        read[field] = list(files)
    return open_text_input(read.pop("inputs", None), budget, **read)


__all__ = ["EMBEDDED_CORPUS", "FORMATS", "TRAINING_SAMPLE", "SampleDigest", "TextInputError", "TextInputNotFoundError",
           "check_text_head", "domain_texts_from_files", "input_format", "open_recorded_sample", "open_text_input",
           "sample_spec", "TextGroup", "WEIGHT_BY", "open_text_mix"]
