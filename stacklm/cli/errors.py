"""The command line's own user error: an argument that the library never sees is wrong."""

from __future__ import annotations

from stacklm.errors import StackLMError


class CliError(StackLMError):
    """A command-line argument the user can fix (a malformed ``DOMAIN=GLOB``, a missing
    ``--out``, ...); printed like every ``StackLMError``: one line, exit status 2."""
