"""How much text a tokenizer input holds, estimated without reading it, and how a byte budget is
shared out between inputs (``text_input.open_text_mix``).

Why estimates: a sample's shares are decided before reading, and a ``.jsonl.gz`` counted by its
compressed size got a fraction of its due (31 MB of kernel text, 11 % of a sample). So every
input is sized by the text it holds:

* **Uncompressed size.** Plain files: their size. ``.gz``: the gzip trailer's ISIZE (the last
  member's size mod 2**32), taken as ISIZE + k * 2**32 with k chosen nearest the sampled ratio
  below; if even that is more than 2x off the sampled ratio (a multi-member file such as
  bgzip's), the sampled ratio. ``.zst``: the first frame's content size when the frame header
  has one and it is within 2x of the sampled ratio (a multi-frame file: the ratio). The
  *sampled ratio* decompresses the file's first ``HEAD_BYTES`` (1 MiB) of output and scales
  the compressed size by what that took; a file that ends inside it is measured exactly.
* **Text.** Text files: the uncompressed size. JSON lines: the uncompressed size times the
  text column's share of the complete lines in that first MiB (keys, quoting and other fields
  are not text). Parquet: the text column's uncompressed size in the file's metadata (its
  encoding's 4-byte length per value included: 14.5% over for 37-byte texts).

A file that holds less than its estimate gives less than its share; the rest passes on to the
inputs read after it (``plan``).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Sequence

HEAD_BYTES = 1 << 20  # decompressed bytes read to measure a compressed file's ratio and text share
_FEED = 16 * 1024  # compressed bytes fed at a time while measuring the head
_TRUST = 2.0  # a header's size more than this factor off the sampled ratio is not the file's size


def _head(path: str) -> tuple[bytes, int, bool]:
    """``(first decompressed bytes, compressed bytes they took, whole file)`` of ``path``:
    compressed input is fed in small blocks, so what the head took is known to within one."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if not path.endswith((".gz", ".zst", ".zstd")):
            data = f.read(HEAD_BYTES)
            return data, len(data), len(data) >= size
        if path.endswith(".gz"):
            new = lambda: zlib.decompressobj(zlib.MAX_WBITS | 16)  # noqa: E731
        else:
            import zstandard

            dctx = zstandard.ZstdDecompressor()
            new = dctx.decompressobj
        out, used, dobj = [], 0, new()
        got = 0
        while got < HEAD_BYTES:
            block = f.read(_FEED)
            if not block:
                break
            used += len(block)
            while block:
                piece = dobj.decompress(block)
                out.append(piece)
                got += len(piece)
                block = dobj.unused_data if dobj.eof else b""  # next member / frame
                if dobj.eof:
                    dobj = new()
        whole = used >= size
    data = b"".join(out)
    return data, max(used, 1), whole


def _nearest(candidate: int, estimate: float, wrap: int | None) -> int | None:
    """``candidate`` (+ k * ``wrap``) nearest ``estimate``; ``None`` when more than ``_TRUST`` x off."""
    if wrap:
        candidate += wrap * max(0, round((estimate - candidate) / wrap))
    if candidate <= 0 or not (estimate / _TRUST <= candidate <= estimate * _TRUST):
        return None
    return candidate


def uncompressed_size(path: str, head: tuple[bytes, int, bool] | None = None) -> tuple[int, str]:
    """``(bytes, how)``: the decompressed size of ``path``, and how it was had (``size``,
    ``measured``, ``gzip ISIZE``, ``zstd frame``, ``sampled ratio``); see the module docstring."""
    size = os.path.getsize(path)
    if not path.endswith((".gz", ".zst", ".zstd")):
        return size, "size"
    data, used, whole = head or _head(path)
    if whole:
        return len(data), "measured"
    estimate = size * len(data) / used
    if path.endswith(".gz"):
        with open(path, "rb") as f:
            f.seek(max(0, size - 4))
            isize = int.from_bytes(f.read(4), "little")
        found = _nearest(isize, estimate, 1 << 32)
        if found is not None:
            return found, "gzip ISIZE"
    else:
        import zstandard

        with open(path, "rb") as f:
            try:
                content = zstandard.get_frame_parameters(f.read(18)).content_size
            except zstandard.ZstdError:
                content = zstandard.CONTENTSIZE_UNKNOWN
        if content not in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR):
            found = _nearest(content, estimate, None)
            if found is not None:
                return found, "zstd frame"
    return int(estimate), "sampled ratio"


def _json_text_share(data: bytes, whole: bool, text_column: str) -> float:
    """The text column's UTF-8 bytes over the bytes of the complete lines of ``data``."""
    lines = data.split(b"\n")
    if not whole:
        lines = lines[:-1]  # cut by the head
    text = total = 0
    for raw in lines:
        total += len(raw) + 1
        try:
            value = json.loads(raw).get(text_column) if raw.strip() else None
        except (ValueError, AttributeError):
            continue  # the reader names a bad line itself, with its number
        if isinstance(value, str):
            text += len(value.encode("utf-8", "surrogatepass"))
    return text / total if total and text else 1.0  # nothing to go by: the file's size


def _parquet_text(path: str, text_column: str) -> int | None:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception:  # noqa: BLE001 -- not parquet after all: the reader says so, naming the file
        return None
    found = None
    for g in range(meta.num_row_groups):
        rg = meta.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            if col.path_in_schema == text_column:
                found = (found or 0) + col.total_uncompressed_size
    return found


def text_estimate(path: str, fmt: str, text_column: str) -> dict[str, int | str]:
    """``{"disk", "uncompressed", "how", "text"}``: ``path``'s size on disk, decompressed
    (and how that was had), and the UTF-8 bytes of text it holds (estimated) when read as
    ``fmt`` (``txt``/``jsonl``/``parquet``) with ``text_column``."""
    disk = os.path.getsize(path)
    if fmt == "parquet":
        text = _parquet_text(path, text_column)
        return {"disk": disk, "uncompressed": disk, "how": "parquet metadata" if text is not None else "size",
                "text": disk if text is None else text}
    compressed = path.endswith((".gz", ".zst", ".zstd"))
    head = _head(path) if compressed or fmt == "jsonl" else None
    full, how = uncompressed_size(path, head)
    text = full if fmt != "jsonl" else round(full * _json_text_share(head[0], head[2], text_column))
    return {"disk": disk, "uncompressed": full, "how": how, "text": text}


def plan(weights: Sequence[float], available: Sequence[float | None]) -> list[int]:
    """The order to read inputs in so that each gets ``weight / (weights still to read)`` of the
    budget left and what one cannot fill passes to the rest: ascending ``available / weight``
    (``None``, unknown, last; ties keep their order), so an input likely to run short is read
    first and its shortfall is shared by all the inputs with text to spare (a water-filling; a
    short input read last would leave the budget unfilled while earlier ones stopped at their
    shares)."""
    def key(i: int) -> float:
        a = available[i]
        return float("inf") if a is None else a / weights[i] if weights[i] > 0 else float("inf")

    return sorted(range(len(weights)), key=key)


def quota(left: int | None, weight: float, weights_left: float, last: bool) -> int | None:
    """One input's share of ``left`` bytes: ``left * weight / weights_left`` (the last input, or
    weights that sum to nothing, take what is left); ``None`` (no budget) stays ``None``."""
    if left is None:
        return None
    if last or weights_left <= 0:
        return left
    return int(left * (weight / weights_left))


__all__ = ["HEAD_BYTES", "plan", "quota", "text_estimate", "uncompressed_size"]
