"""Crash-safe file writes: readers see the old file or the whole new one, never half.

The one implementation behind shards, manifests, prebuild checkpoints and tokenizer files:
write a temporary file in the same folder (its name starts with ``TMP_MARK``, so leftovers of
a killed write are recognisable and never match a real file name), fsync it, rename it over
the target, then fsync the folder so the rename survives a power cut.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from stacklm.parent_death import exit_if_orphaned, orphaned

if TYPE_CHECKING:
    import numpy as np

TMP_MARK = ".tmp-"  # temporary files start with this


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make renames/creations inside ``directory`` durable (no-op where dirs cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. Windows
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(f, data: memoryview) -> None:
    """``f.write`` until done. Its own function so tests can simulate a full disk here."""
    view = memoryview(data).cast("B")
    while view:
        n = f.write(view)
        view = view[n:]


def _bytes_view(data: bytes | memoryview | np.ndarray) -> memoryview:
    """A flat view of ``data``; a numpy array is made contiguous first. numpy is looked up, not
    imported: an array can only exist once numpy is loaded, and the command line imports this
    module (through the tokenizer artifact's name) without loading numpy."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(data, numpy.ndarray):
        return memoryview(numpy.ascontiguousarray(data))
    return memoryview(data)


def atomic_write_bytes(
    path: str | os.PathLike,
    data: bytes | memoryview | np.ndarray,
    *,
    fsync_parent: bool = True,
    on_error: Callable[[OSError, Path, int], BaseException] | None = None,
) -> None:
    """Write ``data`` to ``path`` atomically; on any error the temporary file is removed and
    the error propagates. ``fsync_parent=False`` skips the folder fsync (a caller renaming
    several files in one folder fsyncs it once, after the last). ``on_error(error, path,
    nbytes)`` turns a failed write's ``OSError`` into the exception raised instead (chained to
    it), so a caller can say what the file is for and how to recover (see ``shards``).

    In a worker whose parent has died (``stacklm.parent_death``) it exits instead, before the
    temporary file is created and again before the rename: an orphan writes nothing."""
    exit_if_orphaned()
    path = Path(path)
    # pid and thread both in the name: concurrent writers of one path never share a temp file
    tmp = path.parent / f"{TMP_MARK}{path.name}.{os.getpid()}.{threading.get_ident()}"
    payload = _bytes_view(data)
    try:
        try:
            with open(tmp, "wb") as f:
                _write_all(f, payload)
                f.flush()
                os.fsync(f.fileno())
            if orphaned():  # the parent died during the write: leave nothing behind
                tmp.unlink(missing_ok=True)
                exit_if_orphaned()
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if fsync_parent:
            fsync_dir(path.parent)
    except OSError as e:
        if on_error is not None:
            raise on_error(e, path, payload.nbytes) from e
        if e.filename is None:  # a failed write() names no file: name the one being written
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise


def atomic_write_text(path: str | os.PathLike, text: str, *, fsync_parent: bool = True) -> None:
    """``atomic_write_bytes`` of ``text`` encoded as UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"), fsync_parent=fsync_parent)
