"""State files that can be read back without trusting them: nested ``state_dict``s as data only.

Why not pickle: a prebuild's resume checkpoints (``OUT/.prebuild/<split>-wNNN.ckpt``) live in
the output directory, which the docs put on shared storage for multi-node builds; unpickling a
file there runs whatever code its author chose, in whoever resumes. This format holds only
data, so reading a crafted file can at worst fail with ``StateFileError``:

* one ``.npz`` (a zip of ``.npy`` arrays, read with ``allow_pickle=False``, so an object array
  is refused too), deflated: the buffered documents' text and token ids in a resume state
  shrink about 2.5x;
* member ``state`` (a ``uint8`` array) is the structure as JSON, ``{"format": FORMAT,
  "state": ...}``; every numpy array in it is a reference to its own member ``a<N>``.

JSON has no tuples, numpy scalars, bytes or non-string keys, and ``state_dict`` consumers may
care (a numpy 2 scalar promotes differently from a Python int), so those are tagged
``{"$t": tag, "v": ...}`` and come back as the same types: a resume from a decoded state is
bit-identical. A dict that itself holds a ``"$t"`` key is tagged too, so no value is ambiguous.
Anything else (a class instance, a function) cannot be written: ``dumps`` raises naming where.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from stacklm.errors import StateFileError

FORMAT = "stacklm-state/1"
_JSON = "state"  # the member holding the structure (state.npy in the zip)
_TAG = "$t"


def load_error_detail(e: BaseException, source: bytes | memoryview | str | Path | None = None) -> str:
    """What went wrong reading a data-only file, in a few words for a one-line error. numpy's own
    text for a pickle invites loading it unsafely; ours says it is never loaded. numpy says
    "pickled data" of *any* file that is neither .npy nor .npz (a truncated text file too): with
    ``source`` (the bytes that failed to load, or their file), only a real pickle (``0x80`` +
    protocol 2-5) is called one."""
    msg = str(e).splitlines()[0] if str(e) else ""
    if "pickle" in msg:
        head = _head(source)
        if head is None or is_pickle_head(head):
            return "it holds pickled data, which stacklm never loads"
        return f"neither a .npz nor a .npy file: it starts with {head!r}"
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


def is_pickle_head(head: bytes) -> bool:
    """Whether ``head`` (a file's first bytes) starts a pickle: ``0x80`` and a protocol 2-5."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _head(source, n: int = 12) -> bytes | None:
    """The first ``n`` bytes of ``source`` (bytes, or a file's path); ``None`` if there are none to read."""
    if source is None:
        return None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source[:n])
    try:
        with open(source, "rb") as f:
            return f.read(n)
    except (OSError, TypeError, ValueError):
        return None


def _encode(obj: Any, arrays: list[np.ndarray], where: str) -> Any:
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)) and type(obj) in (int, float):
        return obj
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError(f"{where}: an object array cannot go into a state file (it would need pickle)")
        arrays.append(obj)
        return {_TAG: "nd", "v": len(arrays) - 1}
    if isinstance(obj, np.generic):
        if obj.dtype.hasobject:
            raise TypeError(f"{where}: an object scalar cannot go into a state file")
        arrays.append(np.asarray(obj))
        return {_TAG: "np", "v": len(arrays) - 1}
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "v": [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, arrays, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, (bytes, bytearray)):
        arrays.append(np.frombuffer(bytes(obj), dtype=np.uint8))
        return {_TAG: "bytes", "v": len(arrays) - 1}
    if isinstance(obj, dict):
        if all(type(k) is str for k in obj) and _TAG not in obj:
            return {k: _encode(v, arrays, f"{where}.{k}") for k, v in obj.items()}
        return {_TAG: "dict", "v": [[_encode(k, arrays, f"{where}<key>"), _encode(v, arrays, f"{where}[{k!r}]")] for k, v in obj.items()]}
    raise TypeError(f"{where}: a {type(obj).__module__}.{type(obj).__qualname__} cannot go into a state file (data only: "
                    "dict, list, tuple, str, int, float, bool, None, bytes, numpy arrays and scalars)")


def _decode(obj: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, arrays) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: _decode(v, arrays) for k, v in obj.items()}
    v = obj["v"]
    if tag == "nd":
        return arrays[f"a{v}"]
    if tag == "np":
        return arrays[f"a{v}"][()]
    if tag == "bytes":
        return arrays[f"a{v}"].tobytes()
    if tag == "tuple":
        return tuple(_decode(x, arrays) for x in v)
    if tag == "dict":
        return {_hashable(_decode(k, arrays)): _decode(x, arrays) for k, x in v}
    raise ValueError(f"unknown tag {tag!r}")


def _hashable(key: Any) -> Any:
    if isinstance(key, (list, dict, np.ndarray)):
        raise ValueError(f"a dict key of type {type(key).__name__}")
    return key


def dumps(state: Any) -> bytes:
    """``state`` (nested dicts/lists/tuples of plain values and numpy arrays) as state-file bytes."""
    arrays: list[np.ndarray] = []
    doc = json.dumps({"format": FORMAT, "state": _encode(state, arrays, "state")}, separators=(",", ":")).encode()
    buf = io.BytesIO()
    # np.savez_compressed's layout (one .npy per member), at deflate level 1: a prebuild saves
    # one after every shard, and level 6 took 4x the time for 10% fewer bytes (measured)
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, a in [(_JSON, np.frombuffer(doc, dtype=np.uint8)), *((f"a{i}", a) for i, a in enumerate(arrays))]:
            with zf.open(f"{name}.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.asanyarray(a), allow_pickle=False)
    return buf.getvalue()


def loads(data: bytes, where: str | Path, fix: str) -> Any:
    """The state in ``data`` (read from ``where``). Never unpickles: a pickle, an object array,
    a damaged or foreign file is a ``StateFileError`` naming ``where`` and ending with ``fix``."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise ValueError("a bare .npy array, not a state file")
            arrays = {k: z[k] for k in z.files}
        doc = json.loads(arrays.pop(_JSON).tobytes())
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            found = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"format {found!r}, expected {FORMAT!r}")
        return _decode(doc["state"], arrays)
    except (ValueError, KeyError, TypeError, OSError, EOFError, zipfile.BadZipFile, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StateFileError(f"{where}: not a stacklm state file ({load_error_detail(e, data)}); {fix}") from None
