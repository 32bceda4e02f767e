"""What ``train-tokenizer`` and ``tok-eval`` read, from their command lines: ``--input PATH[:COLUMN]``
specs and ``train-tokenizer --config run.yaml`` (the run config's training mix), as
``stacklm.data.sources.text_input.TextGroup``s.

Why a module of the CLI: a run config is read by the prebuild's loader (``stacklm.prebuild.load_config``,
the trainer's schema of the file), a layer above the data readers, and ``PATH:COLUMN`` is
command-line syntax; both end as groups that ``open_text_mix`` samples.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

from stacklm.errors import UserError

_NOT_A_COLUMN = set("/\\*?[]{}")


def split_input_spec(spec: str, default_column: str) -> tuple[str, str]:
    """``(path, column)`` of ``--input PATH:COLUMN``; a spec without ``:COLUMN`` (or an existing
    file whose name holds a colon, a URL, a Windows drive) keeps ``default_column``. ``PATH:``
    (nothing after the colon) is refused: it would otherwise be looked for as a file named
    ``PATH:``, and the error would say that file does not exist."""
    path, sep, column = spec.rpartition(":")
    if sep and path and not os.path.exists(spec):
        if not column:
            raise UserError(f"--input {spec!r}: the column after ':' is empty; name it (--input {path}:COLUMN) or "
                            f"leave ':' out to read the --text-column (default 'text')")
        if not (set(column) & _NOT_A_COLUMN):
            return path, column
    return spec, default_column


def _refuse_text_columns(spec: str, path: str, fmt: str) -> None:
    """A column given for plain-text files (``--input 'books/*.txt:body'``): a text file is one
    document with no columns, so the column would be ignored without a word. Files that do not
    resolve are left to the reader's own error."""
    from stacklm.data.sources.text_input import input_format
    from stacklm.data.sources.text_sample import resolve_inputs

    try:
        files = resolve_inputs(path)[0]
    except (OSError, ValueError):
        return
    if files and all(input_format(f, fmt) == "txt" for f in files):
        why = "--raw-text reads every file as plain text" if fmt == "txt" else f"{files[0]} is plain text"
        raise UserError(f"--input {spec!r}: {why}, which has no columns (a file is one document); leave "
                        f"':{split_input_spec(spec, '')[1]}' out, or give JSON lines / parquet files for a column")


def input_column_error(err: Exception, specs: Sequence[str], text_column: str) -> Exception:
    """``err`` (a ``TextColumnError`` of a file given with ``--input``) said as the input that
    named the file and the fix in ``--input`` syntax (``PATH:COLUMN``); ``err`` itself when no
    input names its file."""
    from stacklm.data.sources.text_sample import resolve_inputs

    if not hasattr(err, "available"):
        return err
    for spec in specs:
        path, _ = split_input_spec(spec, text_column)
        try:
            files = resolve_inputs(path)[0]
        except (OSError, ValueError):
            continue
        if err.file in files:
            hint = f" {err.hint}" if err.hint else ""
            column = err.nearest or "COLUMN"
            return UserError(f"--input {spec}: column {err.column!r} is not in {err.file}, whose columns are "
                             f"{err.available}.{hint} Name the column after the path: --input {path}:{column} "
                             "(PATH:COLUMN; --text-column sets it for every input)")
    return err


def input_groups(specs: Sequence[str], text_column: str, fmt: str) -> list:
    """One group per text column among ``specs`` (``PATH[:COLUMN]``), in the order first given:
    ``--input a.parquet:content b.jsonl:body c.txt`` reads each file with its own column."""
    from stacklm.data.sources.text_input import TextGroup

    by_column: dict[str, list[str]] = {}
    for spec in specs:
        path, column = split_input_spec(spec, text_column)
        if path != spec:  # a column given with the path
            _refuse_text_columns(spec, path, fmt)
        by_column.setdefault(column, []).append(path)
    if len(by_column) == 1:
        (column, paths), = by_column.items()
        return [TextGroup("input", tuple(paths), text_column=column, fmt=fmt)]
    return [TextGroup(f"input:{column}", tuple(paths), text_column=column, fmt=fmt) for column, paths in by_column.items()]


def input_paths(specs: Sequence[str], text_column: str) -> list[str]:
    """The paths/globs of ``specs``, their columns left off."""
    return [split_input_spec(s, text_column)[0] for s in specs]


def config_groups(path: str, fmt: str) -> tuple[list, str]:
    """The training mix of a run config (``stacklm prebuild``/``stacklm-train fit``'s YAML, or
    a packaged config by name), one group per source: a local source's globs (relative to the
    cwd, as the prebuild reads them) with its format and ``text_column``; a hub or synthetic
    source through its document node (``SourceConfig.build``: ``datasets``, streamed, with
    the source's config, split and data_files). Each is weighted by the run's planned share
    (``DataMix.target_weights``: the entries' weights, or a schedule's average over the
    budget). Returns ``(groups, the config's resolved path)``."""
    from stacklm.data.sources.text_input import TextGroup
    from stacklm.errors import PrebuildError
    from stacklm.prebuild import load_config
    from stacklm.configs import resolve_config

    try:
        resolved = resolve_config(path)
    except UserError as e:
        raise UserError(f"--config: {e}") from None
    try:
        pipeline, _ = load_config(resolved)
    except PrebuildError as e:
        raise UserError(str(e)) from None
    mix = pipeline.mix
    weights = mix.target_weights()
    groups = []
    for entry in mix.entries:
        if entry.kind == "local":
            groups.append(TextGroup(entry.name, tuple(os.path.expanduser(p) for p in entry.paths),
                                    text_column=entry.text_column or "text", fmt=fmt, weight=weights[entry.name]))
        else:
            what = (f"datasets stream {entry.path}" + (f" ({entry.config_name})" if entry.config_name else "")
                    + f" [{entry.split}]" if entry.kind == "hf" else f"synthetic {entry.domain} corpus")
            groups.append(TextGroup(entry.name, (), text_column=entry.text_column or "text", weight=weights[entry.name],
                                    node=entry.build, label=f"{entry.name}: {what}"))
    return groups, str(resolved.resolve())


def groups_record(groups: Sequence, weight_by: str, max_bytes: int | None, config: str | None) -> dict[str, Any]:
    """How a sample of ``groups`` was read, for the artifact's ``metadata.training_sample``:
    per source its files (absolute), column, format and weight, or its stream's label; the
    weighting and the budget. ``tok-eval`` reads it again from what the user names
    (``--train-input``: the run config, or the ``PATH:COLUMN`` inputs), never from these paths."""
    from stacklm.data.sources.text_sample import resolve_inputs

    sources = []
    for g in groups:
        item: dict[str, Any] = {"name": g.name, "text_column": g.text_column, "fmt": g.fmt, "weight": g.weight}
        if g.node is not None:
            item["stream"] = g.label
        else:
            item["inputs"] = [os.path.abspath(p) for p in resolve_inputs(g.inputs)[0]]
        sources.append(item)
    record: dict[str, Any] = {"groups": sources, "weight_by": weight_by, "max_bytes": max_bytes}
    if config is not None:
        record["config"] = config
    return record


def recorded_groups(record: dict, given: Sequence[str] | None, args: argparse.Namespace) -> list | None:
    """The groups of a mix sample (``record`` has ``groups``) rebuilt from ``given``
    (``tok-eval --train-input``): a run config (one ``.yaml``/``.yml``, or a packaged config's
    name when the tokenizer was trained on one) or ``PATH[:COLUMN]`` inputs; ``None`` when
    nothing is given (the reader then says what to give)."""
    if not given:
        return None
    if len(given) == 1 and (given[0].endswith((".yaml", ".yml")) or "config" in record and not os.path.exists(given[0])):
        return config_groups(given[0], record["groups"][0].get("fmt", "auto") if record.get("groups") else "auto")[0]
    return input_groups(given, args.text_column or "text", "txt" if args.raw_text else "auto")


__all__ = ["config_groups", "groups_record", "input_column_error", "input_groups", "input_paths", "recorded_groups",
           "split_input_spec"]
