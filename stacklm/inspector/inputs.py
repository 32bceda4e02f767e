"""The inputs ``stacklm inspect`` reads (a conversations file, a saved batch, a shard
directory), each read and checked into a ``Report``; ``inspect_input`` picks by what it is."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.chat import DEFAULT_ROLE_ALIASES, ConversationFlag, validate_conversation
from stacklm.chat.formats import conversation_from_record
from stacklm.errors import ChatFormatError, UserError
from stacklm.inspector.batches import BatchView, check_view, stop_ids, view_batch, view_windows
from stacklm.inspector.conversations import check_conversation
from stacklm.inspector.families import text_findings
from stacklm.inspector.findings import ERROR, INFO, WARNING, Finding
from stacklm.inspector.report import Report, Sample
from stacklm.inspector.rows import scan_row
from stacklm.inspector.tokenizer_view import InspectTokenizer, load_tokenizer


def _count_text(report: Report, domain: str, text: str, tok: InspectTokenizer) -> None:
    ct = report.chars_tokens[domain]
    ct[0] += len(text)
    ct[1] += len(tok.encode_text(text))


def _read_records(path: Path, limit: int) -> list[tuple[str, Any]]:
    """``(where, raw)`` for up to ``limit`` rows: bytes per JSON line, dicts for parquet."""
    from stacklm.data.sources import file_format, open_binary

    try:
        fmt = file_format(str(path))
    except ValueError as e:
        raise UserError(str(e)) from None
    rows: list[tuple[str, Any]] = []
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        for batch in pf.iter_batches(batch_size=min(limit, 1024)):
            for r in batch.to_pylist():
                rows.append((f"{path} row {len(rows)}", r))
                if len(rows) >= limit:
                    return rows
        return rows
    if fmt != "jsonl":
        raise UserError(f"{path}: conversations come as JSON lines or parquet, not {fmt}")
    with open_binary(str(path)) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                rows.append((f"{path}:{lineno}", line))
                if len(rows) >= limit:
                    break
    return rows


def _count_trained(report: Report, ids: np.ndarray, trained: np.ndarray, tok: InspectTokenizer) -> None:
    got = np.asarray(ids)[np.asarray(trained, dtype=bool)]
    report.trained_tokens += int(got.size)
    report.trained_stop_tokens += int(np.isin(got, list(stop_ids(tok))).sum())


def _stop_finding(report: Report, tok: InspectTokenizer, chat: bool = True) -> None:
    """Error when tokens are trained but never a stop token (end-of-turn / EOS). Only for chat
    data (``chat``: some row holds a role marker or end-of-turn): pre-training rows are windows
    of documents often longer than the rows read, so none of them holding an EOS is normal."""
    if chat and report.trained_tokens and not report.trained_stop_tokens:
        names = ", ".join(sorted(tok.token_repr(i) for i in stop_ids(tok)))[:120]
        report.findings.append(Finding(
            "stop_token_never_trained", ERROR,
            f"{report.trained_tokens} tokens carry loss in {report.sequences} sequences, none of them a stop token ({names}): "
            "the model never learns to end a reply (train_stop_token: false, or a mask that stops before <|end|>/EOS)",
            report.input))


def _truncation_counts(report: Report, turns, ids: np.ndarray, tok: InspectTokenizer, seq_len: int, overlong: str) -> None:
    """What the SFT pipes would do with this conversation at ``seq_len`` (stacklm layout), or
    whether it is longer than ``seq_len`` (other templates)."""
    c = report.counts
    if tok.layout is None:
        if len(ids) > seq_len:
            c["longer_than_seq_len"] = c.get("longer_than_seq_len", 0) + 1
        return
    from stacklm.chat.render import TURNS_CUT, render_for_sft

    _piece, outcome, cut = render_for_sft(turns, tok.raw, seq_len, overlong)
    c[outcome] = c.get(outcome, 0) + 1
    if cut and outcome != "dropped_too_long":
        c[TURNS_CUT] = c.get(TURNS_CUT, 0) + cut


def _invalid_finding(e: ChatFormatError, where: str) -> Finding:
    """A record ``chat.validate_conversation`` (or the record reader) rejects: the SFT and
    preference pipes drop it and count it under the same reason."""
    return Finding("invalid_conversation", ERROR, f"[{e.reason}] {e.detail}; the SFT pipes drop it", e.where or where,
                   key=f"[{e.reason}]")


def _flag_findings(flags: list[ConversationFlag], where: str) -> list[Finding]:
    """A kept record's flags: the SFT pipes train it and count each reason (once per record)."""
    first = {f.reason: f for f in flags}
    return [Finding("roles_out_of_order", WARNING, f"[{f.reason}] {f.message}; the SFT pipes train it and count it", where,
                    key=f"[{f.reason}]") for f in first.values()]


def inspect_conversations(
    path: Path,
    tok: InspectTokenizer,
    limit: int = 200,
    *,
    allow_template_text: bool = False,
    seq_len: int | None = None,
    overlong: str = "truncate",
) -> Report:
    from stacklm.data.sft import parse_json_line

    if not tok.chat_template:
        raise UserError(
            f"{tok.name}: this tokenizer directory has no chat template (tokenizer_config.json 'chat_template'), so it cannot "
            "render conversations; use a tokenizer with one, e.g. an `export_hf` directory or our tokenizer.stacklm.json"
        )
    report = Report(str(path), "conversations", tok.name, eos_id=tok.eos_id)
    n_rows = 0
    for where, raw in _read_records(path, limit):
        n_rows += 1
        try:
            record = parse_json_line(raw, where)[0] if isinstance(raw, bytes) else raw
            turns = conversation_from_record(record, role_aliases=DEFAULT_ROLE_ALIASES, where=where)
            flags = validate_conversation(turns, where=where)
        except ChatFormatError as e:
            report.findings.append(_invalid_finding(e, where))
            continue
        report.findings += _flag_findings(flags, where)
        found, ids, mask = check_conversation(turns, tok, where, allow_template_text)
        report.findings += found
        if not len(ids):
            continue
        report.sequences += 1
        report.ending_with_eos += int(ids[-1] == tok.eos_id)
        _count_trained(report, ids, mask, tok)
        if seq_len:
            _truncation_counts(report, turns, ids, tok, seq_len, overlong)
        domain = str(record.get("domain") or record.get("source") or "chat")
        for t in turns:
            _count_text(report, domain, t.text(), tok)
        if report.sample is None:
            view = BatchView(ids[None], mask[None].astype(bool), np.zeros((1, len(ids)), np.int64), np.arange(len(ids))[None], "x")
            labels = scan_row(ids, tok, True).labels if tok.layout is not None else ["assistant" if m else "" for m in mask]
            report.sample = Sample(ids, view.loss[0], labels, view.pos[0], view.seg[0])
    if report.sequences == 0 and not report.findings:
        raise UserError(f"{path}: no conversations in the file")
    if seq_len:
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(report.counts.items()))
        report.findings.append(Finding("truncation", INFO, f"at seq_len {seq_len} (overlong: {overlong}), of {report.sequences} "
                                       f"conversations -- {parts}", str(path)))
    _stop_finding(report, tok)
    return report


def is_preference_record(raw: Any) -> bool:
    """A TRL preference row (``chosen`` and ``rejected``, standard or conversational, with or
    without ``prompt``), which ``inspect_input`` reads as pairs, not as one conversation."""
    from stacklm.data.sft import parse_json_line

    try:
        record = parse_json_line(raw, "first row")[0] if isinstance(raw, bytes) else raw
    except ChatFormatError:
        return False
    return isinstance(record, Mapping) and "chosen" in record and "rejected" in record


def inspect_pairs(
    path: Path,
    tok: InspectTokenizer,
    limit: int = 200,
    *,
    allow_template_text: bool = False,
    seq_len: int | None = None,
    overlong: str = "truncate",
) -> Report:
    """Preference pairs (``stacklm.data.sft.preference``): per pair, both sides rendered as the
    preference pipeline renders them (``render_pair``: the shared prompt bears no loss, the stop
    token of each completion does) and run through the conversation checks; with ``seq_len`` the
    pipeline's overlong outcome of each pair is counted. One sequence per side."""
    from stacklm.data.sft import parse_json_line
    from stacklm.data.sft.preference import read_pair, render_pair

    if not tok.chat_template:
        raise UserError(f"{tok.name}: this tokenizer directory has no chat template, so it cannot render preference pairs")
    report = Report(str(path), "preference pairs (chosen and rejected sides)", tok.name, eos_id=tok.eos_id)
    pairs = 0
    for where, raw in _read_records(path, limit):
        try:
            record = parse_json_line(raw, where)[0] if isinstance(raw, bytes) else raw
            prompt, chosen, rejected = read_pair(record, role_aliases=DEFAULT_ROLE_ALIASES, where=where).turns()
            flags = [f for comp in (chosen, rejected) for f in validate_conversation([*prompt, *comp], require_assistant=False, where=where)]
        except ChatFormatError as e:
            report.findings.append(_invalid_finding(e, where))
            continue
        report.findings += _flag_findings(flags, where)
        pairs += 1
        sides: tuple = (None, None)
        if tok.layout is not None:  # the pipeline's own rendering (prompt masked), no length limit
            rendered, outcome, _ = render_pair(prompt, chosen, rejected, tok.raw)
            if rendered is None:
                report.findings.append(Finding("nothing_to_train", ERROR, f"[{outcome}] a completion has no trained turn: "
                                               "the preference pipes drop this pair", where, key=f"[{outcome}]"))
                continue
            sides = (rendered.chosen, rendered.rejected)
            if seq_len:
                _, outcome, cut = render_pair(prompt, chosen, rejected, tok.raw, seq_len, overlong)
                report.counts[outcome] = report.counts.get(outcome, 0) + 1
                if cut and outcome != "dropped_too_long":
                    report.counts["turns_cut"] = report.counts.get("turns_cut", 0) + cut  # render.TURNS_CUT
        views = []
        for side, comp, given in zip(("chosen", "rejected"), (chosen, rejected), sides):
            found, ids, mask = check_conversation([*prompt, *comp], tok, f"{where} ({side})", allow_template_text, given)
            report.findings += found
            views.append((ids, mask))
        if tok.layout is None and all(len(ids) for ids, _ in views):  # another template: the shared prefix is the prompt
            a, b = (ids.tolist() for ids, _ in views)
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            views = [(ids, np.where(np.arange(len(ids)) < n, 0, mask)) for ids, mask in views]
        for ids, mask in views:
            if not len(ids):
                continue
            report.sequences += 1
            report.ending_with_eos += int(ids[-1] == tok.eos_id)
            _count_trained(report, ids, mask, tok)
            if report.sample is None:
                labels = scan_row(ids, tok, True).labels if tok.layout is not None else ["assistant" if m else "" for m in mask]
                report.sample = Sample(ids, np.asarray(mask, bool), labels, np.arange(len(ids)), np.zeros(len(ids), np.int64))
        for t in [*prompt, *chosen, *rejected]:
            _count_text(report, "chat", t.text(), tok)
    if pairs == 0 and not report.findings:
        raise UserError(f"{path}: no preference pairs in the file")
    if seq_len and report.counts:
        parts = ", ".join(f"{k}: {v}" for k, v in sorted(report.counts.items()))
        report.findings.append(Finding("truncation", INFO, f"at seq_len {seq_len} (overlong: {overlong}), of {pairs} pairs -- {parts}",
                                       str(path)))
    _stop_finding(report, tok)
    return report


def _inspect_view(report: Report, view: BatchView, tok: InspectTokenizer, where: str) -> Report:
    found, scans = check_view(view, tok, where)
    report.findings += found
    for b in range(view.ids.shape[0]):
        row = view.ids[b]
        real = row[row != tok.pad_id] if tok.pad_id is not None else row
        report.sequences += 1
        report.ending_with_eos += int(tok.eos_id is not None and tok.eos_id in real.tolist())
        labels = np.array(scans[b].labels)
        for c in np.unique(scans[b].conv[scans[b].conv >= -1]):
            sel = scans[b].conv == c
            seg_ids = row[sel]
            domain = "chat" if any(lab == "marker" or lab.startswith("end:") for lab in labels[sel]) else "text"
            for text in tok.text_runs(seg_ids):
                report.findings += text_findings(text, tok.family, tok.special_strings, f"{where} row {b}", strict=False)
                report.chars_tokens[domain][0] += len(text)
            report.chars_tokens[domain][1] += int(sum(int(t) not in tok.special_ids for t in seg_ids))
    report.sample = Sample(view.ids[0], view.loss[0], scans[0].labels, view.pos[0], view.seg[0])
    _count_trained(report, view.ids, view.loss, tok)
    chat = any(lab == "marker" or lab.startswith("end:") for scan in scans for lab in scan.labels)
    _stop_finding(report, tok, chat)
    return report


def inspect_batch_file(path: Path, tok: InspectTokenizer, limit: int = 64) -> Report:
    import torch

    with open(path, "rb") as f:
        head = f.read(4)
    if not head.startswith(b"PK") and not head[:1] == b"\x80":  # torch.save: a zip archive (a pickle before torch 1.6)
        raise UserError(
            f"{path}: not a saved batch (not a file torch.save wrote: neither a zip archive nor a pickle; raw token ids?); "
            "inspect reads torch.save(batch_dict, path) files, a prebuilt shard directory (or its shard_*.tokens.bin) "
            "and .jsonl/.parquet rows"
        )
    try:
        batch = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        import pickle

        # torch's own text for a refused pickle is many lines and suggests loading it unsafely
        detail = ("it holds pickled objects other than tensors, which stacklm never loads" if isinstance(e, pickle.UnpicklingError)
                  else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise UserError(f"{path}: cannot load a saved batch ({detail}); save one with torch.save(batch_dict, path)") from None
    if not isinstance(batch, Mapping):
        raise UserError(f"{path}: expected a dict of tensors (a batch), got {type(batch).__name__}")
    kind = "batch"
    if "chosen_input_ids" in batch:  # a preference batch: every side's row is a sequence to check
        from stacklm.data.contract import BATCH_KEYS

        real = batch["pair_ids"] >= 0 if "pair_ids" in batch else slice(None)  # filler rows hold no pair
        batch = {k: torch.cat([batch[f"{side}_{k}"][real] for side in ("chosen", "rejected")])
                 for k in BATCH_KEYS if f"chosen_{k}" in batch}
        kind = "preference batch (chosen rows, then rejected)"
    batch = {k: (v[:limit] if hasattr(v, "ndim") and v.ndim == 2 else v) for k, v in batch.items()}
    view = view_batch(batch, tok.pad_id, str(path))
    _check_vocab(view.ids, tok, str(path))
    return _inspect_view(Report(str(path), f"{kind} ({view.layout} layout)", tok.name, eos_id=tok.eos_id), view, tok, str(path))


def read_shard_windows(directory: Path, limit: int) -> tuple[np.ndarray, dict[str, Any]]:
    """The first ``limit`` windows of a shard directory, read per docs/architecture.md "Shards on disk".
    With a ``manifest.json`` (a prebuild's split) the shards it lists, after the loader's checks
    (``manifest.check_split``: a damaged manifest or a shard file that is not one is refused);
    without one, the ``shard_*.tokens.bin`` files by name, each sized by its ``meta.bin``. Every
    file is opened through ``stacklm.data.storage.datafiles`` (regular files inside the directory)."""
    from stacklm.data.storage import shards as sh
    from stacklm.data.storage.datafiles import check_data_file
    from stacklm.data.storage.manifest import check_split

    if check_data_file(directory / "manifest.json") is not None:
        layout = check_split(directory)
        manifest, dtype, seq_len = layout.manifest, layout.dtype, layout.seq_len
        listed = list(zip(layout.shard_names, layout.shard_rows))
    else:
        manifest, listed, dtype, seq_len = {}, [], np.dtype("<u2"), None
        for name in sh.list_shard_files(directory):
            if seq_len is None:  # the first shard's; every other meta must agree (check_shard_files)
                seq_len = sh.read_meta(sh.meta_path(directory, name))[1]
            listed.append((name, sh.check_shard_files(directory, name, dtype, seq_len)))
    if not listed:
        raise UserError(f"{directory}: no shard_*.tokens.bin files; is this a prebuilt shard directory?")
    rows: list[np.ndarray] = []
    for name, n_seq in listed:
        take = min(n_seq, limit - sum(len(r) for r in rows))
        if take > 0:
            rows.append(np.asarray(sh.open_tokens(directory, name, dtype, n_seq, seq_len)[:take], dtype=np.int64))
    return np.concatenate(rows), manifest


def _check_vocab(ids: np.ndarray, tok: InspectTokenizer, where: str) -> None:
    if ids.size and (ids.max() >= tok.vocab_size or ids.min() < 0):
        raise UserError(f"{where}: token id {int(ids.max())} is outside this tokenizer's vocab ({tok.vocab_size}); "
                           "inspect with the tokenizer the data was built with")


def split_directory(directory: Path, split: str | None = None) -> Path:
    """The shard directory to read: ``directory`` itself when it holds shards, else its
    ``split`` sub-directory (a prebuild's output holds ``train/`` and ``val/``)."""
    if any(directory.glob("shard_*.tokens.bin")):
        if split is not None and directory.name != split:
            raise UserError(f"{directory}: this is one split's shard directory, not {split!r}; pass the prebuild "
                               f"output directory (its parent) with --split {split}, or this directory without --split")
        return directory
    splits = sorted(d.name for d in directory.iterdir() if d.is_dir() and any(d.glob("shard_*.tokens.bin")))
    if not splits:
        raise UserError(f"{directory}: no shard_*.tokens.bin files here or in a split directory (train/, val/); "
                           "is this a prebuilt shard directory?")
    if split is None:
        split = "train" if "train" in splits else splits[0]
    if split not in splits:
        raise UserError(f"{directory}: no split {split!r}; it has {', '.join(splits)}: pass --split with one of them")
    from stacklm.data.storage.datafiles import check_data_dir

    check_data_dir(directory / split, directory)  # a split linked from outside the build: refused
    return directory / split


def inspect_shards(directory: Path, tok: InspectTokenizer, limit: int = 64) -> Report:
    windows, manifest = read_shard_windows(directory, limit)
    if manifest.get("vocab_size") not in (None, tok.vocab_size):
        raise UserError(f"{directory}: shards were built with vocab_size {manifest['vocab_size']}, the tokenizer has "
                           f"{tok.vocab_size}; pass the tokenizer the shards were built with")
    _check_vocab(windows, tok, str(directory))
    return _inspect_view(Report(str(directory), "shards", tok.name, eos_id=tok.eos_id), view_windows(windows, tok), tok, str(directory))


def inspect_input(
    path: str | Path,
    tokenizer: str | Path | InspectTokenizer,
    *,
    limit: int | None = None,
    prefer_hf: bool = False,
    allow_template_text: bool = False,
    seq_len: int | None = None,
    overlong: str = "truncate",
    split: str | None = None,
) -> Report:
    """Inspect a conversations file, a shard directory or a saved batch (chosen by what it is).
    A shard directory is one split's (``OUT/train``) or a prebuild's output ``OUT`` itself, whose
    ``split`` is read (default: ``train``, else the first there is). A file whose first record has
    ``chosen`` and ``rejected`` is read as preference pairs (``inspect_pairs``). ``allow_template_text``,
    ``seq_len`` and ``overlong`` apply to conversations and pairs files."""
    tok = tokenizer if isinstance(tokenizer, InspectTokenizer) else load_tokenizer(tokenizer, prefer_hf)
    p = Path(path)
    if not p.exists():
        raise UserError(f"{p}: no such file or directory")
    if p.is_file() and p.name.startswith("shard_") and p.name.endswith(".tokens.bin"):
        p = p.parent  # a shard file: read it with its manifest
    if p.is_dir():
        return inspect_shards(split_directory(p, split), tok, limit or 64)
    if p.suffix in (".pt", ".pth", ".bin") or p.name.endswith(".batch"):
        return inspect_batch_file(p, tok, limit or 64)
    first = _read_records(p, 1)
    read = inspect_pairs if first and is_preference_record(first[0][1]) else inspect_conversations
    return read(p, tok, limit or 200, allow_template_text=allow_template_text, seq_len=seq_len, overlong=overlong)
