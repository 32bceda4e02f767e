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
from collections.abc import Iterable, Iterator, Mapping, Sequence
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


def _record_node(path: str, text_column: str):
    """The data pipes' source node for one JSON-lines or parquet file."""
    from stacklm.data.sources.files import LocalFileSource

    return LocalFileSource(path, [path], "tokenizer", text_column=text_column)


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
        node._close()


def share_of(left: int | None, sizes: Sequence[int]) -> int | None:
    """The first file's share of ``left`` bytes among files of ``sizes`` (its size over their
    sum; the last file takes all of ``left``); ``None`` (no budget) stays ``None``."""
    if left is None:
        return None
    total = sum(sizes)
    if len(sizes) == 1 or total == 0:
        return left if len(sizes) == 1 else left // len(sizes)
    return left * sizes[0] // total


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

    Under a budget every file gets a share in proportion to its size on disk (``share_of``;
    compressed files count their compressed size), taken from its start, so a sample of four
    inputs holds all four in proportion rather than the first ones whole; the audit records
    each file's ``quota`` and what it gave (``bytes_yielded``), and ``summary()`` prints it.

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
    try:
        files, duplicates = resolve_inputs(inputs)
    except FileNotFoundError as e:
        raise TextInputNotFoundError(f"{e}; check the path (cwd {os.getcwd()})") from None
    except (IsADirectoryError, ValueError) as e:
        raise TextInputError(str(e)) from None
    formats = {path: input_format(path, fmt) for path in files}
    for path, f in formats.items():
        if f == "txt":
            _sniff(path, fmt)
    specs = [os.fspath(inputs)] if isinstance(inputs, (str, os.PathLike)) else [os.fspath(p) for p in inputs]
    audit = SampleAudit(specs, max_bytes, chunk_bytes)
    audit.duplicate_paths = duplicates
    block = max(chunk_bytes, 64 * 1024)

    sizes = {path: os.path.getsize(path) for path in files}
    audit.file_sizes = dict(sizes)

    def gen_files() -> Iterator[str]:
        budget = _Budget(max_bytes)
        for i, path in enumerate(files):
            if budget.done:
                break
            # Each file's share of what is left, in proportion to its size among the files
            # still to read: a file that yields less than its share (JSON overhead, a short
            # compressed file) passes the rest on; the last file may take all that remains.
            quota = share_of(budget.left, [sizes[p] for p in files[i:]])
            audit._counts(path)["quota"] = quota if quota is not None else -1
            part = _Budget(quota)
            before = audit.bytes_yielded
            if formats[path] == "txt":
                counts = audit._counts(path)
                pieces = _file_pieces(path, part, block, counts)
                try:
                    yield from _chunk_pieces(pieces, part, chunk_bytes, counts, audit)
                finally:
                    pieces.close()
            else:
                yield from _records(_record_node(path, text_column), path, audit, part, chunk_bytes)
            if budget.left is not None:
                budget.left -= audit.bytes_yielded - before
        audit.budget_reached = budget.done

    return TextSample(gen_files(), audit)


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
                         files: Sequence[str] | None = None):
    """The sample a ``sample_spec`` record names, read again with its recorded options
    (``max_bytes``: another budget over the same input). ``files``: where the user says the
    sample's files are (``tok-eval --train-input``). Paths recorded in the artifact are never
    opened: a name read from a data file does not lead out of it; the caller checks that what
    ``files`` hold is the recorded text (``SampleDigest`` against the record's sha256). A record
    that is not one is a ``TokenizerArtifactError`` naming ``source`` and the field; a sample of
    files read without ``files`` is a ``TextInputError`` saying to give them."""
    from stacklm.errors import TokenizerArtifactError

    budget = record.get("max_bytes") if max_bytes is None else max_bytes
    if budget is not None and not (isinstance(budget, int) and budget > 0):
        raise TokenizerArtifactError(f"{source}: field 'metadata.{TRAINING_SAMPLE}.max_bytes': {budget!r} is not a byte count")
    if record.get("inputs") == [EMBEDDED_CORPUS]:
        from stacklm.corpus import iter_default_corpus
        from stacklm.data.sources.text_sample import sample_texts

        return sample_texts(iter_default_corpus(), budget, source="embedded default corpus (Python stdlib)")
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
           "sample_spec", "share_of"]
