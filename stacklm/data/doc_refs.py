"""Buffered documents checkpointed by position, not content (issue 34).

The pre-training graph holds thousands of documents between reading and delivery: the shuffle
buffer (``shuffle_buffer``, 10,000 at stack-100m), the packer's buffer (``pack_buffer_docs``),
the tokenizer's read-ahead and the dedup stage's kept group. Saving their token ids made a
reader's state 60+ MiB on real documents; what identifies a document is far smaller: its source,
part (file), the reader's ``seek`` position (a byte offset in a JSON-lines file, a row of a
parquet file, an index of the synthetic corpus) and its record number. ``DocRefs.save`` stores
that, plus a CRC-32 of what the buffer held (the token ids, the text, or a packer piece) and, for
a document the mix cut to its budget, the kept length. ``DocRefs.load`` re-reads the documents
(each part opened once, positions in ascending order: ``PartNode.reread``), re-tokenizes them
with the run's tokenizer, rebuilds what the buffer held and checks each CRC: a document that
no longer matches (the file changed since the checkpoint) refuses the resume, naming it.

Documents with no position keep their content: a hub stream cannot seek (``HFStreamSource``),
and a document whose text a stage edited (decontamination's ``cut`` mode) is no longer what its
position reads. Those are saved as before (``shuffle.encode_docs``), bounded by the buffers'
sizes, and counted by ``bench/stream_state.py``. (Before, every buffer was saved this way.)

Why our own: torchdata's nodes checkpoint whatever ``get_state`` returns; none of the peers
(litdata, Mosaic streaming, torchtitan) keeps a shuffle or packing buffer of variable-length
documents that must resume exactly, so there is nothing to reuse.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from stacklm.errors import ResumeRefused

# Fields that repeat across many documents: stored as codes into a small table.
_CODED_FIELDS = ("source", "domain")

# The columns of a saved position, in order: the source (index into the saved names), the part
# (``file``), the reader's ``seek``, the ``record``, record - row (``doc_id``'s row: they differ by
# the blank lines before it), the caller's ``extra`` int (a packer piece's offset), the kept
# length of a document the mix cut (0: whole) and the CRC-32 of the payload.
_COLUMNS = ("source", "file", "seek", "record", "row_gap", "extra", "cut", "crc")
BY_POSITION = "by_position"  # marks a state saved by ``DocRefs.save`` (else ``encode_docs``'s)
CUT_FIELD = "full_len"  # set by the mix on a document it cut to its budget: the uncut length


# ---------------------------------------------------------------------------------------
# Content codec: documents without a position (and graphs that save content)
# ---------------------------------------------------------------------------------------
def encode_docs(docs: list[dict]) -> dict[str, Any]:
    """Columnar, compact encoding of tokenized documents (inverse: ``decode_docs``)."""
    n = len(docs)
    for d in docs:
        if not isinstance(d.get("ids"), np.ndarray):
            raise TypeError(
                f"shuffle buffer holds tokenized documents with an np.ndarray 'ids' field; got "
                f"{type(d.get('ids')).__name__} in doc {d.get('doc_id')!r} of source {d.get('source')!r}; "
                "put the shuffle after tokenize"
            )
    lengths = np.fromiter((len(d["ids"]) for d in docs), dtype=np.int64, count=n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    dtype = docs[0]["ids"].dtype if n else np.dtype(np.int32)
    ids = np.concatenate([d["ids"] for d in docs]).astype(dtype, copy=False) if n else np.zeros(0, dtype)
    if ids.size and 0 <= ids.min() and ids.max() <= np.iinfo(np.uint16).max:
        ids = ids.astype(np.uint16)  # vocab <= 65536: half the bytes; decode restores ``dtype``
    keys: list[str] = []
    for d in docs:
        for k in d:
            if k != "ids" and k not in keys:
                keys.append(k)
    fields: dict[str, Any] = {}
    missing = object()
    for k in keys:
        values = [d.get(k, missing) for d in docs]
        has = np.array([v is not missing for v in values], dtype=bool)
        values = [v if v is not missing else None for v in values]
        if k in _CODED_FIELDS and all(isinstance(v, str) for v in values):
            table = sorted(set(values))
            index = {v: i for i, v in enumerate(table)}
            fields[k] = {"table": table, "codes": np.array([index[v] for v in values], dtype=np.int32)}
        else:
            fields[k] = {"values": values}
        if not has.all():
            fields[k]["present"] = has
    return {"ids": ids, "dtype": dtype.str, "offsets": offsets, "fields": fields}


def decode_docs(enc: dict[str, Any]) -> list[dict]:
    offsets = np.asarray(enc["offsets"])
    ids = np.asarray(enc["ids"]).astype(np.dtype(enc["dtype"]), copy=False)
    n = len(offsets) - 1
    docs = [{"ids": ids[offsets[i] : offsets[i + 1]].copy()} for i in range(n)]
    for k, col in enc["fields"].items():
        if "codes" in col:
            table = col["table"]
            values = [table[c] for c in np.asarray(col["codes"]).tolist()]
        else:
            values = col["values"]
        present = col.get("present")
        for i, (d, v) in enumerate(zip(docs, values)):
            if present is None or present[i]:
                d[k] = v
    return docs



def payload_crc(payload: np.ndarray | str) -> int:
    """CRC-32 of a buffer's payload: int32 token ids, or a text's UTF-8 bytes."""
    if isinstance(payload, str):
        return zlib.crc32(payload.encode("utf-8", "surrogatepass"))
    return zlib.crc32(np.ascontiguousarray(payload, dtype=np.int32))


def _narrow(col: np.ndarray) -> np.ndarray:
    """The column in the narrowest integer dtype that holds it (zlib then sees fewer bytes)."""
    lo, hi = (int(col.min()), int(col.max())) if len(col) else (0, 0)
    for dtype in (np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32):
        info = np.iinfo(dtype)
        if info.min <= lo and hi <= info.max:
            return col.astype(dtype)
    return col.astype(np.int64)


def pack_columns(cols: np.ndarray) -> dict[str, Any]:
    """An int64 matrix (columns x rows) as one zlib blob of narrowed columns."""
    narrowed = [_narrow(c) for c in cols]
    blob = zlib.compress(b"".join(c.tobytes() for c in narrowed), 6)
    return {"blob": np.frombuffer(blob, dtype=np.uint8).copy(), "dtypes": [c.dtype.str for c in narrowed], "rows": int(cols.shape[1])}


def unpack_columns(packed: Mapping[str, Any]) -> np.ndarray:
    raw = zlib.decompress(np.asarray(packed["blob"], dtype=np.uint8).tobytes())
    rows, out, at = int(packed["rows"]), [], 0
    for dtype in packed["dtypes"]:
        dt = np.dtype(dtype)
        out.append(np.frombuffer(raw, dtype=dt, count=rows, offset=at).astype(np.int64))
        at += rows * dt.itemsize
    return np.stack(out) if out else np.zeros((0, rows), dtype=np.int64)


def _row_of(doc: dict) -> int:
    """The row in ``doc_id`` (``<source>/<part>/<row>``), which ``PartNode.reread`` rebuilds it with."""
    return int(str(doc.get("doc_id", "")).rsplit("/", 1)[-1] or doc["record"])


class DocRefs:
    """Saves and restores a buffer's documents by position (module docstring).

    ``tokenize``: documents -> the same documents with ``ids`` (``tokenizing.tokenize_docs`` with
    the run's tokenizer: passed in, since the tokenizing stage saves through this module);
    ``sources``: the graph's source nodes by name (each with ``reread``), filled as the graph is
    built. One per graph, shared by its buffering nodes.
    """

    def __init__(self, tokenize: Callable[[list[dict]], list[dict]] | None = None, sources: Mapping[str, Any] | None = None) -> None:
        self.tokenize = tokenize
        self.sources: dict[str, Any] = dict(sources or {})
        self.bytes_by_content = 0  # content-fallback bytes of the last ``save`` (bench/stream_state.py)

    def _seekable(self, doc: dict) -> bool:
        return "seek" in doc and doc.get("source") in self.sources

    def save(self, docs: Sequence[dict], payloads: Sequence[Any] | None = None, extra: Sequence[int] | None = None,
             lengths: Sequence[int] | None = None) -> dict[str, Any]:
        """``docs`` as a buffer holds them (tokenized with ``ids``, or texts), by position where
        they have one. ``payloads``: what the buffer holds for each (default: its ``ids``, or its
        text); ``extra``: an int per document the caller needs back (a packer piece's offset);
        ``lengths``: each document's token count where ``docs`` come without their ``ids`` (the
        packer's: a document the mix cut is re-read and cut to it)."""
        tokenized = bool(docs) and "ids" in docs[0] if payloads is None else True
        if payloads is None:
            payloads = [d["ids"] if tokenized else d["text"] for d in docs]
        at = [i for i, d in enumerate(docs) if self._seekable(d)]
        names = sorted({docs[i]["source"] for i in at})
        code = {n: k for k, n in enumerate(names)}
        cols = np.zeros((len(_COLUMNS), len(at)), dtype=np.int64)
        for j, i in enumerate(at):
            d = docs[i]
            record = int(d["record"])
            cols[:, j] = (code[d["source"]], int(d["file"]), int(d["seek"]), record, record - _row_of(d),
                          int(extra[i]) if extra is not None else 0,
                          (len(d["ids"]) if lengths is None else int(lengths[i])) if CUT_FIELD in d else 0,
                          payload_crc(payloads[i]))
        out: dict[str, Any] = {BY_POSITION: 1, "n": len(docs), "tokenized": int(tokenized), "names": names, "refs": pack_columns(cols)}
        if len(at) < len(docs):  # no position: the content, as before (hub streams, edited texts)
            mine = set(at)
            rest = [i for i in range(len(docs)) if i not in mine]
            out["content_at"] = np.array(rest, dtype=np.int64)
            if tokenized:
                out["content"] = encode_docs([{**docs[i], "ids": np.asarray(payloads[i])} for i in rest])
                self.bytes_by_content = int(out["content"]["ids"].nbytes)
            else:
                out["content"] = [dict(docs[i]) for i in rest]
                self.bytes_by_content = sum(len(str(docs[i].get("text", "")).encode("utf-8", "surrogatepass")) for i in rest)
            if extra is not None:
                out["content_extra"] = np.array([int(extra[i]) for i in rest], dtype=np.int64)
        else:
            self.bytes_by_content = 0
        return out

    def load(self, state: Mapping[str, Any], payload: Callable[[dict, int], Any] | None = None) -> tuple[list[dict], list[Any], list[int]]:
        """``(docs, payloads, extra)`` as saved: documents re-read at their positions (re-tokenized
        when the buffer held tokens), each payload rebuilt by ``payload(doc, extra)`` (default: the
        ids, cut as the mix cut them, or the text) and checked against its CRC."""
        n, tokenized = int(state["n"]), bool(state["tokenized"])
        docs: list[Any] = [None] * n
        payloads: list[Any] = [None] * n
        extras = [0] * n
        content_at = np.asarray(state.get("content_at", np.zeros(0, np.int64)), dtype=np.int64).tolist()
        if content_at:
            content = decode_docs(state["content"]) if tokenized else [dict(d) for d in state["content"]]
            cx = np.asarray(state.get("content_extra", np.zeros(len(content_at), np.int64))).tolist()
            for i, d, x in zip(content_at, content, cx):
                docs[i], payloads[i], extras[i] = d, (d["ids"] if tokenized else d["text"]), int(x)
        cols = unpack_columns(state["refs"])
        at = [i for i in range(n) if docs[i] is None]
        if len(at) != cols.shape[1]:
            raise ValueError(f"a by-position buffer state lists {cols.shape[1]} positions for {len(at)} documents")
        names = list(state["names"])
        for k, name in enumerate(names):
            mine = np.flatnonzero(cols[0] == k)
            if not len(mine):
                continue
            if name not in self.sources:
                raise ResumeRefused(f"refusing to resume: the checkpoint's buffers hold documents of source {name!r}, which this "
                                    f"run's mix does not have ({sorted(self.sources)}); resume with the checkpoint's mix")
            c = cols[:, mine]
            got = self.sources[name].reread(c[1], c[2], c[3], c[3] - c[4])
            if tokenized:
                got = self.tokenize(got)
            for j, doc in zip(mine.tolist(), got):
                i = at[j]
                cut = int(cols[6, j])
                if cut:
                    doc[CUT_FIELD] = len(doc["ids"])
                    doc["ids"] = doc["ids"][:cut]
                x = int(cols[5, j])
                p = payload(doc, x) if payload is not None else (doc["ids"] if tokenized else doc["text"])
                if payload_crc(p) != int(cols[7, j]):
                    raise ResumeRefused(
                        f"refusing to resume: document {doc.get('doc_id')!r} (source {name!r}, record {int(cols[3, j])}) re-read for "
                        "the checkpoint's buffers differs from the one it buffered: the source's files changed since the checkpoint "
                        "(or the tokenizer did). Restore them, or start the run afresh")
                docs[i], payloads[i], extras[i] = doc, p, x
        return docs, payloads, extras


def save_docs(refs: DocRefs | None, docs: Sequence[dict]) -> dict[str, Any]:
    """A buffer of documents: by position with ``refs``, else their content (``encode_docs``)."""
    return refs.save(docs) if refs is not None else encode_docs(list(docs))


def load_docs(refs: DocRefs | None, state: Mapping[str, Any]) -> list[dict]:
    """The inverse of ``save_docs`` (either format: a state saved by content loads anywhere)."""
    if state.get(BY_POSITION):
        if refs is None:
            raise ValueError("a buffer saved by position needs the graph's DocRefs to load")
        return refs.load(state)[0]
    return decode_docs(state)
