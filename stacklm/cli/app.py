"""The ``stacklm`` program: parse, run the command, and the one error path.

Every command reports a mistake the user can fix by raising a ``stacklm.errors.StackLMError``
(or an ``OSError`` about a path the user gave, or a missing optional package:
``stacklm.errors.is_user_error``); ``main`` prints it as one line,
``stacklm <command>: error: <message>``, and exits with status 2. Anything else is a bug in
stacklm and keeps its traceback. ``--debug`` (before or after the command) shows the
traceback of a user error too.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from stacklm.cli.parser import build_parser
from stacklm.errors import is_user_error, user_error_message
from stacklm.once import one_line_warnings

__all__ = ["is_user_error", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``stacklm`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    one_line_warnings()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # stdout closed early (`stacklm ledger DIR | head`): not an error; silence the flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        if args.debug or not is_user_error(e):
            raise
        print(f"stacklm {args.command}: error: {user_error_message(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # `python stacklm/cli/app.py ...` works too
    sys.exit(main())
