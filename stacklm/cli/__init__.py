"""``stacklm`` command line: one subcommand per job, thin over the library functions.

``app.main`` parses the arguments, runs the command and owns the one error path;
``parser.build_parser`` puts the commands together; each ``*_commands`` module registers one
group of them. The library never imports this package, and importing it loads neither torch
nor numpy: a command imports what it needs when it runs, so ``stacklm --help`` stays fast.
"""

from stacklm.cli.app import main
from stacklm.cli.parser import build_parser

__all__ = ["build_parser", "main"]
