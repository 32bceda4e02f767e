"""The ``stacklm`` program: parse, run the command, and the one error path.

Every command reports a mistake the user can fix by raising a ``stacklm.errors.StackLMError``
(or an ``OSError`` about a path the user gave); ``main`` prints it as one line,
``stacklm <command>: error: <message>``, and exits with status 2. Anything else is a bug in
stacklm and keeps its traceback. ``--debug`` (before or after the command) shows the
traceback of a user error too.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from stacklm.cli.parser import build_parser
from stacklm.errors import StackLMError

# User errors of the data and tokenizer layers whose classes do not derive from StackLMError
# yet (they are being moved under it). Matched by class identity, and only once their module
# is loaded (an error of that class can only come from a loaded module), so the error path
# never imports anything. Drop an entry once its class derives from StackLMError.
_USER_ERRORS_OUTSIDE_STACKLM_ERROR = (
    ("stacklm.data.shards", "ShardError"),
    ("stacklm.data.sources", "SourceError"),
    ("stacklm.data.registry", "DataMixError"),
    ("stacklm.tokenizer.bpe", "TokenizerArtifactError"),
    ("stacklm.chat", "ChatFormatError"),
)


def is_user_error(exc: BaseException) -> bool:
    """True for an error the user can fix: printed as one line instead of a traceback."""
    if isinstance(exc, (StackLMError, OSError)):
        return True
    for module_name, class_name in _USER_ERRORS_OUTSIDE_STACKLM_ERROR:
        module = sys.modules.get(module_name)
        if module is not None and isinstance(exc, getattr(module, class_name)):
            return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``stacklm`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except Exception as e:
        if args.debug or not is_user_error(e):
            raise
        print(f"stacklm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # `python stacklm/cli/app.py ...` works too
    sys.exit(main())
