"""The one base class of errors a user can fix.

Everything that goes wrong because of what the user gave us (a path, a config key or value,
a broken source, a full disk, a missing optional dependency) raises a ``StackLMError``
subclass whose message names the file, field or package and says what to do. The command
line prints such an error as one line and exits with status 2 (``--debug`` shows the
traceback); any other exception is a bug in stacklm and keeps its traceback.

Subclasses keep a second, built-in base where callers already catch one (``ValueError`` for
bad values, ``FileNotFoundError`` for missing files, ...), so ``except ValueError`` still works.
"""

from __future__ import annotations


class StackLMError(Exception):
    """An error the user can fix; the message names what is wrong and the fix.

    Errors cross process boundaries (loader workers, prebuild workers), so every subclass must
    survive pickling with its fields, and be constructible from the message alone: torch's
    ``DataLoader`` re-raises a worker's error as ``type(err)(message)`` and falls back to a bare
    ``RuntimeError`` (no longer a ``StackLMError``) when that fails. So a subclass's extra
    ``__init__`` arguments take defaults, and pickling rebuilds from the message and then puts
    the fields back.
    """

    def __reduce__(self):
        return (_rebuild_error, (type(self), self.args, self.__dict__))


def _rebuild_error(cls: type, args: tuple, state: dict) -> StackLMError:
    err = cls(*args)
    err.__dict__.update(state)
    return err


class ConfigError(StackLMError, ValueError):
    """A config file, section, key or value is wrong; the message names where."""


class ArgumentTypeError(StackLMError, TypeError):
    """A library call got an argument of the wrong type; the message names the call, the
    argument and what it accepts."""
