"""Errors of the document sources: every one names the source, and the file or hub path where it applies."""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from stacklm.errors import StackLMError


class SourceError(StackLMError, RuntimeError):
    """A source cannot be read; the message names the source and the file/part."""

    def __init__(self, message: str, *, source: str | None = None, file: str | None = None) -> None:
        super().__init__(message)
        self.source = source
        self.file = file

    def __reduce__(self):  # keyword-only fields: rebuilt by hand when a prebuild worker raises
        return (_rebuild, (self.__class__, str(self), dict(self.__dict__)))


def _rebuild(cls: type, message: str, fields: dict) -> SourceError:
    err = (OSError if issubclass(cls, OSError) else Exception).__new__(cls)  # the base owning the layout
    Exception.__init__(err, message)
    err.__dict__.update(fields)
    return err


class TextColumnError(SourceError, ValueError):
    """The configured text column is not among the dataset's columns."""


class InvalidRecordError(SourceError):
    """One record holds no document (malformed JSON line, not an object, no/null/non-string
    text): skipped and counted under ``reason`` with ``on_invalid: skip``, raised with ``raise``."""

    def __init__(self, message: str, *, reason: str | None = None, source: str | None = None, file: str | None = None) -> None:
        # defaults: every StackLMError is constructible from its message alone (torch re-raises
        # a loader worker's error as ``type(err)(msg)``)
        super().__init__(message, source=source, file=file)
        self.reason = reason


class EmptySourceError(SourceError):
    """The source has no rows, or its first rows are all empty."""


class SourceNotFoundError(SourceError, FileNotFoundError):
    """A glob matched no files."""


def column_error(source: str, column: str, available: Sequence[str], where: str) -> TextColumnError:
    """The error for a missing text column: lists the columns there are and the closest name."""
    available = sorted(map(str, available))
    close = difflib.get_close_matches(column, available, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return TextColumnError(
        f"source {source!r}: text column {column!r} not found in {where}; available columns: {available}.{hint} "
        f"Set text_column to one of them.",
        source=source,
        file=where,
    )
