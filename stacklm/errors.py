"""Every error stacklm raises for a reason outside its own code, and how the command line shows it.

One root and two bases say whose move it is (built-in bases in brackets)::

    StackLMError                      the root: the CLI prints it as one line, exit status 2
    ├── UserError                     what the user gave is wrong: an argument, a config value,
    │   │                             a path, an input the command does not read, a missing extra
    │   ├── ConfigError [ValueError]
    │   │   ├── DataGateError
    │   │   └── ResumeRefused         a checkpoint must not resume on this data or set-up
    │   ├── ArgumentTypeError [TypeError]
    │   ├── MissingDependencyError [ImportError]
    │   ├── TextInputError [ValueError]
    │   │   └── TextInputNotFoundError [FileNotFoundError]
    │   └── LoneSurrogateError [ValueError]
    └── DataError [RuntimeError]      a data file is bad, damaged or does not match: a shard, a
        │                             manifest, a state file, a step log, a source, a tokenizer
        ├── RemoteError
        ├── ShardWriteError [OSError]
        ├── StateFileError [ValueError]
        ├── LedgerError
        ├── PrebuildError
        │   └── TaskFailed
        ├── TokenizerArtifactError [ValueError]
        ├── ChatFormatError [ValueError]
        └── SourceError
            ├── TextColumnError [ValueError]
            ├── InvalidRecordError
            └── SourceNotFoundError [FileNotFoundError]

Every message names the file, field or package and says what to do. Both command lines
(``stacklm <command>`` and ``stacklm-train`` / ``python -m trainer``) print a user error as
``<prog>: error: <message>`` and exit with status 2; ``--debug`` shows the traceback. Besides
``StackLMError``, an ``OSError`` (a path the user gave, a full disk: the message gets the fix for
its errno) and a ``ModuleNotFoundError`` of an optional extra's package (the message names the
extra) and Lightning refusing a trainer setting (``lightning_config_error``) are shown the same way
(``is_user_error``, ``user_error_message``). Any other exception is a bug in stacklm and keeps
its traceback.

A class below a base exists only for a reason said in its docstring: a caller catches it by
name (``except ConfigError`` to add where a value sits, ``except SourceError`` to skip a part,
...); it carries a built-in base that callers already catch and its base lacks (``ValueError``,
``FileNotFoundError``, ``ImportError``, ``OSError``); it carries fields or a name a caller reads
(``DataGateError.findings``, ``TaskFailed.rank``, "raised LedgerError" in a task's failure); or
its class is the answer a caller needs (``ResumeRefused``: start fresh instead). Anything else
raises the base itself.
"""

from __future__ import annotations

import difflib
import errno
import os
import re
from collections.abc import Sequence

# ---------------------------------------------------------------------------------------
# The root and the bases
# ---------------------------------------------------------------------------------------


class StackLMError(Exception):
    """An error the user can act on; the message names what is wrong and the fix.

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


class UserError(StackLMError):
    """What the user gave is wrong and the user fixes it there: a command-line argument, a
    config value, a path, an input that is not what the command reads, a missing optional
    extra. Raised before any work that would be lost; the CLI shows it as one line, exit 2."""


class DataError(StackLMError, RuntimeError):
    """A data file is unusable: a shard (or shard directory), a manifest that is missing or does
    not match, a state file, a step log, a ledger that does not add up, a source, a tokenizer
    file. ``path`` names the file where one applies. The message says what to rebuild or move
    away; the CLI shows it as one line, exit 2. (``RuntimeError``: what shard errors were.)"""

    def __init__(self, message: str, *, path: str | os.PathLike | None = None) -> None:
        super().__init__(message)
        self.path = str(path) if path is not None else None


# ---------------------------------------------------------------------------------------
# User errors kept as their own class (caught by name, or a built-in base callers catch)
# ---------------------------------------------------------------------------------------


class ConfigError(UserError, ValueError):
    """A config file, section, key or value is wrong; the message names where (dotted path).
    Caught by name where a caller adds where the value sits (``config.py``,
    ``prebuild/settings.py``, ``scale/resources.py``, ``prebuild/dedup_pass.py``)."""


# The datamodule's name for a data set-up that does not fit the model or the checkpoint: a
# ``ConfigError`` (documented in docs/trainer.md and exported by ``stacklm.datamodule``).
DataConfigError = ConfigError


class DataGateError(ConfigError):
    """The data gate found an error in the loader's output before the first step; the message
    names each check, where it was seen and how to fix it. ``findings``: their dicts (read by
    callers and tests that ask which checks failed)."""

    def __init__(self, message: str = "", findings: list[dict[str, str]] | None = None) -> None:
        super().__init__(message)
        self.findings = list(findings or [])


class ResumeRefused(ConfigError):
    """A checkpoint must not resume on this data or this set-up (other data, seq_len, world
    size where the mode cannot reshape, a state ahead of what was delivered, ...); raised
    before the first step of the resumed fit, its message starts "refusing to resume" and
    names both sides and the fix. Its own class so a caller (a launcher that would rather start
    fresh) tells a refusal from a wrong value without reading the message; a ``ConfigError``
    because the set-up given is what does not fit (``stacklm-train`` names the config file)."""


class ArgumentTypeError(UserError, TypeError):
    """A library call got an argument of the wrong type (e.g. ``PackedMemmapDataset[1.5]``); the
    message names the call, the argument and what it accepts. (``TypeError``: what Python
    raises for a wrong argument type.)"""


class MissingDependencyError(UserError, ImportError):
    """An optional package a feature needs is not installed; the message says which extra.
    (``ImportError``: callers that fall back when a package is absent catch that.)"""


class TextInputError(UserError, ValueError):
    """An input that cannot be tokenizer training/evaluation text; the message names the file
    and the fix. (``ValueError``: what it was before; kept for callers that catch a bad value.)"""


class TextInputNotFoundError(TextInputError, FileNotFoundError):
    """An input path or glob of the tokenizer commands that matches no file."""


class LoneSurrogateError(UserError, ValueError):
    """``encode(..., strict=True)`` of a string holding a lone surrogate (not encodable as
    UTF-8). (``ValueError``: what an encoder raises for text it cannot encode.)"""


# ---------------------------------------------------------------------------------------
# Data errors kept as their own class
# ---------------------------------------------------------------------------------------


class RemoteError(DataError):
    """Object storage refused or failed a request for good (after retries), or a remote shard
    set is not what its manifest says; the message names the URL and the fix, ``path`` the
    URL. Caught by name where a missing object is an answer, not a failure
    (``data/storage/remote.py``)."""


class ShardWriteError(DataError, OSError):
    """Writing a shard failed (typically: the disk is full); nothing partial is left visible.
    (``OSError``: what the write itself raised.)"""


class StateFileError(DataError, ValueError):
    """A state file that is not a readable stacklm state file (damaged, foreign, or a pickle).
    Caught by name where a prebuild job's damaged state means "redo that job"."""


class LedgerError(DataError):
    """The ledger does not add up: a stage lost or repeated documents or tokens without
    counting them. Its own class because its name is what a failed datatrove task reports
    ("task 0 raised LedgerError: ...")."""


class PrebuildError(DataError):
    """The prebuild cannot start or continue; the message says why and what to do. Caught by
    name where a remote ``--out`` names the URL instead of its staging directory."""


class TaskFailed(PrebuildError):
    """A datatrove task (local, Ray or Slurm) died, raised or left the queue; the run stopped.
    The message names the stage, the task and its log; ``stage``, ``rank`` and ``log`` carry
    them."""

    def __init__(self, message: str = "", stage: str = "", rank: int = -1, log: str = "") -> None:
        super().__init__(message)
        self.stage, self.rank, self.log = stage, rank, log


class TokenizerArtifactError(DataError, ValueError):
    """A tokenizer file (ours, or a foreign ``tokenizer.json`` being imported) that cannot be
    loaded or imported faithfully; the message names the file and the field. (``ValueError``:
    what loading a tokenizer raised before.)"""


class ChatFormatError(DataError, ValueError):
    """A conversation that cannot be trained on. ``reason`` is one of ``INVALID_REASONS`` (the
    counter it lands in when the pipes drop instead of raise); ``where`` locates it. Caught by
    name where an invalid conversation is counted and skipped, or reported by ``inspect``."""

    def __init__(self, message: str, *, reason: str | None = None, where: str | None = None) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.detail = message
        self.reason = reason
        self.where = where


class SourceError(DataError):
    """A document source cannot be read; the message names the source and the file/part, and
    ``source``/``file`` carry them. Caught by name where a part that fails is skipped."""

    def __init__(self, message: str, *, source: str | None = None, file: str | None = None) -> None:
        super().__init__(message, path=file)
        self.source = source
        self.file = file

    def __reduce__(self):  # keyword-only fields: rebuilt by hand when a prebuild worker raises
        return (_rebuild_source_error, (self.__class__, str(self), dict(self.__dict__)))


def _rebuild_source_error(cls: type, message: str, fields: dict) -> SourceError:
    err = (OSError if issubclass(cls, OSError) else Exception).__new__(cls)  # the base owning the layout
    Exception.__init__(err, message)
    err.__dict__.update(fields)
    return err


class TextColumnError(SourceError, ValueError):
    """The configured text column is not among the dataset's columns (see ``column_error``).
    (``ValueError``: what it was before; kept for callers that catch a bad value.)"""


class InvalidRecordError(SourceError):
    """One record holds no document (malformed JSON line, not an object, no/null/non-string
    text): skipped and counted under ``reason`` with ``on_invalid: skip``, raised with ``raise``.
    Caught by name where the skip is counted."""

    def __init__(self, message: str, *, reason: str | None = None, source: str | None = None, file: str | None = None) -> None:
        # defaults: every StackLMError is constructible from its message alone (torch re-raises
        # a loader worker's error as ``type(err)(msg)``)
        super().__init__(message, source=source, file=file)
        self.reason = reason


class SourceNotFoundError(SourceError, FileNotFoundError):
    """A glob or hub path matched no files. Caught by name where a hub split may be absent."""


def column_error(source: str, column: str, available: Sequence[str], where: str) -> TextColumnError:
    """The error for a missing text column: lists the columns there are and the closest name."""
    available = sorted(map(str, available))
    close = difflib.get_close_matches(column, available, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    err = TextColumnError(
        f"source {source!r}: text column {column!r} not found in {where}; available columns: {available}.{hint} "
        f"Set text_column to one of them.",
        source=source,
        file=where,
    )
    # for a caller that knows where the column was set (a run config's field, ``--input PATH:COLUMN``)
    # and says so in its own words (``stacklm.prebuild.settings.entry_column_error``, the tokenizer CLI)
    err.column, err.available, err.hint, err.nearest = column, available, hint.strip(), close[0] if close else None
    return err


# ---------------------------------------------------------------------------------------
# Warnings
# ---------------------------------------------------------------------------------------


class LoneSurrogateWarning(UserWarning):
    """``encode`` replaced lone surrogates with U+FFFD: that string does not round-trip. Its own
    class so a caller can turn it into an error (``warnings.simplefilter("error",
    LoneSurrogateWarning)``) or silence it alone. stacklm's other warnings are plain
    ``RuntimeWarning`` (a run that goes on, but not as asked) or ``UserWarning``."""


# ---------------------------------------------------------------------------------------
# How the command line shows an error
# ---------------------------------------------------------------------------------------

# Which package belongs to which extra: ``require`` (stacklm.optional) checks the extra it is
# given against this, and the CLI names the extra for a package that is missing.
EXTRAS = {"hf": ("transformers", "datasets"), "wandb": ("wandb",), "scale": ("datatrove",), "ray": ("ray",)}

_OS_FIXES = {
    errno.ENOSPC: "the disk is full; free space (or write elsewhere, e.g. another --out) and re-run the same command",
    errno.EDQUOT: "the disk quota is exceeded; free space (or write elsewhere) and re-run the same command",
    errno.EACCES: "permission denied; check the path's permissions or pick another path",
    errno.EPERM: "operation not permitted; check the path's permissions or pick another path",
    errno.ENOENT: "no such file or directory; check the path",
    errno.EISDIR: "is a directory; give a file",
    errno.ENOTDIR: "a part of the path is not a directory; check the path",
    errno.EROFS: "read-only file system; write elsewhere",
    errno.EEXIST: "exists and is not a directory where one is needed (e.g. --out names a file); pass a directory path",
}


def extra_of(exc: BaseException) -> tuple[str, str] | None:
    """``(package, extra)`` when ``exc`` is a ``ModuleNotFoundError`` of an optional extra's
    package (raised by a direct import or by a library such as Lightning's WandbLogger)."""
    if not isinstance(exc, ModuleNotFoundError):
        return None
    packages = {pkg: extra for extra, pkgs in EXTRAS.items() for pkg in pkgs}
    if exc.name is not None:
        top = exc.name.split(".")[0]
        return (top, packages[top]) if top in packages else None
    for pkg, extra in packages.items():  # e.g. Lightning: "`WandbLogger` requires `wandb` ..."
        if re.search(rf"\b{pkg}\b", str(exc)):
            return pkg, extra
    return None


def lightning_config_error(exc: BaseException) -> str | None:
    """The message of Lightning refusing a trainer setting, or ``None``.

    Why: Lightning checks some settings only once the fit has its data (e.g. a
    ``val_check_interval`` larger than the epoch's train batches, found in its fit loop's
    ``setup_data``) and raises a plain ``ValueError`` or its ``MisconfigurationException``:
    what the user set is wrong, so the command line shows it as one line, exit 2, like our own
    config errors, not as a 20-line traceback. Recognized by the class name (no import of
    Lightning here) or, for a ``ValueError``, by being raised in Lightning's own code (its
    innermost frame); a ``ValueError`` from anywhere else is a bug and keeps its traceback."""
    if isinstance(exc, StackLMError):
        return None
    if any(c.__name__ == "MisconfigurationException" for c in type(exc).__mro__):
        return str(exc)
    if type(exc) is ValueError:
        tb = exc.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is not None and f"{os.sep}lightning{os.sep}" in tb.tb_frame.f_code.co_filename:
            return str(exc)
    return None


def is_user_error(exc: BaseException) -> bool:
    """True for an error the user can fix: printed as one line instead of a traceback."""
    return isinstance(exc, (StackLMError, OSError)) or extra_of(exc) is not None or lightning_config_error(exc) is not None


# torch's DataLoader re-raises a worker's exception as the same type, its message replaced by
# "Caught X in DataLoader worker process N.\nOriginal Traceback (most recent call last): ...",
# the worker's original message last.
_WORKER_WRAPPED = re.compile(r"^Caught (\w+) in DataLoader worker process (\d+)\.\s*\nOriginal Traceback", re.S)


def _unwrap_worker(exc: BaseException, text: str) -> str:
    """A loader worker's user error as its own message (with the worker named), not torch's
    wrapper with the worker's whole traceback folded into one line."""
    m = _WORKER_WRAPPED.match(text)
    if not m:
        return text
    name, worker = m.groups()
    tail = text.rsplit(f"\n{name}: ", 1)
    if len(tail) != 2:
        tail = text.rsplit(f"{name}: ", 1)
    return f"{tail[-1].strip()} (in DataLoader worker {worker})" if len(tail) == 2 else text


def user_error_message(exc: BaseException) -> str:
    """The message of a user error, on one line (two at most), naming what is wrong and the fix."""
    if isinstance(exc, StackLMError):
        text = _unwrap_worker(exc, str(exc))
    elif (refused := lightning_config_error(exc)) is not None:
        text = f"the trainer settings: {refused.strip()}"
    elif (found := extra_of(exc)) is not None:
        pkg, extra = found
        text = f"the optional package {pkg!r} is not installed ({exc}): pip install \"stacklm[{extra}]\""
    elif isinstance(exc, OSError):
        where = " -> ".join(repr(str(f)) for f in (exc.filename, exc.filename2) if f is not None)
        fix = _OS_FIXES.get(exc.errno) if exc.errno is not None else None
        if fix:
            text = f"{where + ': ' if where else ''}{fix} ({exc.strerror or exc})"
        else:
            text = str(exc)
    else:
        text = str(exc)
    lines = [" ".join(line.split()) for line in text.strip().splitlines() if line.strip()]
    return lines[0] if len(lines) <= 1 else lines[0] + "\n  " + " ".join(lines[1:])
