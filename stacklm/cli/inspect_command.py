"""``stacklm inspect``: decode, show the loss mask and run the SFT checks (``stacklm.inspector``)."""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from stacklm.cli.arg_types import int_at_least, non_negative_int, positive_int
from stacklm.errors import UserError

EXAMPLES = """examples:
  stacklm inspect chats.jsonl --tokenizer tok/                  # render, mask and check conversations
  stacklm inspect chats.jsonl --tokenizer tok/ --seq-len 2048   # also count what SFT would cut or drop
  stacklm inspect pairs.jsonl --tokenizer tok/                  # preference pairs (chosen/rejected): each side checked
  stacklm inspect shards/ --tokenizer tok/                      # a prebuild output: its train split
  stacklm inspect shards/ --tokenizer tok/ --split val --json findings.json
  stacklm inspect batch.pt --tokenizer tok/                     # a batch saved with torch.save
  stacklm inspect shards/ --row 17 --json                       # where prebuilt row 17 came from
  stacklm inspect runs/stack-100m --step 41200                  # every row of a run's step 41200, from its step log
  stacklm inspect shards/ --why web/a.jsonl/17                  # why the global dedup removed that document, for which kept one
  stacklm inspect stream.yaml --why web/a.jsonl/17              # the same for a stream config's data.pipeline.dedup.index
"""


def add_inspect_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``stacklm inspect`` on the CLI's subparsers (``parser.build_parser``)."""
    p = subparsers.add_parser(
        "inspect",
        help="decode, show the loss mask and run the SFT checks on conversations, shards or a saved batch",
        description="Decode and check chat/SFT data. Exit status 1 when an error-level finding is present, 2 on bad input.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("input", help="conversations .jsonl/.parquet (preference pairs when the first record has chosen and "
                   "rejected), a prebuild output directory (its --split is read), "
                   "one split's shard directory, or a saved batch (.pt)")
    p.add_argument("--tokenizer", help="our artifact (dir or .stacklm.json) or a Hugging Face tokenizer dir (not needed with --row)")
    p.add_argument("--row", type=non_negative_int, help="a prebuilt directory's row N: its tokens and where each piece came from "
                   "(source, file, record, token range in the row, offset in the document)")
    p.add_argument("--step", type=non_negative_int, help="a training run's global step S: every row of it (each rank's "
                   "batches) with where each piece came from, from the run's step log (INPUT: the run's default_root_dir or "
                   "its steplog/ directory)")
    p.add_argument("--why", metavar="SOURCE/FILE/ROW", help="why the global dedup removed this document (its doc_id, as the "
                   "ledger and the dedup index name it): the kept document it duplicates, the estimated and the exact "
                   "similarity, both texts (INPUT: a prebuild output directory, or a config whose data.pipeline.dedup.index "
                   "is set)")
    p.add_argument("--split", help="for a prebuild output directory (and --row, --why): the split to read (default: train; "
                   "--why: every split)")
    p.add_argument("--hf", action="store_true", help="use the HF files of a directory that also holds our artifact")
    p.add_argument("--limit", type=positive_int, help="conversations (default 200) or rows (default 64) to check")
    p.add_argument("--tokens", type=non_negative_int, default=48, help="rows of the per-token table (default 48)")
    p.add_argument("--max-chars", type=non_negative_int, default=1500, help="decoded text shown (default 1500)")
    p.add_argument("--json", nargs="?", const="-", help="also write the findings (each once, with count and first locations) "
                   "and numbers as JSON here; '-' (or no value) prints only the JSON, to stdout")
    p.add_argument("--allow-template-text", action="store_true",
                   help="chat-format markers (ours or another family's) inside message content are warnings, not errors "
                   "(for data that legitimately discusses chat templates)")
    p.add_argument("--seq-len", type=int_at_least(2), help="count the conversations the SFT pipes would truncate or drop at this length")
    p.add_argument("--overlong", choices=("truncate", "keep_end", "drop"), default="truncate",
                   help="the SFT overlong policy --seq-len counts with (default truncate)")
    p.set_defaults(func=cmd_inspect)
    return p


def cmd_inspect(args: argparse.Namespace) -> int:
    from stacklm.inspector import format_report, inspect_input, load_tokenizer

    asked = [f for f, v in (("--row", args.row), ("--step", args.step), ("--why", args.why)) if v is not None]
    if len(asked) > 1:
        raise UserError(f"pass one of --row (a prebuilt row), --step (a training run's step) or --why (a removed document), "
                        f"not {' and '.join(asked)}")
    if args.step is not None and args.split:
        raise UserError("--split is for a prebuild directory; --step reads the train split the run trained on")
    from stacklm.data.storage import remote

    args.input = remote.file_url_path(args.input)  # file:///x: the local /x
    if args.why is not None:
        return _inspect_why(args)
    if args.step is None and remote.is_remote(args.input):  # a shard set in object storage: read from its local mirror
        args.input = str(remote.mirror(args.input))
    if args.row is not None:
        return _inspect_row(args)
    if args.step is not None:
        return _inspect_step(args)
    if not args.tokenizer:
        raise UserError("stacklm inspect: pass --tokenizer (our artifact or a Hugging Face tokenizer dir)")
    tok = load_tokenizer(args.tokenizer, prefer_hf=args.hf)
    report = inspect_input(args.input, tok, limit=args.limit, allow_template_text=args.allow_template_text,
                           seq_len=args.seq_len, overlong=args.overlong, split=args.split)
    if args.json == "-":
        print(json.dumps(report.to_dict(), indent=1))
    else:
        print(format_report(report, tok, args.tokens, args.max_chars))
        if args.json:
            Path(args.json).write_text(json.dumps(report.to_dict(), indent=1))
    return 1 if report.errors else 0


def _json_only(out: dict, args: argparse.Namespace) -> bool:
    """``--json FILE`` writes ``out`` there; ``--json -`` prints only it (then ``True``: done)."""
    if args.json is None:
        return False
    if args.json != "-":
        Path(args.json).write_text(json.dumps(out))
        return False
    print(json.dumps(out))
    return True


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str, prefer_hf: bool):
    from stacklm.inspector import load_tokenizer

    return load_tokenizer(path, prefer_hf=prefer_hf)


def _print_segments(segments: list[dict], input_ids: list[int] | None, args: argparse.Namespace) -> None:
    """One line per piece (token range, source, file, record, offset); with ``--tokenizer`` its text."""
    tok = _tokenizer(args.tokenizer, args.hf) if args.tokenizer and input_ids is not None else None
    for s in segments:
        line = (f"  [{s['row_start']:>6}, {s['row_end']:>6})  {s['source']}  {s['file']}  record {s['record']}  "
                f"doc offset {s['doc_offset']}")
        if tok is not None:
            line += f"\n      {tok.decode(input_ids[s['row_start'] : s['row_end']])[: args.max_chars]!r}"
        print(line)


def _inspect_row(args: argparse.Namespace) -> int:
    """``--row N``: the row's tokens and segments from the prebuild's provenance side files
    (``stacklm.data.storage.provenance``); with ``--tokenizer``, each segment's text too."""
    from stacklm.data.storage.provenance import row_provenance

    out = row_provenance(args.input, args.row, args.split or "train")
    if _json_only(out, args):
        return 0
    print(f"{args.input} [{out['split']}] row {out['row']} ({out['shard']}): {_pieces(len(out['segments']))}")
    _print_segments(out["segments"], out["input_ids"], args)
    return 0


def _inspect_step(args: argparse.Namespace) -> int:
    """``--step S``: every row of a training run's global step ``S`` (``stacklm.inspector.steps``)."""
    from stacklm.inspector.steps import step_provenance

    out = step_provenance(args.input, args.step)
    real = [r for r in out["rows"] if not r.get("padding") and not r.get("skipped")]
    skipped = [r for r in out["rows"] if r.get("skipped")]
    unverified = sum(1 for r in real if not r.get("verified", True))
    if _json_only(out, args):
        return 1 if unverified else 0
    if not args.tokenizer and Path(out["tokenizer"]).exists():  # the run's own tokenizer shows each piece's text
        args.tokenizer = out["tokenizer"]
    check = ("" if out["mode"] == "shards" else
             f"; {len(real) - unverified} of {len(real)} rebuilt from the source files and verified against the logged CRC")
    print(f"{args.input}: step {out['step']} ({out['mode']} mode, run {out['generation']}, {out['world_size']} rank(s)): "
          f"{len(real)} rows, {len(out['rows']) - len(real) - len(skipped)} padding rows{check}")
    for rec in out.get("skip_steps", []):
        a, b = rec["steps"]
        print(f"step {out['step']} is in skip_steps {a}..{b}: its {len(skipped)} rows below (SKIPPED) were passed over, never "
              f"trained; the rows it trained instead are listed without SKIPPED")
    for r in out["rows"]:
        head = ("SKIPPED " if r.get("skipped") else "") + f"rank {r['rank']} batch {r['batch']} row {r['row_in_batch']}"
        if r.get("padding"):
            print(f"{head}: padding (no loss)")
        elif r["segments"] is None:
            print(f"{head}: pieces not known (a window restored from a checkpoint written before stacklm kept them)")
        else:
            extra = f" = prebuilt row {r['row']}" if "row" in r else ("" if r.get("verified") else
                                                                       " (NOT VERIFIED: the sources changed since the run)")
            print(f"{head}{extra}: {_pieces(len(r['segments']))}")
            _print_segments(r["segments"], r["input_ids"], args)
    return 1 if unverified else 0


def _why_sources(args: argparse.Namespace) -> tuple[list[Path], object]:
    """``(evidence files, pipeline config)`` of ``--why``'s INPUT: a finished prebuild (its
    ``dedup-evidence/`` and the config in its top manifest) or a config whose
    ``data.pipeline.dedup.index`` is set (the evidence beside that index)."""
    from stacklm.data.dedup.evidence import build_evidence_files, evidence_path
    from stacklm.data.pipeline import PipelineConfig
    from stacklm.data.storage import remote

    if remote.is_remote(args.input):
        raise UserError(f"--why reads a local build: download {args.input} (its dedup-evidence/ is uploaded with it), "
                        "or run it on the directory the build was staged in")
    where = Path(args.input)
    if where.is_dir():
        from stacklm.data.storage import manifest as mf
        from stacklm.data.storage.datafiles import check_data_file

        if check_data_file(where / "manifest.json") is None:
            raise UserError(f"{where}/manifest.json is missing: --why needs a finished prebuild (or a config with dedup.index)")
        top = mf.read_manifest(where)
        if "splits" not in top:
            raise UserError(f"{where}: one split's directory; pass the prebuild output directory (its parent) with --why")
        files = build_evidence_files(where)
        if not files:
            said = ("was built without global dedup (dedup.exact and dedup.near off): it removed nothing" if "global_dedup" not in top
                    else "holds no dedup evidence (dedup-evidence/ deleted, or its index was decided before stacklm kept it); rebuild it to ask why "
                    f"(`stacklm prebuild --config CONFIG --out NEW_DIR`)")
            raise UserError(f"{where} {said}")
        # a build's content config leaves batch_size out (it does not change the tokens), nor does --why read it
        return files, PipelineConfig.from_dict({"batch_size": 1, **top["build"]["config"]})
    from stacklm.prebuild import load_config

    config, _ = load_config(args.input)
    if not config.dedup.index:
        raise UserError(f"{args.input}: data.pipeline.dedup.index is not set; --why reads the evidence beside a stream "
                        "config's dedup index, or pass a prebuild output directory")
    path = evidence_path(config.dedup.index)
    rebuild = f"rebuild it: stacklm dedup-index --config {args.input} --out {config.dedup.index}"
    if not path.exists():
        raise UserError(f"{path}: no dedup evidence beside the index {config.dedup.index} (deleted, or the index was built "
                        f"before stacklm wrote evidence); {rebuild}")
    from stacklm.data.dedup.evidence import DedupEvidence
    from stacklm.data.dedup.global_index import DedupIndex

    bound, index = DedupEvidence.load(path).meta.get("index_sha256"), DedupIndex.load(config.dedup.index).content_hash
    if bound != index:
        raise UserError(f"{path} is the evidence of another index (index sha256 {str(bound)[:16]}, {config.dedup.index} has "
                        f"{index[:16]}): its answers would not be this index's; {rebuild}")
    return [path], config


def _inspect_why(args: argparse.Namespace) -> int:
    """``--why SOURCE/FILE/ROW``: the dedup decision's evidence for one document, checked
    against the two texts (``stacklm.inspector.removals``)."""
    from stacklm.inspector.removals import explain_removal, format_removal

    files, config = _why_sources(args)
    why = explain_removal(files, config, args.why, args.split)
    if not why["removed"] and args.split is None and Path(args.input).is_dir():
        # every row was read: they must be the build's removed ids, one each (else "not removed" means nothing)
        from stacklm.data.storage import manifest as mf

        counts = mf.read_manifest(args.input).get("global_dedup", {}).get("removed", {})
        listed = sum(int(n) for per in counts.values() for n in per.values())
        if listed != why["removals"]:
            raise UserError(f"{args.input}/dedup-evidence holds {why['removals']:,} removals but the build's index removed "
                            f"{listed:,}: the evidence is not this build's; rebuild to ask why")
    if not _json_only(why, args):
        print(format_removal(why))
    return 0


def _pieces(n: int) -> str:
    return f"{n} piece" + ("" if n == 1 else "s")
