"""A data directory holds data: the one check every reader of a shard set (and of a run's step
log) makes before it opens a file there.

Why: a shard directory often sits on shared storage others write, and its file names are
fixed (``shard_00000.tokens.bin``, ``manifest.json``, ...), so whatever sits under such a name
is read. A FIFO there made ``stacklm inspect`` wait forever (an ``open`` of a FIFO blocks until
a writer comes); a symlink to ``/dev/zero`` read as rows of zeros; symlinks to copies outside
the directory were followed by every reader, so the set vouched for files it does not hold.

The rule (docs/prebuild.md, "Crash safety and resume"): a data file is a **regular file whose
real path lies inside the directory that holds it** (a split's files inside the split
directory, the top manifest inside the build, a split directory inside the build). A symlink
is followed only when its target, every link resolved, stays inside that directory (a link to
a sibling, or into a sub-folder); one that leaves it, or dangles, is refused. FIFOs, devices,
sockets and directories under a file's name are refused, naming the file and what it is.

Never blocking: the checks use ``lstat``, ``realpath`` and ``stat`` only (none opens the file),
and ``open_data_file`` then opens the resolved path with ``O_NONBLOCK | O_NOFOLLOW`` and checks
the opened descriptor again, so a file swapped for a FIFO or a link between the check and the
open is refused too instead of blocking or being followed.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from stacklm.errors import DataError

_FIX = ("a data directory holds only the regular files the build wrote; put the real file back (restore it from a copy) "
        "or rebuild with `stacklm prebuild`")


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, in words."""
    for test, words in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                        (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return words
    return "not a regular file"


def _inside(real: str, root: str | os.PathLike) -> bool:
    real_root = os.path.realpath(root)
    return real == real_root or os.path.commonpath([real, real_root]) == real_root


def _resolve(path: Path, root: Path, want_dir: bool) -> str | None:
    """The real path of ``path`` when it is what it should be (a regular file, or a directory
    with ``want_dir``) inside ``root``; ``None`` when nothing is there. See the module."""
    try:
        lst = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    real = os.path.realpath(path)
    what = "directory" if want_dir else "regular file"
    if stat.S_ISLNK(lst.st_mode):
        if not _inside(real, root):
            raise DataError(f"{path} is a symlink to {real}, outside {root}: {_FIX}", path=path)
        try:
            st = os.stat(real)
        except OSError:
            raise DataError(f"{path} is a symlink to {real}, which does not exist (a dangling link, not a {what}); {_FIX}",
                            path=path) from None
        via = f" (a symlink to {real})"
    else:
        st, via = lst, ""
    ok = stat.S_ISDIR(st.st_mode) if want_dir else stat.S_ISREG(st.st_mode)
    if not ok:
        raise DataError(f"{path} is {_kind(st.st_mode)}{via}, not a {what}: {_FIX}", path=path)
    return real


def check_data_file(path: str | os.PathLike, root: str | os.PathLike | None = None) -> Path | None:
    """The real path of data file ``path`` when it is a regular file inside ``root`` (default:
    the directory holding it); ``None`` when nothing is there (the caller says what a missing
    file means); a ``DataError`` naming the file and what it is otherwise. Opens nothing."""
    path = Path(path)
    real = _resolve(path, Path(root) if root is not None else path.parent, want_dir=False)
    return None if real is None else Path(real)


def check_data_dir(path: str | os.PathLike, root: str | os.PathLike) -> Path | None:
    """``check_data_file`` for a directory inside ``root`` (a split directory of a build)."""
    real = _resolve(Path(path), Path(root), want_dir=True)
    return None if real is None else Path(real)


def open_data_file(path: str | os.PathLike, root: str | os.PathLike | None = None) -> BinaryIO:
    """``path`` opened for reading (unbuffered binary), after ``check_data_file``; a missing file
    is a ``FileNotFoundError``. Opened without blocking and without following a link (see the
    module), and the descriptor checked again: a regular file or a ``DataError``."""
    real = check_data_file(path, root)
    if real is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise DataError(f"{path} became a symlink while it was opened: {_FIX}", path=path) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DataError(f"{path} is {_kind(mode)}, not a regular file: {_FIX}", path=path)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def read_data_bytes(path: str | os.PathLike, root: str | os.PathLike | None = None) -> bytes:
    """The bytes of data file ``path`` (``open_data_file``)."""
    with open_data_file(path, root) as f:
        return f.read()
