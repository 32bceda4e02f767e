"""How a user error reaches the user: which exceptions are the user's to fix, and their one line.

Both command lines (``stacklm`` and ``python -m trainer fit`` / ``stacklm-train``) print a user
error as ``<prog>: error: <message>`` and exit with status 2; ``--debug`` shows the traceback.
User errors are ``StackLMError`` (its message already names the file/field and the fix), an
``OSError`` (a path the user gave, a full disk: the message gets the fix for its errno) and a
``ModuleNotFoundError`` of an optional extra's package (the message names the extra).
"""

from __future__ import annotations

import errno
import re

from stacklm.errors import StackLMError
from stacklm.optional import EXTRAS

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


def is_user_error(exc: BaseException) -> bool:
    """True for an error the user can fix: printed as one line instead of a traceback."""
    return isinstance(exc, (StackLMError, OSError)) or extra_of(exc) is not None


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
