"""``stacklm inspect``: decode, show the loss mask and run the SFT checks (``stacklm.inspector``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from stacklm.cli.arg_types import int_at_least, non_negative_int, positive_int

EXAMPLES = """examples:
  stacklm inspect chats.jsonl --tokenizer tok/                  # render, mask and check conversations
  stacklm inspect chats.jsonl --tokenizer tok/ --seq-len 2048   # also count what SFT would cut or drop
  stacklm inspect shards/ --tokenizer tok/                      # a prebuild output: its train split
  stacklm inspect shards/ --tokenizer tok/ --split val --json findings.json
  stacklm inspect batch.pt --tokenizer tok/                     # a batch saved with torch.save
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
    p.add_argument("input", help="conversations .jsonl/.parquet, a prebuild output directory (its --split is read), "
                   "one split's shard directory, or a saved batch (.pt)")
    p.add_argument("--tokenizer", help="our artifact (dir or .stacklm.json) or a Hugging Face tokenizer dir (not needed with --row)")
    p.add_argument("--row", type=non_negative_int, help="a prebuilt directory's row N: its tokens and where each piece came from "
                   "(source, file, record, token range in the row, offset in the document)")
    p.add_argument("--split", help="for a prebuild output directory (and --row): the split to read (default: train)")
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
    from stacklm.cli.errors import CliError
    from stacklm.inspector import format_report, inspect_input, load_tokenizer

    if args.row is not None:
        return _inspect_row(args)
    if not args.tokenizer:
        raise CliError("stacklm inspect: pass --tokenizer (our artifact or a Hugging Face tokenizer dir)")
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


def _inspect_row(args: argparse.Namespace) -> int:
    """``--row N``: the row's tokens and segments from the prebuild's provenance side files
    (``stacklm.data.storage.provenance``); with ``--tokenizer``, each segment's text too."""
    from stacklm.data.storage.provenance import row_provenance

    out = row_provenance(args.input, args.row, args.split or "train")
    if args.json is not None:
        if args.json != "-":
            Path(args.json).write_text(json.dumps(out))
        else:
            print(json.dumps(out))
            return 0
    tok = None
    if args.tokenizer:
        from stacklm.inspector import load_tokenizer

        tok = load_tokenizer(args.tokenizer, prefer_hf=args.hf)
    print(f"{args.input} [{out['split']}] row {out['row']} ({out['shard']}): {len(out['segments'])} pieces")
    for s in out["segments"]:
        line = (f"  [{s['row_start']:>6}, {s['row_end']:>6})  {s['source']}  {s['file']}  record {s['record']}  "
                f"doc offset {s['doc_offset']}")
        if tok is not None:
            text = tok.decode(out["input_ids"][s["row_start"] : s["row_end"]])
            line += f"\n      {text[: args.max_chars]!r}"
        print(line)
    return 0
