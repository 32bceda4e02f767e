"""The ``stacklm`` argument parser: every command group registers itself here."""

from __future__ import annotations

import argparse

from stacklm.cli.inspect_command import add_inspect_subcommand
from stacklm.cli.prebuild_commands import add_prebuild_subcommands
from stacklm.cli.report_command import add_report_subcommand
from stacklm.cli.tokenizer_commands import add_tokenizer_subcommands

DEBUG_HELP = "on an error, show the full traceback instead of one line"

EXAMPLES = """examples (each command has its own: stacklm COMMAND --help):
  stacklm train-tokenizer --input 'data/**/*.txt' --out tok/      # or .jsonl / .parquet with --text-column
  stacklm tok-eval --tokenizer tok/ --input held_out.jsonl --hf-baseline
  stacklm prebuild --config my.yaml --tokenizer tok/ --out shards/
  stacklm verify shards/
  stacklm inspect shards/ --tokenizer tok/
  stacklm report runs/my-run                                     # loss, mix, drops, lengths as one HTML page
"""


class OneLineParser(argparse.ArgumentParser):
    """An argument error is one line, like every other refusal of the program (exit 2): argparse
    printed its whole usage block ahead of it (``--workers 0``), burying the line that says what
    is wrong. ``--help`` still prints the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    from stacklm import __version__

    p = OneLineParser(
        prog="stacklm", description="stacklm: the training-data layer of a small-LM stack",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"stacklm {__version__}", help="print the version and exit")
    p.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True)
    add_tokenizer_subcommands(sub)
    add_prebuild_subcommands(sub)
    add_inspect_subcommand(sub)
    add_report_subcommand(sub)
    for command in sub.choices.values():
        # also accepted after the command; SUPPRESS keeps a `stacklm --debug CMD` from being reset
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
    return p
